"""`ganscale bench overhead`: what ganscale's trainer costs over a hand-written PyTorch loop.

Both train the `digits` recipe's DCGAN (same networks and init, same global batch, fp32, Adam,
nonsaturating loss, one D step then one G step, EMA of G) in one process on one thread. They
alternate in blocks inside one process, so drift (thermal, other load on the machine) hits both:
the trainer runs its `fit()` as a one-rank gloo group, and after every block of its steps a block of
the plain loop runs (from a hook on the trainer's per-step progress call). A step of the trainer is
the time between two of those calls, minus the plain block in between. Both wall time and the
process's CPU time are measured per step: on a shared machine the wall time also holds the waits for
a core (and the wake-up of gloo's worker thread), the CPU time only what the code does.

What the trainer does on top of the plain loop, by design (and so inside the measured ratio):
latents drawn from a per-(step, phase) seeded generator instead of the global RNG, a gradient norm
of each network every step (logged, and checked for non-finite values), the per-step agreement on
losses, skip and stop (taken locally in one process: no collective), the step-time breakdown
(`log.step_times`), the learning-rate schedule, watchdog marks, EMA beta from a half-life in images,
and a metrics line every `log.every` steps. Samples and
checkpoints are switched off (`log.sample_every=0`, `checkpoint.every=0`; the final step's are not
timed). The plain loop reads both losses every step (`.item()`), as a loop that logs them would.
"""

from __future__ import annotations

import contextlib
import copy
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ganscale import config, preflight
from ganscale.bench.report import median, spread
from ganscale.data import build_dataset
from ganscale.models import build_networks

RECIPE = "digits"
# Periodic outputs are not step costs: off in the trainer, absent in the plain loop.
TRAINER_OVERRIDES = ["log.sample_every=0", "checkpoint.every=0", "log.tensorboard=false", "train.precision=fp32",
                     "train.device=cpu"]


class PlainDCGAN:
    """The same training written the way one would by hand: no wrappers, no collectives, no checks."""

    def __init__(self, cfg: config.Config, reals: Tensor):
        self.G, self.D = build_networks(cfg)  # the same networks and initialisation as the trainer's
        self.G_ema = copy.deepcopy(self.G).eval().requires_grad_(False)
        self.opt_g = torch.optim.Adam(self.G.parameters(), lr=cfg.optim.g.lr, betas=tuple(cfg.optim.g.betas))
        self.opt_d = torch.optim.Adam(self.D.parameters(), lr=cfg.optim.d.lr, betas=tuple(cfg.optim.d.betas))
        self.reals, self.batch, self.z_dim = reals, cfg.train.batch_size, cfg.model.z_dim
        self.beta = 0.5 ** (self.batch / cfg.train.ema_half_life_images)
        self.order, self.position = torch.randperm(len(reals)), 0

    def next_batch(self) -> Tensor:
        if self.position + self.batch > len(self.order):
            self.order, self.position = torch.randperm(len(self.reals)), 0
        index = self.order[self.position:self.position + self.batch]
        self.position += self.batch
        return self.reals[index]

    def step(self) -> tuple[float, float]:
        real = self.next_batch()
        # D step: one forward over [real, fake], as the trainer does.
        with torch.no_grad():
            fake = self.G(torch.randn(self.batch, self.z_dim))
        real_logits, fake_logits = self.D(torch.cat([real, fake])).chunk(2)
        loss_d = F.softplus(-real_logits).mean() + F.softplus(fake_logits).mean()
        loss_d.backward()
        self.opt_d.step()
        self.opt_d.zero_grad(set_to_none=True)
        # G step through a frozen D.
        self.D.requires_grad_(False)
        loss_g = F.softplus(-self.D(self.G(torch.randn(self.batch, self.z_dim)))).mean()
        loss_g.backward()
        self.opt_g.step()
        self.opt_g.zero_grad(set_to_none=True)
        self.D.requires_grad_(True)
        with torch.no_grad():
            torch._foreach_lerp_(list(self.G_ema.parameters()), list(self.G.parameters()), 1.0 - self.beta)
            for ema_buffer, buffer in zip(self.G_ema.buffers(), self.G.buffers()):
                ema_buffer.copy_(buffer)
        return loss_d.item(), loss_g.item()


