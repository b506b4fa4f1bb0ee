"""The command line end to end, through `python -m ganscale` in a subprocess (CPU only)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from ganscale import config

METRIC_KEYS = {"step", "loss_d", "loss_g", "grad_norm_d", "grad_norm_g", "img_per_s"}
SHORT_RUN = ["--set", "train.steps=20", "--set", "log.every=5", "--set", "checkpoint.every=10",
             "--set", "log.sample_every=10"]


def clean_env() -> dict[str, str]:
    """This environment minus any launcher variables, CPU only whatever the machine has."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def ganscale(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ganscale", *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


def explain(result: subprocess.CompletedProcess) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def checkpoint_steps(run: Path) -> list[int]:
    return sorted(int(p.name[5:13]) for p in (run / "checkpoints").glob("step-*.pt"))


# ------------------------------------------------------------------------------ rejected configs
@pytest.mark.parametrize("override, key, hint", [
    ("train.batch_size=63", "train.batch_size", None),
    ("train.stpes=3", "train.stpes", "train.steps"),
    ("train.precision=fp16", "train.precision", None),
])
def test_bad_config_exits_2_and_writes_nothing(tmp_path, override, key, hint):
    result = ganscale("train", "--set", override, "--nproc", "2", "--run-dir", "X", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert key in result.stderr
    if hint:
        assert hint in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "X").exists()
    assert list(tmp_path.iterdir()) == []  # no runs/ either


TINY_RUN = ["--set", "train.steps=2", "--set", "train.batch_size=6", "--set", "log.sample_every=0"]


