"""One run at a time in a run directory (`runlock`): real `ganscale train` processes started together or while
another trains, stale locks (a dead pid on this host, a lapsed lease from another), and a takeover raced by
several processes."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_cli import checkpoint_steps, clean_env, metrics

from ganscale import checkpoint, fault, runlock
from ganscale.config import ConfigError

ENDLESS = ["--set", "train.steps=100000", "--set", "train.batch_size=6", "--set", "log.every=1",
           "--set", "log.sample_every=0", "--set", "log.tensorboard=false", "--set", "checkpoint.every=2"]


def start(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ganscale", "train", *args], cwd=cwd, env=clean_env(), text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # a log line per step: not kept


def wait_for(condition, what: str, processes: list[subprocess.Popen]) -> None:
    """Poll until `condition()`; the test fails when a process it waits on ends first, or after 180 s."""
    deadline = time.time() + 180
    while not condition():
        assert time.time() < deadline, f"still waiting for {what}"
        assert all(p.poll() is None for p in processes), f"a process ended before {what}"
        time.sleep(0.2)


def stop(process: subprocess.Popen) -> subprocess.CompletedProcess:
    """SIGTERM a training run (it checkpoints and exits 3); its exit code and output."""
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def refusal(process: subprocess.Popen) -> str:
    """The one line of a run refused at once (exit 2), asserting it is the only one."""
    _, err = process.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert process.returncode == 2 and len(lines) == 1, f"exit {process.returncode}\n{err}"
    return lines[0]


@pytest.mark.slow
def test_two_runs_started_together_in_one_run_directory_one_trains_and_the_other_is_refused(tmp_path):
    runs = {seed: start(*ENDLESS, "--set", f"train.seed={seed}", "--run-dir", "R", cwd=tmp_path) for seed in (1, 2)}
    try:
        wait_for(lambda: any(p.poll() is not None for p in runs.values()), "one run to be refused", [])
        (refused_seed, refused), = [(s, p) for s, p in runs.items() if p.poll() is not None]
        (seed, holder), = [(s, p) for s, p in runs.items() if p is not refused]
        line = refusal(refused)
        assert line.startswith("ganscale: config error at '--run-dir': 'R' is in use by the run started ")
        assert f"on host {socket.gethostname()} (pid {holder.pid}). Fix: wait for it to end, or choose another " \
               "--run-dir" in line
        wait_for(lambda: (tmp_path / "R" / "metrics.jsonl").is_file(), "the holder to train", [holder])
        stopped = stop(holder)
    finally:
        for p in runs.values():
            if p.poll() is None:
                p.kill()
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    run = tmp_path / "R"
    assert f"seed: {seed}" in (run / "config.yaml").read_text()  # the holder's, whole
    steps = [r["step"] for r in metrics(run)]
    assert steps == list(range(1, steps[-1] + 1)) and checkpoint_steps(run)[-1] == steps[-1]
    assert all(checkpoint.problem(p) is None for p in checkpoint.list_checkpoints(run))
    assert not list(run.glob(f"{runlock.LOCK_NAME}*")) and refused_seed != seed


@pytest.mark.slow
def test_a_resume_while_a_run_trains_is_refused_and_the_nproc_run_is_not_refused_by_its_own_lock(tmp_path):
    trains = start(*ENDLESS, "--nproc", "2", "--run-dir", "R", cwd=tmp_path)
    try:
        # Any checkpoint: keep-k prunes each within a few steps, faster than a poll may look.
        wait_for(lambda: any((tmp_path / "R" / "checkpoints").glob("step-*.json")), "a checkpoint", [trains])
        resumed = start(*ENDLESS, "--set", "train.steps=200000", "--run-dir", "R", "--resume", "auto", cwd=tmp_path)
        line = refusal(resumed)
        assert "'R' is in use by the run started " in line and f"(pid {trains.pid})" in line, line
        stopped = stop(trains)
    finally:
        if trains.poll() is None:
            trains.kill()
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    run = tmp_path / "R"
    assert not list(run.glob("config.resumed-*")) and not (run / runlock.LOCK_NAME).exists()
    assert all(checkpoint.problem(p) is None for p in checkpoint.list_checkpoints(run))
    assert [r["step"] for r in metrics(run)][-1] == checkpoint_steps(run)[-1]  # its own outputs, to where it stopped


def write_lock(run: Path, host: str, pid: int, age_s: float = 0.0, pid_start: int | None = None,
               **fields) -> bytes:
    """An owner record (an older ganscale's, without pid_ns, unless `fields` name it) with a lease `age_s` old."""
    run.mkdir(parents=True, exist_ok=True)
    lock = run / runlock.LOCK_NAME
    lock.write_text(json.dumps({"host": host, "pid": pid, "pid_start": pid_start, "token": "theirs",
                                "started": "2026-11-24 20:31:05", **fields}))
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock.read_bytes()


def a_dead_pid() -> int:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    return finished.pid


@pytest.mark.parametrize("owner", ["dead pid on this host", "pid now another process", "lapsed lease elsewhere"])
def test_a_stale_lock_is_taken_over(tmp_path, owner):
    run = tmp_path / "run"
    if owner == "dead pid on this host":
        write_lock(run, socket.gethostname(), a_dead_pid())
    elif owner == "pid now another process":  # alive, but started after the lock's owner did
        write_lock(run, socket.gethostname(), os.getpid(), pid_start=-1)
    else:
        write_lock(run, "another-host", 1234, age_s=runlock.LEASE_S + 30)
    held = runlock.hold(run)
    owner_now = json.loads((run / runlock.LOCK_NAME).read_text())
    assert owner_now["token"] == held.token != "theirs" and owner_now["pid"] == os.getpid()
    held.release()
    assert list(run.iterdir()) == []  # no lock left, nothing moved aside left


@pytest.mark.parametrize("owner", ["live lease elsewhere", "live pid on this host"])
def test_a_live_lock_is_refused_naming_its_holder_and_left_as_it_is(tmp_path, owner):
    run = tmp_path / "run"
    if owner == "live lease elsewhere":
        before, host, pid = write_lock(run, "another-host", 1234, age_s=runlock.LEASE_S / 2), "another-host", 1234
    else:
        pid = os.getppid()
        before = write_lock(run, socket.gethostname(), pid, age_s=runlock.LEASE_S * 10,
                            pid_start=runlock._process_start(pid))
        host = socket.gethostname()
    with pytest.raises(ConfigError) as refused:
        runlock.hold(run)
    assert refused.value.key == "--run-dir"
    assert refused.value.problem == (f"'{run}' is in use by the run started 2026-11-24 20:31:05 on host {host} "
                                     f"(pid {pid})")
    assert [p.name for p in run.iterdir()] == [runlock.LOCK_NAME] and (run / runlock.LOCK_NAME).read_bytes() == before


class _FullDiskOs:
    """runlock's `os`, whose fdopen gives a file that a full disk refuses to write (`then` runs first)."""

    def __init__(self, then=lambda: None):
        self.then = then

    def __getattr__(self, name):
        return getattr(os, name)

    def fdopen(self, fd, *args, **kwargs):
        real, then = os.fdopen(fd, *args, **kwargs), self.then

        class Refused:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                real.close()

            def write(self, text):
                then()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return Refused()


@pytest.mark.parametrize("existing", [False, True])
def test_a_lock_that_cannot_be_written_is_removed_and_named(tmp_path, monkeypatch, existing):
    """A full disk left an empty run.lock ("a run that is starting") that refused every later run, and the error
    named no file."""
    run = tmp_path / "full" / "run"
    if existing:
        run.mkdir(parents=True)
        (run / "metrics.jsonl").write_text("{}\n")
    monkeypatch.setattr(runlock, "os", _FullDiskOs())
    with pytest.raises(OSError) as refused:
        runlock.hold(run)
    assert refused.value.errno == errno.ENOSPC and refused.value.filename == str(run / runlock.LOCK_NAME)
    if existing:  # the run's own files are kept; only the lock it made goes
        assert [p.name for p in run.iterdir()] == ["metrics.jsonl"]
    else:  # the folders it made go too
        assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()  # space freed
    held = runlock.hold(run)
    assert runlock.token_of(run) == held.token
    held.release()


def test_a_failed_lock_write_leaves_a_lock_that_is_not_its_own(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    lock = run / runlock.LOCK_NAME

    def replaced():  # another run's, in its place (not possible within LEASE_S, but never removed)
        lock.unlink()
        lock.write_text("theirs")

    monkeypatch.setattr(runlock, "os", _FullDiskOs(then=replaced))
    with pytest.raises(OSError, match="No space left on device"):
        runlock.hold(run)
    assert lock.read_text() == "theirs"


def test_train_whose_lock_cannot_be_written_exits_7_naming_it(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ganscale.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runlock, "os", _FullDiskOs())
    result = CliRunner().invoke(main, ["train", "--set", "train.steps=2", "--run-dir", "full/run"])
    assert result.exit_code == 7, result.output
    assert result.output.splitlines() == [f"ganscale: No space left on device: {Path('full/run') / 'run.lock'}. Fix: "
                                          "check that path's permissions and free space, or choose another location "
                                          "(--run-dir)"], result.output
    assert list(tmp_path.iterdir()) == []
    import torch.distributed as dist

    # The one-process group is closed: left open, every later in-process failure (a CliRunner's exit 2) took this
    # for a launcher's worker and left with os._exit, ending pytest itself.
    assert not dist.is_initialized()


def _take_stale_lock(rank, world, run):
    import torch.distributed as dist

    dist.barrier()  # all at once
    try:
        held = runlock.hold(Path(run))
    except ConfigError:
        held = None
    taken: list = [None] * world
    dist.all_gather_object(taken, held.token if held else None)
    dist.barrier()  # every attempt is over before the winner lets go
    owner = json.loads((Path(run) / runlock.LOCK_NAME).read_text())["token"]
    dist.barrier()
    if held:
        held.release()
    return taken, owner


def test_a_stale_lock_raced_for_by_several_processes_is_taken_by_one(tmp_path):
    from dist_helpers import run_ranks

    run = tmp_path / "run"
    write_lock(run, socket.gethostname(), a_dead_pid())
    results = run_ranks(_take_stale_lock, 4, str(run))
    taken, owner = results[0]
    assert [token for token in taken if token] == [owner]
    assert list(run.iterdir()) == []


# ------------------------------------------------------------------------------ PID namespaces
def can_unshare() -> bool:
    """Whether this process may start one in a PID namespace of its own (root, or user namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not can_unshare(), reason="needs `unshare --pid --fork --mount-proc` (root or user namespaces)")
def test_a_resume_from_another_pid_namespace_on_this_host_is_refused_while_the_run_trains(tmp_path):
    """The outside tester's case: containers with host networking on a shared volume (one hostname, their own
    pids). The holder's pid is not visible from the other namespace: only its lease says whether it lives."""
    trains = start(*ENDLESS, "--run-dir", "R", cwd=tmp_path)
    try:
        wait_for(lambda: any((tmp_path / "R" / "checkpoints").glob("step-*.json")), "a checkpoint", [trains])
        token = runlock.token_of(tmp_path / "R")
        resumed = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "ganscale",
                                    "train", *ENDLESS, "--run-dir", "R", "--resume", "auto"], cwd=tmp_path,
                                   env=clean_env(), text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        line = refusal(resumed)
        assert "'R' is in use by the run started " in line and f"(pid {trains.pid})" in line, line
        assert runlock.token_of(tmp_path / "R") == token and trains.poll() is None  # still the holder's, training
        stopped = stop(trains)
    finally:
        if trains.poll() is None:
            trains.kill()
    assert stopped.returncode == 3, stopped.stderr[-3000:]
    assert "no longer this run's" not in stopped.stderr


