"""Where a step's wall time goes, so a user sees what to fix: data wait, D and G forward/backward, the
per-step agreement collective, optimizer work, and outputs (logs, samples, checkpoints).

Each part is timed on this rank with `time.perf_counter`. On CUDA the device is synchronised at each
boundary so that a part is charged for its own kernels rather than for whichever later part happens to
wait for them; that costs a little overlap, so `log.step_times=false` turns the breakdown off.
DDP's and FSDP's gradient communication runs inside backward (overlapped with it), so it is part of
`d_forward_backward`/`g_forward_backward`; `sync` is the wait in the one all-reduce per optimizer step,
which is also where a rank waits for slower peers. Under DDP that all-reduce rides on the gradients'
(parallel.GradientCarrier), so its wait counts in backward and `sync` is near zero.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

PARTS = ("data", "d_forward_backward", "g_forward_backward", "sync", "optimizer", "outputs")


class StepTimes:
    """Seconds per part, summed since the last `take()`."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        self.synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.totals: dict[str, float] = defaultdict(float)

    def part(self, name: str) -> contextlib.AbstractContextManager:
        """`with times.part(name):` charges the block's wall time to `name` (nothing when disabled)."""
        return _Part(self, name) if self.enabled else _NOTHING

    def take(self, steps: int) -> dict[str, float]:
        """Mean milliseconds per step of each part since the last call, as `time_<part>_ms`; then reset."""
        if not self.enabled:
            return {}
        means = {f"time_{name}_ms": 1000 * self.totals.get(name, 0.0) / max(steps, 1) for name in PARTS}
        self.totals.clear()
        return means


_NOTHING = contextlib.nullcontext()  # reusable, and cheaper than a generator-based context per call


class _Part:
    """One timed block (a class rather than @contextmanager: ~10 of these run every step)."""

    __slots__ = ("times", "name", "started")

    def __init__(self, times: StepTimes, name: str):
        self.times, self.name = times, name

    def __enter__(self) -> None:
        self.times.synchronize()
        self.started = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.times.synchronize()
        self.times.totals[self.name] += time.perf_counter() - self.started
