"""The VEEGAN / PacGAN 2D mixture measures: modes captured, high-quality share, reverse KL."""

from __future__ import annotations

import math

import pytest
import torch

from ganscale.data.mixtures import grid25_modes, ring8_modes, sample_mixture
from ganscale.metrics.modes2d import PROTOCOL_SAMPLES, MixtureScore, score_mixture, score_named

KINDS = {"ring8": (ring8_modes, 0.01), "grid25": (grid25_modes, 0.05)}


def _at_modes(modes: torch.Tensor, which: list[int], repeat: int) -> torch.Tensor:
    return modes.double()[torch.tensor(which).repeat_interleave(repeat)]


def test_protocol_sample_count():
    assert PROTOCOL_SAMPLES == 2500


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_true_mixture_scores_perfectly(kind):
    modes_fn, std = KINDS[kind]
    modes = modes_fn()
    x = sample_mixture(modes, std, PROTOCOL_SAMPLES, torch.Generator().manual_seed(0))
    s = score_named(kind, x)
    assert s.samples == PROTOCOL_SAMPLES
    assert s.total_modes == len(modes)
    assert s.modes_captured == len(modes)
    # An isotropic 2D Gaussian lies within 3 std (Euclidean) with probability 1 - e^-4.5 ~ 0.9889,
    # so a 99% floor would be wrong for the true mixture; 0.01 is ~4.7 binomial sd at n = 2500.
    assert abs(s.high_quality - (1 - math.exp(-4.5))) < 0.01
    assert 0.0 <= s.reverse_kl < 0.05


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_single_mode_collapse(kind):
    modes_fn, _ = KINDS[kind]
    modes = modes_fn()
    s = score_named(kind, _at_modes(modes, [3], 500))
    assert s.modes_captured == 1
    assert s.high_quality == 1.0
    assert s.reverse_kl == pytest.approx(math.log(len(modes)), abs=1e-9)


def test_half_the_ring_equally():
    s = score_named("ring8", _at_modes(ring8_modes(), [0, 2, 4, 6], 100))
    assert s.modes_captured == 4
    assert s.high_quality == 1.0
    assert s.reverse_kl == pytest.approx(math.log(2), abs=1e-9)


def test_histogram_counts_only_high_quality_samples():
    # 3 HQ at mode 0, 1 HQ at mode 1, 4 far from every mode: p = (3/4, 1/4) over the HQ samples.
    modes = ring8_modes()
    x = torch.cat([_at_modes(modes, [0, 0, 0, 1], 1), torch.zeros(4, 2, dtype=torch.float64)])
    s = score_mixture(x, modes, 0.01)
    assert s.samples == 8
    assert s.modes_captured == 2
    assert s.high_quality == 0.5
    expected = 0.75 * math.log(0.75 * 8) + 0.25 * math.log(0.25 * 8)
    assert s.reverse_kl == pytest.approx(expected, abs=1e-9)


def test_far_from_every_mode():
    s = score_named("ring8", torch.zeros(100, 2))
    assert s.modes_captured == 0
    assert s.high_quality == 0.0
    assert s.reverse_kl == float("inf")  # documented convention when no sample is HQ
    assert s.as_dict()["high_quality_pct"] == 0.0


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_three_std_boundary(kind):
    modes_fn, std = KINDS[kind]
    modes = modes_fn().double()
    angles = torch.linspace(0, 2 * math.pi, 13, dtype=torch.float64)[:-1]
    unit = torch.stack([angles.cos(), angles.sin()], 1)
    k = 5
    inside = modes[k] + 2.9 * std * unit
    outside = modes[k] + 3.1 * std * unit
    s_in = score_named(kind, inside)
    assert (s_in.modes_captured, s_in.high_quality) == (1, 1.0)
    s_out = score_named(kind, outside)
    assert (s_out.modes_captured, s_out.high_quality) == (0, 0.0)
    s_mix = score_named(kind, torch.cat([inside, outside]))
    assert s_mix.high_quality == 0.5


def test_uses_euclidean_not_per_axis_distance():
    # 2.5 std along each axis: within 3 std per coordinate, but 2.5 * sqrt 2 ~ 3.54 std away.
    modes = grid25_modes()
    x = modes[12:13].double() + 2.5 * 0.05 * torch.ones(1, 2, dtype=torch.float64)
    assert score_mixture(x, modes, 0.05).high_quality == 0.0


def test_float32_and_float64_agree():
    x = sample_mixture(grid25_modes(), 0.05, 1000, torch.Generator().manual_seed(1))
    assert score_named("grid25", x) == score_named("grid25", x.double())


def test_as_dict():
    s = MixtureScore(modes_captured=7, total_modes=8, high_quality=0.25, reverse_kl=0.1, samples=2500)
    assert s.as_dict() == {"modes_captured": 7, "high_quality_pct": 25.0, "reverse_kl": 0.1, "samples": 2500}


def test_unknown_kind_is_named():
    with pytest.raises(ValueError, match="ring9"):
        score_named("ring9", torch.zeros(4, 2))


def test_bad_shapes_rejected():
    with pytest.raises(ValueError):
        score_mixture(torch.zeros(4, 3), ring8_modes(), 0.01)
    with pytest.raises(ValueError):
        score_mixture(torch.zeros(4, 2), torch.zeros(0, 2), 0.01)
