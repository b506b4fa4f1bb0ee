"""Data sources and the world-size-independent batch order.

Every data source is a map-style `Dataset` of tensors in [-1, 1]. `GlobalBatches` decides which
samples form global batch i from the seed alone, then hands each rank its slice, so 1 rank x 2b
and 2 ranks x b see exactly the same samples at every step, and every rank gets the same number
of batches whatever the data set size (the stream runs on across epochs instead of ending unevenly).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, Subset, TensorDataset

from ganscale.config import Config, ConfigError
from ganscale.data.archive import ImageZip
from ganscale.data.custom import user_dataset
from ganscale.data.folder import ImageFolder
from ganscale.data.images import digits
from ganscale.data.mixtures import grid25, ring8
from ganscale.data.mnist import mnist
from ganscale.data.paired import PairedImages
from ganscale.data.stream import GlobalBatches, Slicing


SUBSET_SEED = 0  # StyleGAN's dataset seed: data.max_images picks the same items whatever train.seed is


def build_dataset(cfg: Config, whole: bool = False) -> Dataset:
    """The training data: data.max_images of the source's items (all with `whole`, or when unset)."""
    source = _source(cfg)
    return source if whole or cfg.data.max_images is None else subset(source, cfg.data.max_images, cfg.data.kind)


def subset(dataset: Dataset, n: int, kind: str) -> Dataset:
    """A seeded, fixed choice of n items, in their order in the source; in-memory data stays in memory."""
    if n > len(dataset):
        raise ConfigError("data.max_images", f"{n} is more than the {len(dataset)} items of data.kind={kind}",
                          f"set data.max_images to at most {len(dataset)}, or leave it unset for all")
    chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(SUBSET_SEED))[:n].sort().values
    if isinstance(dataset, TensorDataset):
        return TensorDataset(*(t[chosen] for t in dataset.tensors))
    return Subset(dataset, chosen.tolist())


def _source(cfg: Config) -> Dataset:
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
