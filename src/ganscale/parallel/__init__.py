"""Parallel strategies: functions that take a single-device network and return it wrapped.

The training loop sees only `Wrapped`: call it, switch gradient sync off for all but the last
micro-step, freeze or unfreeze it, take its gradient norm, build its optimizer, gather that
optimizer's state for a checkpoint. It never asks which strategy it has.

Strategies (per network, `parallel.generator` / `parallel.discriminator`):
  ddp    full replica per rank, gradients all-reduced (DistributedDataParallel).
  zero1  ddp + optimizer state sharded over ranks (ZeroRedundancyOptimizer, ZeRO stage 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ganscale.parallel.syncbn import average_batchnorm_stats, convert_batchnorm
from ganscale.runtime import Runtime


class Wrapped:
    """A network as the trainer uses it, whatever the strategy."""

    def __init__(self, module: nn.Module, net: nn.Module):
        self.module = module  # the single-device network: weights, EMA, saving
        self.net = net        # what forward goes through (may communicate)

    def __call__(self, *args, **kwargs) -> Tensor:
        return self.net(*args, **kwargs)

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Around forward *and* backward of a micro-step: off for every micro-step but the last."""
        if enabled or not isinstance(self.net, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.net.no_sync()

    def trainable(self, flag: bool) -> None:
        """Freeze (False) or unfreeze: D is frozen during the G step so G's loss flows through it."""
        self.module.requires_grad_(flag)

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.module.parameters()

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        return optimizer_class(self.module.parameters(), **kwargs)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        """The full optimizer state for a checkpoint (collective for sharded optimizers; valid on rank 0)."""
        return optimizer.state_dict()

    def grad_norm(self, max_norm: float) -> Tensor:
        """The gradient norm before clipping; clips to `max_norm` when it is > 0."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


class ShardedOptimizerState(Wrapped):
    """ZeRO-1: each rank keeps the optimizer state (Adam's moments) of its share of the parameters,
    steps that share, and broadcasts the updated parameters; gradients are still all-reduced by DDP."""

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        return ZeroRedundancyOptimizer(self.module.parameters(), optimizer_class=optimizer_class, **kwargs)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict | None:
        optimizer.consolidate_state_dict(to=0)  # collective: every rank sends its shard to rank 0
        return optimizer.state_dict() if torch.distributed.get_rank() == 0 else None


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shard, for a sharded optimizer)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    return sum(t.numel() * t.element_size() for state in local.state.values() for t in state.values()
               if isinstance(t, Tensor))


def parallelize(module: nn.Module, strategy: str, runtime: Runtime, sync_bn: bool) -> Wrapped:
    """Apply a network's strategy: 'ddp' or 'zero1' (see the module docstring)."""
    wrapped = data_parallel(module, runtime, sync_bn)
    if strategy == "zero1" and runtime.world > 1:
        return ShardedOptimizerState(wrapped.module, wrapped.net)
    return wrapped


def data_parallel(module: nn.Module, runtime: Runtime, sync_bn: bool) -> Wrapped:
    """DDP: a full replica per rank, gradients averaged by all-reduce overlapped with backward.

    Buffers are not broadcast before each forward (that overwrote the second D forward's inputs with
    BatchNorm before torch 2.12, and it is a collective a rank-0-only forward would hang on); with
    `sync_bn` off the trainer averages BatchNorm statistics explicitly before evaluating or saving.
    """
    module.to(runtime.device)
    if runtime.world == 1:
        return Wrapped(module, module)
    if sync_bn:
        module = convert_batchnorm(module, use_cuda=runtime.device.type == "cuda")
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    net = DistributedDataParallel(module, device_ids=device_ids, forward_sync_buffers=False)
    return Wrapped(module, net)


__all__ = ["Wrapped", "ShardedOptimizerState", "parallelize", "data_parallel", "optimizer_state_bytes",
           "average_batchnorm_stats"]