def test_checking_options_and_config_leaves_torch_s_sharding_stack_unloaded(tmp_path):
    """Start-up: a refusal of `ganscale slurm`'s options loads no torch at all, and the modules that check a config
    (preflight, the memory estimate, the strategies' rules) load no DTensor, FSDP2, ZeRO or distributed state-dict
    API (~1 s of CPU at every command and launch), which only a strategy that uses them loads."""
    script = """
import sys
from ganscale import cli
try:
    cli.main(["slurm", "digits", "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2",
              "--time", "90 minutes", "--run-dir", "run"])
except SystemExit as e:
    assert e.code == 2, e.code
assert "torch" not in sys.modules, "a refused option loaded torch"
import ganscale.memory, ganscale.parallel, ganscale.preflight
sharding = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.optim",
            "torch.distributed.checkpoint")
assert not [m for m in sharding if m in sys.modules], [m for m in sharding if m in sys.modules]
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=clean_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, explain(result)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("problem", ["not an image", "a decompression bomb"])
def test_an_image_that_does_not_decode_exits_2_naming_it(tmp_path, problem):
    from PIL import Image

    from image_helpers import write_decompression_bomb_png

    images = tmp_path / "images"
    images.mkdir()
    for i in range(5):
        Image.new("RGB", (12, 12), (40 * i, 0, 0)).save(images / f"{i}.png")
    # Found by name; fails only when training reads it.
    if problem == "not an image":
        (images / "broken.png").write_text("not an image")
    else:
        write_decompression_bomb_png(images / "broken.png")
    result = ganscale("train", *TINY_RUN, "--set", "data.kind=folder", "--set", f"data.path={images}",
                      "--set", "data.resolution=8", "--run-dir", "X", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert "'data.path'" in result.stderr and "broken.png" in result.stderr and "Traceback" not in result.stderr


def test_a_run_with_data_loader_workers_leaves_when_it_is_done(tmp_path):
    """The workers ignore SIGTERM (the trainer stops them): left to the interpreter's exit, which terminates and
    joins its children, they kept a finished run from exiting."""
    result = ganscale("train", *TINY_RUN, "--set", "data.workers=2", "--run-dir", "run", cwd=tmp_path, timeout=120)
    assert result.returncode == 0 and "done: 2 steps" in result.stdout, explain(result)


def test_a_run_directory_that_cannot_be_made_is_one_line_and_exit_7(tmp_path):
    (tmp_path / "afile").write_text("")
    result = ganscale("train", *TINY_RUN, "--run-dir", "afile/run", cwd=tmp_path)
    assert result.returncode == 7, explain(result)
    assert "afile" in result.stderr and "Traceback" not in result.stderr
    assert "Fix: a folder on that path is a file: rename or move it, or choose another location" in result.stderr
    again = ganscale("train", *TINY_RUN, "--run-dir", "afile/run", "--max-restarts", "2", cwd=tmp_path)
    assert again.returncode == 7 and "afile" in again.stderr, explain(again)  # the launcher's own hold on it fails
    assert "Traceback" not in again.stderr and "restarting the workers" not in again.stderr, explain(again)


def test_a_new_run_starts_over_a_failed_runs_files_but_not_over_other_files(tmp_path):
    failed = tmp_path / "failed"  # a run that died before its first checkpoint
    failed.mkdir()
    (failed / "config.yaml").write_text("stale: true\n")
    (failed / "metrics.jsonl").write_text('{"step": 1, "loss_d": 9.0}\n')
    (failed / "profile").mkdir()  # log.profile_steps's folder, written before the first checkpoint
    (failed / "profile" / "rank0.txt").write_text("steps 1-1\n")
    result = ganscale("train", *TINY_RUN, "--set", "log.every=1", "--run-dir", "failed", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert config.build(yaml.safe_load((failed / "config.yaml").read_text())).train.steps == 2
    assert not list(failed.glob("config.resumed-*"))
    assert [r["step"] for r in metrics(failed)] == [1, 2] and metrics(failed)[0]["loss_d"] != 9.0

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "NOTES.txt").write_text("keep me")
    refused = ganscale("train", *TINY_RUN, "--run-dir", "mine", cwd=tmp_path)
    assert refused.returncode == 2 and "--run-dir" in refused.stderr and "NOTES.txt" in refused.stderr
    assert [p.name for p in mine.iterdir()] == ["NOTES.txt"]

    # A config.yaml ganscale did not write (the user's own, trained from where it lies) was replaced by the
    # resolved config; likewise a manifest written there by `ganscale k8s --out DIR/config.yaml`.
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.yaml").write_text("# two steps of the default recipe\ntrain: {steps: 2, batch_size: 6}\n")
    refused = ganscale("train", "own/config.yaml", "--run-dir", "own", cwd=tmp_path)
    assert refused.returncode == 2 and "'own' holds files that are not a ganscale run's (config.yaml)" in \
        refused.stderr, explain(refused)
    assert "keep your own files, a YAML config too, outside it" in refused.stderr
    assert (own / "config.yaml").read_text().startswith("# two steps") and len(list(own.iterdir())) == 1


def test_a_config_file_is_a_failed_run_s_own_only_as_ganscale_writes_it(tmp_path):
    """rundir._own_file: a resolved config (config.to_yaml) may be started over; a hand-written YAML file or a
    multi-document manifest of the same name may not."""
    from ganscale import rundir

    written = tmp_path / "config.yaml"
    written.write_text(config.to_yaml(config.load("digits")))
    assert rundir._own_file(written)
    for text in ("train:\n    steps: 2\n", "# mine\ntrain: {steps: 2}\n", "kind: ConfigMap\n---\nkind: JobSet\n",
                 "train: [\n"):
        written.write_text(text)
        assert not rundir._own_file(written), text
    resumed = tmp_path / "config.resumed-00000010.yaml"
    resumed.write_text("train: {steps: 20}\n")
    assert not rundir._own_file(resumed) and rundir._own_file(tmp_path / "metrics.jsonl")
    written.unlink()
    os.mkfifo(written)  # never read: it would block
    assert not rundir._own_file(written)
    written.unlink()
    written.mkdir()
    assert not rundir._own_file(written)


def test_resume_auto_that_finds_no_run_says_it_starts_a_new_one(tmp_path):
    result = ganscale("train", *TINY_RUN, "--resume", "auto", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert result.stderr.count("--resume auto: no run of 'digits' with a checkpoint under runs/, so this is a new "
                               "run") == 1, explain(result)
    assert len(list((tmp_path / "runs").iterdir())) == 1


@pytest.mark.parametrize("name, shown", [("no-such-recipe", "no-such-recipe"),
                                         ("no-such\nrecipe\x1b[2J", "no-such\\nrecipe\\x1b[2J")])
def test_missing_recipe_exits_2(tmp_path, name, shown):
    """Named in one line; a newline or a terminal escape in the name is shown escaped, not acted on."""
    result = ganscale("train", name, "--run-dir", "X", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert result.stderr.count("\n") == 1 and f"'{shown}' is neither a shipped recipe" in result.stderr, explain(result)
    assert list(tmp_path.iterdir()) == []


def test_recipes_lists_each_with_its_description(tmp_path):
    result = ganscale("recipes", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    lines = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for name in ("digits", "ring8", "grid25"):
        assert name in lines
        description = config.load(name).description
        assert description and description in lines[name]
    assert "(default)" in lines[config.DEFAULT_RECIPE]


def test_export_of_a_dir_without_checkpoints_exits_2(tmp_path):
    (tmp_path / "empty").mkdir()
    result = ganscale("export", "empty", "--out", "W.safetensors", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert "checkpoint" in result.stderr
    assert not (tmp_path / "W.safetensors").exists()


# ------------------------------------------------------------------------ default recipe, 2 ranks
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """The default recipe for 20 steps on 2 processes; tests read it, never change it. What the command printed
    on stderr is kept beside it, in stderr.txt."""
    cwd = tmp_path_factory.mktemp("cli")
    result = ganscale("train", "--nproc", "2", *SHORT_RUN, "--run-dir", "RUN", cwd=cwd)
    assert result.returncode == 0, explain(result)
    (cwd / "stderr.txt").write_text(result.stderr)
    return cwd / "RUN"


@pytest.mark.slow
def test_run_directory_contents(trained_run):
    run = trained_run
    saved = config.build(yaml.safe_load((run / "config.yaml").read_text()))
    assert saved.name == config.DEFAULT_RECIPE
    assert (saved.train.steps, saved.log.every, saved.checkpoint.every) == (20, 5, 10)

    records = metrics(run)
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    for record in records:
        assert METRIC_KEYS <= set(record)
        assert all(math.isfinite(record[k]) for k in METRIC_KEYS)
        assert record["img_per_s"] > 0

    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)

    samples = sorted((run / "samples").glob("*.png"))
    assert [p.name for p in samples] == ["step-00000010.png", "step-00000020.png"]
    with Image.open(samples[-1]) as picture:
        assert picture.mode == "RGB" and min(picture.size) >= 8 * 8

    assert checkpoint_steps(run) == [10, 20]  # keep 3: nothing pruned yet
    assert (run / "checkpoints" / "step-00000020.pt").is_file()
    assert not list((run / "checkpoints").glob(".*"))  # no temporary files left behind

    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 20
    assert summary["world_size"] == 2
    assert summary["global_batch"] == saved.train.batch_size
    assert summary["micro_batch"] * 2 * summary["accumulation_steps"] == saved.train.batch_size
    assert summary["final"]["step"] == 20


@pytest.mark.slow
def test_the_default_recipe_on_2_ranks_normalises_across_ranks_without_a_warning(trained_run):
    """The default recipe's G has BatchNorm; parallel.sync_bn unset makes its statistics cross-rank on 2 ranks, as
    one process normalises the whole batch: nothing to warn of, and the saved config leaves it unset."""
    stderr = (trained_run.parent / "stderr.txt").read_text()
    assert not [line for line in stderr.splitlines() if line.startswith("ganscale: warning:")], stderr
    assert config.build(yaml.safe_load((trained_run / "config.yaml").read_text())).parallel.sync_bn is None


@pytest.mark.slow
def test_tensorboard_has_the_logged_scalars(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(trained_run / "tensorboard"))
    events.Reload()
    assert METRIC_KEYS - {"step"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss_d")] == [5, 10, 15, 20]
    assert "samples" in events.Tags()["images"]


@pytest.mark.slow
def test_resuming_a_finished_run_or_an_older_checkpoint_into_it_leaves_it_as_it_is(trained_run, tmp_path):
    run = tmp_path / "RUN"
    shutil.copytree(trained_run, run)
    shutil.copytree(trained_run, tmp_path / "OTHER")
    files = sorted(p for p in run.rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}

    done = ganscale("train", *SHORT_RUN, "--run-dir", "RUN", "--resume", "auto", cwd=tmp_path)  # steps=20: done
    assert done.returncode == 0 and "nothing to do" in done.stdout, explain(done)
    refused = [  # (command line, the option each error names)
        (["--set", "train.steps=15", "--run-dir", "RUN", "--resume", "auto"], "'train.steps'"),
        (["--set", "train.steps=30", "--resume", "RUN/checkpoints/step-00000010.pt"], "'--resume'"),
        (["--set", "train.steps=30", "--run-dir", "RUN", "--resume", "OTHER/checkpoints/step-00000020.pt"],
         "'--run-dir'"),
        (["--set", "train.steps=30", "--resume", "RUN/checkpoints/step-00000020.json"], "completion marker, not"),
        (["--set", "train.steps=15", "--resume", "RUN/checkpoints"], "'train.steps': RUN/checkpoints/step-00000020")]
    for args, key in refused:
        result = ganscale("train", "--set", "log.every=5", "--set", "checkpoint.every=10", *args, cwd=tmp_path)
        assert result.returncode == 2 and key in result.stderr, explain(result)
    assert sorted(p for p in run.rglob("*") if p.is_file()) == files  # nothing written, nothing removed
    assert all(p.read_bytes() == content for p, content in before.items())

    branched = ganscale("train", "--set", "train.steps=12", "--set", "log.every=2", "--run-dir", "BRANCH",
                        "--resume", "RUN/checkpoints/step-00000010.pt", cwd=tmp_path)  # the fix the error gives
    assert branched.returncode == 0, explain(branched)
    assert checkpoint_steps(tmp_path / "BRANCH") == [12]


def ganscale_ranks(rank_args: list[list[str]], cwd: Path, timeout: float = 90, setup: dict[int, object] | None = None,
                   node_per_rank: bool = False) -> list[subprocess.CompletedProcess]:
    """`python -m ganscale train ARGS` once per rank with the environment torchrun gives its workers (rendezvous
    at rank 0's store), each rank its own ARGS and optional `setup` (run in the child before it starts); all on
    one node, or each as the one rank of its own node (`node_per_rank`); each rank's exit code and output. A rank
    still running after `timeout` (left waiting) fails the test."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world, setup = len(rank_args), setup or {}
    ranks = [subprocess.Popen([sys.executable, "-m", "ganscale", "train", *args], cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=setup.get(rank),
                              env={**clean_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(rank), "WORLD_SIZE": str(world),
                                   "LOCAL_RANK": "0" if node_per_rank else str(rank),
                                   "LOCAL_WORLD_SIZE": "1" if node_per_rank else str(world),
                                   "OMP_NUM_THREADS": "1"})
             for rank, args in enumerate(rank_args)]
    results = []
    try:
        for rank, process in enumerate(ranks):
            try:
                out, err = process.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"rank {rank} still running after {timeout} s: left waiting") from None
            results.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.communicate()
    return results


