"""scikit-learn's bundled 8x8 digits (nothing to download) with their classes: items are (image, label), the image
a (1, 8, 8) tensor in [-1, 1]."""

from __future__ import annotations

import torch
from sklearn.datasets import load_digits
from torch.utils.data import Dataset


class LabelledDigits(Dataset):
    """The 1,797 digits, or only those of the first `n_classes` classes."""

    def __init__(self, n_classes: int = 10):
        digits = load_digits(n_class=n_classes)
        self.images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 8 - 1  # 0..16 -> [-1, 1]
        self.labels = torch.tensor(digits.target)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.images[index], int(self.labels[index])
