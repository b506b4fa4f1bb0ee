"""Checkpoint integrity: completion marker, checksum, fallback to the newest intact one; failed writes
leave nothing behind; malformed or foreign files are named, never a traceback."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import resource
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from ganscale import checkpoint
from ganscale.config import ConfigError


def _state(step: int) -> dict:
    """What every ganscale checkpoint holds (networks, step, config), small."""
    return {"step": step, "config": "name: test\n", "G": {"w": torch.full((256,), float(step))},
            "D": {"w": torch.zeros(4)}, "G_ema": {"w": torch.full((256,), float(step))}}


def _two_checkpoints(run_dir):
    for step in (10, 20):
        checkpoint.save(_state(step), run_dir, step, keep=3)
    return checkpoint.checkpoint_dir(run_dir)


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_intact_checkpoints_load_and_the_newest_is_used(tmp_path):
    folder = _two_checkpoints(tmp_path)
    assert checkpoint.newest_valid(tmp_path) == folder / "step-00000020.pt"
    assert checkpoint.load(folder / "step-00000020.pt")["step"] == 20
    assert _names(folder) == ["step-00000010.json", "step-00000010.pt", "step-00000020.json", "step-00000020.pt"]


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes() + b"more"), "grown"),  # was reported as truncated
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "corrupted"),
    (lambda p: checkpoint.manifest_path(p).unlink(), "incomplete"),
    # A malformed completion marker is an unverifiable checkpoint, like a garbage file (was: AttributeError)
    (lambda p: checkpoint.manifest_path(p).write_text("[1,2]"), "malformed completion marker"),
    (lambda p: checkpoint.manifest_path(p).write_text('"text"'), "malformed completion marker"),
    (lambda p: checkpoint.manifest_path(p).write_text('{"files": {"step-00000020.pt": null}}'), "malformed"),
    (lambda p: checkpoint.manifest_path(p).write_text('{"files": []}'), "malformed"),
    (lambda p: checkpoint.manifest_path(p).write_text('{"files": {}}'), "malformed"),
    (lambda p: checkpoint.manifest_path(p).write_text('{"files": {"step-00000020.pt": {"bytes": "1", "sha256": 2}}}'),
     "malformed"),
    (lambda p: checkpoint.manifest_path(p).write_text('{"step": 20}'), "malformed"),
    (lambda p: checkpoint.manifest_path(p).write_bytes(b"\xff\xfe garbage"), "unreadable completion marker"),
])
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_used(tmp_path, capsys, damage, reason):
    folder = _two_checkpoints(tmp_path)
    newest = folder / "step-00000020.pt"
    damage(newest)
    assert checkpoint.newest_valid(tmp_path) == folder / "step-00000010.pt"
    warning = capsys.readouterr().err
    assert str(newest) in warning and reason in warning
    assert warning.splitlines()[-1] == f"ganscale: using checkpoint {folder / 'step-00000010.pt'}, the newest intact one"
    assert checkpoint.newest_valid(tmp_path / "nothing") is None and capsys.readouterr().err == ""
    with pytest.raises(ConfigError, match=reason) as raised:
        checkpoint.load(newest)
    assert raised.value.key == str(newest)


def test_a_checkpoint_renamed_with_its_marker_is_intact_and_one_copied_without_it_says_so(tmp_path):
    folder = _two_checkpoints(tmp_path)
    for suffix in (".pt", ".json"):
        (tmp_path / f"best{suffix}").write_bytes((folder / f"step-00000020{suffix}").read_bytes())
    assert checkpoint.problem(tmp_path / "best.pt") is None
    assert checkpoint.load(tmp_path / "best.pt")["step"] == 20
    (tmp_path / "best.pt").write_bytes((folder / "step-00000010.pt").read_bytes())  # other bytes: still caught
    assert "truncated" in checkpoint.problem(tmp_path / "best.pt") or "corrupted" in checkpoint.problem(
        tmp_path / "best.pt")
    (tmp_path / "copy.pt").write_bytes((folder / "step-00000020.pt").read_bytes())
    assert "copy.json" in checkpoint.problem(tmp_path / "copy.pt")
    assert "copied without it" in checkpoint.problem(tmp_path / "copy.pt")


def test_pruning_never_removes_the_checkpoint_just_written_for_a_newer_unfinished_one(tmp_path):
    """A crash left step 30 without its marker; the run resumed from 20 and saves 25 with keep=1."""
    checkpoint.save(_state(20), tmp_path, 20, keep=1)
    unfinished = checkpoint.save(_state(30), tmp_path, 30, keep=2)
    checkpoint.manifest_path(unfinished).unlink()
    written = checkpoint.save(_state(25), tmp_path, 25, keep=1)
    assert checkpoint.newest_valid(tmp_path) == written  # it was removed with step 20, leaving nothing intact
    assert checkpoint.step_of(written) == 25 and checkpoint.list_checkpoints(tmp_path)[-1] == unfinished


def test_keep_prunes_checkpoints_and_their_markers(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save({"step": step}, tmp_path, step, keep=2)
    names = sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir())
    assert names == ["step-00000003.json", "step-00000003.pt", "step-00000004.json", "step-00000004.pt"]


# ------------------------------------------------------------------------------------- failed writes
class _FullDisk:
    """A file that takes `room` bytes, then fails as a full disk does."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.f.write(bytes(data[:self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.fixture
def full_disk(monkeypatch):
    """torch.save writes part of the file, then the disk is full: torch reports a RuntimeError
    ("unexpected pos") whose context is the OSError, as on a real full disk."""
    real = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real(obj, _FullDisk(f, 1000), *a, **k))


def test_train_with_a_full_disk_says_so_in_one_line_and_exits_7(tmp_path, monkeypatch):
    import io

    real = torch.save  # files fill the disk; in-memory pickling (the RNG states' all-gather) does not
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: real(
        obj, f if isinstance(f, io.BytesIO) else _FullDisk(f, 1000), *a, **k))
    result = _train_two_steps_here(tmp_path, monkeypatch, sample_every=0)
    assert result.exit_code == 7, result.output
    assert "ganscale: could not write checkpoint" in result.output and "no space left" in result.output
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # no temporary file left



def _train_two_steps_here(tmp_path, monkeypatch, sample_every: int):
    """`ganscale train` in this process, into tmp_path/run (click's runner: monkeypatched writes apply)."""
    import torch.distributed as dist

    from ganscale.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        return CliRunner().invoke(main, ["train", "--set", "train.steps=2", "--set", "train.batch_size=8",
                                         "--set", f"log.sample_every={sample_every}", "--run-dir", "run"])
    finally:  # a rank's own failure leaves its group open until the process exits; this process goes on
        if dist.is_initialized():
            dist.destroy_process_group()


def _fill_the_disk(monkeypatch, method: str, file_of, room: int = 10):
    """Replace `method`, which writes a file (`file_of(self, *args)`), by one that writes `room` bytes of it, then
    fails as a full disk does."""
    def full(*args, **kwargs):
        with open(file_of(*args), "wb") as f:
            f.write(b"x" * room)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(method, full)


@pytest.mark.parametrize("written, writer, file_of", [
    ("config.yaml", "pathlib.Path.write_text", lambda path, text: path),
    ("samples/step-00000001.png", "PIL.Image.Image.save", lambda picture, path, *rest: path),
])
def test_a_full_disk_before_the_first_checkpoint_names_the_file_and_leaves_none_of_it(tmp_path, monkeypatch, written,
                                                                                     writer, file_of):
    _fill_the_disk(monkeypatch, writer, file_of)
    result = _train_two_steps_here(tmp_path, monkeypatch, sample_every=1)
    assert result.exit_code == 7, result.output
    assert f"ganscale: No space left on device: run/{written}. Fix:" in result.output, result.output
    target = tmp_path / "run" / written
    # Nothing written before config.yaml: its run directory is not left behind either (runlock's abandon).
    assert not target.exists() and (written != "config.yaml" or not target.parent.exists())
    assert not target.parent.exists() or not [p for p in target.parent.iterdir() if p.name.startswith(".")]