def test_the_owner_record_names_its_pid_namespace(tmp_path):
    held = runlock.hold(tmp_path / "run")
    try:
        owner = json.loads((tmp_path / "run" / runlock.LOCK_NAME).read_text())
    finally:
        held.release()
    assert owner["pid_ns"] == (os.readlink("/proc/self/ns/pid") if Path("/proc/self/ns/pid").exists() else None)


def test_a_lock_from_another_pid_namespace_on_this_host_is_judged_by_its_lease(tmp_path, monkeypatch):
    """Its pid (dead, or another process, from here) says nothing: it is taken over only once its lease lapses."""
    monkeypatch.setattr(runlock, "LEASE_S", 1.0)
    run = tmp_path / "run"
    before = write_lock(run, socket.gethostname(), a_dead_pid(), pid_ns="pid:[4026500000]")
    with pytest.raises(ConfigError, match="is in use by the run started"):
        runlock.hold(run)
    assert (run / runlock.LOCK_NAME).read_bytes() == before
    time.sleep(1.5)  # its lease lapses
    held = runlock.hold(run)
    assert json.loads((run / runlock.LOCK_NAME).read_text())["token"] == held.token
    held.release()


def test_a_dead_pid_in_this_pid_namespace_is_taken_over_at_once(tmp_path):
    run = tmp_path / "run"
    write_lock(run, socket.gethostname(), a_dead_pid(), pid_ns=runlock._pid_namespace())  # a fresh lease
    held = runlock.hold(run)
    assert json.loads((run / runlock.LOCK_NAME).read_text())["token"] == held.token
    held.release()


