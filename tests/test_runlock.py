"""One run at a time in a run directory (`runlock`): real `ganscale train` processes started together or while
another trains, stale locks (a dead pid on this host, a lapsed lease from another), and a takeover raced by
several processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import checkpoint_steps, clean_env, metrics

from ganscale import checkpoint, runlock
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


def write_lock(run: Path, host: str, pid: int, age_s: float = 0.0, pid_start: int | None = None) -> bytes:
    run.mkdir(parents=True, exist_ok=True)
    lock = run / runlock.LOCK_NAME
    lock.write_text(json.dumps({"host": host, "pid": pid, "pid_start": pid_start, "token": "theirs",
                                "started": "2026-11-24 20:31:05"}))
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