def test_rank_0_decides_the_run_directory_and_resume_point_for_every_rank(tmp_path):
    """A rank whose view of the run directory differs (another node, a stale network file system) follows rank 0:
    rank 1 is pointed at an empty folder while rank 0 sees the finished run."""
    finished = ganscale("train", *TINY_RUN, "--run-dir", "RUN", cwd=tmp_path)
    assert finished.returncode == 0, explain(finished)
    files = {p: p.read_bytes() for p in (tmp_path / "RUN").rglob("*") if p.is_file()}
    common = [*TINY_RUN, "--set", "parallel.timeout_s=30", "--resume", "auto"]

    done = ganscale_ranks([[*common, "--run-dir", "RUN"], [*common, "--run-dir", "ELSEWHERE"]], tmp_path)
    assert [r.returncode for r in done] == [0, 0], "\n".join(map(explain, done))
    assert "nothing to do" in done[0].stdout and done[1].stdout == ""  # said once, by rank 0

    past = [*common, "--set", "train.steps=1"]  # the run is at step 2: refused, on every rank, naming the key
    refused = ganscale_ranks([[*past, "--run-dir", "RUN"], [*past, "--run-dir", "ELSEWHERE"]], tmp_path)
    assert [r.returncode for r in refused] == [2, 2], "\n".join(map(explain, refused))
    assert "'train.steps'" in refused[0].stderr and "Traceback" not in refused[0].stderr
    assert refused[1].stderr == ""  # one refusal, agreed: said once on the node, by rank 0
    assert not (tmp_path / "ELSEWHERE").exists()
    assert {p: p.read_bytes() for p in (tmp_path / "RUN").rglob("*") if p.is_file()} == files


def test_a_restart_resumes_from_the_run_directory_once_it_holds_an_intact_checkpoint(tmp_path):
    from ganscale import checkpoint
    from ganscale.rundir import resume_after_restart

    run, branch_source = tmp_path / "new", "OTHER/checkpoints/step-00000010.pt"
    assert resume_after_restart(run, branch_source) == branch_source  # died before its first save
    assert resume_after_restart(run, None) is None
    unfinished = checkpoint.save({"step": 12}, run, 12, keep=3)
    checkpoint.manifest_path(unfinished).unlink()  # died while completing its first save
    assert resume_after_restart(run, branch_source) == branch_source
    assert checkpoint.remove_unfinished(run) == [unfinished] and checkpoint.list_checkpoints(run) == []
    checkpoint.save({"step": 12}, run, 12, keep=3)
    assert resume_after_restart(run, branch_source) == "auto"


