"""Hang detection: a per-rank thread that turns "no progress" into a named, fast failure.

The trainer marks progress (`mark`) at each phase and right before each of its own collectives; a
mark is one counter increment and a tuple, nothing more. The watchdog thread publishes the rank's
latest mark to the process group's store every few seconds. When a rank has made no progress for
`fault.hang_timeout_s`, its watchdog writes that rank's Python stacks, its last marks (the
record of ganscale's collectives) and PyTorch's flight recorder (every collective of every process
group, NCCL or gloo, with sizes and states; read it with `torchfrtrace`) to RUN_DIR/diagnostics/,
reads every rank's published progress, names the ranks that are behind (they never arrived at the
collective the others wait in), and exits with code 5. The elastic agent then stops the remaining workers.

Compiling is not a hang: while torch compiles on a rank (its own compile callbacks say when: the first steps, a
recompile, a lazy backward, CUDA-graph recording), that rank and any rank that waits for it are allowed
COMPILE_PATIENCE_S more. Each rank publishes whether it is compiling with its progress.
"""

from __future__ import annotations

import faulthandler
import json
import os
import selectors
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import suppress
from pathlib import Path

import torch.distributed as dist

try:  # private: read in torch 2.11-2.14 (ganscale.versions' compile-callbacks); without it, no compile patience
    from torch._dynamo.callback import CallbackArgs, callback_handler
except ImportError:
    CallbackArgs, callback_handler = object, None

from ganscale.config import FaultConfig
from ganscale.fault import EXIT_HANG, StopSignals

KEY = "ganscale/progress/{rank}"
STOP_SIGNALS = {int(sig) for sig in StopSignals.SIGNALS}
COMPILE_PATIENCE_S = 1800.0  # compiling, max-autotune's tuning and CUDA-graph recording can take many minutes


def watch_period(timeout_s: float, exit_timeout_s: float) -> float:
    """How often the watchdog thread publishes progress and checks its clocks."""
    return max(0.2, min(5.0, timeout_s / 4, exit_timeout_s / 4))


