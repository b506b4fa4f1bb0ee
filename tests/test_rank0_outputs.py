"""What rank 0 alone writes (config, metrics, samples, checkpoint) fails on every rank together: rank 0 with its
own one-line message, the other ranks with the same kind of error naming it, all with rank 0's exit code, and
none left waiting in a collective. Two real worker processes on gloo, started as a launcher would, so each
rank's exit code and output can be read."""

from __future__ import annotations

import errno
import resource
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import clean_env, metrics

from ganscale import checkpoint

FAST = ["--set", "model.g_width=32", "--set", "model.d_width=32", "--set", "train.batch_size=64",
        "--set", "log.tensorboard=false", "--set", "fault.hang_timeout_s=300"]
TIMEOUT_S = 60  # far below the hang watchdog (300 s) and the collective timeout (600 s): a hang fails the test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_two_ranks(run: Path, *settings: str, rank0_file_limit: int | None = None) -> list[subprocess.CompletedProcess]:
    """`ganscale train ring8` as ranks 0 and 1 of one group; each rank's exit code and output."""
    port = _free_port()
    workers = []
    for rank in (0, 1):
        env = {**clean_env(), "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        limit = rank0_file_limit if rank == 0 else None
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "ganscale", "train", "ring8", "--run-dir", str(run), *FAST, *settings],
            cwd=run.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=(lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None))
    results = []
    try:
        for worker in workers:
            stdout, stderr = worker.communicate(timeout=TIMEOUT_S)
            results.append(subprocess.CompletedProcess(worker.args, worker.returncode, stdout, stderr))
    finally:
        for worker in workers:
            if worker.poll() is None:  # a rank left waiting: the failure this file is about
                worker.kill()
                worker.communicate()
    return results


def explain(results: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"--- rank {rank}: exit {r.returncode}\n{r.stderr[-3000:]}" for rank, r in enumerate(results))


def one_line(result: subprocess.CompletedProcess) -> str:
    """The worker's one 'ganscale:' line, asserting there is no traceback."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("ganscale:")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


def intact_checkpoints(run: Path) -> list[str]:
    return [p.name for p in checkpoint.list_checkpoints(run) if checkpoint.problem(p) is None]


@pytest.mark.slow
def test_a_sample_picture_rank_0_cannot_write_stops_both_ranks_with_its_message(tmp_path):
    run = tmp_path / "run"
    (run / "samples" / "step-00000010.png").mkdir(parents=True)  # a folder where the picture goes
    results = train_two_ranks(run, "--set", "train.steps=20", "--set", "log.every=5",
                              "--set", "checkpoint.every=5", "--set", "log.sample_every=10")
    assert [r.returncode for r in results] == [1, 1], explain(results)
    own, told = (one_line(r) for r in results)
    assert own.startswith("ganscale: Is a directory: ") and own.endswith(
        "Fix: check that path's permissions and free space, or choose another location (--run-dir, --out)")
    assert "step-00000010.png" in own
    assert told == own.replace("ganscale: ", "ganscale: rank 0 could not write its samples: ", 1)
    assert intact_checkpoints(run) == ["step-00000005.pt"]  # the step-10 checkpoint comes after the samples
    assert [r["step"] for r in metrics(run)] == [5, 10]


@pytest.mark.slow
def test_a_checkpoint_rank_0_cannot_write_stops_both_ranks_and_keeps_the_earlier_one(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000020.json").mkdir(parents=True)  # a folder where step 20's marker goes
    results = train_two_ranks(run, "--set", "train.steps=20", "--set", "log.every=5",
                              "--set", "checkpoint.every=10", "--set", "log.sample_every=0")
    assert [r.returncode for r in results] == [1, 1], explain(results)
    own, told = (one_line(r) for r in results)
    assert own.startswith(f"ganscale: could not write checkpoint {run / 'checkpoints' / 'step-00000020.pt'}")
    assert told == own.replace("ganscale: ", "ganscale: rank 0 could not write its checkpoint: ", 1)
    assert intact_checkpoints(run) == ["step-00000010.pt"]
    assert not (run / "summary.json").exists()


@pytest.mark.slow
def test_a_metrics_record_rank_0_cannot_write_stops_both_ranks_with_its_error(tmp_path):
    run = tmp_path / "run"
    # Rank 0 may write files of at most 16 KiB: its config fits, its metrics.jsonl soon does not (EFBIG).
    results = train_two_ranks(run, "--set", "train.steps=100000", "--set", "log.every=1",
                              "--set", "checkpoint.every=0", "--set", "log.sample_every=0",
                              rank0_file_limit=16 * 1024)
    assert [r.returncode for r in results] == [1, 1], explain(results)
    assert "OSError: [Errno 27] File too large" in results[0].stderr  # not a known failure: its traceback
    assert "rank 0 could not write its metrics: File too large" in results[1].stderr
    assert 10 < (run / "metrics.jsonl").read_text().count("\n") < 100  # the last record is cut short


@pytest.mark.slow
def test_a_config_rank_0_cannot_write_stops_both_ranks_before_training(tmp_path):
    run = tmp_path / "run"
    (run / "config.yaml").mkdir(parents=True)
    results = train_two_ranks(run, "--set", "train.steps=20")
    assert [r.returncode for r in results] == [1, 1], explain(results)
    own, told = (one_line(r) for r in results)
    assert own.startswith("ganscale: Is a directory: ") and "config.yaml" in own
    assert told == own.replace("ganscale: ", "ganscale: rank 0 could not write its run directory: ", 1)
    assert not (run / "metrics.jsonl").exists()


def test_the_other_ranks_error_is_shown_as_rank_0_s_with_the_same_exit_code():
    """What the CLI makes of rank 0's error and of the one the other ranks raise from its report."""
    from ganscale.cli import _known_failure
    from ganscale.trainer import Rank0WriteFailed, _error_of_rank0, _report

    refused = PermissionError(errno.EACCES, "Permission denied", "/runs/x/samples/step-00000010.png")
    full = checkpoint.CheckpointWriteError("could not write checkpoint /runs/x/step-1.pt: no space left on device. "
                                           "Fix: free space", errno.ENOSPC)
    for error, what in ((refused, "samples"), (full, "checkpoint")):
        theirs = _error_of_rank0(what, _report(error))
        assert type(theirs) is type(error) and theirs.errno == error.errno
        own_line, own_code = _known_failure(error)
        their_line, their_code = _known_failure(theirs)
        assert their_code == own_code == 1
        assert their_line == own_line.replace("ganscale: ", f"ganscale: rank 0 could not write its {what}: ", 1)
    bug = _error_of_rank0("samples", _report(ValueError("bad shape\nmore detail")))
    assert isinstance(bug, Rank0WriteFailed) and str(bug) == "rank 0 could not write its samples: ValueError: bad shape"
    assert _known_failure(bug) is None  # shown with its traceback and exit 1, as rank 0's own ValueError
