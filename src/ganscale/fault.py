"""Named ways a run ends early, and their exit codes.

Every rank reaches these together: the decisions behind them are agreed in the trainer's per-step
collective, so no rank is left waiting in a collective the others have abandoned.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

EXIT_CONFIG = 2       # bad config, data or checkpoint: nothing was written
EXIT_PREEMPTED = 3    # SIGTERM/SIGINT: the current step finished, a checkpoint was written; --resume auto
EXIT_NON_FINITE = 4   # too many consecutive non-finite steps: stopped, the last good checkpoint is kept
EXIT_HANG = 5         # a rank made no progress for fault.hang_timeout_s: diagnostics/ written, ranks named
EXIT_PEER_FAILED = 6  # this rank stopped because another rank died first (its error is the one to read)
EXIT_FILE_REFUSED = 7  # the system refused a file operation (permissions, a full or read-only disk): one line
EXIT_REPLICAS_DIFFER = 8  # tensors every rank must hold identically differ at a checkpoint: it was not written
EXIT_TAKEN_OVER = 9   # another run took the run directory's lock over: every rank stopped, writing nothing more

# File operations the system refused: one line and exit 7 in every command (EEXIST: a file where a folder goes).
REFUSED_FILE_OPERATION = {errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG,
                          errno.EIO, errno.ENOTDIR, errno.EISDIR, errno.EEXIST}

RESTARTS_ENV = "GANSCALE_RESTARTS"  # set by `train --max-restarts` for each start of the worker group


def restart_count() -> int:
    """How many times this worker group was restarted: by ganscale's launcher, or by torchrun --max-restarts."""
    return int(os.environ.get(RESTARTS_ENV) or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


PEER_FAILURE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


# What torch says where a collective or the rendezvous gave up waiting for a peer (parallel.timeout_s): gloo, the
# store, NCCL's watchdog.
PEER_TIMEOUT_SIGNS = ("Timed out waiting", "Timed out after", "wait timeout after", "collective operation timeout")


def is_peer_timeout(error: BaseException) -> bool:
    """Another rank did not come within parallel.timeout_s: stuck or gone where the hang watchdog does not watch
    (start-up, a resume's checkpoint read, the end of training)."""
    return isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_TIMEOUT_SIGNS)


def is_peer_failure(error: BaseException) -> bool:
    """A communication error caused by another rank dying (gloo reports it at once), not by this rank."""
    import torch.distributed as dist

    return isinstance(error, dist.DistBackendError) or any(sign in str(error) for sign in PEER_FAILURE_SIGNS)


def peer_failure_summary(error: BaseException, width: int = 200) -> str:
    """The error's first line up to the sign of the peer's failure (backend errors add sentences after it), at most
    `width` characters: its end kept, and a cut marked with an ellipsis."""
    line = (str(error).strip().splitlines() or [""])[0]
    signs = [line.index(sign) + len(sign) for sign in PEER_FAILURE_SIGNS if sign in line]
    line = line[:min(signs)] if signs else line
    return line if len(line) <= width else "..." + line[-(width - 3):]


# What gloo and NCCL (ncclRemoteError) say where this rank's connection to another closed under it, the other rank
# having exited: quoted, they name the backend's own source file and socket, which tell a user nothing.
CONNECTION_CLOSED_SIGNS = (*PEER_FAILURE_SIGNS, "remote process exited or there was a network error")


def peer_failure_cause(error: BaseException) -> str:
    """Why this rank stopped, for "stopped because another rank failed first (...)": "its connection to the others
    closed" where the backend said so, any other cause as peer_failure_summary sums it up."""
    if any(sign in str(error) for sign in CONNECTION_CLOSED_SIGNS):
        return "its connection to the others closed"
    return peer_failure_summary(error)


class Preempted(Exception):
    """A stop was requested by a signal on some rank; every rank checkpointed and stopped."""

    exit_code = EXIT_PREEMPTED


class NonFiniteTraining(Exception):
    """Losses or gradients stayed non-finite for `fault.max_consecutive_skips` steps."""

    exit_code = EXIT_NON_FINITE


