"""Named ways a run ends early, and their exit codes.

Every rank reaches these together: the decisions behind them are agreed in the trainer's per-step
collective, so no rank is left waiting in a collective the others have abandoned.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable

EXIT_CONFIG = 2       # bad config, data or checkpoint: nothing was written
EXIT_PREEMPTED = 3    # SIGTERM/SIGINT: the current step finished, a checkpoint was written; --resume auto
EXIT_NON_FINITE = 4   # too many consecutive non-finite steps: stopped, the last good checkpoint is kept
EXIT_HANG = 5         # a rank made no progress for fault.hang_timeout_s: diagnostics/ written, ranks named
EXIT_PEER_FAILED = 6  # this rank stopped because another rank died first (its error is the one to read)

RESTARTS_ENV = "GANSCALE_RESTARTS"  # set by `train --max-restarts` for each start of the worker group


def restart_count() -> int:
    """How many times this worker group was restarted: by ganscale's launcher, or by torchrun --max-restarts."""
    return int(os.environ.get(RESTARTS_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def is_peer_failure(error: BaseException) -> bool:
    """A communication error caused by another rank dying (gloo reports it at once), not by this rank."""
    import torch.distributed as dist

    return isinstance(error, dist.DistBackendError) or any(sign in str(error) for sign in PEER_FAILURE_SIGNS)


class Preempted(Exception):
    """A stop was requested by a signal on some rank; every rank checkpointed and stopped."""

    exit_code = EXIT_PREEMPTED


class NonFiniteTraining(Exception):
    """Losses or gradients stayed non-finite for `fault.max_consecutive_skips` steps."""

    exit_code = EXIT_NON_FINITE


class StopSignals:
    """While active, SIGTERM and SIGINT only set a flag; the trainer agrees on it with the other ranks."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, on_signal: Callable[[str], None]):
        self.on_signal = on_signal
        self.previous: dict[int, object] = {}
        self.wakeup: socket.socket | None = None  # readable as soon as a signal arrives (see __enter__)
        self._wakeup_write: socket.socket | None = None
        self._previous_wakeup_fd = -1

    def __enter__(self) -> StopSignals:
        try:
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread (e.g. embedded use): leave signals alone
            self.previous.clear()
            return self
        # A Python handler runs only when the main thread returns to the interpreter, which a rank blocked
        # in a collective never does. The C-level handler also writes the signal number to this socket at
        # once, so another thread (the watchdog) learns of the request while the main thread is stuck.
        self.wakeup, self._wakeup_write = socket.socketpair()
        self._wakeup_write.setblocking(False)
        self._previous_wakeup_fd = signal.set_wakeup_fd(self._wakeup_write.fileno(), warn_on_full_buffer=False)
        return self

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        print(f"ganscale: {name} received; finishing this step, then checkpointing", file=sys.stderr, flush=True)
        self.on_signal(name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self.wakeup.close()
            self._wakeup_write.close()


# ----------------------------------------------------------------------------------- fault injection
# Test-only: GANSCALE_INJECT_FAULT="KIND@RANK:STEP[:SECONDS]" makes rank RANK misbehave at the start of
# step STEP: `raise` an exception, or `sleep` SECONDS (a hang, for the watchdog).
# Used by the fault-injection tests; read once per process, checked once per step.
INJECT_ENV = "GANSCALE_INJECT_FAULT"


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection."""


def _parse_injection(spec: str | None) -> tuple[str, int, int, float] | None:
    if not spec:
        return None
    kind, _, where = spec.partition("@")
    if kind not in ("raise", "sleep"):
        raise ValueError(f"{INJECT_ENV}: unknown fault kind {kind!r} (known: raise, sleep)")
    rank, step, *seconds = where.split(":")
    return kind, int(rank), int(step), float(seconds[0]) if seconds else 3600.0


def injected_fault(environ: dict | None = None) -> Callable[[int, int], None]:
    """A per-step hook (step, rank) that fires the configured fault, or does nothing."""
    import os
    import time

    parsed = _parse_injection((environ if environ is not None else os.environ).get(INJECT_ENV))
    if parsed is None:
        return lambda step, rank: None
    kind, bad_rank, bad_step, seconds = parsed

    def fire(step: int, rank: int) -> None:
        if (rank, step) != (bad_rank, bad_step):
            return
        if kind == "raise":
            raise InjectedFault(f"injected fault on rank {rank} at step {step}")
        time.sleep(seconds)
    return fire
