"""In-memory image data: scikit-learn's bundled 8x8 digits (ships with the package, no download)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def digits(resolution: int = 8, channels: int = 1, labels: bool = False) -> TensorDataset:
    """(images,) or, with `labels`, (images, classes 0-9 as int64)."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1)  # (1797, 1, 8, 8), 0..16
    images = images / 8.0 - 1.0
    if resolution != 8:
        images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False).clamp(-1, 1)
    images = images.expand(-1, channels, -1, -1).contiguous()
    if labels:
        return TensorDataset(images, torch.tensor(bunch.target, dtype=torch.int64))
    return TensorDataset(images)
