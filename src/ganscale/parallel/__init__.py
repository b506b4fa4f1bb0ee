"""Parallel strategies: functions that take a single-device network and return it wrapped.

The training loop sees only `Wrapped`: call it, switch gradient sync off for all but the last
micro-step, freeze or unfreeze it, take its gradient norm. It never asks which strategy it has.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
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

    def grad_norm(self, max_norm: float) -> Tensor:
        """The gradient norm before clipping; clips to `max_norm` when it is > 0."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


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


__all__ = ["Wrapped", "data_parallel", "average_batchnorm_stats"]
