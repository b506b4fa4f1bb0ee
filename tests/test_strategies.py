"""Per-network strategies (issue 3, first slice: zero1): each trains exactly as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_helpers import max_relative_difference, run_ranks, train_and_collect
from test_distributed import SMALL_MLP, TOLERANCE

pytestmark = pytest.mark.slow

# Four equal hidden layers per network: ZeRO-1 shards whole tensors, so equal ones split evenly.
MLP_ADAM = {**SMALL_MLP, "model.g_width": 64, "model.d_width": 64, "model.g_layers": 5, "model.d_layers": 5}


def _with_state_bytes(rank, world, overrides, run_dir):
    from ganscale.parallel import optimizer_state_bytes

    def hook(trainer):
        return lambda: {"G": optimizer_state_bytes(trainer.opt_g), "D": optimizer_state_bytes(trainer.opt_d)}
    return train_and_collect(rank, world, overrides, run_dir, steps_hook=hook)


@pytest.mark.parametrize("generator, discriminator", [("zero1", "ddp"), ("ddp", "zero1"), ("zero1", "zero1")])
def test_zero1_on_two_ranks_equals_one_process(tmp_path, generator, discriminator):
    one = run_ranks(_with_state_bytes, 1, MLP_ADAM, str(tmp_path / "one"))[0]
    two = run_ranks(_with_state_bytes, 2, {**MLP_ADAM, "parallel.generator": generator,
                                          "parallel.discriminator": discriminator}, str(tmp_path / "two"))
    for rank in two:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(one[net], rank[net]) <= TOLERANCE, net
    # Optimizer state held per rank: a sharded network holds at most 0.55x of the full state.
    for net, strategy in (("G", generator), ("D", discriminator)):
        held = [rank["extra"][net] for rank in two]
        if strategy == "zero1":
            assert max(held) <= 0.55 * one["extra"][net], (net, held, one["extra"][net])
        else:
            assert held == [one["extra"][net]] * 2


def _stop_and_resume(rank, world, first, second, root):
    """Train `first` (world size of this call) to step 10, then hand back the checkpoint path."""
    from ganscale import checkpoint

    root = Path(root)
    train_and_collect(rank, world, first, str(root / "stopped"))
    return checkpoint.latest(root / "stopped")


def _resume_from(rank, world, overrides, run_dir, path):
    return train_and_collect(rank, world, overrides, run_dir, resume=Path(path))


def test_zero1_checkpoint_resumes_under_ddp_on_one_rank(tmp_path):
    zero = {**MLP_ADAM, "parallel.generator": "zero1", "parallel.discriminator": "zero1", "checkpoint.every": 10}
    straight = run_ranks(train_and_collect, 1, {**MLP_ADAM, "train.steps": 20}, str(tmp_path / "straight"))[0]
    path = run_ranks(_stop_and_resume, 2, {**zero, "train.steps": 10}, None, str(tmp_path))[0]
    resumed = run_ranks(_resume_from, 1, {**MLP_ADAM, "train.steps": 20}, str(tmp_path / "stopped"), str(path))[0]
    for net in ("G", "D", "G_ema"):
        assert max_relative_difference(straight[net], resumed[net]) <= TOLERANCE, net