class ReplicaDivergence(Exception):
    """Parameters or buffers differ across ranks where they must be identical (found by every rank at once)."""

    exit_code = EXIT_REPLICAS_DIFFER


class RunDirectoryTakenOver(Exception):
    """Another run took over this run's directory (run.lock holds its token now, runlock.LockWatch): every rank
    stopped at the same step and wrote nothing more there, no checkpoint either (the other run's directory now)."""

    exit_code = EXIT_TAKEN_OVER

    @classmethod
    def at(cls, run_dir: Path, lock: Path, step: int) -> RunDirectoryTakenOver:
        """The stop of a run whose `lock` in `run_dir` another run holds now, found at `step` (either engine)."""
        return cls(f"another run took over the run directory {run_dir} (the lock {lock} is that run's now): this run "
                   f"stopped at step {step} and wrote nothing more there, no checkpoint either")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. no space left on device). Not bad input: the run stops with
    exit code 7 (EXIT_FILE_REFUSED) and this one-line message; what the failed write had written is removed,
    the checkpoints written before are untouched."""

    exit_code = EXIT_FILE_REFUSED

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code


class RankFailed(Exception):
    """Another rank failed at what every rank agreed on (rank 0 writing its outputs, every rank reading a
    checkpoint), for a reason other than a config error or a refused file operation (those keep their type on
    every rank); raised on the other ranks, naming that rank's error."""


@contextmanager
def rank0_writes(what: str, mark: Callable[[str], None] = lambda where: None) -> Iterator[None]:
    """Around what rank 0 alone writes (config, log, samples, a checkpoint). Collective on leaving the block: one
    broadcast tells every rank whether rank 0's writes succeeded; if not, every rank raises, rank 0 its own error,
    the others the same kind of error naming it (`error_of_rank`), so the CLI shows them alike. A rank 0 that
    failed alone would leave its peers waiting in their next collective, until a timeout that hides the cause.
    `mark` is told before the collective (the hang watchdog). Nothing is sent in a one-rank group."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    main = dist.get_rank() == 0
    failure = None
    try:
        yield
    except Exception as e:
        if not main:  # another rank's own error: it leaves at once, as anywhere else
            raise
        failure = e
    mark(f"broadcast of whether rank 0 wrote its {what}")
    failed = _flag(failure is not None)
    dist.broadcast(failed, src=0)
    if not failed.item():
        return
    told = [report_of(failure) if main else None]  # only on failure: the report itself
    dist.broadcast_object_list(told, src=0)
    if failure is not None:
        raise failure  # unchanged: the CLI shows it as before
    raise error_of_rank(0, f"write its {what}", told[0])


@contextmanager
def every_rank_or_none(doing: str, mark: Callable[[str], None] = lambda where: None) -> Iterator[None]:
    """Around what each rank does on its own and may fail at alone (read a checkpoint its node may not see).
    Collective on leaving the block: one all-reduce of a flag; if any rank failed, every rank raises, each failed
    rank its own error, the others the first failed rank's, named (`error_of_rank`). Nothing is sent in a one-rank
    group. Not for blocks with collectives inside: a rank that fails before one leaves its peers waiting in it."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    failure = None
    try:
        yield
    except Exception as e:
        failure = e
    mark(f"all-reduce of whether every rank could {doing}")
    failed = _flag(failure is not None)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if not failed.item():
        return
    reports: list = [None] * dist.get_world_size()  # only on failure: who failed, and at what
    dist.all_gather_object(reports, report_of(failure) if failure is not None else None)
    raise agreed_error(dist.get_rank(), failure, reports, doing)


def agreed_error(rank: int, failure: Exception | None, reports: list, doing: str) -> Exception:
    """What rank `rank` raises once every rank's report (None where it did not fail) is known: a failed rank its
    own error, said once where several found the same; the others the first failed rank's, named."""
    first = next(r for r, report in enumerate(reports) if report is not None)
    if failure is None:
        return error_of_rank(first, doing, reports[first])
    return told_by(first, failure) if rank != first and reports[rank] == reports[first] else failure