# ------------------------------------------------------------------------------ a lock taken over
@pytest.mark.parametrize("stops_run", [False, True])
def test_a_hold_taken_over_is_lost_no_longer_renewed_and_left_to_its_new_owner(tmp_path, monkeypatch, capsys,
                                                                               stops_run):
    """`stops_run`: a training loop stops on it and says so; else the hold warns by itself."""
    monkeypatch.setattr(runlock, "RENEW_S", 0.05)
    run = tmp_path / "run"
    held = runlock.hold(run)
    held.stops_run = stops_run
    try:
        time.sleep(0.3)
        assert not held.lost.is_set() and held.verify()
        theirs = write_lock(run, "another-host", 1234, age_s=30)  # the other run, as its renewals found it
        deadline = time.time() + 10
        while not held.lost.is_set():
            assert time.time() < deadline, "the hold's thread did not find it lost"
            time.sleep(0.05)
        time.sleep(0.3)
        assert not held.verify() and time.time() - (run / runlock.LOCK_NAME).stat().st_mtime > 20  # not renewed
    finally:
        held.release()
    assert (run / runlock.LOCK_NAME).read_bytes() == theirs
    warned = f"ganscale: warning: the lock {run / runlock.LOCK_NAME} is no longer this run's"
    assert (warned in capsys.readouterr().err) != stops_run


