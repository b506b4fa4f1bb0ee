"""One run at a time in a run directory: a lock file, `RUN_DIR/run.lock`, held for the run's whole life.

Made with O_CREAT|O_EXCL (atomic on local disks and on NFS); it holds its owner as JSON (host, pid, start time,
a token). The owner renews it (its mtime, a lease) every RENEW_S seconds and removes it when it ends. A lock
whose owner is gone is taken over: on the same host, when its pid is dead (or now another process); from another
host, when its lease is LEASE_S old (the file system stamps the renewals; LEASE_S leaves room for clock skew).
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
LEASE_S = 60.0  # a lock from another host not renewed for this long is its crashed (or cut off) owner's


class RunLock:
    """This process's hold on a run directory (`hold`): renewed from a daemon thread until `release`."""

    def __init__(self, path: Path, token: str, made: list[Path]):
        self.path, self.token, self.made = path, token, made
        self._stop = threading.Event()
        self._renewer = threading.Thread(target=self._renew, name="ganscale-run-lock", daemon=True)
        self._renewer.start()

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                if (_owner(self.path) or {}).get("token") != self.token:
                    print(f"ganscale: warning: the lock {self.path} is no longer this run's (its lease lapsed and "
                          "another run took it over)", file=sys.stderr, flush=True)
                    return
                os.utime(self.path)  # the file system's clock stamps the lease
            except OSError:  # a file system hiccup: the next renewal tries again, well within the lease
                continue

    def release(self, abandon: bool = False) -> None:
        """Stop renewing and remove the lock (if still ours); `abandon`: the run wrote nothing, so the folders
        `hold` made for it are removed too."""
        self._stop.set()
        if (_owner(self.path) or {}).get("token") == self.token:
            self.path.unlink(missing_ok=True)
        for folder in self.made if abandon else []:
            try:
                folder.rmdir()
            except OSError:  # not empty: something else is there now
                break

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def hold(run_dir: Path) -> RunLock:
    """Take the run directory (made if missing) for this process, taking over a stale lock; a ConfigError naming
    the holder when another run holds it."""
    made = [p for p in (run_dir, *run_dir.parents) if not p.exists()]
    run_dir.mkdir(parents=True, exist_ok=True)
    lock, token = run_dir / LOCK_NAME, uuid.uuid4().hex
    owner = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
             "started": time.strftime("%Y-%m-%d %H:%M:%S"), "token": token}
    for _ in range(3):  # a stale lock taken over, and lost to a third run: at most a few tries
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            _take_over_if_stale(run_dir)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(owner))
        return RunLock(lock, token, made)
    refuse_if_held(run_dir)
    raise ConfigError("--run-dir", f"'{run_dir}' is being taken by another run", "wait for it to start, or choose "
                      "another --run-dir")


def held_by_parent(run_dir: Path) -> bool:
    """True in a worker of the `--nproc` parent that holds `run_dir`."""
    token = os.environ.get(TOKEN_ENV)
    return token is not None and (_owner(run_dir / LOCK_NAME) or {}).get("token") == token


def refuse_if_held(run_dir: Path) -> None:
    """A ConfigError naming the holder when another live run holds `run_dir`; writes nothing."""
    lock = run_dir / LOCK_NAME
    seen = _seen(lock)
    if seen is None or _stale(*seen):
        return
    owner = seen[0]
    holder = (f"the run started {owner.get('started')} on host {owner.get('host')} (pid {owner.get('pid')})"
              if owner else f"a run that is starting (see {lock})")
    raise ConfigError("--run-dir", f"'{run_dir}' is in use by {holder}", "wait for it to end, or choose another "
                      "--run-dir")


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
    if owner and owner.get("host") == socket.gethostname():
        pid = owner.get("pid")
        return not (isinstance(pid, int) and _process_start(pid) is not None
                    and _process_start(pid) == owner.get("pid_start"))
    return age_s > LEASE_S


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
