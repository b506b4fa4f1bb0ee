"""Keeping non-finite values out of the model: what a skipped step undoes, and what is never saved.

A step skipped for a non-finite loss or gradient leaves the parameters as they were, but its forwards already
moved the buffers (BatchNorm running statistics, spectral norm's u/v, counters): `BufferSnapshot` puts them back.
Whatever non-finite value still reaches a parameter or buffer stops the run, named, before it is saved, drawn
from or exported (`first_non_finite`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ganscale.fault import NonFiniteTraining
from ganscale.parallel import local


class BufferSnapshot:
    """The buffers of each network, copied into tensors allocated once: `take` them before the forwards a step
    owns, `restore` them when every rank agreed to skip it. Nothing is copied for networks without buffers."""

    def __init__(self, **networks: nn.Module):
        self.live = {name: [local(b) for b in m.buffers()] for name, m in networks.items()}
        self.saved = {name: [b.clone() for b in live] for name, live in self.live.items()}

    @torch.no_grad()
    def take(self, *names: str) -> None:
        for name in names:
            if self.live[name]:
                torch._foreach_copy_(self.saved[name], self.live[name])

    @torch.no_grad()
    def restore(self, *names: str) -> None:
        for name in names:
            if self.live[name]:
                torch._foreach_copy_(self.live[name], self.saved[name])


def first_non_finite(tensors: dict[str, list[tuple[str, Tensor]]]) -> str | None:
    """The name ("G_ema.net.1.running_var") of the first floating tensor holding a NaN or an infinity, or None.
    One fused max-abs per network (NaN and infinities survive it; a large finite value cannot overflow it)."""
    for prefix, named in tensors.items():
        floating = [(name, local(t).detach()) for name, t in named if t.is_floating_point() and local(t).numel()]
        if not floating:
            continue
        peaks = torch._foreach_norm([t for _, t in floating], ord=float("inf"))
        # FSDP2's CPU offload keeps parameter shards on the CPU and buffers (BatchNorm's statistics) on the GPU
        device = next((p.device for p in peaks if p.device.type != "cpu"), peaks[0].device)
        peaks = torch.stack([p.to(device) for p in peaks])
        if not bool(peaks.isfinite().all()):
            return f"{prefix}.{floating[int((~peaks.isfinite()).nonzero()[0])][0]}"
    return None


def refuse_non_finite(tensors: dict[str, list[tuple[str, Tensor]]], where: str, fix: str) -> None:
    """Raise `NonFiniteTraining` naming the first non-finite tensor of `tensors` (found in `where`)."""
    name = first_non_finite(tensors)
    if name is not None:
        raise NonFiniteTraining(f"{name} {where} holds NaN or infinite values; {fix}")


def refuse_non_finite_checkpoint(state: dict, networks: tuple[str, ...], path, fix: str) -> None:
    """For what reads a checkpoint's networks (export, sample, eval): none of them may be non-finite."""
    refuse_non_finite({net: list(state[net].items()) for net in networks}, f"in checkpoint {path}", fix)
