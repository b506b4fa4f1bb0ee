"""Where a step's wall time goes, so a user sees what to fix: data wait, D and G forward/backward, the
per-step agreement collective, optimizer work, and outputs (logs, samples, checkpoints).

Each part is timed on this rank with `time.perf_counter`. On CUDA the device is synchronised at each
boundary so that a part is charged for its own kernels rather than for whichever later part happens to
wait for them. That stalls the GPU's queue, so on CUDA only one step in CUDA_SAMPLE_EVERY is timed (the
first of each logging interval, then every CUDA_SAMPLE_EVERY-th), the others run unsynchronised;
`outputs` (logs, samples, checkpoints: rare steps) is timed whenever it runs. `log.step_times=false`
turns the breakdown off.
DDP's and FSDP's gradient communication runs inside backward (overlapped with it), so it is part of
`d_forward_backward`/`g_forward_backward`; `sync` is the wait in the one all-reduce per optimizer step,
which is also where a rank waits for slower peers. Under DDP that all-reduce rides on the gradients'
(parallel.GradientCarrier), so its wait counts in backward and `sync` is near zero.
"""

from __future__ import annotations

import contextlib
import time

import torch

PARTS = ("data", "d_forward_backward", "g_forward_backward", "sync", "optimizer", "outputs")
EVERY_TIME = {"outputs"}  # parts of rare steps: timed whenever they run
CUDA_SAMPLE_EVERY = 8     # on CUDA, one step in this many is timed (synchronised)


class StepTimes:
    """Seconds per part, summed since the last `take()`."""

    def __init__(self, device: torch.device, enabled: bool = True):
        self.enabled = enabled
        cuda = device.type == "cuda"
        self.sample_every = CUDA_SAMPLE_EVERY if cuda else 1
        self._parts = {name: _Part(torch.cuda.synchronize if cuda else None) for name in PARTS}
        self._since_take, self._timed_steps, self._timing = 0, 0, enabled

    def begin_step(self) -> None:
        """Before each step: whether its parts are timed (the first step since `take`, then one in
        `sample_every`)."""
        self._timing = self.enabled and self._since_take % self.sample_every == 0
        self._since_take += 1
        self._timed_steps += self._timing

    def part(self, name: str) -> contextlib.AbstractContextManager:
        """`with times.part(name):` charges the block's wall time to `name` (nothing when disabled, or when
        this step is not timed)."""
        return self._parts[name] if self._timing or (self.enabled and name in EVERY_TIME) else _NOTHING

    def take(self, steps: int) -> dict[str, float]:
        """Mean milliseconds per step of each part since the last call, as `time_<part>_ms`; then reset. A
        sampled part's mean is over the steps timed, `outputs`' over all `steps`."""
        if not self.enabled:
            return {}
        means = {f"time_{name}_ms": 1000 * part.total / max(steps if name in EVERY_TIME else self._timed_steps, 1)
                 for name, part in self._parts.items()}
        for part in self._parts.values():
            part.total = 0.0
        self._since_take, self._timed_steps = 0, 0
        return means


_NOTHING = contextlib.nullcontext()  # reusable


class _Part:
    """One part's timer, reused by every block charged to it (blocks of one part never nest). About
    ten blocks run every step: a reused object rather than a generator-based context manager per block."""

    __slots__ = ("synchronize", "started", "total")

    def __init__(self, synchronize):
        self.synchronize, self.started, self.total = synchronize, 0.0, 0.0

    def __enter__(self) -> None:
        if self.synchronize is not None:
            self.synchronize()
        self.started = time.perf_counter()

    def __exit__(self, *exc) -> None:
        if self.synchronize is not None:
            self.synchronize()
        self.total += time.perf_counter() - self.started