_check_ins = 0  # the start check-ins this process has made: every rank of a group makes as many


def check_ins() -> int:
    return _check_ins


def check_in(store, rank: int, world: int, refusal: Exception | None = None) -> Exception | None:
    """Before the process group, on the launcher's store: each rank says whether it can start (None, or the error
    that refused its config, data or code on this node) and hears every other rank, so a rank refused on one node
    only (data.path missing there) ends every node at once. Returns what this rank then raises (agreed_error), or
    None where no rank was refused."""
    import json

    global _check_ins
    start = f"ganscale/start{_check_ins}"
    _check_ins += 1
    store.set(f"{start}/rank{rank}", json.dumps(None if refusal is None else report_of(refusal)))
    store.wait([f"{start}/rank{r}" for r in range(world)])  # every rank comes: a refused one at once
    reports = [json.loads(store.get(f"{start}/rank{r}")) for r in range(world)]
    if all(report is None for report in reports):
        return None
    # Rank 0 may serve the store (srun's tasks, no agent): nobody leaves before every rank has read it.
    store.set(f"{start}/read{rank}", "")
    store.wait([f"{start}/read{r}" for r in range(world)])
    return agreed_error(rank, refusal, reports, "start")


def refused_before_start(refusal: Exception, check_ins_before: int) -> Exception:
    """`refusal`, raised in a rank of a launched group before it checked in (runtime.start), as it must be
    raised: told to every rank at a check-in made for it; marked as said by rank 0 where the group has no store
    yet (srun's tasks before ganscale adopted them, which every task reads alike: the config); unchanged in a
    process without peers."""
    from ganscale.config import ConfigError

    if check_ins() != check_ins_before or not has_peers():
        return refusal
    from ganscale import runtime
    from ganscale.launch import environment_errors

    if not runtime.in_launched_group():
        return told_by(0, refusal) if isinstance(refusal, ConfigError) else refusal
    if environment_errors(os.environ):  # the launcher's variables are what is refused: they name no store to tell
        return refusal
    try:
        return check_in(*runtime.launcher_store(runtime.DEFAULT_TIMEOUT_S), refusal) or refusal
    except Exception:  # noqa: BLE001 - the store unreachable, or a peer that never came: this rank's refusal stands
        return refusal


def _flag(value: bool):
    """A one-element tensor for a flag collective, on the device the default group's backend sends from."""
    import torch
    import torch.distributed as dist

    nccl = dist.get_backend() == "nccl"
    return torch.tensor([int(value)], device=torch.cuda.current_device() if nccl else "cpu")


def report_of(error: Exception) -> dict:
    """What a rank tells the others of its failure: enough for them to raise the same kind of error."""
    from ganscale.config import ConfigError

    if isinstance(error, ConfigError):
        return {"kind": "config", "key": error.key, "problem": error.problem, "fix": error.fix}
    kind = ("checkpoint" if isinstance(error, CheckpointWriteError)
            else "file" if isinstance(error, OSError) and error.errno is not None else type(error).__name__)
    message = (str(error).strip().splitlines() or [""])[0][:2000]  # its first line, whole
    return {"kind": kind, "message": message,
            **{name: getattr(error, name, None) for name in ("errno", "strerror", "filename")}}


def error_of_rank(rank: int, doing: str, report: dict) -> Exception:
    """The other ranks' error for what rank `rank` failed at (`doing`: "write its samples"): its type (and errno,
    or config key and fix), so the CLI shows it the same way (one line, same exit code), and a message naming
    that rank and its own; marked `told_by` that rank, which prints it."""
    from ganscale.config import ConfigError

    told, kind = f"rank {rank} could not {doing}", report["kind"]
    if kind == "config":
        error = ConfigError(report["key"], f"{told}: {report['problem']}", report["fix"])
    elif kind == "checkpoint":
        error = CheckpointWriteError(f"{told}: {report['message']}", report["errno"])
    elif kind == "file":  # the subclass of its errno, as the failed rank's
        error = OSError(report["errno"], f"{told}: {report['strerror'] or report['message']}", report["filename"])
    elif kind == NonFiniteTraining.__name__:  # the same exit code on every rank
        error = NonFiniteTraining(f"{told}: {report['message']}")
    else:
        error = RankFailed(f"{told}: {kind}: {report['message']}")
    return told_by(rank, error)


