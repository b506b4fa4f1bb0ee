"""`ganscale bench throughput`: images/s of a full GAN training iteration, its model FLOPs and (on CUDA) MFU.

One iteration = one D step (G forward without gradients, one D forward over [real, fake], backward,
Adam step) then one G step (G forward, D forward with D frozen, backward, Adam step), written
directly (no trainer: this measures the models). Images/s counts the batch once per iteration.
Real images are random tensors of the right shape; the numbers depend only on shapes.

Model FLOPs are counted by torch.utils.flop_counter.FlopCounterMode over one whole iteration
(forward and backward of both networks; convolutions, matmuls and attention: the operators it
knows; elementwise work and the optimizer are not counted). MFU = FLOPs per iteration / median
iteration time / peak. Peaks are the GPU's dense ones, found by its name (GPU_PEAKS: H100 SXM and H200:
bf16 989 TFLOP/s, fp32 67 TFLOP/s, the fp32 peak without tensor cores; cuDNN runs fp32 convolutions as
TF32 by default, so fp32 MFU can exceed what that peak suggests). `--peak-tflops` sets another peak; a GPU
not in the table, or a CPU, has none by default (no MFU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode

from ganscale import objectives
from ganscale.models.biggan import BigGANDiscriminator, BigGANGenerator
from ganscale.models.dcgan import DCGANDiscriminator, DCGANGenerator
from ganscale.models.stylegan2 import StyleGAN2Discriminator, StyleGAN2Generator

# Dense peaks in TFLOP/s (NVIDIA's data sheets) by what torch.cuda.get_device_name contains; the first match counts.
GPU_PEAKS = (("H200 NVL", {"bf16": 835.0, "fp32": 60.0}), ("H200", {"bf16": 989.0, "fp32": 67.0}),
             ("H100 NVL", {"bf16": 835.0, "fp32": 60.0}), ("H100 PCIe", {"bf16": 756.0, "fp32": 51.0}),
             ("H100", {"bf16": 989.0, "fp32": 67.0}), ("A100", {"bf16": 312.0, "fp32": 19.5}))
N_CLASSES = 10
STYLEGAN2_Z = 512  # z and w, as StyleGAN2's configs


def gpu_peak_tflops(gpu_name: str, precision: str) -> float | None:
    """The dense peak of the GPU named `gpu_name` at `precision` (GPU_PEAKS), or None for a GPU not in it."""
    return next((peaks[precision] for name, peaks in GPU_PEAKS if name in gpu_name), None)


@dataclass
class GanPair:
    """G and D with a uniform calling convention: G(z, y), D(x, y) (y ignored when unconditional)."""
    name: str
    G: nn.Module
    D: nn.Module
    z_dim: int
    conditional: bool
    loss: str

    def generate(self, z: Tensor, y: Tensor) -> Tensor:
        return self.G(z, y) if self.conditional else self.G(z)

    def discriminate(self, x: Tensor, y: Tensor) -> Tensor:
        return self.D(x, y) if self.conditional else self.D(x)


def build(model: str, resolution: int, width: int) -> GanPair:
    torch.manual_seed(0)
    if model == "dcgan":
        return GanPair("dcgan", DCGANGenerator(100, 3, resolution, width), DCGANDiscriminator(3, resolution, width),
                       100, False, "nonsaturating")
    if model == "stylegan2":  # width: channel_base (channels at resolution r: min(width // r, 512)); main phases only
        return GanPair("stylegan2", StyleGAN2Generator(resolution, STYLEGAN2_Z, 3, channel_base=width),
                       StyleGAN2Discriminator(resolution, 3, channel_base=width), STYLEGAN2_Z, False, "nonsaturating")
    attn = max(8, resolution // 2)  # BigGAN puts its attention one octave below the output
    return GanPair("biggan", BigGANGenerator(resolution, width, 120, N_CLASSES, 3, 128, attn),
                   BigGANDiscriminator(resolution, width, N_CLASSES, 3, attn), 120, True, "hinge")


def make_iteration(pair: GanPair, batch: int, resolution: int, device: torch.device,
                   precision: str) -> Callable[[], None]:
    """A closure running one full training iteration (D step + G step) on fixed random reals."""
    pair.G.to(device).train()
    pair.D.to(device).train()
    opt_g = torch.optim.Adam(pair.G.parameters(), lr=1e-4, betas=(0.0, 0.999))
    opt_d = torch.optim.Adam(pair.D.parameters(), lr=4e-4, betas=(0.0, 0.999))
    real = torch.rand(batch, 3, resolution, resolution, device=device) * 2 - 1
    labels = torch.randint(N_CLASSES, (batch,), device=device)
    both_labels = torch.cat([labels, labels])
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    def iteration() -> None:
        with torch.no_grad(), autocast:
            fake = pair.generate(torch.randn(batch, pair.z_dim, device=device), labels)
        with autocast:
            logits = pair.discriminate(torch.cat([real, fake.to(real.dtype)]), both_labels)
        real_logits, fake_logits = logits.chunk(2)
        objectives.d_loss(pair.loss, real_logits, fake_logits).backward()
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        pair.D.requires_grad_(False)
        with autocast:
            fake = pair.generate(torch.randn(batch, pair.z_dim, device=device), labels)
            loss_g = objectives.g_loss(pair.loss, pair.discriminate(fake, labels))
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad(set_to_none=True)
        pair.D.requires_grad_(True)

    return iteration


def measure(model: str, batch: int, resolution: int, width: int, device: torch.device, precision: str,
            iters: int, warmup: int, peak_tflops: float | None) -> dict:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # this row's peak, not the largest of the rows before
    pair = build(model, resolution, width)
    iteration = make_iteration(pair, batch, resolution, device, precision)
    with FlopCounterMode(display=False) as counter:  # also the first warm-up iteration
        iteration()
    flops = counter.get_total_flops()
    for _ in range(warmup - 1):
        iteration()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        iteration()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    step = statistics.median(times)
    if peak_tflops is None and device.type == "cuda":
        peak_tflops = gpu_peak_tflops(torch.cuda.get_device_name(device), precision)
    row = {"model": model, "resolution": resolution, "width": width, "batch": batch, "precision": precision,
           "params_G": sum(p.numel() for p in pair.G.parameters()),
           "params_D": sum(p.numel() for p in pair.D.parameters()),
           "iter_median_s": step, "iter_min_s": min(times), "iter_max_s": max(times), "img_per_s": batch / step,
           "gflop_per_iter": flops / 1e9, "achieved_tflops": flops / step / 1e12,
           "peak_tflops": peak_tflops, "mfu": (flops / step / 1e12 / peak_tflops) if peak_tflops else None}
    if device.type == "cuda":
        row["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    return row
