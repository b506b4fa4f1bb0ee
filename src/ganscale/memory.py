"""The memory a run needs, estimated before anything starts: a size no machine here can hold is one config error.

G and D are built on torch's meta device (shapes only, nothing allocated) and run forward there, with a hook on
every module that computes, to count per rank:
  state        parameters and buffers, gradients and Adam's two moments (of parameters the user did not freeze)
               and G_ema, each divided over the ranks
               that shard it (zero1: Adam; zero2: gradients and Adam; fsdp: all; hsdp: all, over a shard group;
               pipeline: all, over the stages; FSDP's CPU offload on a GPU: none on the device);
  activations  the outputs the heaviest step keeps for backward on one micro-batch (a pipeline rank: its share
               of its replica's), twice a network's for a double backward (R1, gradient penalty, path length),
               plus backward's working set, twice the largest output;
               Or drawing the sample grid between steps (no gradients), where that needs more;
  latents      the noise of a global batch and of the sample grid (drawn whole on every rank).
Left out: the functional operations between modules, temporaries, the allocator's slack and the framework itself.
So the estimate is below the real peak, and a run is refused only when it exceeds REFUSE_ABOVE x the memory.
A user's network whose forward needs real values (`.item()`, numpy, a branch on a tensor) cannot run on meta: its
activations are not counted, and the estimate says so (`Estimate.note`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor, nn

from ganscale.config import Config, ConfigError, LogConfig, ModelConfig, TrainConfig
from ganscale.metrics.modes2d import PROTOCOL_SAMPLES
from ganscale.models import meta_networks
from ganscale.observe.samples import grid_bytes, grid_pixels
from ganscale.parallel import FULLY_SHARDED
from ganscale.preflight import reuses_fake
from ganscale.runtime import uses_cuda
from ganscale.tasks import Paired, Unconditional, build_task

REFUSE_ABOVE = 1.0  # the estimate leaves out what the module docstring lists: above the memory, a run cannot fit
GiB = 2**30
FP32 = 4
# Keys that set a size, and the value the refusal tries instead to find the one that drives it (their defaults).
SIZE_KEYS = {**{f"model.{k}": ModelConfig.model_fields[k].default for k in ("z_dim", "g_width", "d_width",
                                                                           "g_layers", "d_layers", "shared_dim")},
             "log.samples": LogConfig.model_fields["samples"].default}
SMALL_BATCH = TrainConfig.model_fields["batch_size"].default


@dataclass
class Estimate:
    """Bytes one rank needs, by part."""
    state: int
    activations: int
    latents: int
    unestimated: str | None = None
    """Why the activations were not estimated (then counted as 0), else None."""

    @property
    def total(self) -> int:
        return self.state + self.activations + self.latents

    @property
    def note(self) -> str | None:
        """The one line a run prints when its activations were not estimated."""
        if self.unestimated is None:
            return None
        return (f"activations were not estimated: {self.unestimated}; the memory check counts parameters, "
                "gradients, Adam, G_ema and latents only")

    def __str__(self) -> str:
        return (f"{gib(self.total)} (parameters, gradients, Adam and G_ema {gib(self.state)}; activations "
                f"{gib(self.activations)}; latents {gib(self.latents)})")


def gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:,.2f} GiB" if n_bytes >= GiB / 10 else f"{n_bytes / 2**20:,.1f} MiB"


# ------------------------------------------------------------------------------------------------- measuring
def _computes(module: nn.Module) -> bool:
    """A module whose forward is its own computation, not a container's: no children but its parametrizations."""
    return all(name == "parametrizations" for name, _ in module.named_children())


