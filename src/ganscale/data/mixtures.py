"""2D Gaussian mixtures of the VEEGAN / PacGAN protocol.

ring8: 8 modes at (cos 2 pi i/8, sin 2 pi i/8), std 0.01. grid25: 25 modes at {-4,-2,0,2,4}^2, std 0.05.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import TensorDataset


def ring8_modes() -> torch.Tensor:
    angles = torch.arange(8, dtype=torch.float64) * (2 * math.pi / 8)  # not linspace(0, 2 pi, 8): 7 distinct
    return torch.stack([angles.cos(), angles.sin()], 1).float()


def grid25_modes() -> torch.Tensor:
    axis = torch.arange(-4.0, 5.0, 2.0)
    return torch.cartesian_prod(axis, axis)


MIXTURE_MODES = {"ring8": ring8_modes, "grid25": grid25_modes}  # data.kind -> its modes


def sample_mixture(modes: torch.Tensor, std: float, n: int, generator: torch.Generator) -> torch.Tensor:
    which = torch.randint(len(modes), (n,), generator=generator)
    return modes[which] + std * torch.randn(n, modes.shape[1], generator=generator)


def ring8(n: int, seed: int = 0) -> TensorDataset:
    return TensorDataset(sample_mixture(ring8_modes(), 0.01, n, torch.Generator().manual_seed(seed)))


def grid25(n: int, seed: int = 0) -> TensorDataset:
    return TensorDataset(sample_mixture(grid25_modes(), 0.05, n, torch.Generator().manual_seed(seed)))
