"""One run at a time in a run directory: a lock file, `RUN_DIR/run.lock`, held for the run's whole life.

Made with O_CREAT|O_EXCL (atomic on local disks and on NFS); it holds its owner as JSON (host, PID namespace, pid,
start time, a token). The owner renews it (its mtime, a lease) every RENEW_S seconds and removes it when it ends. A
lock whose owner is gone is taken over: on the same host and in the same PID namespace, when its pid is dead (or now
another process); otherwise (another host, or another container on this one, whose pids this process cannot see)
when its lease is LEASE_S old (the file system stamps the renewals; LEASE_S leaves room for clock skew).

A run whose lock was taken over anyway (its lease lapsed: a frozen or cut-off host) learns it from `LockWatch.lost`
and stops without writing anything more (fault.RunDirectoryTakenOver, exit 9).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from ganscale.config import ConfigError

LOCK_NAME = "run.lock"
TOKEN_ENV = "GANSCALE_RUN_LOCK"  # the `--nproc` parent's token: its workers run under its hold
RENEW_S = 5.0
LEASE_S = 60.0  # a lock from another host (or PID namespace) not renewed for this long is its crashed owner's
CONFIRM_S = 0.2  # a lock that looks taken over is read again this much later before the run stops


class LockWatch:
    """Whether the hold `token` on the lock `path` is still this run's: checked every RENEW_S seconds from a daemon
    thread, and at once by `verify`. `lost` is set, for good, once another run holds it (or none does)."""

    renews = False  # a watcher (an `--nproc` worker's rank 0) only looks: its launcher renews the lease

    def __init__(self, path: Path, token: str):
        self.path, self.token = path, token
        self.lost = threading.Event()
        self.stops_run = False  # set by what stops the run on `lost` (the trainer, a launcher's workers): it says so
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._watch, name="ganscale-run-lock", daemon=True)
        self._renewer.start()

    def _watch(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if not self.verify():
                    if not self.stops_run:  # a holder with no loop to stop on it: say it
                        print(f"ganscale: warning: the lock {self.path} is no longer this run's (its lease lapsed "
                              "and another run took it over)", file=sys.stderr, flush=True)
                    return
                if self.renews:
                    os.utime(self.path)  # the file system's clock stamps the lease
            except OSError:  # a file system hiccup: the next renewal tries again, well within the lease
                continue

    def is_lost(self, read_now: bool) -> bool:
        """Whether another run holds the lock: read now (`verify`), or as the lock's thread last found it. A lock
        unreadable for a moment says nothing: the thread keeps looking."""
        if not read_now:
            return self.lost.is_set()
        try:
            return not self.verify()
        except OSError:
            return self.lost.is_set()

    def verify(self) -> bool:
        """Whether the lock is still this run's, read now (a small file read; sets `lost` when not). OSError where
        the lock cannot be read (a file system hiccup): that says nothing either way."""
        if self.lost.is_set():
            return False
        if self._token_now() == self.token:
            return True
        # A takeover that raced another moves a fresh lock aside for an instant and puts it back: look again.
        time.sleep(CONFIRM_S)
        if self._token_now() == self.token:
            return True
        self.lost.set()
        return False

    def _token_now(self) -> str | None:
        try:
            owner = json.loads(self.path.read_text())
        except (FileNotFoundError, ValueError):  # no lock, or another run writing its own: not ours either way
            return None
        return owner.get("token") if isinstance(owner, dict) else None

    def release(self, abandon: bool = False) -> None:
        """Stop watching (the lock is the launcher's to remove)."""
        self._stop.set()

    def __enter__(self) -> LockWatch:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.release(abandon=exc_type is not None)  # failed: the folders made for it go, where still empty


class RunLock(LockWatch):
    """This process's hold on a run directory (`hold`): renewed from a daemon thread until `release`."""

    renews = True

    def __init__(self, path: Path, token: str, made: list[Path]):
        self.made = made
        super().__init__(path, token)

    def release(self, abandon: bool = False) -> None:
        """Stop renewing and remove the lock (if still ours); `abandon`: the run failed, so the folders `hold` made
        for it are removed too where it left them empty."""
        self._stop.set()
        if (_owner(self.path) or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        for folder in self.made if abandon else []:
            try:
                folder.rmdir()
            except OSError:  # not empty: something else is there now
                break


def hold(run_dir: Path) -> RunLock:
    """Take the run directory (made if missing) for this process, taking over a stale lock; a ConfigError naming
    the holder when another run holds it."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    run_dir.mkdir(parents=True, exist_ok=True)
    lock, token = run_dir / LOCK_NAME, uuid.uuid4().hex
    owner = {"host": socket.gethostname(), "pid_ns": _pid_namespace(), "pid": os.getpid(),
             "pid_start": _process_start(os.getpid()), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "token": token,
             "slurm_job": os.environ.get("SLURM_JOB_ID")}
    for _ in range(3):  # a stale lock taken over, and lost to a third run: at most a few tries
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _take_over_if_stale(run_dir)
            continue
        created = None
        try:
            created = os.fstat(fd)  # which file is ours: the only one a failed write below may remove
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(owner))
        except BaseException as e:
            if created is None:
                os.close(fd)
            _abandon(lock, created, made)
            if isinstance(e, OSError):  # the write's error names no file (a full disk): name the lock's
                raise OSError(e.errno, e.strerror or str(e), str(lock)) from e
            raise
        return RunLock(lock, token, made)
    refuse_if_held(run_dir)
    raise ConfigError("--run-dir", f"'{run_dir}' is being taken by another run", "wait for it to start, or choose "
                      "another --run-dir")


def _abandon(lock: Path, created: os.stat_result | None, made: list[Path]) -> None:
    """After a failed write of the lock `hold` created (a full disk): remove it, as its owner record is missing or cut
    short, which reads as a run that is starting and refuses every later one; then the folders `hold` made. Only the
    file it created (`created`, its stat): an empty lock is not stale for LEASE_S, so no other run has replaced it
    yet, but a file that is not ours is never removed."""
    try:
        now = lock.stat()
        if created is None or (now.st_dev, now.st_ino) == (created.st_dev, created.st_ino):
            lock.unlink()
    except OSError:  # gone already, or the disk refuses this too: nothing more to do here
        pass
    for folder in made:
        try:
            folder.rmdir()
        except OSError:  # not empty: something else is there now
            break


def watch_parent_hold(run_dir: Path) -> LockWatch | None:
    """In a worker of the `--nproc` parent that holds `run_dir`: a watch on that hold (its rank 0 stops the run
    when it is lost); None elsewhere."""
    if not held_by_parent(run_dir):
        return None
    return LockWatch(run_dir / LOCK_NAME, os.environ[TOKEN_ENV])


def held_by_parent(run_dir: Path) -> bool:
    """True in a worker of the `--nproc` parent that holds `run_dir`."""
    token = os.environ.get(TOKEN_ENV)
    return token is not None and (_owner(run_dir / LOCK_NAME) or {}).get("token") == token


def refuse_if_held(run_dir: Path, here_only: bool = False) -> None:
    """A ConfigError naming the holder when another live run holds `run_dir`; writes nothing. `here_only`: only a
    holder seen alive by its pid (this host and PID namespace) that is not a Slurm job's (which may end or requeue
    before a job submitted now starts); a lease of another host's says nothing of the time to come."""
    lock = run_dir / LOCK_NAME
    seen = _seen(lock)
    if seen is None or _stale(*seen):
        return
    owner = seen[0]
    if here_only and not (_here(owner) and not owner.get("slurm_job")):
        return
    holder = (f"the run started {owner.get('started')} on host {owner.get('host')} (pid {owner.get('pid')})"
              if owner else f"a run that is starting (see {lock})")
    # A lock with no owner written is a start in progress, or one that failed: say when it stops counting.
    clears = "" if owner else f" (unless it is renewed, another run takes it over {LEASE_S:.0f} s after it was written)"
    raise ConfigError("--run-dir", f"'{run_dir}' is in use by {holder}", f"wait for it to end{clears}, or choose "
                      "another --run-dir")


def _take_over_if_stale(run_dir: Path) -> None:
    """Remove a stale lock, race-free: moved aside under a name of our own (one mover wins), then checked to be
    the very file judged stale; a fresh lock moved by mistake (its stale one was taken over meanwhile) goes back."""
    lock = run_dir / LOCK_NAME
    seen = _seen(lock)
    if seen is None or not _stale(*seen):
        refuse_if_held(run_dir)
        return
    aside = run_dir / f"{LOCK_NAME}.stale-{uuid.uuid4().hex}"
    try:
        os.rename(lock, aside)
    except FileNotFoundError:  # another run took it over first
        return
    moved = _seen(aside)
    if moved is None or (moved[0], moved[2]) != (seen[0], seen[2]):
        try:
            os.link(aside, lock)  # atomic: fails if yet another lock is there
        except OSError:
            pass
    aside.unlink(missing_ok=True)


def _seen(lock: Path) -> tuple[dict | None, float, int] | None:
    """(owner or None while it is being written, age of its lease in seconds, mtime_ns), or None without a lock."""
    try:
        stat = lock.stat()
        return _owner(lock), time.time() - stat.st_mtime, stat.st_mtime_ns
    except FileNotFoundError:
        return None


def _stale(owner: dict | None, age_s: float, _mtime_ns: int) -> bool:
    # Its pid means something here only on this host and in this PID namespace: another container's pid looks dead
    # (or is another process) from here. A record without pid_ns (an older ganscale's) counts as this namespace.
    if _here(owner):
        pid = owner.get("pid")
        return not (isinstance(pid, int) and _process_start(pid) is not None
                    and _process_start(pid) == owner.get("pid_start"))
    return age_s > LEASE_S


def _here(owner: dict | None) -> bool:
    """Whether the lock's owner is a process of this host and PID namespace, whose pid this process can check."""
    ours = _pid_namespace()
    return bool(owner) and owner.get("host") == socket.gethostname() and owner.get("pid_ns", ours) == ours


def token_of(run_dir: Path) -> str | None:
    """The token of the hold on `run_dir` as this process sees it; None where it sees no lock."""
    return (_owner(run_dir / LOCK_NAME) or {}).get("token")


def _owner(lock: Path) -> dict | None:
    """The lock's owner; None when there is no lock, or it is being written (or is not a lock of ours)."""
    try:
        owner = json.loads(lock.read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def _pid_namespace() -> str | None:
    """This process's PID namespace ("pid:[4026531836]" on Linux); None where there is none to read."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    """When process `pid` started (Linux: clock ticks after boot, so a reused pid differs); None if it is gone.
    Without /proc: the pid itself while it is alive."""
    if Path("/proc/self/stat").is_file():
        try:
            return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        except (OSError, ValueError, IndexError):
            return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        pass
    return pid