def test_torchrun_max_restarts_without_a_run_directory_is_refused(tmp_path):
    env = {**clean_env(), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999", "TORCHELASTIC_MAX_RESTARTS": "2"}
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", *TINY_RUN], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "'--run-dir'" in result.stderr, explain(result)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("variable, value, said", [
    ("MASTER_PORT", "abc", "'MASTER_PORT': 'abc' is not a port number (1-65535)"),
    ("MASTER_PORT", "99999", "'MASTER_PORT': '99999' is not a port number (1-65535)"),
    ("WORLD_SIZE", "abc", "'WORLD_SIZE': 'abc' is not a process count"),
    ("RANK", "1", "'RANK': 1 is not below WORLD_SIZE=1"),
    ("LOCAL_WORLD_SIZE", "1", "'LOCAL_RANK': 1 is not below LOCAL_WORLD_SIZE=1"),
    ("TORCHELASTIC_RESTART_COUNT", "-1", "'TORCHELASTIC_RESTART_COUNT': '-1' is not a restart count"),
    ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "abc", "'TORCH_ELASTIC_SHUTDOWN_TIMEOUT': 'abc' is not a number of seconds"),
    ("SLURM_NTASKS", "abc", "'SLURM_NTASKS': 'abc' is not a task count"),  # a torchrun worker in a Slurm job
    ("SLURM_GPUS_ON_NODE", "4(x2)", "'SLURM_GPUS_ON_NODE': '4(x2)' is not a GPU count"),
    ("SLURM_RESTART_COUNT", "abc", "'SLURM_RESTART_COUNT': 'abc' is not a requeue count"),  # the start line's
    ("SLURM_JOB_ID", "abc", "'SLURM_JOB_ID': 'abc' is not a job id"),
    ("SLURM_TASKS_PER_NODE", "2(x", "'SLURM_TASKS_PER_NODE': '2(x' is not Slurm's list of tasks per node"),
])
def test_a_malformed_launcher_variable_is_refused_by_name_before_anything_is_written(tmp_path, variable, value,
                                                                                     said):
    env = {**clean_env(), "RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29999", "SLURM_JOB_ID": "7", variable: value}  # was a ValueError's traceback, exit 1
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", *TINY_RUN, "--run-dir", "RUN"], cwd=tmp_path,
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith(f"ganscale: config error at {said}"), explain(result)
    assert len(result.stderr.splitlines()) == 1 and "Fix: " in result.stderr, explain(result)
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_renamed_with_its_marker_resumes_into_a_named_run_directory(tmp_path):
    finished = ganscale("train", *TINY_RUN, "--run-dir", "RUN", cwd=tmp_path)  # trained to step 2
    assert finished.returncode == 0, explain(finished)
    for suffix in (".pt", ".json"):
        shutil.copy(tmp_path / "RUN" / "checkpoints" / f"step-00000002{suffix}", tmp_path / f"best{suffix}")
    nowhere = ganscale("train", *TINY_RUN, "--set", "train.steps=3", "--resume", "best.pt", cwd=tmp_path)
    assert nowhere.returncode == 2 and "'--run-dir'" in nowhere.stderr, explain(nowhere)  # was: trained into '.'
    past = ganscale("train", *TINY_RUN, "--set", "train.steps=1", "--resume", "best.pt", "--run-dir", "NEW",
                    cwd=tmp_path)
    assert past.returncode == 2 and "'train.steps'" in past.stderr, explain(past)  # its step, from its marker
    on = ganscale("train", *TINY_RUN, "--set", "train.steps=3", "--resume", "best.pt", "--run-dir", "NEW",
                  cwd=tmp_path)
    assert on.returncode == 0, explain(on)
    assert checkpoint_steps(tmp_path / "NEW") == [3] and [r["step"] for r in metrics(tmp_path / "NEW")] == [3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["NEW", "RUN", "best.json", "best.pt"]


def test_when_rank_0_cannot_decide_the_run_directory_every_rank_stops(tmp_path):
    args = [*TINY_RUN, "--resume", "x" * 300]  # rank 0's check of it fails: File name too long (not a refusal)
    ranks = ganscale_ranks([args, args], tmp_path, node_per_rank=True)  # rank 1's node says it too
    assert [r.returncode for r in ranks] == [1, 1], "\n".join(map(explain, ranks))
    assert "rank 0 could not decide the run directory: File name too long" in ranks[1].stderr


def test_checkpoints_are_ordered_by_step_and_compared_by_step(tmp_path, monkeypatch):
    from ganscale import checkpoint, rundir
    from ganscale.config import ConfigError

    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for name in ("step-99999999.pt", "step-100000000.pt", "step-100000000.dcp", "step-00000010.pt"):
        (folder / name).write_bytes(b"")
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run")] == [
        "step-00000010.pt", "step-99999999.pt", "step-100000000.dcp", "step-100000000.pt"]
    monkeypatch.setattr(checkpoint, "problem", lambda path: None)  # every one of them intact
    rundir._refuse_two_histories(tmp_path / "run", folder / "step-100000000.dcp")  # the same step: not older
    with pytest.raises(ConfigError, match="step-100000000.pt"):
        rundir._refuse_two_histories(tmp_path / "run", folder / "step-99999999.pt")