def measure(steps: int, repeats: int, warmup: int = 20, batch: int | None = None,
            profile: bool = False) -> dict:
    """Alternate `repeats` blocks of `steps` steps of each loop; per-step wall and CPU seconds, and the ratios."""
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    overrides = [*TRAINER_OVERRIDES, f"train.steps={warmup + repeats * steps}"]
    if batch is not None:
        overrides.append(f"train.batch_size={batch}")
    cfg = config.load(RECIPE, overrides)
    preflight.check(cfg, 1, False)
    plain = PlainDCGAN(cfg, build_dataset(cfg).tensors[0])
    # Per step, per loop: wall seconds and this process's CPU seconds (all its threads). On a shared
    # machine, wall time also holds the waits for a core; CPU time is what the code itself costs.
    wall: dict[str, list[list[float]]] = {"plain": [], "ganscale": []}
    cpu: dict[str, list[list[float]]] = {"plain": [], "ganscale": []}
    profiler = cProfile.Profile() if profile else None
    resumed = {"wall": 0.0, "cpu": 0.0}

    def plain_block(n: int, keep: bool) -> None:
        walls, cpus = [], []
        for _ in range(n):
            started, started_cpu = time.perf_counter(), time.process_time()
            plain.step()
            walls.append(time.perf_counter() - started)
            cpus.append(time.process_time() - started_cpu)
        if keep:
            wall["plain"].append(walls)
            cpu["plain"].append(cpus)

    runtime = start("cpu")
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            trainer = Trainer(cfg, runtime, Path(run_dir))
            advance = trainer.reporter.log.advance

            def timed_advance(n: int = 1) -> None:
                advance(n)
                now, now_cpu = time.perf_counter(), time.process_time()
                if profiler:
                    profiler.disable()
                done = trainer.step
                if done > warmup:
                    wall["ganscale"][-1].append(now - resumed["wall"])
                    cpu["ganscale"][-1].append(now_cpu - resumed["cpu"])
                if done >= warmup and (done - warmup) % steps == 0 and done < cfg.train.steps:
                    if done == warmup:
                        plain_block(warmup, keep=False)
                    plain_block(steps, keep=True)
                    wall["ganscale"].append([])
                    cpu["ganscale"].append([])
                resumed["wall"], resumed["cpu"] = time.perf_counter(), time.process_time()
                if profiler and done >= warmup:
                    profiler.enable()

            trainer.reporter.log.advance = timed_advance
            resumed["wall"], resumed["cpu"] = time.perf_counter(), time.process_time()
            trainer.fit()
    finally:
        if profiler:
            profiler.disable()
        runtime.close()
    result = {"batch": cfg.train.batch_size, "steps_per_block": steps, "blocks": repeats, "warmup_steps": warmup}
    for clock, blocks in (("wall", wall), ("cpu", cpu)):
        plain_all = [t for block in blocks["plain"] for t in block]
        ours_all = [t for block in blocks["ganscale"] for t in block]
        block_ratios = [median(o) / median(p) for p, o in zip(blocks["plain"], blocks["ganscale"])]
        result[clock] = {"plain_median_s": median(plain_all), "ganscale_median_s": median(ours_all),
                         "plain_range_s": spread(plain_all), "ganscale_range_s": spread(ours_all),
                         "ratio": median(ours_all) / median(plain_all), "block_ratios": block_ratios,
                         "ratio_of_block_medians": median(block_ratios), "timed_steps": [len(plain_all), len(ours_all)]}
    if profiler:
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        result["profile"] = text.getvalue()
    return result