def test_a_hold_moved_aside_for_an_instant_by_a_racing_takeover_is_not_lost(tmp_path, monkeypatch):
    """`_take_over_if_stale` may move a fresh lock aside and put it back: that is not a takeover."""
    monkeypatch.setattr(runlock, "CONFIRM_S", 0.5)
    held = runlock.hold(tmp_path / "run")
    lock, aside = tmp_path / "run" / runlock.LOCK_NAME, tmp_path / "run" / "aside"
    try:
        os.rename(lock, aside)
        threading.Timer(0.1, lambda: os.link(aside, lock)).start()
        assert held.verify() and not held.lost.is_set()
    finally:
        aside.unlink(missing_ok=True)
        held.release()


def everything_but_the_lock(run: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(run)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file() and p.name != runlock.LOCK_NAME}


def take_over_after_checkpoint(trains: subprocess.Popen, run: Path, step: int) -> tuple[bytes, dict, str]:
    """Once the training `trains` has written checkpoint `step` of `run`, another run takes the lock over: (that
    run's lock, what `run` held then but the lock, the training's stderr once it has ended)."""
    try:
        wait_for(lambda: (run / "checkpoints" / f"step-{step:08d}.json").is_file(), f"checkpoint {step}", [trains])
        time.sleep(0.3)  # what the step writes after its checkpoint (keep-k pruning) is done
        theirs = write_lock(run, "another-host", 4321)  # taken over: another run's token, a fresh lease
        written = everything_but_the_lock(run)
        _, err = trains.communicate(timeout=120)
    finally:
        if trains.poll() is None:
            trains.kill()
    return theirs, written, err


