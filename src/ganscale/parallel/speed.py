"""The fast path: memory layout, compilation and CUDA graphs, applied to networks the way strategies are.

- `in_layout(module, channels_last)` puts an image network's 4-D weights in NHWC before it is wrapped
  (DDP's gradient buckets then take the same strides); convolutions follow their weights' layout, so the
  activations are NHWC too, which is what tensor-core convolutions want.
- `compiled(wrapped, mode)` runs the wrapped network's forward through `torch.compile`; modes
  `reduce-overhead` and `max-autotune` also record CUDA graphs on a GPU, replaying a batch-1 step without
  launch overhead.
  The strategy keeps working underneath: a compiled DDP module still reduces gradients in backward and
  still honours `no_sync`, since `Wrapped.gradient_sync` acts on the DDP module itself. Likewise
  `Wrapped.power_iteration` pauses spectral norm after a step's first micro-step by putting its
  parametrizations in eval mode (a classic hook: its n_power_iterations to 0): Dynamo guards on both, so with
  accumulation a network with spectral norm gets a second graph (per form of its forward) for its later
  micro-steps, compiled once, not per step.
- `choose_convolution_algorithms(benchmark)` lets cuDNN time each convolution shape's algorithms once and keep the
  fastest (`train.cudnn_benchmark`, on by default, as in PyTorch's DCGAN example and StyleGAN2-ADA), instead of
  taking its heuristic's pick; the eager and the compiled path both run cuDNN's convolutions.
- `fp32_in_tf32(enabled)`: fp32 convolutions in TF32 (`train.tf32`, torch's default), or everything in full fp32.
- Fused Adam is the optimizer's own option (`optim.fused`), set where the trainer builds its optimizers.

What compilation cannot do is refused by preflight.check: double backward (R1, gradient penalty), FSDP2's
hooks and pipeline stages.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ganscale.parallel import Wrapped


def in_layout(module: nn.Module, channels_last: bool) -> nn.Module:
    """The network with its 4-D weights in channels-last (NHWC) layout when asked; others are unchanged."""
    return module.to(memory_format=torch.channels_last) if channels_last else module


def choose_convolution_algorithms(benchmark: bool) -> None:
    """cuDNN's algorithm choice for this process: timed per shape (`benchmark`) or its heuristic's (no effect off
    CUDA). Inductor's compiled graphs call the same convolutions, so this holds for the fast path too."""
    torch.backends.cudnn.benchmark = benchmark


class _IgnoredProfilerRanges(logging.Filter):
    """Drops Dynamo's warning that a profiler range in traced code is ignored: DDP's forward opens one
    ("DistributedDataParallel.forward"), so every compiled DDP run printed it once per rank, with nothing to do."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Profiler") and message.endswith("will be ignored"))


DYNAMO_PROFILER_LOGGERS = ("torch._dynamo.variables.ctx_manager", "torch._dynamo.variables.torch")


def compiled(wrapped: Wrapped, mode: str) -> Wrapped:
    """The network's forward compiled with `torch.compile(mode=mode)` ("off": left eager)."""
    if mode != "off":
        for name in DYNAMO_PROFILER_LOGGERS:
            logger = logging.getLogger(name)
            if not any(isinstance(f, _IgnoredProfilerRanges) for f in logger.filters):
                logger.addFilter(_IgnoredProfilerRanges())
        wrapped.forward = wrapped.forward_without_grad = torch.compile(wrapped.net, mode=mode)
    if records_cuda_graphs(mode):  # CUDA-graph trees must be told where an iteration starts (~0.1 ms a call)
        wrapped.begin_iteration = torch.compiler.cudagraph_mark_step_begin
    return wrapped


def traffic_unmeasurable(mode: str) -> str | None:
    """Why a run compiled in `mode` cannot have its communication measured (parallel/traffic.py), or None: the
    meter's dispatch mode would turn the compiled networks back to eager for the rest of the run."""
    return None if mode == "off" else f"train.compile={mode}: a dispatch mode would make the networks run eagerly"


def records_cuda_graphs(mode: str) -> bool:
    """Whether torch.compile's `mode` records CUDA graphs (reduce-overhead and max-autotune do). Unmarked, their
    graph trees start a new iteration at every compiled call, which frees the outputs of the one before: the
    gradients of an earlier micro-step of accumulation included."""
    from torch._inductor import list_mode_options

    return mode != "off" and bool(list_mode_options(mode).get("triton.cudagraphs"))


def fp32_in_tf32(enabled: bool) -> None:
    """Convolutions in TF32 on GPUs that have it (torch's default), or, off, convolutions and matrix products in
    full fp32 (no effect off CUDA). torch's per-backend precision settings: its older allow_tf32 flags, mixed
    with them, raise."""
    torch.backends.cudnn.conv.fp32_precision = "tf32" if enabled else "ieee"
    if not enabled:
        torch.backends.cuda.matmul.fp32_precision = "ieee"
