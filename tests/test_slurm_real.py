"""A real Slurm: jobs through sbatch/srun on the test cluster of tests/slurm_cluster.py, `ganscale slurm` end to
end (a job trains as `ganscale train --nproc 2` does, bit for bit) and stopped by Slurm's signal, requeued and
resumed to the same final checkpoint, by `scancel --signal=USR1` and by the clock (a job near its `--time` limit).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)
from test_cli import clean_env, explain

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # scripts/test.sh runs them after the others, one at a time

TINY = ["--set", "train.batch_size=6", "--set", "log.sample_every=0", "--set", "log.every=1"]


def _wait_job(env: dict, job: str, timeout_s: float = 120) -> str:
    """Waits until the job has left the queue (a requeued job stays in it, pending); its `scontrol show job` line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip()
        if not queued:
            return subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True,
                                  text=True).stdout.strip()
        time.sleep(1)
    pytest.fail(f"job {job} did not finish in {timeout_s} s")


def test_sbatch_srun_hostname(slurm_cluster, tmp_path):  # noqa: F811
    output = tmp_path / "hostname.out"
    submitted = subprocess.run(["sbatch", "--parsable", "-o", str(output), "--wrap", "srun hostname"],
                               env=slurm_cluster, capture_output=True, text=True, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    _wait_job(slurm_cluster, submitted.stdout.strip().split(";")[0])
    assert output.read_text().strip()


def _job_env(cluster: dict) -> dict:
    env = clean_env()
    env.update(SLURM_CONF=cluster["SLURM_CONF"], GLOO_SOCKET_IFNAME="lo")  # sbatch exports it to the job
    return env


def _submit(cluster: dict, cwd: Path, run: Path, settings: list[str], job_env: dict | None = None) -> str:
    """`ganscale slurm` of a two-process CPU job; the job id it printed. `job_env`: more environment for the job."""
    done = subprocess.run([sys.executable, "-m", "ganscale", "slurm", "ring8", "--nodes", "1", "--gpus-per-node", "0",
                           "--procs-per-node", "2", "--run-dir", str(run), *settings], cwd=cwd,
                          env={**_job_env(cluster), **(job_env or {})}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, explain(done)
    return re.search(r"job (\d+)", done.stdout)[1]


def _train(cwd: Path, run: Path, settings: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "ganscale", "train", "ring8", "--nproc", "2", "--run-dir", str(run),
                           *settings], cwd=cwd, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, explain(done)


def _job_log(run: Path) -> str:
    return "\n".join(p.read_text() for p in sorted((run / "slurm").glob("*.out")) + sorted((run / "slurm").glob("*.err")))


def _assert_same_final_checkpoint(a: Path, b: Path, step: int) -> None:
    name = f"checkpoints/step-{step:08d}.pt"
    first, second = (torch.load(run / name, weights_only=True) for run in (a, b))
    assert first.keys() == second.keys()
    for key in first.keys() - {"config"}:
        _assert_same(first[key], second[key], key)


def _assert_same(x, y, where: str) -> None:
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for key in x:
            _assert_same(x[key], y[key], f"{where}.{key}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_same(u, v, f"{where}[{i}]")
    else:
        assert x == y, where


def test_ganscale_slurm_trains_as_ganscale_train_does(slurm_cluster, tmp_path):  # noqa: F811
    """In a run directory whose name holds a space, a quote and a % (which sbatch reads as a pattern in #SBATCH
    --output/--error): the job's log and the run are in it, as named."""
    settings = [*TINY, "--set", "train.steps=3"]
    run = tmp_path / "slurm-run 5%u it's"
    job = _submit(slurm_cluster, tmp_path, run, settings)
    state = _wait_job(slurm_cluster, job, timeout_s=300)
    assert "JobState=COMPLETED" in state, f"{state}\n{_job_log(run)}"
    assert f"ganscale: job {job}," in (run / "slurm" / f"{job}.out").read_text()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["requeues"] == 0, summary
    _train(tmp_path, tmp_path / "local-run", settings)
    _assert_same_final_checkpoint(run, tmp_path / "local-run", 3)


def _submit_and_wait_for_training(env: dict, tmp_path: Path, settings: list[str]) -> tuple[Path, str]:
    """(run directory, job id) of a job submitted with `settings`, once it has logged 3 steps (5 minutes at most)."""
    run = tmp_path / "slurm-run"
    job = _submit(env, tmp_path, run, settings)
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    return run, job


def test_a_signalled_job_checkpoints_requeues_itself_and_resumes_to_the_same_result(slurm_cluster, tmp_path):  # noqa: F811
    """USR1 to the batch shell (what Slurm sends before the time limit): the workers stop at an agreed checkpoint,
    the script requeues the job, which comes back and resumes (`--resume auto`) to an uninterrupted run's result."""
    steps = 400
    # No periodic checkpoint before the end: the rerun can only resume from the one written on the signal.
    settings = [*TINY, "--set", f"train.steps={steps}", "--set", f"checkpoint.every={steps}"]
    run, job = _submit_and_wait_for_training(slurm_cluster, tmp_path, settings)
    signalled = subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_cluster, capture_output=True,
                               text=True)
    assert signalled.returncode == 0, signalled.stderr
    state = _wait_job(slurm_cluster, job, timeout_s=600)
    log = _job_log(run)
    assert "JobState=COMPLETED" in state and "Restarts=0 " not in state, f"{state}\n{log}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["requeues"] >= 1 and summary["steps"] == steps, f"{summary}\n{log}"
    assert "restart 1," in log, log  # the script's first line on the requeued run
    assert re.search(r"stopped at step \d+ on request", log) and "resuming from" in log, log
    _train(tmp_path, tmp_path / "local-run", settings)
    _assert_same_final_checkpoint(run, tmp_path / "local-run", steps)


def test_a_job_near_its_time_limit_is_signalled_checkpoints_requeues_and_resumes(slurm_cluster, tmp_path):  # noqa: F811
    """`--time 00:02:00 --signal-lead 55`: slurmctld (its time checks run every 30 s) signals the batch shell 35 to
    65 s after the start. Rank 0's step 5 would take 100 s (an injected slow step, which a stop signal ends), so the
    signal always comes before the run could finish; every rank stops after that step with a checkpoint, the job
    requeues, and the next start resumes to an uninterrupted run's result."""
    steps = 12
    settings = [*TINY, "--set", f"train.steps={steps}", "--set", "checkpoint.every=4"]
    run = tmp_path / "slurm-run"
    job = _submit(slurm_cluster, tmp_path, run, [*settings, "--time", "00:02:00", "--signal-lead", "55"],
                  job_env={"GANSCALE_INJECT_FAULT": "slow@0:5:100"})
    state = _wait_job(slurm_cluster, job, timeout_s=400)
    log = _job_log(run)
    assert "JobState=COMPLETED" in state, f"{state}\n{log}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["requeues"] == 1 and summary["steps"] == steps, f"{summary}\n{log}"
    assert "stopped at step 6 on request" in log, log  # the slow step ended, then every rank stopped
    _train(tmp_path, tmp_path / "local-run", settings)
    _assert_same_final_checkpoint(run, tmp_path / "local-run", steps)


def test_a_cancelled_job_checkpoints_and_ends_without_requeueing_itself(slurm_cluster, tmp_path):  # noqa: F811
    """Plain `scancel` (SIGTERM to the batch shell and every step): the workers stop at an agreed checkpoint and
    the job ends, exit 3, not requeued; it requeued itself and trained on. The job asks Slurm for a CPU per
    process (it had one CPU for the node's every process)."""
    steps = 400
    settings = [*TINY, "--set", f"train.steps={steps}", "--set", f"checkpoint.every={steps}"]
    run, job = _submit_and_wait_for_training(slurm_cluster, tmp_path, settings)
    shown = subprocess.run(["scontrol", "show", "job", "-o", job], env=slurm_cluster, capture_output=True, text=True)
    assert " NumCPUs=2 " in shown.stdout, shown.stdout
    cancelled = subprocess.run(["scancel", job], env=slurm_cluster, capture_output=True, text=True)
    assert cancelled.returncode == 0, cancelled.stderr
    state = _wait_job(slurm_cluster, job, timeout_s=120)
    log = _job_log(run)
    assert "JobState=CANCELLED" in state and " Restarts=0 " in state and " ExitCode=3:0 " in state, f"{state}\n{log}"
    assert re.search(r"stopped at step \d+ on request", log) and "restart 1," not in log, log
    assert json.loads((run / "summary.json").read_text())["stopped"] == "preempted"
    assert list((run / "checkpoints").glob("step-*")), log