def told_by(rank: int, error: Exception) -> Exception:
    """`error`, marked as one that rank `rank` has too and says (`told_elsewhere`)."""
    error.told_by = rank
    return error


def told_elsewhere(error: BaseException) -> bool:
    """True for an error another rank prints (`told_by`): its own node's output shows it once, from that rank;
    a node without it shows it from its first rank. This rank then exits with its code, silently."""
    teller = getattr(error, "told_by", None)
    rank = int(os.environ.get("RANK", "0"))
    if teller is None or teller == rank:
        return False
    first = rank - int(os.environ.get("LOCAL_RANK", "0"))  # a node's ranks are consecutive, from its LOCAL_RANK 0
    node_size = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("WORLD_SIZE", "1"))
    return first <= teller < first + node_size or rank != first


def under_launcher(environ=os.environ) -> bool:
    """True in a worker started by torchrun / the elastic launcher."""
    return "TORCHELASTIC_RUN_ID" in environ or ("RANK" in environ and "MASTER_ADDR" in environ)


def has_peers(environ=os.environ) -> bool:
    """Whether this process is one rank of a group that a launcher (torchrun, `--nproc`'s elastic agent) or srun's
    tasks make: its stop on a signal must be agreed with the others (slurm.task_environment for srun's)."""
    return under_launcher(environ) or ("SLURM_STEP_ID" in environ and environ.get("SLURM_NTASKS", "1") != "1")


def handled_stop_signals() -> list[signal.Signals]:
    """StopSignals.SIGNALS, but a SIGHUP this process ignores: started under nohup, its run is to outlive the
    terminal."""
    return [sig for sig in StopSignals.SIGNALS
            if not (sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN)]


class StoppedBeforeTraining(BaseException):
    """A stop signal before training began in a process with no peers to agree with (one process, or the `--nproc`
    launcher before its workers start): raised where it lands, so `finally` blocks release the run directory's lock
    and remove half-written files. A BaseException, as KeyboardInterrupt: no `except Exception` takes it for a
    failure of what it interrupted."""

    exit_code = EXIT_PREEMPTED

    def __init__(self, signal_name: str):
        super().__init__(f"stopped by {signal_name} before training began: nothing was trained, no checkpoint "
                         "written; continue with --resume auto (or start it again)")


class StartupStops:
    """SIGTERM and SIGINT from `ganscale train`'s start until training begins, where `StopSignals` takes over
    (`hand_over`): without it a stop signal then killed the process (exit 143, its run.lock left behind) or unwound
    as Ctrl-C does. `peers` (`has_peers`): this process is one rank of several, so the signal is only kept, and its
    trainer's first step stops on it, agreed with every rank by the step's collective (then checkpointed, as any
    stop); otherwise StoppedBeforeTraining is raised at once. Main thread only (elsewhere a no-op)."""

    def __init__(self, peers: bool):
        self.peers = peers
        self.originals: dict[int, object] = {}  # the handlers before this command began: put back by `__exit__`
        self.pending: int | None = None  # a signal kept for the trainer (`peers`)
        self.over = False  # training began in this process (`hand_over`), or a launcher's workers ran (`launched`)

    @classmethod
    def active(cls, peers: bool) -> StartupStops:
        """The one this process entered already (`python -m ganscale train` enters it first thing), else a new one."""
        return _starting if _starting is not None else cls(peers)

    def __enter__(self) -> StartupStops:
        global _starting
        if _starting is self:  # entered already: its handlers are in place
            return self
        try:
            for sig in handled_stop_signals():
                self.originals[sig] = signal.signal(sig, self._handle)
        except ValueError:  # not the main thread: leave signals alone
            self.__exit__()
            return self
        _starting = self
        return self

    def _handle(self, signum: int, _frame) -> None:
        if self.over:  # training ran here, and what handled its signals put this handler back: as before it
            signal.signal(signum, self.originals[signum])
            os.kill(os.getpid(), signum)
            return
        name = signal.Signals(signum).name
        if not self.peers:
            raise StoppedBeforeTraining(name)
        if self.pending is None and os.environ.get("LOCAL_RANK", "0") == "0":  # said once a node, as StopSignals
            print(f"ganscale: {name} received while the run starts; it stops after its first step, with a checkpoint",
                  file=sys.stderr, flush=True)
        self.pending = self.pending or signum

    def hand_over(self, previous: dict[int, object]) -> int | None:
        """Training begins: StopSignals installed its handlers, replacing `previous`, which become the handlers from
        before this command began (StopSignals puts them back at its end). Returns the signal kept, if any."""
        self.over = True
        for sig, handler in previous.items():
            if handler == self._handle:
                previous[sig] = self.originals.get(sig, signal.SIG_DFL)
        return self.pending

    def __exit__(self, *exc) -> None:
        global _starting
        _starting = None
        for sig, handler in self.originals.items():
            signal.signal(sig, handler)


