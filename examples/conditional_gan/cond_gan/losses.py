"""The non-saturating loss with one-sided label smoothing (Salimans et al. 2016): D aims at `real_target` for
real samples instead of 1. Functions of float32 logits, means over the batch."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


class SmoothedNonSaturating:
    def __init__(self, real_target: float = 0.9):
        self.real_target = real_target

    def d_loss(self, real: Tensor, fake: Tensor) -> Tensor:
        smoothed = F.binary_cross_entropy_with_logits(real, real.new_full(real.shape, self.real_target))
        return smoothed + F.softplus(fake).mean()

    def g_loss(self, fake: Tensor) -> Tensor:
        return F.softplus(-fake).mean()


smoothed = SmoothedNonSaturating(0.9)  # an instance the Python API can be given (examples/api/train.py)
