"""ADA and DiffAugment (ganscale.augment): each operation, per-sample seeding, and on real processes (gloo, CPU):
2 ranks augment and adapt p exactly as one process, and a resumed run goes on with the stopped run's p."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dist_helpers import max_relative_difference, run_ranks, train_and_collect
from ganscale import augment, config, preflight, randomness
from ganscale.config import ADA_OPERATIONS, ConfigError
from test_cli import clean_env

TOLERANCE = 1e-5  # as tests/test_distributed.py: max |difference| relative to each tensor's scale, fp32
POLICIES = ("color", "translation", "cutout")
SEEDS = torch.tensor([11, 12, 13, 14, 15, 16, 17, 18])


def _images(n: int = 8, channels: int = 3, size: int = 16) -> torch.Tensor:
    return torch.rand(n, channels, size, size, generator=torch.Generator().manual_seed(0)) * 2 - 1


def _ada(op: str, p: float = 1.0):
    return lambda x, seeds=SEEDS: augment.ada(x, p, (op,), 3, seeds[:len(x)])


def _diff(policy: str):
    return lambda x, seeds=SEEDS: augment.diffaugment(x, (policy,), 3, seeds[:len(x)])


OPERATIONS = {**{f"ada-{op}": _ada(op) for op in ADA_OPERATIONS},
              **{f"diffaugment-{policy}": _diff(policy) for policy in POLICIES}}


@pytest.mark.parametrize("name", sorted(OPERATIONS))
def test_each_operation_changes_images_and_passes_gradients(name):
    """At p=1 every operation changes the batch; its backward is the transpose of what it does (for fixed draws an
    augmentation is affine in the images: <v, J u> = <J^T v, u>, J u read off two forwards)."""
    apply = OPERATIONS[name]
    x = _images()
    y = apply(x)
    assert (y - x).abs().max() > 1e-2, f"{name} left the images as they were"
    u, v = torch.randn_like(x), torch.randn_like(y)
    forward = ((apply(x + u) - y) * v).sum()
    leaf = x.clone().requires_grad_(True)
    (apply(leaf) * v).sum().backward()
    backward = (leaf.grad * u).sum()
    assert leaf.grad.abs().sum() > 0, f"no gradient reaches the images through {name}"
    assert torch.allclose(forward, backward, rtol=1e-3, atol=1e-3), (name, forward.item(), backward.item())


@pytest.mark.parametrize("op", ADA_OPERATIONS)
def test_each_ada_operation_at_p_zero_is_the_identity(op):
    x = _images()
    assert torch.equal(augment.ada(x, 0.0, (op,), 3, SEEDS), x)
    assert torch.equal(augment.ada(x, 0.0, ADA_OPERATIONS, 3, SEEDS), x)


def test_ada_at_intermediate_p_augments_some_samples_and_leaves_others():
    """Each operation is drawn per sample with probability p: at p=0.3, some samples come out unchanged (up to the
    resampling's rounding), and others do not."""
    x = _images(64)
    seeds = torch.arange(64) * 7919 + 3
    y = augment.ada(x, 0.3, ("xflip", "rotate90", "xint", "brightness"), 3, seeds)
    changed = (y - x).flatten(1).abs().max(1).values > 1e-4
    assert 0 < int(changed.sum()) < 64


@pytest.mark.parametrize("kind", ["ada", "diffaugment"])
def test_a_sample_is_augmented_alike_alone_or_in_a_batch(kind):
    """The trainer's path: the seeds come from the micro-batch's latents (randomness.seeds_from), so sample 2 of a
    batch of 4 is augmented as that sample alone is; another sample is augmented otherwise."""
    cfg = config.load("digits", [f"augment.kind={kind}", "augment.p=1", "data.channels=3"])
    augmentation = augment.build_augmentation(cfg)
    x, z = _images(4), torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    with randomness.seeds_from(z):
        batch = augmentation(x)
    with randomness.seeds_from(z[2:3]):
        alone = augmentation(x[2:3])
    with randomness.seeds_from(z[1:2]):
        other_seed = augmentation(x[2:3])
    assert torch.equal(batch[2:3], alone)
    assert not torch.allclose(other_seed, alone)


@pytest.mark.parametrize("kind", ["ada", "diffaugment"])
def test_a_pair_is_augmented_together(kind):
    """pix2pix's D sees (input, output) concatenated on channels: both images get one and the same transform."""
    x = _images(8)
    pair = torch.cat([x, x], dim=1)
    y = (augment.ada(pair, 1.0, ADA_OPERATIONS, 3, SEEDS) if kind == "ada"
         else augment.diffaugment(pair, POLICIES, 3, SEEDS))
    assert torch.equal(y[:, :3], y[:, 3:])
    assert not torch.allclose(y[:, :3], x)


def test_ada_p_moves_towards_the_target_by_the_reals_judged_over_the_speed():
    cfg = config.load("digits", ["augment.kind=ada", "augment.target=0.6", "augment.speed_images=1000"])
    ada = augment.build_augmentation(cfg)  # batch 64: p moves by 2 x 64 / 1000 per interval of 2 D steps
    ada.adjust(0.9, False)
    ada.adjust(0.5, True)  # r_t = 0.7 > 0.6: overfitting, more augmentation
    assert ada.p == pytest.approx(0.128)
    ada.adjust(0.2, False)
    ada.adjust(float("nan"), True)  # a skipped step's sign is not counted: r_t = 0.2, 1 D step
    assert ada.p == pytest.approx(0.128 - 0.064)
    for _ in range(5):
        ada.adjust(-1.0, True)
    assert ada.p == 0.0  # kept in [0, 1]


# --------------------------------------------------------------------------------------------- in training
SMALL_ADA = {"model.z_dim": 16, "model.g_width": 16, "model.d_width": 16, "train.batch_size": 16,
             "train.steps": 5, "train.ema_half_life_images": 50, "log.every": 1, "log.sample_every": 0,
             "checkpoint.every": 0, "log.tensorboard": "false",
             # p starts at 0.5 and moves by 16 / 64 every step
             "augment.kind": "ada", "augment.p": 0.5, "augment.interval": 1, "augment.speed_images": 64}


def _augment_state(trainer):
    return lambda: trainer.augment.state_dict()


def _logged_p(run_dir) -> list[float]:
    return [json.loads(line)["augment_p"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_augment_and_adapt_p_as_one_process(tmp_path):
    """The digits DCGAN with ADA: weights within the tolerance of the distributed tests, p the same on both ranks
    and equal to one process's after every adjustment (logged each step); without ADA the run trains otherwise."""
    one = run_ranks(train_and_collect, 1, SMALL_ADA, str(tmp_path / "one"), _augment_state)[0]
    two = run_ranks(train_and_collect, 2, SMALL_ADA, str(tmp_path / "two"), _augment_state)
    assert two[0]["extra"] == two[1]["extra"] == one["extra"]
    p_one = _logged_p(tmp_path / "one")
    assert p_one == _logged_p(tmp_path / "two") and len(set(p_one)) > 1, p_one  # p moved, identically
    for net in ("G", "D", "G_ema"):
        diff = max_relative_difference(one[net], two[0][net])
        assert diff <= TOLERANCE, f"{net} differs by {diff:.2e} (relative)"
    plain = run_ranks(train_and_collect, 1, {**SMALL_ADA, "augment.kind": "none"}, str(tmp_path / "plain"))[0]
    assert max_relative_difference(one["D"], plain["D"]) > 1e-3  # the augmentation reached D


def _resume_probe(rank, world, overrides, root):
    from pathlib import Path

    from dist_helpers import resume_point

    root = Path(root)
    straight = train_and_collect(rank, world, {**overrides, "train.steps": 6}, str(root / "straight"),
                                 _augment_state)
    train_and_collect(rank, world, {**overrides, "train.steps": 3}, str(root / "stopped"))
    resume_from = resume_point({**overrides, "train.steps": 6}, str(root / "stopped"))
    resumed = train_and_collect(rank, world, {**overrides, "train.steps": 6}, str(root / "stopped"), _augment_state,
                                resume_from)
    return {"straight": straight, "resumed": resumed, "resumed_from": resume_from.name}


@pytest.mark.slow
def test_a_resumed_run_has_the_uninterrupted_runs_p_and_weights(tmp_path):
    """Stopped at step 3, in the middle of an interval of 2 (its signs so far are saved too), resumed to 6: the same
    p, and bitwise the same weights, as 6 straight steps, on 2 ranks."""
    overrides = {**SMALL_ADA, "augment.interval": 2, "checkpoint.every": 3}
    for result in run_ranks(_resume_probe, 2, overrides, str(tmp_path)):
        assert result["resumed_from"] == "step-00000003.pt"
        assert result["resumed"]["extra"] == result["straight"]["extra"]
        assert result["straight"]["extra"]["p"] != SMALL_ADA["augment.p"]
        for net in ("G", "D", "G_ema"):
            for key, value in result["straight"][net].items():
                assert torch.equal(value, result["resumed"][net][key]), f"{net}.{key}"


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("recipe, setting, key", [
    ("digits", "augment.policy=[color,mixup]", "augment.policy"),
    ("digits", "augment.target=1.0", "augment.target"),
    ("digits", "augment.target=0", "augment.target"),
    ("ring8", "augment.kind=ada", "augment.kind"),
])
def test_bad_augment_config_exits_2_with_one_line(tmp_path, recipe, setting, key):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", recipe, "--run-dir", str(run_dir),
                             "--set", "augment.kind=diffaugment", "--set", setting],
                            capture_output=True, text=True, timeout=120, env=clean_env())
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and f"'{key}'" in lines[0] and "Fix:" in lines[0], result.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("settings, key", [
    (["augment.kind=ada", "parallel.generator=pipeline", "parallel.discriminator=pipeline"], "augment.kind"),
    (["augment.kind=ada", "data.channels=4"], "augment.ada_ops"),
])
def test_augmentation_where_it_cannot_run_is_refused(settings, key):
    cfg = config.load("digits", settings)
    with pytest.raises(ConfigError) as refused:
        preflight.check(cfg, 2, False)
    assert refused.value.key == key
