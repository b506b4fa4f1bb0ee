"""How many bytes a training step communicates, by kind of collective, as measured (not estimated).

Every collective and point-to-point operation in PyTorch, whoever issues it (DDP's reducer in C++,
FSDP2's all-gathers and reduce-scatters, ZeroRedundancyOptimizer's broadcasts, our own all-reduces,
DTensor's functional collectives, pipeline send/recv), goes through the dispatcher as a `c10d` or
`_c10d_functional` operator. A dispatch mode sees each one with its tensors, on whatever thread autograd
runs it. The mode costs a Python call per operator, so the trainer measures one step, not every step.

Bytes are payload bytes: the size of the full tensor that is reduced, gathered, scattered, broadcast or
sent (for an all-gather, the gathered tensor; for a reduce-scatter, the tensor before scattering). What
crosses the wire per rank follows from the algorithm (a ring all-reduce moves 2(W-1)/W of the payload).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = {  # operator name (without overload) -> kind reported
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "send": "send_recv", "recv_": "send_recv", "recv_any_source_": "send_recv",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all",
    "gather_": "gather", "scatter_": "scatter", "reduce_": "reduce",
}


def _tensor_bytes(value) -> int:
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class _Counter(TorchDispatchMode):
    def __init__(self, into: dict[str, int]):
        super().__init__()
        self.into = into

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = KINDS.get(func._opname)
            if kind is not None:
                # The payload is the biggest tensor argument or result: an all-gather's output, a
                # reduce-scatter's input, an all-reduce's buffer (the same for every op layout above).
                self.into[kind] += max([_tensor_bytes(a) for a in args] + [_tensor_bytes(out)])
                self.into["ops"] += 1
        return out


_NOTHING = contextlib.nullcontext()


class TrafficMeter:
    """Bytes communicated per phase of a step ("d_step", "g_step"), measured while `enabled`.

    `unmeasurable`: why nothing can be measured in this run, or None. A network compiled by torch.compile is one
    such reason: a compiled forward called under a dispatch mode runs eagerly, and torch then runs that forward's
    code eagerly for the rest of the process, without a word."""

    def __init__(self, unmeasurable: str | None = None) -> None:
        self.enabled = False
        self.start_up = False  # the measured step also carries one-time work (a run or resume of under 3 steps)
        self.unmeasurable = unmeasurable
        self.by_phase: dict[str, dict[str, int]] = {}

    def measure(self, phase: str) -> contextlib.AbstractContextManager:
        """`with meter.measure(phase):` counts the block's collectives while enabled (a shared no-op else)."""
        if not self.enabled or self.unmeasurable:
            return _NOTHING
        return _Counter(self.by_phase.setdefault(phase, defaultdict(int)))

    def totals(self) -> dict[str, int]:
        """Payload bytes per phase (all kinds together), e.g. {"d_step": ..., "g_step": ...}."""
        return {phase: sum(v for k, v in kinds.items() if k != "ops") for phase, kinds in self.by_phase.items()}

    def report(self) -> str:
        if self.unmeasurable:
            return f"not measured ({self.unmeasurable})"
        lines = []
        for phase, kinds in self.by_phase.items():
            parts = ", ".join(f"{kind} {n / 2**20:.3f} MiB" for kind, n in kinds.items() if kind != "ops" and n)
            lines.append(f"{phase}: {parts or 'nothing'} ({kinds.get('ops', 0)} ops)")
        start_up = " (a step of the run's first two: one-time work included, e.g. DDP's buckets)" if self.start_up else ""
        return "; ".join(lines) + start_up