_starting: StartupStops | None = None  # the active StartupStops of this process, if any


def launched() -> None:
    """In a `--nproc` launcher, once its workers ran (torch's agent handled the signals meanwhile): a stop signal is
    no longer one before training began."""
    if _starting is not None:
        _starting.over = True


class StopSignals:
    """While active, SIGTERM and SIGINT only set a flag; the trainer agrees on it with the other ranks. A signal
    kept while the run started (StartupStops) sets it at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal closed (ssh lost, window shut)

    def __init__(self, on_signal: Callable[[str], None]):
        self.on_signal = on_signal
        self.previous: dict[int, object] = {}
        self.said = False  # the stop request was announced
        self.wakeup: socket.socket | None = None  # readable as soon as a signal arrives (see __enter__)
        self._wakeup_write: socket.socket | None = None
        self._previous_wakeup_fd = -1

    def __enter__(self) -> StopSignals:
        try:
            for sig in handled_stop_signals():
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
        kept = _starting.hand_over(self.previous) if _starting is not None else None
        if kept is not None:  # as if it arrived now: the flag, and the watchdog's exit clock (the wakeup socket)
            self._wakeup_write.send(bytes([kept]))
            self.on_signal(signal.Signals(kept).name)
        return self

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        # Said once a node (a launcher passes the signal to each worker), and once a run: a worker whose launcher
        # was killed gets the kernel's SIGTERM more than once.
        if os.environ.get("LOCAL_RANK", "0") == "0" and not self.said:
            print(f"ganscale: {name} received; finishing this step, then checkpointing", file=sys.stderr, flush=True)
            self.said = True
        self.on_signal(name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.wakeup is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd)
            self.wakeup.close()
            self._wakeup_write.close()


@contextmanager
def terminate_unwinds() -> Iterator[None]:
    """While active, SIGTERM raises SystemExit(128 + SIGTERM) (the exit status a killed process has), so `finally`
    and `except BaseException` blocks remove what a command had half written. Only where nothing else handles
    SIGTERM (its handler is the default: training's StopSignals, or an embedding program's own, stay as they are)
    and only on the main thread, where Python runs signal handlers. SIGINT already raises KeyboardInterrupt."""
    def _leave(signum: int, _frame) -> None:
        raise SystemExit(128 + signum)

    installed = False
    try:
        if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _leave)
            installed = True
    except ValueError:  # not the main thread
        pass
    try:
        yield
    finally:
        if installed:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


DIAGNOSIS_S = 5.0  # the hang watchdog writing stacks, marks and the flight recorder, then leaving (well under 1 s here)


def stop_grace_s(exit_timeout_s: float) -> float:
    """The longest a rank takes from a stop signal to its exit: fault.exit_timeout_s, then the diagnosis (the hang
    watchdog wakes at that deadline). A launcher's or scheduler's grace (SIGTERM, then SIGKILL) must be longer."""
    return exit_timeout_s + DIAGNOSIS_S


LAUNCHER_TEARDOWN_S = 15.0  # a `--nproc` launcher's own exit once its workers have left


def run_training_process(command: list[str], exit_timeout_s: float, timeout_s: float | None = None,
                         **popen: object) -> subprocess.CompletedProcess:
    """subprocess.run of a `ganscale train` command that, interrupted (Ctrl-C, a SIGTERM under terminate_unwinds,
    `timeout_s`), stops the training as a scheduler would (SIGTERM, its grace for fault.exit_timeout_s to
    checkpoint and leave, then SIGKILL) before the exception goes on: subprocess.run left it running under init
    on a SIGTERM."""
    grace_s = stop_grace_s(exit_timeout_s) + LAUNCHER_TEARDOWN_S
    with subprocess.Popen(command, **popen) as training:
        try:
            out, err = training.communicate(timeout=timeout_s)
        except BaseException as e:
            training.terminate()
            try:
                out, err = training.communicate(timeout=grace_s)
            except subprocess.TimeoutExpired:
                training.kill()
                out, err = training.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                e.stdout, e.stderr = out, err  # as subprocess.run gives them
            raise
    return subprocess.CompletedProcess(command, training.returncode, out, err)


# ----------------------------------------------------------------------------------- fault injection
# Test-only: GANSCALE_INJECT_FAULT="KIND@RANK:STEP[:SECONDS]" makes rank RANK misbehave at the start of
# step STEP: `raise` an exception, `sleep` SECONDS (a hang, for the watchdog), `slow`: a step that takes SECONDS
# unless a stop signal arrives (a long step that a scheduler's signal interrupts), or `noise`: from then on, every
# linear and convolution layer in training mode adds noise drawn from the rank's own RNG stream (a network whose
# randomness is per rank, for `ganscale verify`).
# Used by the fault-injection tests; read once per process, checked once per step.
INJECT_ENV = "GANSCALE_INJECT_FAULT"
NOISE_SCALE = 0.01  # of the injected noise: far above rounding, small enough to keep training finite


class InjectedFault(RuntimeError):
    """Raised by the test-only fault injection."""


INJECTION = re.compile(r"(raise|sleep|slow|noise)@(\d+):(\d+)(?::(\d+\.?\d*|\.\d+))?")


def _parse_injection(spec: str | None) -> tuple[str, int, int, float] | None:
    if not spec:
        return None
    found = INJECTION.fullmatch(spec)
    if found is None:
        from ganscale.config import ConfigError

        raise ConfigError(INJECT_ENV, f"'{spec}' is no fault to inject",
                          "set it to KIND@RANK:STEP[:SECONDS] with KIND raise, sleep, slow or noise (e.g. raise@1:3, "
                          "sleep@1:3:300), or unset it (it is for ganscale's own tests)")
    kind, rank, step, seconds = found.groups()
    return kind, int(rank), int(step), float(seconds) if seconds else 3600.0


def check_injection(environ=os.environ) -> None:
    """A ConfigError naming GANSCALE_INJECT_FAULT where its value is malformed (checked before anything is
    written; each rank reads it again as training starts)."""
    _parse_injection(environ.get(INJECT_ENV))


def _per_rank_noise(module, args, output):
    """A global forward hook: noise from this rank's RNG stream on the output of a training layer."""
    import torch

    layers = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.ConvTranspose2d)
    if isinstance(module, layers) and module.training and isinstance(output, torch.Tensor):
        return output + NOISE_SCALE * torch.randn_like(output)
    return output


def injected_fault(environ: dict | None = None, stopping: Callable[[], bool] = lambda: False) -> Callable[[int, int], None]:
    """A per-step hook (step, rank) that fires the configured fault, or does nothing. `stopping`: whether this rank
    has a stop signal (ends a `slow` step)."""
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
        if kind == "noise":
            from torch.nn.modules.module import register_module_forward_hook

            register_module_forward_hook(_per_rank_noise)
            return
        if kind == "slow":
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and not stopping():
                time.sleep(0.1)
            return
        time.sleep(seconds)
    return fire