def test_a_failed_write_removes_its_temporary_file_and_says_why(tmp_path, request):
    folder = _two_checkpoints(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    request.getfixturevalue("full_disk")  # from here on
    for _ in range(3):  # every retry used to leave another .step-00000030.pt.tmp-PID
        with pytest.raises(checkpoint.CheckpointWriteError) as raised:
            checkpoint.save(_state(30), tmp_path, 30, keep=3)
        message = str(raised.value)
        assert message.startswith(f"could not write checkpoint {folder / 'step-00000030.pt'}: no space left on device")
        assert "Fix: free space" in message and "\n" not in message
        assert raised.value.errno == errno.ENOSPC and raised.value.exit_code == 7
        assert isinstance(raised.value, OSError) and not isinstance(raised.value, ConfigError)  # not bad input
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # nothing left, nothing lost
    assert checkpoint.newest_valid(tmp_path) == folder / "step-00000020.pt"


def test_a_failed_completion_marker_removes_the_unmarked_checkpoint(tmp_path, monkeypatch):
    folder = _two_checkpoints(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    real = checkpoint._write_atomically

    def marker_fails(path, write):
        if path.suffix == ".json":
            return real(path, lambda f: write(_FullDisk(f, 10)))
        return real(path, write)
    monkeypatch.setattr(checkpoint, "_write_atomically", marker_fails)
    with pytest.raises(checkpoint.CheckpointWriteError, match="step-00000030.json.*no space left on device"):
        checkpoint.save(_state(30), tmp_path, 30, keep=3)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_error_that_is_not_the_disk_keeps_its_own_traceback_and_leaves_nothing(tmp_path):
    folder = _two_checkpoints(tmp_path)
    with pytest.raises(Exception) as raised:  # a bug: an object torch cannot pickle
        checkpoint.save({**_state(30), "bad": lambda: 0}, tmp_path, 30, keep=3)
    assert not isinstance(raised.value, checkpoint.CheckpointWriteError)
    assert _names(folder) == ["step-00000010.json", "step-00000010.pt", "step-00000020.json", "step-00000020.pt"]


def test_leftovers_of_dead_writers_are_swept_before_a_write_and_nothing_else(tmp_path):
    folder = _two_checkpoints(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        stale = [f".step-00000030.pt.tmp-{dead_pid}", f".step-00000030.json.tmp-{dead_pid}",
                 f".step-00000030.pt.tmp-{os.getpid()}"]  # this process writes nothing while it sweeps
        kept = [f".step-00000030.pt.tmp-{live.pid}",  # a live writer's
                "notes.txt", ".step-00000030.pt.tmp-abc", ".other.pt.tmp-1", "step-00000030.pt.tmp-1",
                f".step-00000030.pt.tmp-{dead_pid}.bak"]
        for name in stale + kept:
            (folder / name).write_bytes(b"x" * 100)
        (folder / ".step-00000025.dcp.tmp").mkdir()  # a sharded write's staging folder, interrupted
        (folder / ".step-00000025.dcp.tmp" / "__0_0.distcp").write_bytes(b"x")
        (folder / ".keep.dcp.tmp").mkdir()
        checkpoint.save(_state(40), tmp_path, 40, keep=3)
        names = set(_names(folder))
        assert not names & {*stale, ".step-00000025.dcp.tmp"}
        assert set(kept) | {".keep.dcp.tmp", "step-00000010.pt", "step-00000020.pt", "step-00000040.pt"} <= names
    finally:
        live.kill()
        live.wait()


@contextlib.contextmanager
def _one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_failed_sharded_write_leaves_no_staging_folder(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.filesystem import FileSystem

    run = tmp_path / "run"
    real = FileSystem.create_stream

    @contextlib.contextmanager
    def full_disk(self, path, mode):
        with real(self, path, mode) as stream:
            yield _FullDisk(stream, 100) if str(path).endswith(".distcp") else stream

    shards = {"G": {"model": {"w": torch.randn(1000)}}}
    with _one_rank(tmp_path):
        assert checkpoint.save_sharded(shards, _state(10), run, 10, keep=3) is not None
        folder = checkpoint.checkpoint_dir(run)
        (folder / ".step-00000015.dcp.tmp").mkdir()  # left by a write that was killed
        before = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if "15" not in p.name)
        monkeypatch.setattr(FileSystem, "create_stream", full_disk)
        with pytest.raises(checkpoint.CheckpointWriteError, match=r"step-00000020\.dcp: no space left on device") as e:
            checkpoint.save_sharded(shards, _state(20), run, 20, keep=3)
    # Every rank gets the failure (dcp gathers each rank's): rank 0 says it, once, for all of them.
    assert getattr(e.value, "told_by", None) == 0
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) == before
    assert checkpoint.problem(folder / "step-00000010.dcp") is None


# ------------------------------------------------------------------------------ foreign files, fix texts
@pytest.mark.parametrize("state, what", [
    ({"step": 1, "w": torch.ones(3)}, "no 'G', 'D', 'G_ema', 'config'"),
    ({**_state(1), "G": [torch.ones(3)]}, "'G' is a list, not a dict of tensors"),
    ({**_state(1), "G_ema": {"w": 1.0}}, "'G_ema' is a dict, not a dict of tensors"),
    ({**_state(1), "config": {"name": "x"}}, "'config' is a dict, not YAML text"),
    ([1, 2], "it holds a list, not a dict"),
])
def test_an_intact_file_that_is_not_a_ganscale_checkpoint_is_named(tmp_path, state, what):
    path = checkpoint.save(state, tmp_path, 1, keep=3)  # intact: its completion marker matches
    with pytest.raises(ConfigError, match="this is not a ganscale checkpoint: " + what.replace("(", r"\(")) as raised:
        checkpoint.load(path)
    assert raised.value.key == str(path)


def _resume_state(step: int) -> dict:
    """What a resume reads, as the Checkpointer writes it (two ranks, fp16's scaler, ADA, Adam's state by name)."""
    from ganscale.precision import Precision

    net = torch.nn.Linear(2, 1)
    adam = torch.optim.Adam(net.parameters())
    net(torch.ones(1, 2)).sum().backward()
    adam.step()
    names, saved = [name for name, _ in net.named_parameters()], adam.state_dict()
    by_name = {"state": {names[i]: moments for i, moments in saved["state"].items()},
               "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                for group in saved["param_groups"]]}
    return {**_state(step), "data_position": 2 * step, "skipped_steps": 1, "consecutive_skips": 0, "pl_mean": 0.5,
            "world_size": 2, "opt_g": by_name, "opt_d": by_name,
            "scaler": Precision("fp16", torch.device("cpu")).state_dict(),
            "augment": {"p": 0.2, "sign_sum": 1.5, "d_steps": 3}, "rng": [checkpoint.rng_state()] * 2}


def _rng_with(part: str, **changed) -> list[dict]:
    state = checkpoint.rng_state()
    return [state, {**state, part: {**state[part], **changed} if part == "numpy" else changed["value"]}]


# The outside tester's cases (a field changed, the completion marker rewritten to match) and more of each kind.
TAMPERED = [
    ("rng", [None], "'rng' is not every rank's RNG state: rank 0's state is None, not a dict of 'torch' and 'numpy'"),
    ("rng", {}, "'rng' is a dict, not a list of every rank's RNG state"),
    ("rng", [checkpoint.rng_state()], "'rng' holds 1 rank(s)' RNG states, but 'world_size' is 2"),
    ("rng", _rng_with("torch", value=torch.zeros(3, dtype=torch.uint8)), "'rng' is not every rank's RNG state: "
     "rank 1's state is not a dict of 'torch' and 'numpy' states: its 'torch' is a uint8 tensor of shape (3,)"),
    ("rng", _rng_with("cuda", value=torch.zeros(16)), "rank 1's state is not a dict of 'torch' and 'numpy' states: "
     "its 'cuda' is a float32 tensor of shape (16,)"),
    ("rng", _rng_with("numpy", keys=torch.zeros(3, dtype=torch.int64)), "rank 1's 'numpy' state is not numpy's "
     "MT19937 state: its 'keys' is an int64 tensor of shape (3,)"),
    ("rng", _rng_with("numpy", pos=700), "rank 1's 'numpy' state is not numpy's MT19937 state: its 'pos' is 700"),
    ("skipped_steps", None, "'skipped_steps' is None, not a count (an int >= 0)"),
    ("consecutive_skips", -1, "'consecutive_skips' is -1, not a count"),
    ("scaler", 5, "'scaler' is 5, not fp16's loss scaler state"),
    ("scaler", {"scale": 1.0}, "'scaler' is not fp16's loss scaler state: it has no 'growth_factor'"),
    ("step", 2, "'step' is 2, but its name says step 4"),
    ("data_position", "x", "'data_position' is 'x', not a count"),
    ("data_position", 5, "'data_position' is 5, not a multiple of its step 4 (step x loss.n_critic)"),
    ("pl_mean", float("nan"), "'pl_mean' is nan, not a finite number"),
    ("augment", {"p": 2.0, "sign_sum": 0.0, "d_steps": 0}, "'augment' is not ADA's state: its 'p' is 2.0"),
    ("world_size", "2", "'world_size' is '2', not a number of ranks"),
    ("opt_g", 5, "'opt_g' is 5, not an optimizer state by parameter name"),
    ("opt_d", {"state": {}, "param_groups": [{"params": ["weight"], "eps": "x"}]},
     "'opt_d' is not an optimizer state by parameter name: a parameter group's 'eps' is 'x'"),
    ("config", "x: [", "'config' is not YAML text (while parsing"),
    ("config", "- 1", "'config' is YAML of a list, not of a config"),
]


def test_a_checkpoint_as_the_checkpointer_writes_it_passes_every_check(tmp_path):
    path = checkpoint.save(_resume_state(4), tmp_path, 4, keep=3)
    assert checkpoint.load(path, require=checkpoint.RESUME_KEYS)["augment"]["p"] == 0.2
    with _one_rank(tmp_path):
        sharded = checkpoint.save_sharded(_SHARDS, _resume_state(6), tmp_path, 6, keep=3)
    assert checkpoint.load_meta(sharded)["step"] == 6


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("key, value, what", TAMPERED, ids=[f"{key}-{i}" for i, (key, _, _) in enumerate(TAMPERED)])
def test_a_tampered_field_under_a_matching_marker_is_refused_naming_the_file_and_the_field(tmp_path, sharded, key,
                                                                                          value, what):
    """Was a TypeError traceback (rng, skipped_steps, scaler), a silent reseed (rng={}), or blamed loss.n_critic."""
    state = {**_resume_state(4), key: value}
    if sharded:
        if key in ("opt_g", "opt_d"):
            pytest.skip("a sharded checkpoint's optimizer state is in its shards, read into the run's own structure")
        with _one_rank(tmp_path):
            path = checkpoint.save_sharded(_SHARDS, state, tmp_path, 4, keep=3)
    else:
        path = checkpoint.save(state, tmp_path, 4, keep=3)  # its marker matches: only its content says it
    with pytest.raises(ConfigError) as refused:
        checkpoint.load_meta(path) if sharded else checkpoint.load(path, checkpoint.RESUME_KEYS, checkpoint.RESUME_FIX)
    assert refused.value.key == str(path) and "\n" not in str(refused.value)
    assert refused.value.problem.startswith("this is not a ganscale checkpoint: '") and what in refused.value.problem, \
        refused.value.problem
    assert refused.value.fix == checkpoint.RESUME_FIX


def test_export_sample_and_eval_refuse_a_step_or_config_they_cannot_use_and_read_nothing_else(tmp_path):
    for step, config, what in ((4, "x: [", "'config' is not YAML text"),
                               (4, "7", "'config' is YAML of 7, not of a config"),
                               ("4", "name: test\n", "'step' is '4', not a count")):
        path = checkpoint.save({**_state(4), "step": step, "config": config}, tmp_path / str(len(what)), 4, keep=3)
        with pytest.raises(ConfigError, match="this is not a ganscale checkpoint: " + what.replace("(", r"\(")):
            checkpoint.load(path, require=checkpoint.GENERATOR_KEYS)
    best = tmp_path / "best.pt"  # a copy renamed with its marker: the marker tells its step
    torch.save(_state(3), best)
    checkpoint.manifest_path(best).write_text(json.dumps(checkpoint._manifest(best, 4)))
    with pytest.raises(ConfigError, match="'step' is 3, but its completion marker says step 4"):
        checkpoint.load(best)
    path = checkpoint.save({**_resume_state(4), "rng": None}, tmp_path / "rng", 4, keep=3)  # only a resume reads it
    assert checkpoint.load(path, require=checkpoint.GENERATOR_KEYS)["step"] == 4
    with pytest.raises(ConfigError, match="'rng' is None, not a list"):
        checkpoint.load(path, require=checkpoint.RESUME_KEYS)


@pytest.fixture(scope="module")
def trained_two_steps(tmp_path_factory):
    from dist_helpers import train_in_process
    from test_distributed import SMALL_DCGAN

    from ganscale import config

    run = tmp_path_factory.mktemp("trained")
    settings = {**SMALL_DCGAN, "train.steps": 2, "checkpoint.every": 2}
    train_in_process(config.load(None, [f"{k}={v}" for k, v in settings.items()]), run)
    return run, {**settings, "train.steps": 4}


@pytest.mark.parametrize("key, value", [("rng", [None]), ("skipped_steps", None), ("scaler", 5), ("rng", {}),
                                        ("step", 1), ("data_position", "x")])
def test_a_resume_from_a_tampered_checkpoint_is_refused_before_anything_is_restored(tmp_path, trained_two_steps,
                                                                                  key, value):
    from ganscale import config
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    trained, settings = trained_two_steps
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (path,) = checkpoint.list_checkpoints(run)
    torch.save({**torch.load(path, weights_only=True), key: value}, path)
    _remark(path)
    before = _files_under(run)
    runtime = start("cpu")
    try:
        with pytest.raises(ConfigError) as refused:
            Trainer(config.load(None, [f"{k}={v}" for k, v in settings.items()]), runtime, run, path)
    finally:
        runtime.close()
    assert refused.value.key == str(path) and f"this is not a ganscale checkpoint: {key!r} is" in str(refused.value)
    assert _files_under(run) == before


def test_fix_texts_fit_the_command(tmp_path):
    folder = _two_checkpoints(tmp_path)
    newest = folder / "step-00000020.pt"
    newest.write_bytes(newest.read_bytes()[:-100])
    with pytest.raises(ConfigError) as raised:  # export, sample, eval: they have no --resume nor --run-dir
        checkpoint.load(newest)
    assert "--resume" not in str(raised.value) and "--run-dir" not in str(raised.value)
    with pytest.raises(ConfigError, match="--resume PATH"):  # a resume may say so
        checkpoint.load(newest, fix=checkpoint.RESUME_FIX)
    from ganscale.export import export_generator
    with pytest.raises(ConfigError, match="pass another file with --checkpoint") as raised:
        export_generator(tmp_path, tmp_path / "g.safetensors", newest)
    assert "--resume" not in str(raised.value)


def test_a_sharded_checkpoint_is_checked_like_a_full_one(tmp_path):
    run = tmp_path / "run"
    shards = {"G": {"model": {"w": torch.ones(8)}, "ema": {"w": torch.ones(8)}}, "D": {"model": {"w": torch.ones(2)}}}
    with _one_rank(tmp_path):
        path = checkpoint.save_sharded(shards, _state(10), run, 10, keep=3)
        no_d = checkpoint.save_sharded({"G": shards["G"]}, _state(20), run, 20, keep=3)
    assert checkpoint.load(path)["step"] == 10  # export, sample, eval: one process reads the full networks
    with pytest.raises(ConfigError, match="this is not a ganscale checkpoint: no 'D'"):
        checkpoint.load(no_d)
    with pytest.raises(ConfigError, match="no 'data_position', 'skipped_steps', 'scaler', 'rng'.*--resume PATH"):
        checkpoint.load_meta(path)  # what a resume reads besides the shards


def test_a_sharded_checkpoint_that_does_not_fit_is_a_runtime_error_not_dcp_s_base_exception(tmp_path):
    """DCP's CheckpointException is a BaseException: the trainer's and the CLI's handlers missed it (a traceback)."""
    run = tmp_path / "run"
    with _one_rank(tmp_path):
        path = checkpoint.save_sharded({"G": {"model": {"w": torch.ones(8)}}}, _state(10), run, 10, keep=3)
        with pytest.raises(RuntimeError, match="^ValueError: .*w"):
            checkpoint.load_sharded(path, {"G": {"model": {"w": torch.ones(5)}}})


def _save_on_node_local_disks(rank, world, root):
    """Rank 1 writes its shards into a folder of the same name under another root: another node's disk."""
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ganscale import checkpoint

    root = Path(root)
    if rank == 1:
        own = checkpoint._shard_writer
        checkpoint._shard_writer = lambda staging: own(root / "node1" / staging.relative_to(root))
        (root / "node1" / "run" / "checkpoints" / ".step-00000010.dcp.tmp").mkdir(parents=True)
    w = distribute_tensor(torch.arange(8.0), init_device_mesh("cpu", (world,)), [Shard(0)])
    try:
        checkpoint.save_sharded({"G": {"model": {"w": w}}}, {"step": 10}, root / "run", 10, keep=3)
    except checkpoint.CheckpointWriteError as e:
        return str(e)
    return None


def test_a_sharded_checkpoint_on_disks_the_nodes_do_not_share_is_refused_on_every_rank(tmp_path):
    from dist_helpers import run_ranks

    errors = run_ranks(_save_on_node_local_disks, 2, str(tmp_path))
    assert all(e and "not on a file system every node shares" in e for e in errors), errors
    assert errors[1].startswith("rank 0 could not write its checkpoint: could not write checkpoint")
    assert checkpoint.list_checkpoints(tmp_path / "run") == []  # nothing that would pass as intact
    assert not (checkpoint.checkpoint_dir(tmp_path / "run") / ".step-00000010.dcp.tmp").exists()


def _export(*args, cwd):
    from ganscale.cli import main

    with contextlib.chdir(cwd):
        return CliRunner().invoke(main, ["export", *args])


def test_export_of_a_foreign_file_exits_2_with_one_line(tmp_path):
    run = tmp_path / "run"
    foreign = checkpoint.save({"step": 1, "w": torch.ones(3)}, run, 1, keep=3)
    result = _export(str(run), "--checkpoint", str(foreign), "--out", "g.safetensors", cwd=tmp_path)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert f"{foreign}': this is not a ganscale checkpoint: no 'G'" in result.output
    assert "Traceback" not in result.output and "KeyError" not in result.output
    assert not (tmp_path / "g.safetensors").exists()
    checkpoint.manifest_path(foreign).write_text("[1,2]")  # no intact checkpoint left in the run
    result = _export(str(run), "--out", "g.safetensors", cwd=tmp_path)
    assert result.exit_code == 2 and "malformed completion marker" in result.output, result.output
    assert "AttributeError" not in result.output


def test_export_of_a_checkpoint_holding_nan_exits_4_naming_the_tensor(tmp_path):
    state = _state(10)
    state["G_ema"]["w"][3] = float("nan")
    path = checkpoint.save(state, tmp_path / "run", 10, keep=3)
    result = _export(str(tmp_path / "run"), "--out", "g.safetensors", cwd=tmp_path)
    assert result.exit_code == 4, result.output
    assert f"ganscale: G_ema.w in checkpoint {path} holds NaN or infinite values" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "g.safetensors").exists()


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes fail with EFBIG in this process, as under `ulimit -f` (Python ignores SIGXFSZ);
    a refused write without root's tricks (chattr +i)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_export_that_cannot_write_its_output_leaves_nothing(tmp_path):
    """safetensors' save_file reported a refused write as a SafetensorError, with no OSError behind it: exit 2, "a
    config error at '--out'" with a fix about free space. Python's own write raises the OSError (EFBIG here)."""
    from ganscale import export

    _two_checkpoints(tmp_path)
    out = tmp_path / "out" / "g.safetensors"
    with pytest.raises(OSError) as refused, file_size_limit(1024):  # the file is 2 KB and more
        export.export_generator(tmp_path, out)
    # The CLI's one line and exit 7, as for any refused write.
    assert refused.value.errno == errno.EFBIG and refused.value.filename == str(out)
    assert list(out.parent.iterdir()) == []


def test_export_refused_by_the_system_exits_7_with_the_usual_line(tmp_path):
    """As `ulimit -f 1; ganscale export ...` (or a folder made immutable): exit 7, the line every command gives."""
    _two_checkpoints(tmp_path / "run")
    out = tmp_path / "out" / "g.safetensors"
    out.parent.mkdir()
    from test_cli import clean_env

    result = subprocess.run([sys.executable, "-m", "ganscale", "export", "run", "--out", str(out)], cwd=tmp_path,
                            env=clean_env(), capture_output=True, text=True, timeout=300,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024)))
    assert result.returncode == 7 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-1] == (  # after the note that this run has no config file
        f"ganscale: File too large: {out}. Fix: check that path's permissions and free space, or choose another "
        "location (RUN_DIR, --out)"), result.stderr[-3000:]
    assert list(out.parent.iterdir()) == []


