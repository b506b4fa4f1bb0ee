"""In-memory image data: scikit-learn's bundled 8x8 digits (ships with the package, no download)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

# Inside the scikit-learn package: 64 pixels (0-16) and the class per row. Read with numpy, as load_digits does:
# importing sklearn.datasets costs more than a short training run (over a second per process).
DIGITS_CSV = ("datasets", "data", "digits.csv.gz")


def packaged_file(package: str, parts: tuple[str, ...]) -> Path | None:
    """A data file inside an installed package, found without importing it; None where it is not installed."""
    spec = importlib.util.find_spec(package)
    return Path(spec.submodule_search_locations[0]).joinpath(*parts) if spec and spec.submodule_search_locations \
        else None


def labelled_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits, (N, 1, 8, 8) scaled from 0..16 to [-1, 1], and their classes 0-9 (int64)."""
    path = packaged_file("sklearn", DIGITS_CSV)
    if path is None:
        raise ModuleNotFoundError("scikit-learn, whose 8x8 digits data.kind=digits reads, is not installed "
                                  "(pip install scikit-learn)")
    rows = np.loadtxt(path, delimiter=",")
    images = torch.tensor(rows[:, :-1], dtype=torch.float32).reshape(-1, 1, 8, 8) / 8.0 - 1.0
    return images, torch.tensor(rows[:, -1], dtype=torch.int64)


def digits(resolution: int = 8, channels: int = 1, labels: bool = False) -> TensorDataset:
    """(images,) or, with `labels`, (images, classes 0-9 as int64)."""
    images, classes = labelled_digits()
    if resolution != 8:
        images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", align_corners=False).clamp(-1, 1)
    images = images.expand(-1, channels, -1, -1).contiguous()
    if labels:
        return TensorDataset(images, classes)
    return TensorDataset(images)
