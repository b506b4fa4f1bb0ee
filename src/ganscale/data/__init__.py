"""Data sources and the world-size-independent batch order.

Every data source is a map-style `Dataset` of tensors in [-1, 1]. `GlobalBatches` decides which
samples form global batch i from the seed alone, then hands each rank its slice, so 1 rank x 2b
and 2 ranks x b see exactly the same samples at every step, and every rank gets the same number
of batches whatever the data set size (the stream runs on across epochs instead of ending unevenly).
"""

from __future__ import annotations

from torch.utils.data import Dataset

from ganscale.config import Config
from ganscale.data.archive import ImageZip
from ganscale.data.custom import user_dataset
from ganscale.data.folder import ImageFolder
from ganscale.data.images import digits
from ganscale.data.mixtures import grid25, ring8
from ganscale.data.mnist import mnist
from ganscale.data.paired import PairedImages
from ganscale.data.stream import GlobalBatches, Slicing


def build_dataset(cfg: Config) -> Dataset:
    d = cfg.data
    if d.kind == "digits":
        return digits(d.resolution, d.channels, d.labels)
    if d.kind == "mnist":
        return mnist(d.resolution, d.channels, d.labels)
    if d.kind == "zip":
        return ImageZip(d.path, d.resolution, d.channels, cfg.model.n_classes if d.labels else None)
    if d.kind == "ring8":
        return ring8(d.size, seed=cfg.train.seed)
    if d.kind == "grid25":
        return grid25(d.size, seed=cfg.train.seed)
    if d.kind == "custom":
        return user_dataset(cfg)
    if d.kind == "paired":
        return PairedImages(d.path, d.load_size, d.resolution, d.direction, seed=cfg.train.seed, channels=d.channels)
    return ImageFolder(d.path, d.resolution, d.channels)


__all__ = ["build_dataset", "GlobalBatches", "Slicing", "ImageFolder", "ImageZip", "PairedImages"]