def test_export_writes_its_output_with_the_usual_permissions(tmp_path):
    from ganscale.export import export_generator

    _two_checkpoints(tmp_path)
    umask = os.umask(0o022)
    try:
        out = export_generator(tmp_path, tmp_path / "g.safetensors")
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o644  # was 0600: safetensors' private temporary file, renamed
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _files_under(folder) -> dict:
    """Every path under `folder` with what it is: a regular file's bytes, else its kind."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() and not p.is_symlink() else
            ("link" if p.is_symlink() else "folder" if p.is_dir() else "other") for p in folder.rglob("*")}


# What a run's training (and eval, slurm) wrote there, each kept byte for byte by every refusal below.
RUN_RECORDS = ["metrics.jsonl", "fingerprints.jsonl", "summary.json", "run.lock", "run.lock.stale-0a1b",
               "samples/step-00000010.png", "tensorboard/events.out.tfevents.1.host", "diagnostics/rank0-stacks.txt",
               "profile/rank0.txt", "eval.json", "slurm/job.sbatch"]


@pytest.mark.parametrize("command", ["export", "sample", "interpolate", "style-mix"])
@pytest.mark.parametrize("out, why", [
    ("", "the file name is empty"),
    ("run/checkpoints/step-00000020.pt", "is inside the checkpoints of run"),
    ("run/checkpoints/step-00000030.pt", "is inside the checkpoints of run"),  # would pass for the newest
    ("run/config.yaml", "is the config of run"),
    ("run/config.resumed-00000010.yaml", "is the config of run"),
    ("to-config.yaml", "is the config of run"),  # a link to it
    # The log a resume appends to (an export over it became a safetensors file), the summary the API reads, ...
    ("run/metrics.jsonl", "is the metrics.jsonl of run"),
    ("run/fingerprints.jsonl", "is the fingerprints.jsonl of run"),
    ("run/summary.json", "is the summary.json of run"),
    ("run/run.lock", "is the run.lock of run"),
    ("run/run.lock.stale-0a1b", "is the run.lock.stale-0a1b of run"),
    ("run/samples/step-00000010.png", "is inside the samples/ of run"),
    ("run/samples/step-00000020.png", "is inside the samples/ of run"),  # one the next sample step writes
    ("to-samples/step-00000010.png", "is inside the samples/ of run"),  # through a link to the folder
    ("run/tensorboard/events.out.tfevents.1.host", "is inside the tensorboard/ of run"),
    ("run/diagnostics/rank0-stacks.txt", "is inside the diagnostics/ of run"),
    ("run/profile/rank0.txt", "is inside the profile/ of run"),
    ("run/eval.json", "is the eval.json of run {run}, which no command but eval writes"),
    ("run/slurm/job.sbatch", "is inside the slurm/ of run {run}, which no command but slurm writes"),
    ("folder", "exists and is not a regular file"),
    ("fifo", "exists and is not a regular file"),  # as a device node: a rename would have replaced it
    ("existing.png", "already exists"),
])
def test_an_output_is_never_written_over_a_run_s_files_nor_a_non_regular_or_existing_one(tmp_path, command, out,
                                                                                          why):
    run = tmp_path / "run"
    _two_checkpoints(run)
    (run / "config.yaml").write_text("name: test\n")
    for record in RUN_RECORDS:
        (run / record).parent.mkdir(exist_ok=True)
        (run / record).write_bytes(b"the run's " + record.encode())
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "existing.png").write_bytes(b"mine")
    (tmp_path / "to-config.yaml").symlink_to(run / "config.yaml")
    (tmp_path / "to-samples").symlink_to(run / "samples")
    before = _files_under(tmp_path)
    from ganscale.cli import main

    why = why.format(run=run)
    if why.endswith(" of run"):
        why += f" {run}, which no command but train writes (not even with --force)"
    forced = [[]] if why == "already exists" else [[], ["--force"]]  # --force replaces only an existing file
    for force in forced:
        with contextlib.chdir(tmp_path):
            result = CliRunner().invoke(main, [command, "run", "--out", out, *force])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert result.output.count("\n") == 1 and "Traceback" not in result.output, result.output
        assert f"config error at '--out': {f'{out!r} ' if out else ''}{why}" in result.output, result.output
        assert _files_under(tmp_path) == before


@pytest.mark.parametrize("out, why", [
    ("run/config.yaml", "is the config of run"),
    ("run/checkpoints/step-00000010.pt", "is inside the checkpoints of run"),
    ("run/samples/step-00000010.png", "is inside the samples/ of run"),
    ("run/metrics.jsonl", "is the metrics.jsonl of run"),
    ("run/run.lock", "is the run.lock of run"),
])
def test_a_run_directory_holding_only_its_lock_is_a_run(tmp_path, out, why):
    """A run starting (its config.yaml comes once its data and networks are built) or killed right after taking its
    run directory holds only run.lock there: its own files are refused as any run's (they were written)."""
    from ganscale.outputs import check_output
    from ganscale.runlock import LOCK_NAME

    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).write_text('{"host": "node7", "pid": 4242, "token": "0a1b"}')
    with contextlib.chdir(tmp_path), pytest.raises(ConfigError) as refused:
        check_output(out, True)
    assert refused.value.problem == f"'{out}' {why} {run}, which no command but train writes (not even with --force)"
    assert _files_under(tmp_path) == {"run": "folder", "run/run.lock": (run / LOCK_NAME).read_bytes()}


