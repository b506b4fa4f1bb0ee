"""What rank 0 alone writes (config, metrics, samples, checkpoint) fails on every rank together: rank 0 with its
own one-line message, the other ranks with the same kind of error naming it (said once per node), all with
rank 0's exit code, and none left waiting in a collective. Two real worker processes on gloo, started as a
launcher would, so each rank's exit code and output can be read."""

from __future__ import annotations

import errno
import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import clean_env, ganscale, ganscale_ranks, metrics

from ganscale import checkpoint

FAST = ["--set", "model.g_width=32", "--set", "model.d_width=32", "--set", "train.batch_size=64",
        "--set", "log.tensorboard=false", "--set", "fault.hang_timeout_s=300"]
TIMEOUT_S = 60  # far below the hang watchdog (300 s) and the collective timeout (600 s): a hang fails the test


def train_two_ranks(run: Path, *settings: str, rank0_file_limit: int | None = None) -> list[subprocess.CompletedProcess]:
    """`ganscale train ring8` as ranks 0 and 1 of one group, each on a node of its own (so each node's output says
    the error once); each rank's exit code and output."""
    limit = rank0_file_limit
    setup = {0: lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))} if limit else None
    args = ["ring8", "--run-dir", str(run), *FAST, *settings]
    return ganscale_ranks([args, args], cwd=run.parent, timeout=TIMEOUT_S, setup=setup, node_per_rank=True)


def explain(results: list[subprocess.CompletedProcess]) -> str:
    return "\n".join(f"--- rank {rank}: exit {r.returncode}\n{r.stderr[-3000:]}" for rank, r in enumerate(results))