def test_each_rank_gets_its_own_gpu_or_a_named_error():
    """More local ranks than visible GPUs failed in CUDA's set_device ('invalid device ordinal')."""
    from ganscale.launch import check_gpus
    from ganscale.runtime import gpu_of

    assert [gpu_of(rank, 4) for rank in range(4)] == [0, 1, 2, 3]
    assert gpu_of(5, 1, narrowed=True) == 0  # a launcher that shows each task only its own GPU
    with pytest.raises(config.ConfigError, match="local rank 1, but this node shows 1 GPU"):
        gpu_of(1, 1)  # torchrun with 2 ranks on a one-GPU node: not both on GPU 0
    with pytest.raises(config.ConfigError, match="local rank 4, but this node shows 4 GPU"):
        gpu_of(4, 4)
    cfg = config.load(None, [])  # train.device=auto
    check_gpus(cfg, 4, 4)
    check_gpus(cfg, 8, 0)  # no GPU: a CPU run
    with pytest.raises(config.ConfigError) as refused:
        check_gpus(cfg, 8, 4)
    assert refused.value.key == "--nproc" and "--nproc 4 or fewer" in str(refused.value)
    check_gpus(config.load(None, ["train.device=cpu"]), 8, 4)


def test_a_data_error_found_by_the_workers_is_not_restarted(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for i in range(5):
        Image.new("RGB", (12, 12), (40 * i, 0, 0)).save(images / f"{i}.png")
    (images / "broken.png").write_text("not an image")  # only a worker reading it finds out
    result = ganscale("train", *TINY_RUN, "--set", "data.kind=folder", "--set", f"data.path={images}",
                      "--set", "data.resolution=8", "--nproc", "2", "--max-restarts", "2", "--run-dir", "X",
                      cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert "broken.png" in result.stderr and "not restarting the workers" in result.stderr
    assert "restarting the workers (" not in result.stderr, explain(result)


def test_a_config_error_of_every_worker_is_printed_once(tmp_path):
    """Both ranks find that the checkpoint does not fit: one line says so, then the launcher's line naming the
    workers; no second copy from rank 1 and none of torch's own agent lines."""
    finished = ganscale("train", *TINY_RUN, "--run-dir", "RUN", cwd=tmp_path)
    assert finished.returncode == 0, explain(finished)
    result = ganscale("train", *TINY_RUN, "--set", "train.steps=4", "--set", "model.g_width=32", "--nproc", "2",
                      "--run-dir", "RUN", "--resume", "auto", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    said = [line for line in result.stderr.splitlines() if line and not line.startswith("ganscale: warning:")]
    assert len(said) == 2 and "does not fit this run's model/optimizer config" in said[0], explain(result)
    assert said[1] in ("ganscale: worker rank 0 failed with exit code 2 (see its output above)",  # 1 was stopped
                       "ganscale: worker ranks 0, 1 failed with exit code 2 (see their output above)")


@pytest.mark.parametrize("setting, said", [("train.stepz=3", "config error at 'train.stepz'"),
                                           ("train.batch_size=15", "config error at 'train.batch_size'")])
def test_a_config_error_under_torchrun_is_printed_once_on_the_node(tmp_path, setting, said):
    """Every torchrun worker refuses the config alike (while loading it, or preflight's check of it): each printed
    the line, against the README's "once on each node"."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "ganscale", "train", "--set", setting, "--run-dir", str(tmp_path / "run")],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=180)
    assert result.returncode != 0 and (result.stdout + result.stderr).count(said) == 1, explain(result)
    assert not (tmp_path / "run").exists()


def test_an_error_told_by_another_rank_is_printed_by_its_rank_and_once_on_each_other_node(monkeypatch):
    from ganscale.fault import told_by, told_elsewhere

    shown = {}
    for rank in range(4):  # two nodes of two ranks; rank 1 failed, the others were told
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank % 2))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        shown[rank] = not told_elsewhere(told_by(1, ValueError("x"))) and not told_elsewhere(ValueError("own"))
    assert shown == {0: False, 1: True, 2: True, 3: False}


@pytest.mark.slow
def test_rerun_without_resume_is_refused_then_resume_continues(trained_run, tmp_path):
    run = tmp_path / "RUN"
    shutil.copytree(trained_run, run)
    before = {p.name: p.read_bytes() for p in [run / "metrics.jsonl", run / "summary.json", run / "config.yaml"]}

    refused = ganscale("train", "--nproc", "2", *SHORT_RUN, "--run-dir", "RUN", cwd=tmp_path)
    assert refused.returncode == 2, explain(refused)
    assert "--run-dir" in refused.stderr
    assert "--resume" in refused.stderr  # the fix
    assert {name: (run / name).read_bytes() for name in before} == before
    assert checkpoint_steps(run) == [10, 20]

    resumed = ganscale("train", "--nproc", "2", *SHORT_RUN, "--set", "train.steps=30", "--run-dir", "RUN",
                       "--resume", "auto", cwd=tmp_path)
    assert resumed.returncode == 0, explain(resumed)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 30
    assert summary["world_size"] == 2
    assert [r["step"] for r in metrics(run)] == [5, 10, 15, 20, 25, 30]  # appended, nothing repeated
    assert checkpoint_steps(run) == [10, 20, 30]
    # the original config stays; the changed one is kept beside it
    assert (run / "config.yaml").read_bytes() == before["config.yaml"]
    resumed_cfg = yaml.safe_load((run / "config.resumed-00000020.yaml").read_text())
    assert resumed_cfg["train"]["steps"] == 30


def test_a_resume_without_a_recipe_continues_with_the_run_s_own_config(tmp_path):
    """Not the default recipe: that dropped the run's recipe and --set values (a silently other training, or a
    'does not fit' error); the newest config of the run is the base, and --set still applies on top."""
    first = ganscale("train", "ring8", "--set", "model.g_width=24", "--set", "train.steps=2", "--set",
                     "train.batch_size=8", "--set", "log.tensorboard=false", "--run-dir", "RUN", cwd=tmp_path)
    assert first.returncode == 0, explain(first)
    more = ganscale("train", "--run-dir", "RUN", "--resume", "auto", "--set", "train.steps=3", cwd=tmp_path)
    assert more.returncode == 0, explain(more)
    assert "resuming with the run's own config, RUN/config.yaml" in more.stdout
    again = ganscale("train", "--resume", "RUN/checkpoints/step-00000003.pt", "--run-dir", "BRANCH",
                     "--set", "train.steps=4", cwd=tmp_path)  # from a file: its run's newest config
    assert again.returncode == 0, explain(again)
    assert "RUN/config.resumed-00000002.yaml" in again.stdout
    resumed = yaml.safe_load((tmp_path / "BRANCH" / "config.yaml").read_text())
    assert (resumed["name"], resumed["data"]["kind"], resumed["model"]["g_width"]) == ("ring8", "ring8", 24)
    assert (resumed["train"]["steps"], resumed["train"]["batch_size"]) == (4, 8)
    # A branch from before a changed config takes the config of its own step, not the run's newest.
    changed = ganscale("train", "--run-dir", "RUN", "--resume", "auto", "--set", "train.steps=5", "--set",
                       "optim.g.lr=0.01", cwd=tmp_path)
    assert changed.returncode == 0 and (tmp_path / "RUN" / "config.resumed-00000003.yaml").is_file(), explain(changed)
    early = ganscale("train", "--resume", "RUN/checkpoints/step-00000002.pt", "--run-dir", "EARLY", "--set",
                     "train.steps=4", cwd=tmp_path)
    assert early.returncode == 0 and "RUN/config.resumed-00000002.yaml" in early.stdout, explain(early)
    original_lr = yaml.safe_load((tmp_path / "RUN" / "config.yaml").read_text())["optim"]["g"]["lr"]
    assert yaml.safe_load((tmp_path / "EARLY" / "config.yaml").read_text())["optim"]["g"]["lr"] == original_lr != 0.01
    # Going back to a config the run had before is recorded too, and is what the next resume continues with.
    back = ganscale("train", "--run-dir", "RUN", "--resume", "auto", "--set", "train.steps=6", "--set",
                    "optim.g.lr=0.0002", cwd=tmp_path)
    assert back.returncode == 0 and "RUN/config.resumed-00000003.yaml" in back.stdout, explain(back)
    assert yaml.safe_load((tmp_path / "RUN" / "config.resumed-00000005.yaml").read_text())["optim"]["g"]["lr"] == 0.0002


def test_commands_refuse_a_config_error_before_importing_torch(tmp_path):
    """Importing torch takes seconds; a mistyped option is answered without it, and writes nothing."""
    probe = ("import sys\nfrom ganscale.cli import main\ntry:\n    main(sys.argv[1:])\n"
             "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    for key, refused in (("train.stepz", ["train", "--set", "train.stepz=3"]),
                         ("train.steps", ["train", "ring8", "--set", "train.steps=x", "--nproc", "2"]),
                         ("train.stepz", ["verify", "ring8", "--set", "train.stepz=3"]),
                         ("train.stepz", ["k8s", "--set", "train.stepz=3", "--nodes", "2", "--gpus-per-node", "1",
                                          "--image", "img"]),
                         ("train.stepz", ["slurm", "--set", "train.stepz=3", "--nodes", "2", "--gpus-per-node", "1"])):
        result = subprocess.run([sys.executable, "-c", probe, *refused, "--run-dir", "RUN"], cwd=tmp_path,
                                capture_output=True, text=True)
        assert result.stdout == "2 False\n" and result.stderr.count("\n") == 1, explain(result)
        assert f"'{key}'" in result.stderr and not (tmp_path / "RUN").exists(), explain(result)


def test_a_refused_resume_without_a_recipe_says_only_its_refusal(tmp_path):
    """The note naming the run's own config came before the refusal (two lines for one refused command): it is said
    once the run starts (once the checkpoint has loaded; with --nproc, by the workers' rank 0)."""
    first = ganscale("train", "ring8", "--set", "train.steps=2", "--set", "train.batch_size=8", "--set",
                     "log.tensorboard=false", "--run-dir", "RUN", cwd=tmp_path)
    assert first.returncode == 0, explain(first)
    for refused_set in ("train.stepz=3", "model.pack=3"):  # refused by the config's loading, and by preflight
        for nproc in ([], ["--nproc", "2"]):
            refused = ganscale("train", "--run-dir", "RUN", "--resume", "auto", "--set", refused_set, *nproc,
                               cwd=tmp_path)
            assert refused.returncode == 2 and refused.stdout == "", explain(refused)
            assert refused.stderr.count("\n") == 1 and refused_set.split("=")[0] in refused.stderr, explain(refused)
    for nproc in ([], ["--nproc", "2"]):  # refused as the checkpoint loads (with --nproc: in a worker)
        misfit = ganscale("train", "--run-dir", "RUN", "--resume", "auto", "--set", "model.g_width=32", "--set",
                          "train.steps=3", *nproc, cwd=tmp_path)
        said = misfit.stderr.splitlines()  # with --nproc, the launcher's line naming the workers follows
        assert misfit.returncode == 2 and misfit.stdout == "" and len(said) == 1 + bool(nproc), explain(misfit)
        assert "does not fit this run's model/optimizer config (model.g_width is 32 here, " in said[0], explain(misfit)
    resumed = ganscale("train", "--run-dir", "RUN", "--resume", "auto", "--set", "train.steps=3", "--nproc", "2",
                       cwd=tmp_path)
    assert resumed.returncode == 0 and resumed.stdout.count("resuming with the run's own config") == 1, explain(resumed)


def test_a_resume_without_a_recipe_of_a_run_missing_its_config_file_is_refused(tmp_path):
    """Not the default recipe in its place (a misfit error that blamed the missing file, or another training): one
    line naming it; the run's RECIPE given, the resume goes on."""
    first = ganscale("train", "ring8", "--set", "model.g_width=24", "--set", "train.steps=2", "--set",
                     "log.tensorboard=false", "--run-dir", "RUN", cwd=tmp_path)
    assert first.returncode == 0, explain(first)
    (tmp_path / "RUN" / "config.yaml").unlink()
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "RUN").rglob("*")}
    for resume in ("auto", "RUN/checkpoints/step-00000002.pt"):
        refused = ganscale("train", "--run-dir", "RUN", "--resume", resume, "--set", "train.steps=3", cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, explain(refused)
        assert ("config error at '--resume': RUN/checkpoints/step-00000002.pt has no config file to continue with "
                "(RUN/config.yaml is missing). Fix: give the recipe") in refused.stderr, explain(refused)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "RUN").rglob("*")} == before
    given = ganscale("train", "ring8", "--set", "model.g_width=24", "--run-dir", "RUN", "--resume", "auto", "--set",
                     "train.steps=3", cwd=tmp_path)
    assert given.returncode == 0, explain(given)


