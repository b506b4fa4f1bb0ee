"""Checkpoint integrity: completion marker, checksum, fallback to the newest intact one."""

from __future__ import annotations

import pytest
import torch

from ganscale import checkpoint
from ganscale.config import ConfigError


def _two_checkpoints(run_dir):
    for step in (10, 20):
        checkpoint.save({"step": step, "w": torch.full((256,), float(step))}, run_dir, step, keep=3)
    return checkpoint.checkpoint_dir(run_dir)


def test_intact_checkpoints_load_and_the_newest_is_used(tmp_path):
    folder = _two_checkpoints(tmp_path)
    assert checkpoint.newest_valid(tmp_path) == folder / "step-00000020.pt"
    assert checkpoint.load(folder / "step-00000020.pt")["step"] == 20
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000010.json", "step-00000010.pt",
                                                        "step-00000020.json", "step-00000020.pt"]


@pytest.mark.parametrize("damage, reason", [
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "corrupted"),
    (lambda p: checkpoint.manifest_path(p).unlink(), "incomplete"),
])
def test_a_damaged_newest_checkpoint_is_reported_and_the_previous_used(tmp_path, capsys, damage, reason):
    folder = _two_checkpoints(tmp_path)
    newest = folder / "step-00000020.pt"
    damage(newest)
    assert checkpoint.newest_valid(tmp_path) == folder / "step-00000010.pt"
    warning = capsys.readouterr().err
    assert str(newest) in warning and reason in warning
    with pytest.raises(ConfigError, match=reason):
        checkpoint.load(newest)


def test_keep_prunes_checkpoints_and_their_markers(tmp_path):
    for step in (1, 2, 3, 4):
        checkpoint.save({"step": step}, tmp_path, step, keep=2)
    names = sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir())
    assert names == ["step-00000003.json", "step-00000003.pt", "step-00000004.json", "step-00000004.pt"]
