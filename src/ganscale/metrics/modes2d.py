"""2D Gaussian-mixture quality measures of the VEEGAN / PacGAN protocol.

The protocol is defined in VEEGAN (Srivastava et al., NeurIPS 2017, section 5.1) and reused by
PacGAN (Lin et al., NeurIPS 2018, section 4): draw ``PROTOCOL_SAMPLES`` points from the
generator; a point is *high quality* when it lies within 3 standard deviations (Euclidean
distance) of its nearest mode; a mode is *captured* when it is the nearest mode of at least one
high-quality point; and the *reverse KL* is KL(generated mode histogram || uniform over modes),
where the histogram counts high-quality points by their nearest mode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ganscale.data.mixtures import grid25_modes, ring8_modes

PROTOCOL_SAMPLES = 2500
HQ_STDS = 3.0  # a sample within this many std of its nearest mode is high quality

_NAMED = {
    "ring8": (ring8_modes, 0.01),
    "grid25": (grid25_modes, 0.05),
}


@dataclass(frozen=True)
class MixtureScore:
    modes_captured: int
    total_modes: int
    high_quality: float  # fraction in [0, 1]
    reverse_kl: float  # nats; inf when no sample is high quality
    samples: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "modes_captured": self.modes_captured,
            "high_quality_pct": 100.0 * self.high_quality,
            "reverse_kl": self.reverse_kl,
            "samples": self.samples,
        }


def score_mixture(samples: torch.Tensor, modes: torch.Tensor, std: float) -> MixtureScore:
    """Score 2D ``samples`` (N, 2) against mixture ``modes`` (M, 2) of common ``std``.

    - high_quality: share of samples whose Euclidean distance to the nearest mode is <= 3 * std.
    - modes_captured: number of modes that are the nearest mode of at least one HQ sample.
    - reverse_kl: KL(p || uniform) = sum over modes with p > 0 of p * log(p * M), where p is the
      histogram of HQ samples by nearest mode, normalised to sum to 1. It is 0 when all modes are
      equally hit and log(M) when one mode takes every HQ sample.

    Convention: when no sample is high quality (including N == 0) the histogram is undefined and
    reverse_kl is ``float('inf')`` (worse than any attainable value, whose maximum is log(M));
    high_quality is then 0.0 and modes_captured 0.

    Computed in float64, vectorised with ``torch.cdist``; ties in the nearest mode go to the
    lower mode index (argmin).
    """
    if samples.ndim != 2 or samples.shape[1] != 2:
        raise ValueError(f"samples must have shape (N, 2), got {tuple(samples.shape)}")
    if modes.ndim != 2 or modes.shape[1] != 2 or modes.shape[0] == 0:
        raise ValueError(f"modes must have shape (M, 2) with M >= 1, got {tuple(modes.shape)}")
    if not std > 0:
        raise ValueError(f"std must be positive, got {std}")

    x = samples.detach().to(device="cpu", dtype=torch.float64)
    mu = modes.detach().to(device="cpu", dtype=torch.float64)
    n, m = x.shape[0], mu.shape[0]
    if n == 0:
        return MixtureScore(0, m, 0.0, float("inf"), 0)

    # compute_mode: exact distances, not the matmul shortcut (which loses precision near 0).
    dist = torch.cdist(x, mu, compute_mode="donot_use_mm_for_euclid_dist")  # (N, M)
    nearest_dist, nearest = dist.min(dim=1)
    hq = nearest_dist <= HQ_STDS * std  # NaN samples compare False: never HQ
    n_hq = int(hq.sum())
    counts = torch.bincount(nearest[hq], minlength=m).to(torch.float64)
    captured = int((counts > 0).sum())

    if n_hq == 0:
        reverse_kl = float("inf")
    else:
        p = counts / n_hq
        nz = p > 0
        reverse_kl = float((p[nz] * torch.log(p[nz] * m)).sum())
        reverse_kl = max(reverse_kl, 0.0)  # clamp rounding below 0 for an exactly uniform histogram

    return MixtureScore(
        modes_captured=captured,
        total_modes=m,
        high_quality=n_hq / n,
        reverse_kl=reverse_kl,
        samples=n,
    )


def score_named(kind: str, samples: torch.Tensor) -> MixtureScore:
    """Score ``samples`` against the named mixture: "ring8" (std 0.01) or "grid25" (std 0.05)."""
    if kind not in _NAMED:
        raise ValueError(f"unknown mixture kind {kind!r}; expected one of {sorted(_NAMED)}")
    modes_fn, std = _NAMED[kind]
    return score_mixture(samples, modes_fn(), std)