@contextlib.contextmanager
def outputs_of(network: nn.Module) -> Iterator[list[int]]:
    """Inside: the bytes of every new tensor the network's computing modules return, in call order (in-place
    results and views are the tensors they came from)."""
    sizes: list[int] = []

    def record(module: nn.Module, inputs: tuple, output) -> None:
        for tensor in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(tensor, Tensor) and tensor._base is None and not any(tensor is i for i in inputs):
                sizes.append(tensor.numel() * tensor.element_size())

    hooks = [m.register_forward_hook(record) for m in network.modules() if _computes(m)]
    try:
        yield sizes
    finally:
        for hook in hooks:
            hook.remove()


def _bytes(*tensors: Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _network_bytes(net: nn.Module) -> tuple[int, int, int]:
    """(parameter bytes, trained parameter bytes, buffer bytes) of a network. Trained: the parameters that
    require gradients when ganscale gets the network; one the user froze gets no gradient and no Adam state."""
    return (_bytes(*net.parameters()), _bytes(*(p for p in net.parameters() if p.requires_grad)),
            _bytes(*net.buffers()))


# ------------------------------------------------------------------------------------------------- training
def _divisors(cfg: Config, strategy: str, world: int, local_ranks: int) -> tuple[int, int, int]:
    """Over how many ranks (parameters, gradients, Adam's state) of a network are spread. Coarse: FSDP's
    all-gathered layer, ZeroRedundancyOptimizer's uneven split and the pipeline's unequal stages are left out."""
    p = cfg.parallel
    if world == 1:
        return 1, 1, 1
    if strategy == "pipeline":
        return (p.pipeline_stages,) * 3
    if strategy == "hsdp":
        return (p.mesh[1] if p.mesh else min(local_ranks, world),) * 3
    return {"ddp": (1, 1, 1), "zero1": (1, 1, world), "zero2": (1, world, world)}.get(strategy, (world,) * 3)


def _state_bytes(cfg: Config, generator: nn.Module, discriminator: nn.Module, world: int, local_ranks: int,
                 on_cuda: bool) -> int:
    total = 0
    for net, strategy, with_ema in ((generator, cfg.parallel.generator, True),
                                    (discriminator, cfg.parallel.discriminator, False)):
        if on_cuda and cfg.parallel.cpu_offload and strategy in FULLY_SHARDED:
            continue  # shards, gradients and Adam's state live in host memory
        params, trained, buffers = _network_bytes(net)
        on_params, on_grads, on_adam = _divisors(cfg, strategy, world, local_ranks)
        copies = 2 if with_ema else 1  # G_ema: placed and sharded like G
        total += copies * (params + buffers) // on_params + trained // on_grads + 2 * trained // on_adam
    return total


def _real_sample(cfg: Config, task: Unconditional, n: int) -> tuple[Tensor, ...]:
    """A meta micro-batch shaped as the data stream yields it."""
    from ganscale.data.mixtures import MIXTURE_MODES

    d = cfg.data
    shape = (n, 2) if d.kind in MIXTURE_MODES else (n, d.channels, d.resolution, d.resolution)
    images = torch.empty(shape)
    if isinstance(task, Paired):
        return images, torch.empty_like(images)
    return (images, torch.zeros(n, dtype=torch.int64)) if task.n_classes else (images,)


def _step_activations(cfg: Config, generator: nn.Module, discriminator: nn.Module, world: int) -> tuple[int, int]:
    """(bytes kept for backward in the heavier step, the largest single output) of one micro-batch, in fp32."""
    task = build_task(cfg, previews=False)
    micro = cfg.micro_batch(world)
    with torch.device("meta"):
        real = _real_sample(cfg, task, micro)
        z = torch.empty(micro, cfg.model.z_dim)
        labels = torch.zeros(micro, dtype=torch.int64) if task.n_classes else None
        parts = 3 if cfg.loss.with_gradient_penalty else 2  # D judges [real, fake(, interpolates)] in one forward
        with outputs_of(generator) as g_outputs:
            fake = task.generate(generator, real, z, labels)
        critic_input = torch.cat([task.critic_view(real, fake)] * parts)
        with outputs_of(discriminator) as d_step:
            discriminator(critic_input, *task.critic_conditions(real, labels))
        with outputs_of(discriminator) as g_step:
            discriminator(task.critic_view(real, fake), *task.critic_conditions(None, labels))
    g_forward = _bytes(z, *real) + sum(g_outputs)
    kept_g = g_forward if reuses_fake(cfg, world, task.same_fake_for_g)[0] else 0  # G's graph kept for its step
    loss = cfg.loss
    # A double backward keeps the first backward's graph too, about the forward's size again.
    d_kept = sum(d_step) * (2 if loss.penalises_input_gradient else 1)
    d_heavier = _bytes(critic_input) + d_kept + kept_g
    g_heavier = g_forward + sum(g_step)
    # Path length regularisation: G's forward on micro / pl_batch_shrink samples, differentiated twice.
    path_length = 2 * g_forward // loss.pl_batch_shrink if loss.pl_weight > 0 else 0
    return max(d_heavier, g_heavier, path_length), max([*g_outputs, *d_step, 0])


def _sample_grid_bytes(cfg: Config, generator: nn.Module) -> int:
    """Drawing the run's sample grid (log.samples, or the 2D protocol's points), between steps, in fp32."""
    from ganscale.data.mixtures import MIXTURE_MODES

    task = build_task(cfg, previews=False)
    if isinstance(task, Paired):  # its grid translates a few fixed pairs, whatever log.samples
        return 0
    n = PROTOCOL_SAMPLES if cfg.data.kind in MIXTURE_MODES else cfg.log.samples
    return _drawing_bytes(generator, task.preview, torch.empty(n, cfg.model.z_dim, device="meta"),
                          task.grid_columns)[0]


def training_estimate(cfg: Config, world: int, local_ranks: int = 1, on_cuda: bool = False) -> Estimate:
    """What one rank of a `world`-rank run of `cfg` needs (`local_ranks` of them on a node)."""
    generator, discriminator = meta_networks(cfg)
    latents = (cfg.train.batch_size + cfg.log.samples) * cfg.model.z_dim * FP32
    state = _state_bytes(cfg, generator, discriminator, world, local_ranks, on_cuda)
    try:
        activations = _activation_bytes(cfg, generator, discriminator, world)
    except Exception as e:  # noqa: BLE001 - any error of a user's forward on meta (a shipped network's: raised)
        return Estimate(state, 0, latents, _not_on_meta(cfg, e))
    return Estimate(state, activations, latents)


def _not_on_meta(cfg: Config, error: Exception) -> str:
    """Why a user's forward could not be counted: the error's first line. A shipped network's error is raised."""
    if cfg.model.kind != "custom":
        raise error
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"the networks' forward does not run on the meta device ({reason})"


def _activation_bytes(cfg: Config, generator: nn.Module, discriminator: nn.Module, world: int) -> int:
    """Activations of the heavier step on one rank, or of drawing the sample grid where that needs more."""
    kept, largest = _step_activations(cfg, generator, discriminator, world)
    stages = cfg.parallel.pipeline_stages if cfg.parallel.pipelined else 1  # each holds its layers' outputs
    half = cfg.train.precision in ("bf16", "fp16")  # autocast's outputs are 2 bytes
    return max((kept // stages + 2 * largest) // (2 if half else 1), _sample_grid_bytes(cfg, generator))


def _with(cfg: Config, key: str, value: int) -> Config:
    changed = cfg.model_copy(deep=True)
    section, field = key.split(".")
    setattr(getattr(changed, section), field, value)
    return changed


def _driving_key(cfg: Config, world: int, estimate: Callable[[Config], Estimate]) -> tuple[str, str]:
    """(key, how much lowering it helps): the size key whose default (or 64 samples per rank) lowers the estimate
    the most; the batch, when no key is above its default."""
    batch_key = "train.micro_batch" if cfg.train.micro_batch else "train.batch_size"
    small_batch = cfg.data_ranks(world) * SMALL_BATCH if batch_key == "train.batch_size" else SMALL_BATCH
    tried = []
    for key, default in (*SIZE_KEYS.items(), (batch_key, small_batch)):
        section, field = key.split(".")
        if getattr(getattr(cfg, section), field) > default:
            tried.append((estimate(_with(cfg, key, default)).total, key, default))
    if not tried:
        return batch_key, ""
    lower, key, default = min(tried)
    return key, f" (with {key}={default} the estimate is {gib(lower)})"


# ------------------------------------------------------------------------------------------------- the machine
def host_available() -> int:
    """Bytes this host can still give: MemAvailable, within the container's memory limit where one is set."""
    try:
        meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        room = int(meminfo["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        room = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                           "memory/memory.usage_in_bytes")):  # cgroup v2, v1
        with contextlib.suppress(OSError, ValueError):
            cgroup = Path("/sys/fs/cgroup")
            room = min(room, int((cgroup / limit).read_text()) - int((cgroup / usage).read_text()))
    return max(room, 0)


def available(device: torch.device, local_ranks: int) -> int:
    """Bytes one rank may use: a GPU's free memory, or the host's available memory shared by its local ranks."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return host_available() // local_ranks


def where(device_type: str, local_ranks: int) -> str:
    """What `available` measured, for the refusal."""
    if device_type == "cuda":
        return "free on the GPU of the rank with the least"
    return f"available per rank (this machine's available memory over its {local_ranks} rank(s))"


# ------------------------------------------------------------------------------------------------- refusing
def check_training(cfg: Config, world: int, room: int, room_is: str, local_ranks: int = 1,
                   on_cuda: bool = False) -> Estimate:
    """ConfigError when one rank's estimate exceeds REFUSE_ABOVE x `room` bytes (described by `room_is`); else the
    estimate."""
    def estimate(config: Config) -> Estimate:
        return training_estimate(config, world, local_ranks, on_cuda)

    needed = estimate(cfg)
    if needed.total <= REFUSE_ABOVE * room:
        return needed
    key, helps = _driving_key(cfg, world, estimate)
    if needed.activations <= needed.state:
        more = ", or shard G and D over more ranks (parallel.generator=fsdp, parallel.discriminator=fsdp)"
    elif cfg.train.micro_batch is None:
        more = ", or set train.micro_batch to accumulate the batch in smaller micro-batches"
    else:
        more = "" if key == "train.micro_batch" else ", or lower train.micro_batch (more micro-steps accumulate)"
    raise ConfigError(key, f"one rank needs about {needed}, more than the {gib(room)} {room_is}",
                      f"lower {key}{helps}{more}")


def check_before_launch(cfg: Config, nproc: int) -> None:
    """The check of `train --nproc` before any worker starts: CPU ranks share this host's available memory; a GPU
    rank gets its device's total here (no CUDA context opened in the parent), its free memory in the worker."""
    on_cuda = uses_cuda(cfg.train.device)
    if on_cuda:
        room = min(torch.cuda.get_device_properties(i).total_memory for i in range(nproc))
    else:
        room = available(torch.device("cpu"), nproc)
    room_is = "of each rank's GPU" if on_cuda else where("cpu", nproc)
    check_training(cfg, nproc, room, room_is, nproc, on_cuda)


def _drawing_bytes(generator: nn.Module, preview: Callable[[nn.Module, Tensor], Tensor], z: Tensor,
                   columns: int | None) -> tuple[int, torch.Size]:
    """Bytes of drawing a picture from latents `z` (meta): G's forward without gradients (a layer's input and
    output at a time), the samples in fp32 and the grid picture (2D data: a fixed-size scatter plot); and the
    shape of the samples the picture shows."""
    with torch.device("meta"), torch.no_grad(), outputs_of(generator) as outputs:
        samples = preview(generator, z)
    in_flight = max((a + b for a, b in zip([_bytes(z), *outputs], outputs)), default=0)
    grid = 0 if samples.dim() == 2 else grid_bytes(samples.shape, columns)
    return in_flight + samples.numel() * FP32 + grid, samples.shape


def check_sampling(cfg: Config, preview: Callable[[nn.Module, Tensor], Tensor], n: int,
                   columns: int | None, option: str = "--n") -> str | None:
    """`ganscale sample --n` (and interpolate's, and eval's `--samples` of a 2D mixture, drawn at once):
    ConfigError at `option` when the latents and drawing n samples exceed the host's available memory, or their
    grid is a picture larger than Pillow opens. The line to print when G's forward could not be counted (then only
    the latents and samples are), else None."""
    z = torch.empty(n, cfg.model.z_dim, device="meta")
    try:
        (drawing, shown), note = _drawing_bytes(meta_networks(cfg)[0].eval(), preview, z, columns), None
    except Exception as e:  # noqa: BLE001 - any error of a user's forward on meta (a shipped network's: raised)
        drawing, shown = n * math.prod(cfg.data.sample_shape) * FP32, torch.Size((n, *cfg.data.sample_shape))
        note = f"drawing was not estimated: {_not_on_meta(cfg, e)}; the memory check counts latents and samples only"
    needed = _bytes(z) + drawing
    room = host_available()
    if needed > REFUSE_ABOVE * room:
        fits = max(1, math.floor(n * room / needed))  # every part grows with n
        raise ConfigError(option, f"{n} samples need about {gib(needed)}, more than the {gib(room)} this machine has "
                          "available", f"draw at most about {fits} ({option} {fits})")
    limit = Image.MAX_IMAGE_PIXELS  # what Pillow opens without refusing it as a decompression bomb
    pixels = grid_pixels(shown, columns) if len(shown) == 4 else 0
    if limit and pixels > limit:
        most = next(k for k in range(math.floor(n * limit / pixels), 0, -1)  # the estimate, down to one that opens
                    if grid_pixels(torch.Size((k, *shown[1:])), columns) <= limit)
        raise ConfigError("--n", f"the grid of {n} samples is {pixels:,} pixels, more than Pillow opens ({limit:,}; "
                          "it refuses more as a decompression bomb)", f"draw at most {most} (--n {most})")
    return note


def check_scoring(n: int, bytes_per_sample: int) -> None:
    """`ganscale eval --samples` of an image run: ConfigError when the n samples' noise and features
    (`bytes_per_sample`, their copies included) exceed the host's available memory."""
    needed, room = n * bytes_per_sample, host_available()
    if needed > REFUSE_ABOVE * room:
        fits = max(1, math.floor(room / bytes_per_sample))
        raise ConfigError("--samples", f"scoring {n} samples needs about {gib(needed)} for their noise and features, "
                          f"more than the {gib(room)} this machine has available",
                          f"score at most about {fits} (--samples {fits}; thousands give stable numbers)")


GIF_FRAME_BYTES_PER_PIXEL = 1  # Pillow's GIF writer keeps every frame, palette-quantized: a byte a pixel, until the end


def check_animation(cfg: Config, n: int, count: int, steps: int, columns: int | None) -> None:
    """`ganscale interpolate`: ConfigError naming --count and --steps when the GIF's count x steps frames, which
    Pillow holds in memory until the file is written, exceed the host's available memory."""
    frames = count * steps
    frame = grid_pixels(torch.Size((n, *cfg.data.sample_shape)), columns) * GIF_FRAME_BYTES_PER_PIXEL
    room = host_available()
    if frames * frame > REFUSE_ABOVE * room:
        fits = max(1, math.floor(room / frame))
        raise ConfigError("--count/--steps", f"a GIF of {count} x {steps} = {frames:,} frames of {frame:,} bytes "
                          f"(Pillow holds every frame until the file is written) needs about {gib(frames * frame)}, "
                          f"more than the {gib(room)} this machine has available",
                          f"lower --count or --steps so that --count x --steps is at most {fits:,} (or lower --n)")