def test_export_reads_a_sharded_checkpoint_folder_named_by_checkpoint(tmp_path):
    from safetensors import safe_open

    run = tmp_path / "run"
    trained = ganscale("train", "ring8", "--set", "train.steps=2", "--set", "checkpoint.every=1", "--set",
                       "checkpoint.format=sharded", "--set", "model.g_width=8", "--set", "model.d_width=8",
                       "--run-dir", str(run), cwd=tmp_path)
    assert trained.returncode == 0, explain(trained)
    out = tmp_path / "W.safetensors"
    result = ganscale("export", str(run), "--out", str(out), "--checkpoint",
                      str(run / "checkpoints" / "step-00000001.dcp"), cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["step"] == "1" and any(k.startswith("G_ema.") for k in f.keys())


def test_export_of_another_runs_checkpoint_says_whose_config_it_exports_with(tmp_path):
    from safetensors import safe_open

    runs = {}
    for name, width in (("A", 8), ("B", 16)):
        runs[name] = tmp_path / name
        trained = ganscale("train", "ring8", "--set", "train.steps=1", "--set", f"model.g_width={width}",
                           "--set", "model.d_width=8", "--run-dir", name, cwd=tmp_path)
        assert trained.returncode == 0, explain(trained)
    a_checkpoint = runs["A"] / "checkpoints" / "step-00000001.pt"
    result = ganscale("export", "B", "--out", "W.safetensors", "--checkpoint", str(a_checkpoint), cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert (f"note: {a_checkpoint} is not a checkpoint of B; written by a 'ring8' run with another config than its "
            "own, it is exported with the config it was written with") in result.stderr
    with safe_open(str(tmp_path / "W.safetensors"), "pt") as f:
        assert yaml.safe_load(f.metadata()["config"])["model"]["g_width"] == 8  # A's weights with A's config
    shutil.copy(a_checkpoint, tmp_path / "copy.pt")  # the same run's checkpoint moved elsewhere: nothing to say
    shutil.copy(a_checkpoint.with_suffix(".json"), tmp_path / "copy.json")  # with its completion marker
    result = ganscale("export", "A", "--out", "V.safetensors", "--checkpoint", "copy.pt", cwd=tmp_path)
    assert result.returncode == 0 and "note:" not in result.stderr, explain(result)
    (runs["B"] / "config.yaml").unlink()  # its own checkpoint, its config lost: not called another run's
    result = ganscale("export", "B", "--out", "U.safetensors", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert ("note: B has no config file; B/checkpoints/step-00000001.pt, written by a 'ring8' run, is exported with "
            "the config it was written with") in result.stderr, explain(result)


@pytest.mark.slow
def test_export_writes_g_and_g_ema(trained_run, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "W.safetensors"
    result = ganscale("export", str(trained_run), "--out", str(out), cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert out.is_file()
    state = torch.load(trained_run / "checkpoints" / "step-00000020.pt", map_location="cpu", weights_only=True)
    with safe_open(str(out), "pt") as f:
        keys = set(f.keys())
        assert f.metadata()["step"] == "20"
        g_keys = {k[len("G."):] for k in keys if k.startswith("G.")}
        ema_keys = {k[len("G_ema."):] for k in keys if k.startswith("G_ema.")}
        assert keys == {f"G.{k}" for k in g_keys} | {f"G_ema.{k}" for k in ema_keys}
        assert g_keys == set(state["G"]) and ema_keys == set(state["G_ema"])
        assert g_keys  # not empty
        for k in g_keys:
            assert torch.equal(f.get_tensor(f"G.{k}"), state["G"][k])
        for k in ema_keys:
            assert torch.equal(f.get_tensor(f"G_ema.{k}"), state["G_ema"][k])
    assert not list(tmp_path.glob(".*tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("command, out", [("sample", "afile/grid.png"), ("export", "afile/g.safetensors")])
def test_a_file_where_the_output_s_folder_goes_is_one_line_and_exit_2_for_every_command(trained_run, tmp_path,
                                                                                         command, out):
    (tmp_path / "afile").write_text("")  # a file where the output's folder goes: bad input, not a refused write
    result = ganscale(command, str(trained_run), "--out", out, cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert "Traceback" not in result.stderr and "'afile' in 'afile/" in result.stderr, explain(result)
    assert "is a file, not a folder" in result.stderr, explain(result)
    assert (tmp_path / "afile").read_text() == ""


# --------------------------------------------------------------------------------- ring8, 1 rank
@pytest.mark.slow
def test_ring8_trains_in_one_process_and_draws_a_scatter(tmp_path):
    result = ganscale("train", "ring8", "--set", "train.steps=50", "--run-dir", "R", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    run = tmp_path / "R"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["world_size"]) == (50, 1)
    assert [r["step"] for r in metrics(run)] == [50]  # log.every 250 > steps: only the final step
    assert checkpoint_steps(run) == [50]
    samples = list((run / "samples").glob("*.png"))
    assert [p.name for p in samples] == ["step-00000050.png"]
    with Image.open(samples[0]) as picture:
        pixels = np.asarray(picture.convert("RGB"))
    assert pixels.shape[0] == pixels.shape[1]  # a square scatter canvas, not an image grid
    colours = {tuple(c) for c in pixels.reshape(-1, 3).tolist()}
    assert {(255, 255, 255), (30, 60, 160), (200, 30, 30)} <= colours  # background, points, mode markers
    assert not (tmp_path / "runs").exists()  # --run-dir given: nothing under the default root


@pytest.mark.slow
def test_same_command_runs_under_torchrun(tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "ganscale", "train", "--set", "train.steps=10", "--set", "log.every=5",
                             "--run-dir", str(run)], cwd=tmp_path, env=clean_env(), capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 10


def test_corrupt_checkpoint_on_resume_exits_2_naming_the_file(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    bad = run / "checkpoints" / "step-00000010.pt"
    bad.write_bytes(b"not a checkpoint")
    result = ganscale("train", "--run-dir", str(run), "--resume", "auto", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert "step-00000010.pt" in result.stderr and "Traceback" not in result.stderr
    assert bad.read_bytes() == b"not a checkpoint"  # nothing already written is touched


@pytest.mark.slow
def test_resume_auto_passes_over_a_corrupted_newest_checkpoint(tmp_path, trained_run):
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    newest = run / "checkpoints" / "step-00000020.pt"
    newest.write_bytes(newest.read_bytes()[:-10])  # truncated, as by a crash mid-copy
    result = ganscale("train", "--run-dir", str(run), "--resume", "auto", "--nproc", "2", *SHORT_RUN[:-4],
                      "--set", "train.steps=25", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert f"skipping checkpoint {newest}" in result.stderr and "truncated" in result.stderr
    assert [r["step"] for r in metrics(run)] == [5, 10, 15, 20, 25]  # redone from step 10


def test_replicas_that_differ_end_in_one_line_and_their_own_exit_code(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ganscale import launch
    from ganscale.cli import main
    from ganscale.fault import EXIT_REPLICAS_DIFFER, ReplicaDivergence

    def diverged(cfg, run_dir, resume, note=None):
        raise ReplicaDivergence("replicas differ: G.net.0.weight on ranks 0, 1 (it must be bitwise identical)")
    monkeypatch.setattr(launch, "run_worker", diverged)
    result = CliRunner().invoke(main, ["train", *TINY_RUN, "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == EXIT_REPLICAS_DIFFER == 8, result.output
    assert result.output == "ganscale: replicas differ: G.net.0.weight on ranks 0, 1 (it must be bitwise identical)\n"


def test_a_short_training_imports_nothing_it_does_not_use(tmp_path):
    """Start-up is most of a short run: torch's pipelining and scikit-learn (whose digits file is read directly)
    cost over a second per process, on every rank. Neither is imported by a run that does not pipeline."""
    script = ("import sys\n"
              "from ganscale.cli import main\n"
              "try:\n"
              "    main(['train', '--set', 'train.steps=1', '--set', 'log.sample_every=0', '--run-dir', 'run'],\n"
              "         standalone_mode=False)\n"
              "finally:\n"
              "    print(sorted(m for m in ('sklearn', 'torch.distributed.pipelining') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=clean_env(), capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, explain(result)
    assert result.stdout.splitlines()[-1] == "[]", explain(result)
    assert checkpoint_steps(tmp_path / "run") == [1]


def test_a_refused_file_operation_names_the_command_s_own_locations(tmp_path):
    """The fix of a refused file operation named --run-dir and --out whatever the command: eval has neither (it
    writes RUN_DIR/eval.json), make-facades writes FOLDER. A folder where a file goes, and a file where a folder goes,
    are said as such."""
    (tmp_path / "a-file").write_text("")
    made = ganscale("make-facades", "a-file/sub", "--n", "2", cwd=tmp_path)
    assert made.returncode == 7 and made.stderr.strip() == (
        "ganscale: File exists: a-file. Fix: a file is where that folder goes: rename or move it, or choose another "
        "location (FOLDER)"), explain(made)
    trained = ganscale("train", "ring8", "--set", "train.steps=2", "--set", "log.tensorboard=false", "--run-dir", "run",
                       cwd=tmp_path)
    assert trained.returncode == 0, explain(trained)
    (tmp_path / "run" / "eval.json").mkdir()
    scored = ganscale("eval", "run", cwd=tmp_path)
    assert scored.returncode == 7 and scored.stderr.strip().endswith(
        "Is a directory: run/eval.json. Fix: a folder is where that file is written: rename or move it, or choose "
        "another location (RUN_DIR)"), explain(scored)


def test_sampling_a_run_whose_config_file_was_edited_names_the_settings_that_changed(tmp_path):
    """The run's config.yaml edited after training (model.g_width): `sample` said the checkpoint 'was written by a
    'ring8' run, this one is 'ring8''; it now names the setting, both values and the file to put it back in."""
    trained = ganscale("train", "ring8", "--set", "train.steps=2", "--set", "log.tensorboard=false", "--run-dir", "run",
                       cwd=tmp_path)
    assert trained.returncode == 0, explain(trained)
    written = (tmp_path / "run" / "config.yaml").read_text()
    width = config.load(str(tmp_path / "run" / "config.yaml")).model.g_width
    edited = written.replace(f"g_width: {width}\n", f"g_width: {width * 2}\n")
    assert edited != written
    (tmp_path / "run" / "config.yaml").write_text(edited)
    result = ganscale("sample", "run", "--out", "s.png", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, explain(result)
    assert f"model.g_width is {width * 2} here, {width} in the checkpoint's config" in result.stderr, explain(result)
    assert "set those back in" in result.stderr and "config.yaml" in result.stderr, explain(result)