def test_a_manifest_is_not_written_as_the_config_of_a_run_holding_only_its_lock(tmp_path):
    from ganscale.cli import main
    from ganscale.runlock import LOCK_NAME

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK_NAME).write_text('{"host": "node7", "pid": 4242, "token": "0a1b"}')
    before = _files_under(tmp_path)
    with contextlib.chdir(tmp_path):
        result = CliRunner().invoke(main, ["k8s", "ring8", "--image", "img", "--out", "run/config.yaml", "--force"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output  # was written, then replaced
    assert "config error at '--out': 'run/config.yaml' is the config of run" in result.output, result.output
    assert _files_under(tmp_path) == before

def test_an_output_may_be_any_other_file_of_a_run_directory(tmp_path):
    """Only a run's own files are refused: a new file beside them, or the manifest `ganscale k8s` writes there by
    the same rule (RUN_DIR/k8s/job.yaml, replaced with --force), is written."""
    from ganscale.outputs import check_output

    run = tmp_path / "run"
    _two_checkpoints(run)  # a run by its checkpoints (a config.yaml would have to fit them, for the export below)
    (run / "k8s").mkdir()
    (run / "k8s" / "job.yaml").write_text("kind: JobSet\n")
    with contextlib.chdir(tmp_path):
        assert check_output("run/my-grid.png", False) == Path("run/my-grid.png")
        assert check_output("run/k8s/job.yaml", True) == Path("run/k8s/job.yaml")
        assert check_output("run/samples-mine/grid.png", False) == Path("run/samples-mine/grid.png")
    assert _export(str(run), "--out", str(run / "g.safetensors"), cwd=tmp_path).exit_code == 0
    assert (run / "g.safetensors").is_file()


def test_export_refuses_an_out_that_is_not_a_safetensors_file(tmp_path):
    _two_checkpoints(tmp_path)
    before = _files_under(tmp_path)
    result = _export(str(tmp_path), "--out", "g.pt", cwd=tmp_path)
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "config error at '--out': 'g.pt' is not a .safetensors file" in result.output, result.output
    assert "give --out a name ending in .safetensors" in result.output
    assert _files_under(tmp_path) == before


def test_export_replaces_an_existing_file_only_with_force(tmp_path):
    _two_checkpoints(tmp_path)
    (tmp_path / "g.safetensors").write_bytes(b"mine")
    assert _export(str(tmp_path), "--out", "g.safetensors", cwd=tmp_path).exit_code == 2
    assert (tmp_path / "g.safetensors").read_bytes() == b"mine"
    result = _export(str(tmp_path), "--out", "g.safetensors", "--force", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    from safetensors import safe_open
    with safe_open(str(tmp_path / "g.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "20"


def test_an_output_that_became_a_non_regular_file_is_not_renamed_over(tmp_path):
    from ganscale.outputs import write_output

    fifo = tmp_path / "g.png"
    os.mkfifo(fifo)  # after --out was checked: the rename would replace it, as it replaced /dev/null as root
    with pytest.raises(ConfigError, match="is not a regular file"):
        write_output(fifo, lambda tmp: tmp.write_bytes(b"picture"))
    assert fifo.is_fifo() and _names(tmp_path) == ["g.png"]


def _open_for_resume(rank, world, overrides, sources):
    """Build a Trainer resuming from sources[rank] (each rank's view of the checkpoint); (SHA-256s computed, error)."""
    from pathlib import Path

    from ganscale import config
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    hashed = []
    own = checkpoint._sha256
    checkpoint._sha256 = lambda path: hashed.append(path) or own(path)
    cfg = config.load(None, [f"{k}={v}" for k, v in overrides.items()])
    try:
        trainer = Trainer(cfg, start("cpu"), Path(sources[rank]).parent.parent, Path(sources[rank]))
        return len(hashed), None, trainer.step
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return len(hashed), e, None


def test_a_resume_hashes_the_checkpoint_on_rank_0_only_and_a_rank_that_cannot_see_it_stops_every_rank(tmp_path):
    """Rank 0 verifies the content; the others check they see every file at its size (a node-local run directory
    on rank 1: its error on rank 1, the same ConfigError naming rank 1 on rank 0, and no rank left waiting)."""
    from dist_helpers import run_ranks, train_in_process
    from test_distributed import SMALL_DCGAN

    from ganscale import config

    settings = {**SMALL_DCGAN, "train.steps": 4, "checkpoint.every": 4}
    train_in_process(config.load(None, [f"{k}={v}" for k, v in settings.items()]), tmp_path / "run")
    (saved,) = checkpoint.list_checkpoints(tmp_path / "run")
    more = {**settings, "train.steps": 6}

    results = run_ranks(_open_for_resume, 2, more, [str(saved)] * 2)
    assert [(count, error, step) for count, error, step in results] == [(1, None, 4), (0, None, 4)]

    elsewhere = tmp_path / "node1" / "run" / "checkpoints" / saved.name  # rank 1's node never saw the file
    elsewhere.parent.mkdir(parents=True)
    (_, mine, _), (_, theirs, _) = run_ranks(_open_for_resume, 2, more, [str(saved), str(elsewhere)])
    assert isinstance(theirs, ConfigError) and theirs.key == str(elsewhere) and "incomplete" in theirs.problem
    assert isinstance(mine, ConfigError) and mine.key == theirs.key and mine.fix == theirs.fix
    assert mine.problem == f"rank 1 could not read the checkpoint: {theirs.problem}"

    with zipfile.ZipFile(saved) as archive:  # a changed byte inside a weight: only rank 0's check of the content
        record = max(archive.infolist(), key=lambda info: info.file_size)
    with open(saved, "r+b") as f:
        f.seek(record.header_offset + 26)
        name_length, extra_length = struct.unpack("<HH", f.read(4))
        f.seek(name_length + extra_length + record.file_size // 2, os.SEEK_CUR)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    (_, mine, _), (_, theirs, _) = run_ranks(_open_for_resume, 2, more, [str(saved)] * 2)
    assert isinstance(mine, ConfigError) and "corrupted" in mine.problem
    assert isinstance(theirs, ConfigError) and theirs.problem == f"rank 0 could not read the checkpoint: {mine.problem}"


def test_a_cpu_run_leaves_the_cuda_generator_alone(monkeypatch):
    """Restoring a checkpoint's RNG states touches CUDA's only in a run on CUDA (else: a context on GPU 0)."""
    touched = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state: touched.append(state))
    state = {**checkpoint.rng_state(), "cuda": torch.zeros(16, dtype=torch.uint8)}
    checkpoint.set_rng_state(state, cuda=False)
    assert touched == []
    checkpoint.set_rng_state(state, cuda=True)
    assert len(touched) == 1


def test_a_resume_trains_with_the_optimizer_settings_it_is_given_not_the_checkpoint_s(tmp_path):
    """A resumed run's --set optim.* (recorded in its config.resumed file) is what its Adam uses."""
    from dist_helpers import train_in_process
    from test_distributed import SMALL_DCGAN

    from ganscale import config
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    settings = {**SMALL_DCGAN, "train.steps": 2, "checkpoint.every": 2}
    train_in_process(config.load(None, [f"{k}={v}" for k, v in settings.items()]), tmp_path)
    changed = {**settings, "train.steps": 4, "optim.d.lr": 0.01, "optim.g.betas": "[0.0, 0.9]",
               "optim.d.weight_decay": 0.001}
    runtime = start("cpu")
    try:
        trainer = Trainer(config.load(None, [f"{k}={v}" for k, v in changed.items()]), runtime, tmp_path,
                          checkpoint.latest(tmp_path))
    finally:
        runtime.close()
    assert trainer.step == 2  # resumed, with the optimizer state of the checkpoint and the settings given now
    (d_group,), (g_group,) = trainer.opt_d.param_groups, trainer.opt_g.param_groups
    assert (d_group["initial_lr"], d_group["weight_decay"], tuple(g_group["betas"])) == (0.01, 0.001, (0.0, 0.9))
    assert trainer.opt_d.state  # Adam's moments came back


def test_a_checkpoint_that_does_not_fit_names_the_first_tensor_that_differs(tmp_path):
    from dist_helpers import train_in_process
    from test_distributed import SMALL_DCGAN

    from ganscale import config
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    settings = {**SMALL_DCGAN, "train.steps": 2, "checkpoint.every": 2}
    train_in_process(config.load(None, [f"{k}={v}" for k, v in settings.items()]), tmp_path)
    wider = config.load(None, [f"{k}={v}" for k, v in {**settings, "train.steps": 4, "model.g_width": 32}.items()])

    def refusal() -> ConfigError:
        runtime = start("cpu")
        try:
            with pytest.raises(ConfigError) as refused:
                Trainer(wider, runtime, tmp_path, checkpoint.latest(tmp_path))
        finally:
            runtime.close()
        return refused.value

    refused = refusal()
    assert "does not fit this run's model/optimizer config" in refused.problem
    assert "size mismatch for " in refused.problem  # torch's first line alone named no tensor
    assert refused.fix.endswith(f"({tmp_path / 'config.yaml'})")  # the file it was written with
    resumed_config = tmp_path / "config.resumed-00000002.yaml"  # as a resume that changed the config writes it
    resumed_config.write_text((tmp_path / "config.yaml").read_text())
    assert refusal().fix.endswith(f"({resumed_config})")


# ------------------------------------------------------------------------------ crafted files run no code
class _Payload:
    """Pickles as a call of `call` with `argument`: what a crafted checkpoint would run as it is read."""

    def __init__(self, call, argument: str):
        self.call, self.argument = call, argument

    def __reduce__(self):
        return self.call, (self.argument,)


def _payloads(ran) -> list[_Payload]:
    """Three ways a pickle can run code, each creating the file `ran`."""
    import builtins

    return [_Payload(os.system, f"touch {ran}"), _Payload(builtins.exec, f"open({str(ran)!r}, 'w').close()"),
            _Payload(builtins.eval, f"open({str(ran)!r}, 'w')")]


def _craft(path, name: str, payload) -> None:
    """Replace file `name` of sharded checkpoint `path` by `payload` (.metadata: DCP's plain pickle, meta.pt:
    torch.save), with a completion marker that matches, as anyone who can write the one can write the other."""
    target = path / name
    target.unlink(missing_ok=True)
    target.write_bytes(pickle.dumps(payload)) if name == ".metadata" else torch.save(payload, target)
    _remark(path)


_SHARDS = {"G": {"model": {"w": torch.ones(8)}, "ema": {"w": torch.ones(8)}}, "D": {"model": {"w": torch.ones(2)}}}


@pytest.mark.parametrize("payload", range(3))
@pytest.mark.parametrize("name", [".metadata", checkpoint.META])
def test_a_crafted_sharded_checkpoint_is_refused_unread_and_the_previous_used(tmp_path, name, payload):
    run, ran = tmp_path / "run", tmp_path / "ran"
    with _one_rank(tmp_path):
        older = checkpoint.save_sharded(_SHARDS, _state(10), run, 10, keep=3)
        newest = checkpoint.save_sharded(_SHARDS, _state(20), run, 20, keep=3)
        _craft(newest, name, _payloads(ran)[payload])
        assert "unreadable: it holds more than tensors and plain data" in checkpoint.problem(newest)
        assert checkpoint.newest_valid(run) == older  # a resume, export, sample and eval take the older one
        with pytest.raises(ConfigError, match="unreadable"):
            checkpoint.load(newest)
        if name == ".metadata":  # every rank of a resume reads it, past the check of rank 0
            with pytest.raises(RuntimeError, match="refused"):
                checkpoint.load_sharded(newest, {"G": {"model": {"w": torch.zeros(8)}}})
    assert not ran.exists()


def test_a_crafted_non_tensor_item_in_a_shard_file_is_refused_unread(tmp_path):
    run, ran = tmp_path / "run", tmp_path / "ran"
    with _one_rank(tmp_path):  # DCP writes a non-tensor item with torch.save into the shard file
        path = checkpoint.save_sharded({**_SHARDS, "extra": _payloads(ran)[0]}, _state(10), run, 10, keep=3)
        with pytest.raises(RuntimeError, match="refused"):
            checkpoint.load_sharded(path, {"G": {"model": {"w": torch.zeros(8)}}, "extra": None})
    assert not ran.exists()


def test_a_sharded_checkpoint_whose_metadata_points_an_item_at_a_crafted_pickle_is_passed_over_unread(tmp_path, capsys):
    """Its .metadata and meta.pt were checked, not its non-tensor items: a resume failed in DCP's load, saying the
    networks had changed since."""
    from torch.distributed.checkpoint import FileSystemReader

    run, ran = tmp_path / "run", tmp_path / "ran"
    shards = {**_SHARDS, "G": {**_SHARDS["G"], "optim": {"param_groups": [{"lr": 0.5}]}}}  # lr: a non-tensor item
    with _one_rank(tmp_path):
        older = checkpoint.save_sharded(shards, _state(10), run, 10, keep=3)
        newest = checkpoint.save_sharded(shards, _state(20), run, 20, keep=3)
    metadata = FileSystemReader(str(newest)).read_metadata()  # written by this test: trusted
    torch.save(_payloads(ran)[0], newest / "crafted.distcp")  # pickled, never called
    (info,) = (info for index, info in metadata.storage_data.items() if index.fqn == "G.optim.param_groups.0.lr")
    info.relative_path, info.offset, info.length = "crafted.distcp", 0, (newest / "crafted.distcp").stat().st_size
    metadata.storage_meta = None
    (newest / ".metadata").write_bytes(pickle.dumps(metadata))
    _remark(newest)
    assert checkpoint.problem(newest).startswith("unreadable: it holds more than tensors and plain data, refused")
    assert checkpoint.problem(newest).endswith("it was not written by ganscale, or was altered")
    assert checkpoint.newest_valid(run) == older  # whose lr item is read as plainly
    assert f"skipping checkpoint {newest}: unreadable: it holds more than tensors" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="unreadable"):
        checkpoint.load(newest)
    assert not ran.exists()


def test_a_resume_whose_dcp_load_refuses_an_item_says_the_checkpoint_is_unreadable_not_that_the_networks_changed(
        tmp_path, monkeypatch):
    """Where rank 0's check did not see it (a file replaced after it): was 'does not fit the networks this run
    builds ... ganscale's dcgan networks changed since (another version)'."""
    from dist_helpers import train_in_process
    from test_distributed import SMALL_DCGAN
    from torch.distributed.checkpoint import FileSystemReader

    from ganscale import config
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    settings = [f"{k}={v}" for k, v in {**SMALL_DCGAN, "train.steps": 2, "checkpoint.every": 2,
                                        "checkpoint.format": "sharded"}.items()]
    train_in_process(config.load(None, settings), tmp_path)
    path, ran = checkpoint.latest(tmp_path), tmp_path / "ran"
    metadata = FileSystemReader(str(path)).read_metadata()  # written by this test: trusted
    torch.save(_payloads(ran)[0], path / "crafted.distcp")  # pickled, never called
    item = next(info for index, info in metadata.storage_data.items() if ".param_groups." in index.fqn)
    item.relative_path, item.offset, item.length = "crafted.distcp", 0, (path / "crafted.distcp").stat().st_size
    metadata.storage_meta = None
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _remark(path)
    monkeypatch.setattr(checkpoint, "_check_items", lambda path: None)  # as if replaced after rank 0 checked it
    runtime = start("cpu")
    try:
        with pytest.raises(ConfigError) as refused:
            Trainer(config.load(None, [*settings, "train.steps=4"]), runtime, tmp_path, path)
    finally:
        runtime.close()
    assert refused.value.key == str(path) and "does not fit" not in refused.value.problem
    assert refused.value.problem.startswith("this checkpoint cannot be used (unreadable: it holds more than tensors")
    assert refused.value.fix.startswith("it was not written by ganscale, or was altered: resume from another")
    assert not ran.exists()


def test_a_sharded_checkpoint_naming_shard_files_outside_its_folder_is_refused(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "run"
    with _one_rank(tmp_path):
        path = checkpoint.save_sharded(_SHARDS, _state(10), run, 10, keep=3)
    metadata = FileSystemReader(str(path)).read_metadata()  # written by this test: trusted
    for info in metadata.storage_data.values():
        info.relative_path = "../../../elsewhere.distcp"
    metadata.storage_meta = None
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    _remark(path)
    assert "shard outside the checkpoint" in checkpoint.problem(path)



def _remark(path) -> None:
    """A completion marker that matches what `path` now holds."""
    checkpoint.manifest_path(path).write_text(json.dumps(checkpoint._manifest(path, checkpoint.step_of(path))))


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("content, reason", [
    (b"not a checkpoint", "unreadable: "),
    (pickle.dumps({"step": 20}), "unreadable: "),  # a plain pickle: the right kind of object in neither format
    (pickle.dumps([1, 2])[:-3], "unreadable: "),  # cut short
], ids=["garbage", "plain-pickle", "cut-short"])
def test_an_intact_checkpoint_that_cannot_be_read_is_one_line_and_passed_over(tmp_path, capsys, sharded, content,
                                                                               reason):
    """Its bytes match its marker (anyone can write both): a resume falls back as for a truncated one."""
    run = tmp_path / "run"
    if sharded:
        with _one_rank(tmp_path):
            older = checkpoint.save_sharded(_SHARDS, _state(10), run, 10, keep=3)
            newest = checkpoint.save_sharded(_SHARDS, _state(20), run, 20, keep=3)
        (newest / ".metadata").write_bytes(content)
    else:
        older, newest = checkpoint.save(_state(10), run, 10, 3), checkpoint.save(_state(20), run, 20, 3)
        newest.write_bytes(content)
    _remark(newest)
    assert checkpoint.newest_valid(run) == older
    warning = capsys.readouterr().err
    assert f"skipping checkpoint {newest}: {reason}" in warning and warning.count("\n") == 2, warning
    with pytest.raises(ConfigError, match=reason) as refused:
        checkpoint.load(newest)
    assert "\n" not in str(refused.value) and "weights_only" not in str(refused.value)



@contextlib.contextmanager
def _within(seconds: int):
    """Fails the test, rather than hanging it, when the block takes longer (a read that never ends)."""
    import signal

    def hung(*_):
        raise AssertionError(f"still running after {seconds} s: a read blocked")

    signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


EMPTY = {"bytes": 0, "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}  # of b""


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("make, what", [(os.mkfifo, "a FIFO"), (lambda p: p.symlink_to("/dev/zero"),
                                                                 "a character device")], ids=["fifo", "dev-zero"])
def test_a_checkpoint_file_that_is_no_regular_file_is_named_and_passed_over_never_read(tmp_path, capsys, sharded,
                                                                                        make, what):
    """Its size (0) matched a marker of 0 bytes, and hashing it blocked (FIFO) or never ended (/dev/zero)."""
    run = tmp_path / "run"
    if sharded:
        with _one_rank(tmp_path):
            older = checkpoint.save_sharded(_SHARDS, _state(10), run, 10, keep=3)
            newest = checkpoint.save_sharded(_SHARDS, _state(20), run, 20, keep=3)
        member = next(newest.glob("*.distcp"))
    else:
        older, newest = checkpoint.save(_state(10), run, 10, 3), checkpoint.save(_state(20), run, 20, 3)
        member = newest
    member.unlink()
    make(member)
    marker = json.loads(checkpoint.manifest_path(newest).read_text())
    marker["files"][member.name] = EMPTY
    checkpoint.manifest_path(newest).write_text(json.dumps(marker))
    with _within(20):
        assert checkpoint.problem(newest) == f"not a regular file: {member.name} is {what}" + (
            " (named pipe)" if what == "a FIFO" else "")
        assert checkpoint.newest_valid(run) == older
        with pytest.raises(ConfigError, match="not a regular file"):
            checkpoint.load(newest)
    assert f"skipping checkpoint {newest}: not a regular file" in capsys.readouterr().err
    with _within(20), pytest.raises(OSError, match="not a regular file"):  # opened plainly, a FIFO waits for a writer
        checkpoint._sha256(member)


def test_a_completion_marker_too_large_for_ganscale_to_have_written_is_not_read_whole(tmp_path, capsys):
    """A sparse 1 TB marker was read whole: a MemoryError traceback."""
    run = tmp_path / "run"
    older, newest = checkpoint.save(_state(10), run, 10, 3), checkpoint.save(_state(20), run, 20, 3)
    os.truncate(checkpoint.manifest_path(newest), 1 << 40)  # sparse: no disk used
    assert "unreadable completion marker step-00000020.json (over 16 MiB" in checkpoint.problem(newest)
    assert checkpoint.newest_valid(run) == older
    assert f"skipping checkpoint {newest}: unreadable completion marker" in capsys.readouterr().err
    copy = tmp_path / "best.pt"  # a copy renamed with its marker: its step is read from the marker
    copy.write_bytes(older.read_bytes())
    checkpoint.manifest_path(copy).touch()
    os.truncate(checkpoint.manifest_path(copy), 1 << 40)
    assert checkpoint.step_of(copy) is None
    checkpoint.manifest_path(newest).unlink()
    os.mkfifo(checkpoint.manifest_path(newest))  # opened plainly, it would wait for a writer
    with _within(20):
        assert "unreadable completion marker step-00000020.json (step-00000020.json is a FIFO" in \
            checkpoint.problem(newest)


@pytest.mark.parametrize("make", [lambda p: p.write_bytes(pickle.dumps({"step": 20})), lambda p: p.write_bytes(b""),
                                  lambda p: p.symlink_to("/etc/passwd")], ids=["raw-pickle", "empty", "etc-passwd"])
def test_a_file_that_is_not_torch_s_is_said_to_be_so_in_one_line(tmp_path, capsys, make):
    """Was torch's 'mmap can only be used with files saved with torch.save(_use_new_zipfile_serialization=True)'."""
    run = tmp_path / "run"
    older, newest = checkpoint.save(_state(10), run, 10, 3), checkpoint.save(_state(20), run, 20, 3)
    newest.unlink()
    make(newest)
    _remark(newest)
    reason = "unreadable: step-00000020.pt is not a torch checkpoint file (torch.save writes a zip archive; this is " \
             "not one)"
    assert checkpoint.problem(newest) == reason
    assert checkpoint.newest_valid(run) == older
    assert "mmap" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="not a torch checkpoint file"):
        checkpoint.load(newest)


def test_a_checkpoint_of_the_wrong_kind_of_entry_says_which_not_missing(tmp_path):
    """A folder named step-N.pt was 'step-N.pt is missing'."""
    run = tmp_path / "run"
    checkpoint.save(_state(10), run, 10, 3)
    folder = checkpoint.checkpoint_dir(run)
    (folder / "step-00000020.pt").mkdir()
    (folder / "step-00000020.pt" / "step-00000020.pt").write_bytes(b"")  # what the marker names: not looked into
    (folder / "step-00000020.json").write_text(json.dumps({"step": 20, "files": {"step-00000020.pt": EMPTY}}))
    assert checkpoint.problem(folder / "step-00000020.pt") == "step-00000020.pt is a folder, not a checkpoint file"
    (folder / "step-00000030.dcp").write_bytes(b"")
    (folder / "step-00000030.json").write_text(json.dumps({"step": 30, "files": {".metadata": EMPTY}}))
    assert checkpoint.problem(folder / "step-00000030.dcp") == "step-00000030.dcp is not a folder, as a .dcp " \
                                                                 "checkpoint is"
    assert checkpoint.newest_valid(run) == folder / "step-00000010.pt"


@pytest.mark.slow
def test_resume_auto_passes_over_intact_checkpoints_that_cannot_be_read(tmp_path):
    """A malformed .dcp was an AttributeError traceback, an unloadable .pt eight lines of torch text and exit 2."""
    from test_cli import SHORT_RUN, explain, ganscale

    trained = ganscale("train", *SHORT_RUN, "--run-dir", "RUN", cwd=tmp_path)
    assert trained.returncode == 0, explain(trained)
    folder = checkpoint.checkpoint_dir(tmp_path / "RUN")
    (folder / "step-00000020.pt").write_bytes(b"PK\x03\x04 not a zip")
    malformed = folder / "step-00000025.dcp"
    malformed.mkdir()
    (malformed / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": None}))
    for path in (folder / "step-00000020.pt", malformed):
        _remark(path)
    resumed = ganscale("train", "--run-dir", "RUN", "--resume", "auto", "--set", "train.steps=30", cwd=tmp_path)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, explain(resumed)
    for skipped in ("step-00000025.dcp: unreadable: ValueError", "step-00000020.pt: unreadable: RuntimeError"):
        assert resumed.stderr.count(f"skipping checkpoint RUN/checkpoints/{skipped}") == 1, explain(resumed)
    assert resumed.stderr.count("the newest intact one") == 1, explain(resumed)  # said once, not per decision
    assert checkpoint.step_of(checkpoint.newest_valid(tmp_path / "RUN")) == 30



@pytest.mark.slow
def test_a_newest_checkpoint_of_another_recipe_is_refused_by_every_command_as_by_a_resume(tmp_path):
    from test_cli import SHORT_RUN, explain, ganscale

    for recipe, run in (("digits", "RUN"), ("ring8", "RING")):
        trained = ganscale("train", recipe, *SHORT_RUN, "--run-dir", run, cwd=tmp_path)
        assert trained.returncode == 0, explain(trained)
    # Newer than RUN's own, at the step its name says (a step-20 file named step-30 is refused for that alone).
    copied = checkpoint.checkpoint_dir(tmp_path / "RUN") / "step-00000030.pt"
    foreign = torch.load(tmp_path / "RING" / "checkpoints" / "step-00000020.pt", weights_only=True)
    torch.save({**foreign, "step": 30, "data_position": 30}, copied)
    _remark(copied)
    before = _files_under(tmp_path)
    for command in (["export", "--out", "g.safetensors"], ["sample", "--out", "g.png"], ["eval", "--samples", "10"],
                    ["train", "--resume", "auto", "--set", "train.steps=40"]):
        args = [command[0], *(["--run-dir"] if command[0] == "train" else []), "RUN", *command[1:]]
        refused = ganscale(*args, cwd=tmp_path)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, explain(refused)
        assert "RUN/checkpoints/step-00000030.pt" in refused.stderr.splitlines()[-1], explain(refused)
        assert "does not fit" in refused.stderr, explain(refused)
        assert _files_under(tmp_path) == before


@pytest.mark.slow
def test_no_command_runs_a_crafted_sharded_checkpoint_and_a_resume_passes_over_it(tmp_path):
    """In a run trained with the full format: the format is taken from the .dcp name."""
    from test_cli import SHORT_RUN, explain, ganscale

    trained = ganscale("train", "--nproc", "2", *SHORT_RUN, "--run-dir", "RUN", cwd=tmp_path)
    assert trained.returncode == 0, explain(trained)
    ran = tmp_path / "ran"
    crafted = tmp_path / "RUN" / "checkpoints" / "step-00000025.dcp"
    crafted.mkdir()
    _craft(crafted, ".metadata", _payloads(ran)[0])
    alone = tmp_path / "ALONE" / "checkpoints"
    alone.mkdir(parents=True)
    shutil.copytree(crafted, alone / crafted.name)
    shutil.copy(checkpoint.manifest_path(crafted), alone)
    commands = [["export", "--out", "g.safetensors"], ["sample", "--out", "g.png"], ["eval", "--samples", "10"]]
    for command in commands:
        used = ganscale(command[0], "RUN", *command[1:], cwd=tmp_path)
        assert used.returncode == 0 and f"skipping checkpoint RUN/checkpoints/{crafted.name}: unreadable" in \
            used.stderr, explain(used)
        assert "using checkpoint RUN/checkpoints/step-00000020.pt" in used.stderr, explain(used)
        refused = ganscale(command[0], "ALONE", *command[1:], "--force" if "--out" in command else "--seed=0",
                           cwd=tmp_path)
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, explain(refused)
        assert f"newest: {crafted.name}, unreadable" in refused.stderr.splitlines()[-1], explain(refused)
    resumed = ganscale("train", "--run-dir", "RUN", "--resume", "auto", "--nproc", "2", "--set", "train.steps=30",
                       "--set", "checkpoint.every=10", cwd=tmp_path)
    assert resumed.returncode == 0 and f"skipping checkpoint RUN/checkpoints/{crafted.name}" in resumed.stderr, \
        explain(resumed)
    assert "using checkpoint RUN/checkpoints/step-00000020.pt" in resumed.stderr, explain(resumed)
    assert checkpoint.step_of(checkpoint.newest_valid(tmp_path / "RUN")) == 30
    refused = ganscale("train", "--run-dir", "ALONE", "--resume", "auto", cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, explain(refused)
    assert not ran.exists()