class Watchdog:
    def __init__(self, rank: int, world: int, timeout_s: float, diagnostics_dir: Path,
                 exit_timeout_s: float = FaultConfig().exit_timeout_s):
        self.rank, self.world, self.timeout_s, self.exit_timeout_s = rank, world, timeout_s, exit_timeout_s
        self.stop_requested_at: float | None = None  # when a stop signal arrived (monotonic)
        self.signals: socket.socket | None = None  # readable when a stop signal arrives (fault.StopSignals)
        self.diagnostics_dir = Path(diagnostics_dir)
        self.count, self.where, self.last_progress = 0, "start", time.monotonic()
        self.compiling = ""  # what torch compiles on this rank right now ("dynamo", "lazy_backward", ...), else ""
        self.compile_patience_s = COMPILE_PATIENCE_S  # allowed on top of timeout_s while this rank or a peer compiles
        self.compile_seen_at = float("-inf")  # when the thread, out of time, last saw this rank or a peer compiling
        self.history: deque[tuple[float, int, str]] = deque(maxlen=64)
        self.store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
        self.parent = os.getppid()  # a launcher's agent holds the store: once it is gone, so is the store
        self._stop = threading.Event()
        self._wake, self._waker = socket.socketpair()  # wakes the thread: to publish a compile at once, or to stop
        self._waker.setblocking(False)  # the training loop must never wait on it
        self._thread = threading.Thread(target=self._run, name="ganscale-watchdog", daemon=True)

    def watching(self, signals: socket.socket | None) -> Watchdog:
        """Also bound the time from a stop signal to this rank's exit (fault.exit_timeout_s)."""
        self.signals = signals
        return self

    def __enter__(self) -> Watchdog:
        # Registered whether or not the run compiles: they are called only when torch does compile, and then the
        # allowance is due. Removed in __exit__, so no watchdog outlives its run in this process.
        if callback_handler is not None:
            callback_handler.register_start_callback(self._compile_started)
            callback_handler.register_end_callback(self._compile_ended)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if callback_handler is not None:
            callback_handler.remove_start_callback(self._compile_started)
            callback_handler.remove_end_callback(self._compile_ended)
        self._stop.set()
        self._waker.send(b"x")
        self._thread.join(timeout=5)
        self._wake.close()
        self._waker.close()

    def mark(self, where: str) -> None:
        """Progress: called by the training loop's own thread (cheap: no I/O, no locks)."""
        self.count += 1
        self.where = where
        self.last_progress = time.monotonic()
        self.history.append((time.time(), self.count, where))

    def _compile_started(self, args: CallbackArgs) -> None:
        """torch's callback: a compile began on this rank (in the main thread, or autograd's for a lazy backward)."""
        self.compiling = args.callback_trigger.name.lower()  # dynamo, lazy_backward, cudagraph_recording
        self._compile_progress(f"torch.compile: compiling ({self.compiling})")

    def _compile_ended(self, args: CallbackArgs) -> None:
        self._compile_progress(f"torch.compile: compiled ({self.compiling})")
        self.compiling = ""

    def _compile_progress(self, what: str) -> None:
        # Progress, but not a mark: ranks compare mark counts to find who is behind, and they need not compile alike.
        self.last_progress = time.monotonic()
        self.history.append((time.time(), self.count, what))
        with suppress(OSError):  # full or closed: the thread publishes within a period anyway
            # Publish now: a peer waiting in a collective for this rank must see it before its own time is up.
            self._waker.send(b"c")

    # ------------------------------------------------------------------ watchdog thread
    def _run(self) -> None:
        period = watch_period(self.timeout_s, self.exit_timeout_s)
        while not self._stop.is_set():
            if self.stop_requested_at is None:
                self._wait_for_signal(period)
            else:  # wake at the exit deadline, not up to a period after it: a stop's grace is short
                left = self.stop_requested_at + self.exit_timeout_s - time.monotonic()
                self._wait_for_signal(min(period, max(0.0, left) + 0.05))
            if self._stop.is_set():
                return
            self._publish()
            now = time.monotonic()
            if self.stop_requested_at is not None and now - self.stop_requested_at > self.exit_timeout_s:
                self._diagnose_and_exit(f"asked to stop {self.exit_timeout_s:.0f} s ago (fault.exit_timeout_s), "
                                        f"this rank has not finished its step")
            elif now - self.last_progress > self.timeout_s:
                # Out of time, unless this rank compiles or a peer does (this rank waits for it in a collective):
                # that is allowed compile_patience_s, and timeout_s more once it is over (for the peer to arrive).
                if self.compiling or self._a_peer_compiles():
                    self.compile_seen_at = now
                    allowed = self.timeout_s + self.compile_patience_s
                else:
                    allowed = self.timeout_s + max(0.0, self.compile_seen_at - self.last_progress)
                if now - self.last_progress > allowed:
                    self._diagnose_and_exit(f"no progress for {allowed:.0f} s")

    def _a_peer_compiles(self) -> bool:
        """Whether another rank published that it is compiling; read from the store only once this rank's time is up,
        up to the first such rank."""
        return any(compiling for rank, _, compiling, _ in self._published() if rank != self.rank)

    def _wait_for_signal(self, period: float) -> None:
        """Sleep for `period`, noting a stop signal the moment it arrives (even if the main thread is blocked)."""
        # selectors (epoll/poll), not select.select: select() cannot watch a descriptor numbered 1024 or above, and
        # a process with many open files (data.workers=500) gets such numbers; the thread would die of it.
        with selectors.DefaultSelector() as selector:
            selector.register(self._wake, selectors.EVENT_READ)
            if self.signals is not None and self.signals.fileno() >= 0:  # -1 once closed: training is over
                selector.register(self.signals, selectors.EVENT_READ)
            readable = [key.fileobj for key, _ in selector.select(period)]
        if self._wake in readable:
            self._wake.recv(64)  # a compile began or ended (the caller publishes it), or __exit__
        if self.signals is not None and self.signals in readable:
            try:
                arrived = self.signals.recv(64)  # one byte per signal: its number
            except OSError:  # closed: training is over
                return
            # Other handled signals (a DataLoader's SIGCHLD) arrive here too; only stop requests start the clock.
            if self.stop_requested_at is None and any(number in STOP_SIGNALS for number in arrived):
                self.stop_requested_at = time.monotonic()

    def _publish(self) -> None:
        # A set on a store whose server died prints a C++ stack (~40 lines) before it raises: not tried once the
        # launcher is gone (its workers are stopping).
        if self.store is not None and os.getppid() != self.parent:
            self.store = None
        if self.store is None:
            return
        try:
            self.store.set(KEY.format(rank=self.rank), f"{self.count}|{self.compiling}|{self.where}")
        except Exception:  # noqa: BLE001 - the store may be gone while the job is torn down
            pass

    def _published(self) -> Iterator[tuple[int, int, str, str]]:
        """(rank, mark count, what it compiles or "", where) of each rank that published, read one rank at a time."""
        for rank in range(self.world):
            key = KEY.format(rank=rank)
            try:
                if self.store is None or not self.store.check([key]):
                    continue
                count, compiling, where = self.store.get(key).decode().split("|", 2)
            except Exception:  # noqa: BLE001
                continue
            yield rank, int(count), compiling, where

    def _others(self) -> dict[int, tuple[int, str]]:
        return {rank: (count, _shown(where, compiling)) for rank, count, compiling, where in self._published()}

    def _diagnose_and_exit(self, why: str) -> None:
        # Where the main thread is now, not where it last marked: slow local work (an optimizer step after the mark
        # "DDP all-reduce in backward") or a stop that waits for a step must not be blamed on the last mark.
        location = main_thread_location()
        if location:
            why = f"{why} ({location})"
        try:  # best effort: a full disk (or a file named diagnostics) must not keep the hang from being reported
            self._write_diagnostics(location)
            written = f"Stacks and each rank's last collectives: {self.diagnostics_dir}/"
        except OSError as e:
            written = f"No diagnostics were written to {e.filename or self.diagnostics_dir}/"
            print(f"ganscale: rank {self.rank} could not write its hang diagnostics to "
                  f"{e.filename or self.diagnostics_dir}: {e.strerror or e}", file=sys.stderr, flush=True)
        progress = self._others()
        progress[self.rank] = (self.count, _shown(self.where, self.compiling))
        ahead = max(count for count, _ in progress.values())
        behind = sorted(rank for rank in range(self.world) if progress.get(rank, (-1, ""))[0] < ahead)
        if self.rank in behind and self.stop_requested_at is None:  # a stop's grace leaves no time to wait
            # Let a rank that did arrive report first (it names us); exit a little later.
            time.sleep(2 * watch_period(self.timeout_s, self.exit_timeout_s) + 1)
        if behind:
            where = "; ".join(f"rank {r} last at '{progress[r][1]}'" if r in progress else f"rank {r} never reported"
                              for r in behind)
            verdict = f"rank(s) {', '.join(map(str, behind))} did not arrive ({where})"
        else:
            verdict = f"all ranks stopped at the same point ('{self.where}'): a hang inside it"
        print(f"ganscale: hang detected on rank {self.rank}: {why}. {verdict}. {written}", file=sys.stderr,
              flush=True)
        os._exit(EXIT_HANG)

    def _write_diagnostics(self, location: str) -> None:
        """This rank's stacks, last collectives and flight recorder, into diagnostics_dir; an OSError if refused."""
        self.diagnostics_dir.mkdir(parents=True, exist_ok=True)
        with open(self.diagnostics_dir / f"rank{self.rank}-stacks.txt", "w") as f:
            if location:
                f.write(f"# {location}\n\n")
                f.flush()  # faulthandler writes to the descriptor, after this line
            faulthandler.dump_traceback(file=f, all_threads=True)
        with open(self.diagnostics_dir / f"rank{self.rank}-collectives.txt", "w") as f:
            f.write("time\tmark\twhere (ganscale's phases and collectives, torch's compiles, oldest first)\n")
            for stamp, count, where in self.history:
                f.write(f"{stamp:.3f}\t{count}\t{where}\n")
        _write_flight_recorder(self.diagnostics_dir / f"rank{self.rank}-flight-recorder.json")


