"""PacGAN packing (model.pack) and maxout units (model.d_maxout) in the MLP discriminator."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dist_helpers import max_relative_difference, run_ranks, train_and_collect
from ganscale import config, preflight
from ganscale.config import ConfigError
from ganscale.models import build_networks
from ganscale.models.mlp import MLPDiscriminator

TOLERANCE = 1e-5  # as in test_distributed.py: max |difference| relative to each tensor's scale, fp32

SMALL_PACKED = {"model.kind": "mlp", "data.kind": "ring8", "data.size": 500, "model.z_dim": 4, "model.g_width": 32,
                "model.d_width": 32, "model.g_layers": 2, "model.d_layers": 2, "model.g_batchnorm": "false",
                "model.pack": 4, "model.d_maxout": 3, "loss.r1_gamma": 1.0, "train.batch_size": 16, "train.steps": 4,
                "log.every": 100, "log.sample_every": 0, "checkpoint.every": 0, "log.tensorboard": "false"}


# ------------------------------------------------------------------------------------------ the network
@pytest.mark.parametrize("maxout", [0, 5])
def test_packed_d_gives_one_logit_per_pack_that_depends_on_every_member(maxout):
    torch.manual_seed(0)
    pack, batch = 4, 12
    D = MLPDiscriminator(2, 16, 3, pack=pack, maxout=maxout)
    assert D.net[0].in_features == pack * 2
    x = torch.randn(batch, 2)
    logits = D(x)
    assert logits.shape == (batch // pack, 1)
    for member in range(batch):
        moved = x.clone()
        moved[member] += 0.5
        changed = (D(moved) - logits).abs().flatten() > 1e-6
        assert changed.tolist() == [i == member // pack for i in range(batch // pack)], member
    # one pack judged alone gives the same logit as inside the batch
    torch.testing.assert_close(D(x[4:8]), logits[1:2])


def test_maxout_takes_the_max_of_each_group_of_pieces():
    D = MLPDiscriminator(2, 3, 1, maxout=2)
    assert D.net[0].out_features == 6
    h = torch.arange(12.0).view(2, 6) * torch.tensor([1.0, -1.0] * 3)
    assert D.net[1](h).tolist() == [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]


def test_unpacked_d_is_unchanged_by_the_new_options():
    base = config.load("ring8", ["model.pack=1", "model.d_maxout=0"])
    _, D = build_networks(base)
    torch.manual_seed(0)
    reference = MLPDiscriminator(2, base.model.d_width, base.model.d_layers)
    assert D.state_dict().keys() == reference.state_dict().keys()
    assert isinstance(D.net[1], torch.nn.LeakyReLU)


# ------------------------------------------------------------------------------------- refused configs
@pytest.mark.parametrize("recipe, overrides, world, key, hint", [
    ("digits", ["model.pack=2"], 1, "model.pack", "model.kind=mlp"),  # a DCGAN D
    ("digits", ["model.d_maxout=5"], 1, "model.d_maxout", "model.kind=mlp"),
    ("ring8", ["model.pack=3"], 1, "model.pack", "divisor of 256"),  # the recipe's batch of 256
    ("ring8", ["model.pack=4", "train.batch_size=8"], 4, "model.pack", "divisor of 2"),  # 2 samples per rank
    ("ring8", ["model.pack=4", "train.batch_size=24", "train.micro_batch=6"], 2, "model.pack", "train.micro_batch"),
    ("ring8", ["model.pack=2", "loss.kind=wgan-gp", "loss.r1_gamma=0"], 1, "model.pack", "wgan-gp"),
    ("ring8", ["model.pack=2", "parallel.generator=pipeline", "parallel.discriminator=pipeline", "loss.r1_gamma=0"],
     2, "model.pack", "pipeline"),
    ("ring8", ["model.d_maxout=1"], 1, "model.d_maxout", "model.d_maxout=0"),
])
def test_bad_pack_is_refused_naming_the_option_and_the_fix(recipe, overrides, world, key, hint):
    cfg = config.load(recipe, overrides)
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, world, False)
    assert info.value.key == key, str(info.value)
    assert hint in str(info.value)


def test_pack_zero_is_refused():
    with pytest.raises(ConfigError) as info:
        config.load("ring8", ["model.pack=0"])
    assert info.value.key == "model.pack"


@pytest.mark.slow
def test_bad_pack_exits_2_from_the_command_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "ring8", "--set", "model.pack=3",
                             "--run-dir", "X"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "model.pack" in result.stderr and "Fix:" in result.stderr
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------ 2 ranks == 1 rank
@pytest.mark.slow
def test_packed_d_with_r1_two_ranks_with_accumulation_equal_one_rank(tmp_path):
    """Packs are formed inside each rank's micro-batch, so 2 ranks x 2 micro-steps of 4 samples (one pack of
    reals and one of fakes each) train as 1 rank x 16, R1 included."""
    one = run_ranks(train_and_collect, 1, {**SMALL_PACKED, "train.micro_batch": 16}, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, {**SMALL_PACKED, "train.micro_batch": 4}, str(tmp_path / "two"))
    assert two[0]["summary"]["accumulation_steps"] == 2
    assert one["D"]["net.0.weight"].shape[1] == 8  # the packed input: 4 samples x 2 coordinates
    for rank in two:
        for net in ("G", "D", "G_ema"):
            diff = max_relative_difference(one[net], rank[net])
            assert diff <= TOLERANCE, f"{net} differs by {diff:.2e} (relative)"