# `python -m ganscale` whose hold is never checked by its thread (it would find a takeover within RENEW_S): only
# the trainer's own look before an iteration that writes can find it.
UNWATCHED = ("import sys; from ganscale import runlock; runlock.RENEW_S = 3600.0; from ganscale.cli import main; "
             "sys.argv[0] = 'ganscale'; main()")


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [None, 2])
def test_a_run_whose_lock_another_run_took_over_stops_and_writes_nothing_more(tmp_path, nproc):
    """Rank 0 pauses 3 s at the start of step 5 (checkpoint step-4 written); meanwhile another run takes the lock.
    Every rank stops in that step's agreement: exit 9, one line naming the lock, nothing written since. One process:
    found by the trainer's look before writing (the lock's thread is kept out). `--nproc`: the launcher holds the
    lock, its workers' rank 0 watches it, and the launcher does not restart them."""
    env = {**clean_env(), fault.INJECT_ENV: "sleep@0:4:3"}
    python = [sys.executable, "-m", "ganscale"] if nproc else [sys.executable, "-c", UNWATCHED]
    launched = ["--nproc", str(nproc), "--max-restarts", "1"] if nproc else []
    trains = subprocess.Popen([*python, "train", *ENDLESS, *launched, "--run-dir", "R"],
                              cwd=tmp_path, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = tmp_path / "R"
    theirs, written, err = take_over_after_checkpoint(trains, run, 4)
    assert trains.returncode == fault.EXIT_TAKEN_OVER == 9, err[-3000:]
    said = [line for line in err.splitlines() if "took over" in line]
    assert said == [f"ganscale: another run took over the run directory R (the lock R/{runlock.LOCK_NAME} is that "
                    "run's now): this run stopped at step 5 and wrote nothing more there, no checkpoint either"], err
    assert "Traceback" not in err and "another rank failed first" not in err and "no longer this run's" not in err
    if nproc:
        assert "not restarting the workers: another run holding the run directory would stop them again" in err, err
    assert everything_but_the_lock(run) == written and (run / runlock.LOCK_NAME).read_bytes() == theirs
    assert checkpoint_steps(run)[-1] == 4 and not (run / "summary.json").exists()


@pytest.mark.parametrize("launch", [[], ["--nproc", "2"]], ids=["one-process", "nproc-2"])
def test_a_run_refused_after_taking_its_new_folder_leaves_no_folder_behind(tmp_path, launch):
    """Refused once it held its new run directory (a resume from a checkpoint that does not fit; an image folder
    with no images, found as the data set is built): it left the empty folder, and the parents it made, behind."""
    from test_cli import ganscale

    first = ganscale("train", "ring8", "--set", "train.steps=2", "--set", "log.tensorboard=false", "--run-dir", "r1",
                     cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    (tmp_path / "empty").mkdir()
    for refused in (["digits", "--resume", "r1"], ["digits", "--set", "data.kind=folder", "--set", "data.path=empty"]):
        result = ganscale("train", *refused, *launch, "--run-dir", "new/run", cwd=tmp_path)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert not (tmp_path / "new").exists(), sorted(p.name for p in (tmp_path / "new").rglob("*"))
    kept = tmp_path / "kept"
    kept.mkdir()
    result = ganscale("train", "digits", "--resume", "r1", *launch, "--run-dir", "kept", cwd=tmp_path)
    assert result.returncode == 2 and kept.is_dir()  # a folder that was there before stays


def test_a_lock_without_its_owner_says_when_another_run_takes_it_over(tmp_path):
    """An empty or unreadable run.lock (a start in progress, or one that failed): its refusal said only 'wait for it
    to end', though it clears itself: it says after how long another run takes it over."""
    run = tmp_path / "run"
    run.mkdir()
    (run / runlock.LOCK_NAME).write_text("")
    with pytest.raises(ConfigError) as refused:
        runlock.refuse_if_held(run)
    assert "a run that is starting" in refused.value.problem
    assert f"another run takes it over {runlock.LEASE_S:.0f} s after it was written" in refused.value.fix