def _shown(where: str, compiling: str) -> str:
    """A rank's last mark, and the compile it is in since (if any)."""
    return f"{where}, then torch.compile: compiling ({compiling})" if compiling else where


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def main_thread_location() -> str:
    """One clause naming where the main thread is right now: its innermost frame and, when that is not
    ganscale's own code, the innermost frame that is, e.g. "main thread in torch/optim/adam.py:123
    _single_tensor_adam, called from ganscale/trainer.py:301 d_step". Empty if it cannot be told."""
    try:
        frame = sys._current_frames().get(threading.main_thread().ident)
        if frame is None:
            return ""
        innermost, ours = frame, None
        while frame is not None:
            if os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR + os.sep):
                ours = frame
                break
            frame = frame.f_back
        where = f"main thread in {_describe(innermost)}"
        if ours is not None and ours is not innermost:
            where += f", called from {_describe(ours)}"
        return where
    except Exception:  # noqa: BLE001 - a diagnosis must not fail on the way out
        return ""


def _describe(frame) -> str:
    """'torch/optim/adam.py:123 _single_tensor_adam': the file relative to its sys.path entry (else its name)."""
    filename = frame.f_code.co_filename
    shown = os.path.basename(filename)
    if os.path.isabs(filename):
        roots = [os.path.abspath(entry) for entry in sys.path if entry and isinstance(entry, str)]
        roots = [root for root in roots if filename.startswith(root.rstrip(os.sep) + os.sep)]
        if roots:
            shown = os.path.relpath(filename, max(roots, key=len))
    return f"{shown}:{frame.f_lineno} {frame.f_code.co_name}"


def _write_flight_recorder(path: Path) -> None:
    """PyTorch's record of every collective this process issued (op, sizes, state, sequence number), as
    `torchfrtrace` reads it; empty when TORCH_FR_BUFFER_SIZE=0. NCCL keeps its own recorder (CUDA builds):
    under NCCL that is the one dumped, the generic one (gloo's) holds nothing of its collectives."""
    try:
        from torch._C import _distributed_c10d as c10d

        nccl = dist.is_initialized() and "nccl" in dist.get_backend()  # "nccl", or "cpu:gloo,cuda:nccl"
        dump = getattr(c10d, "_dump_nccl_trace_json", None) if nccl else None
        path.write_bytes((dump or c10d._dump_fr_trace_json)(True, True))  # collectives, only the active ones
    except Exception as e:  # a diagnosis must not fail on the way out
        path.write_text(json.dumps({"error": f"flight recorder unavailable: {e}"}))