def one_line(result: subprocess.CompletedProcess) -> str:
    """The worker's one 'ganscale:' line, asserting there is no traceback. Warnings printed at the start are not
    it."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines()
             if line.startswith("ganscale:") and not line.startswith("ganscale: warning:")]
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
    assert [r.returncode for r in results] == [7, 7], explain(results)
    own, told = (one_line(r) for r in results)
    assert own.startswith("ganscale: Is a directory: ") and own.endswith(
        "Fix: a folder is where that file is written: rename or move it, or choose another location (--run-dir)")
    assert "step-00000010.png" in own
    assert told == own.replace("ganscale: ", "ganscale: rank 0 could not write its samples: ", 1)
    assert intact_checkpoints(run) == ["step-00000005.pt"]  # the step-10 checkpoint comes after the samples
    assert [r["step"] for r in metrics(run)] == [5, 10]


@pytest.mark.slow
@pytest.mark.parametrize("form, suffix", [("full", "pt"), ("sharded", "dcp")])
def test_a_checkpoint_rank_0_cannot_write_stops_both_ranks_and_keeps_the_earlier_one(tmp_path, form, suffix):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000020.json").mkdir(parents=True)  # a folder where step 20's marker goes
    results = train_two_ranks(run, "--set", "train.steps=20", "--set", "log.every=5", "--set", "checkpoint.every=10",
                              "--set", "log.sample_every=0", "--set", f"checkpoint.format={form}")
    assert [r.returncode for r in results] == [7, 7], explain(results)
    own, told = (one_line(r) for r in results)
    assert own.startswith(f"ganscale: could not write checkpoint {run / 'checkpoints' / f'step-00000020.{suffix}'}")
    assert told == own.replace("ganscale: ", "ganscale: rank 0 could not write its checkpoint: ", 1)
    assert intact_checkpoints(run) == [f"step-00000010.{suffix}"]
    assert not (run / "summary.json").exists()


@pytest.mark.slow
def test_a_metrics_record_rank_0_cannot_write_stops_both_ranks_with_its_error(tmp_path):
    run = tmp_path / "run"
    # Rank 0 may write files of at most 16 KiB: its config fits, its metrics.jsonl soon does not (EFBIG).
    results = train_two_ranks(run, "--set", "train.steps=100000", "--set", "log.every=1",
                              "--set", "checkpoint.every=0", "--set", "log.sample_every=0",
                              rank0_file_limit=16 * 1024)
    assert [r.returncode for r in results] == [7, 7], explain(results)
    own, told = (one_line(r) for r in results)
    assert own.startswith("ganscale: File too large: ") and "metrics.jsonl" in own
    assert told == own.replace("ganscale: ", "ganscale: rank 0 could not write its metrics: ", 1)
    assert 10 < (run / "metrics.jsonl").read_text().count("\n") < 100  # the last record is cut short


def test_a_record_cut_short_by_a_failed_write_is_dropped_when_the_run_resumes(tmp_path):
    from ganscale.observe import RunLog

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss_d": 1.0}\n{"step": 2, "loss_d": 0.9}\n{"step": 3, "lo')
    RunLog(tmp_path, total_steps=10, start_step=2, tensorboard=False, enabled=True).close({})
    assert [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        '{"step": 1, "loss_d": 1.0}', '{"step": 2, "loss_d": 0.9}']


@pytest.mark.slow
def test_a_resume_that_cannot_rewrite_metrics_names_the_file_and_leaves_no_temporary(tmp_path):
    """A resume rewrites metrics.jsonl without the steps it redoes; a full disk there (here: a file size limit) is
    exit 7 with one line naming metrics.jsonl, leaving the file as it was and nothing that is not a run's file."""
    from ganscale.rundir import RUN_FILES

    run = tmp_path / "run"
    first = ganscale("train", "ring8", "--run-dir", str(run), *FAST, "--set", "train.steps=2",
                     "--set", "checkpoint.every=2", "--set", "log.every=1", "--set", "log.sample_every=0", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    padding = json.dumps({"step": 1, "note": "x" * 1000}) + "\n"
    with open(run / "metrics.jsonl", "a") as f:  # records the resume keeps: its rewrite exceeds the 16 KiB allowed
        f.write(padding * 20)
    before = (run / "metrics.jsonl").read_text()
    limit = 16 * 1024
    resumed = subprocess.run([sys.executable, "-m", "ganscale", "train", "--run-dir", str(run), "--resume", "auto",
                              "--set", "train.steps=4"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                             timeout=TIMEOUT_S, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE,
                                                                                      (limit, limit)))
    assert resumed.returncode == 7, resumed.stderr[-3000:]
    assert one_line(resumed).startswith(f"ganscale: File too large: {run / 'metrics.jsonl'}. Fix: ")
    assert (run / "metrics.jsonl").read_text() == before
    assert [p.name for p in run.iterdir() if not RUN_FILES.match(p.name)] == []


@pytest.mark.slow
def test_a_config_rank_0_cannot_write_stops_both_ranks_before_training(tmp_path):
    run = tmp_path / "run"
    # Its run.lock (~250 bytes) fits, its config (a few KiB) does not.
    results = train_two_ranks(run, "--set", "train.steps=20", rank0_file_limit=1024)
    assert [r.returncode for r in results] == [7, 7], explain(results)
    own, told = (one_line(r) for r in results)
    assert own.startswith("ganscale: File too large: ") and "config.yaml" in own
    assert told == own.replace("ganscale: ", "ganscale: rank 0 could not write its run directory: ", 1)
    assert not (run / "metrics.jsonl").exists()


def test_the_other_ranks_error_is_shown_as_rank_0_s_with_the_same_exit_code():
    """What the CLI makes of rank 0's error and of the one the other ranks raise from its report."""
    from ganscale.cli import _known_failure
    from ganscale.fault import RankFailed, error_of_rank, report_of

    refused = PermissionError(errno.EACCES, "Permission denied", "/runs/x/samples/step-00000010.png")
    full = checkpoint.CheckpointWriteError("could not write checkpoint /runs/x/step-1.pt: no space left on device. "
                                           "Fix: free space", errno.ENOSPC)
    for error, what in ((refused, "samples"), (full, "checkpoint")):
        theirs = error_of_rank(0, f"write its {what}", report_of(error))
        assert type(theirs) is type(error) and theirs.errno == error.errno
        own_line, own_code = _known_failure(error)
        their_line, their_code = _known_failure(theirs)
        assert their_code == own_code == 7
        assert their_line == own_line.replace("ganscale: ", f"ganscale: rank 0 could not write its {what}: ", 1)
    bug = error_of_rank(0, "write its samples", report_of(ValueError("bad shape\nmore detail")))
    assert isinstance(bug, RankFailed) and str(bug) == "rank 0 could not write its samples: ValueError: bad shape"
    assert _known_failure(bug) is None  # shown with its traceback and exit 1, as rank 0's own ValueError


def test_off_a_terminal_a_step_prints_what_a_person_reads_and_the_files_keep_every_field(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ganscale.observe import RunLog

    values = {"loss_d": 1.25, "penalty_d": 0.0, "grad_norm_d": 3.5, "loss_g": 0.75, "l1_g": 0.0, "grad_norm_g": 2.0,
              "skipped_steps": 0, "held_bytes_g": 123456, "held_bytes_d": 654321, "comm_bytes_d_step": 1000,
              "comm_bytes_g_step": 2000, **{f"time_{part}_ms": 1.5 for part in
                                            ("data", "d_forward_backward", "g_forward_backward", "optimizer", "sync",
                                             "outputs")}}
    log = RunLog(tmp_path, total_steps=100, start_step=0, tensorboard=True, enabled=True)
    log.log(10, values, images_per_step=64)
    log.log(20, {**values, "penalty_d": 0.5, "skipped_steps": 1}, images_per_step=64)
    log.close({})
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("step 10/100 loss_d 1.25 loss_g 0.75 grad_norm_d 3.5 grad_norm_g 2 img_per_s "), first
    assert " left " in first and not any(word in first for word in ("held", "comm", "time_", "penalty", "l1_g", "skip"))
    assert "penalty_d 0.5" in second and "skipped_steps 1" in second  # shown where the run has them
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert set(records[0]) == {"step", "img_per_s", *values}
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"img_per_s", *values}
