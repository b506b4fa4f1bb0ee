"""Feature extractors for image metrics: images (N, C, H, W) in [-1, 1] -> features (N, D).

Pluggable: anything with a `name`, a `device` and `__call__(images) -> (N, D)` works with
`ganscale.metrics.images`. Shipped: `digits` and `mnist` (the package's own digit classifiers, any
resolution and channel count, resized to 8x8 or 32x32 grey) and `inception` (Inception-v3 pool features
from a weights file the user supplies; nothing is ever downloaded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from ganscale.config import ConfigError
from ganscale.metrics import digits_classifier

EXTRACTORS = ("digits", "mnist", "inception")


class FeatureExtractor(Protocol):
    name: str
    device: torch.device

    def __call__(self, images: torch.Tensor) -> torch.Tensor: ...


class DigitsFeatures:
    """Penultimate layer (128 features) of a shipped digit classifier (`dataset` digits or mnist); inputs
    become grey at the classifier's side (8 or 32) first."""

    def __init__(self, weights: Path | None = None, device: torch.device | str = "cpu", dataset: str = "digits"):
        self.name, self.device = dataset, torch.device(device)
        model, self.record = digits_classifier.load(weights, dataset)
        self.model = model.to(self.device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        grey = images.to(self.device, torch.float32).mean(1, keepdim=True)  # RGB -> grey: the classifier saw grey
        side = self.model.side
        if grey.shape[-2:] != (side, side):
            grey = F.interpolate(grey, size=(side, side), mode="bilinear", align_corners=False, antialias=True)
        return self.model.features(grey.clamp(-1, 1))


INCEPTION_FILES = ("pt_inception-2015-12-05-6726825d.pth (pytorch-fid's release 'fid_weights')",
                   "weights-inception-2015-12-05-6726825d.pth (torch-fidelity's release 'v0.2.0')")


def inception_features(weights: str | Path | None, device: torch.device | str = "cpu",
                       preprocess: str = "pytorch-fid") -> FeatureExtractor:
    """The FID Inception-v3 from a local weights file; a ConfigError says which file and where to put it."""
    how = ("download one of " + " or ".join(INCEPTION_FILES) + " on a machine with internet access, copy it "
           "here, and pass --inception-weights PATH (ganscale never downloads weights)")
    if weights is None:
        raise ConfigError("--inception-weights", "--features inception needs a local Inception-v3 weights file", how)
    if not Path(weights).is_file():
        raise ConfigError("--inception-weights", f"no file at {weights}", how)
    from ganscale.metrics.inception import InceptionFeatures

    return InceptionFeatures(Path(weights), device, preprocess)


def build_extractor(name: str, device: torch.device | str = "cpu", inception_weights: str | Path | None = None,
                    digits_weights: str | Path | None = None,
                    inception_preprocess: str = "pytorch-fid") -> FeatureExtractor:
    if name in digits_classifier.DATASETS:  # digits_weights: a refitted classifier of that data set
        return DigitsFeatures(Path(digits_weights) if digits_weights else None, device, name)
    if name == "inception":
        return inception_features(inception_weights, device, inception_preprocess)
    raise ConfigError("--features", f"unknown feature extractor {name!r}", f"use one of {', '.join(EXTRACTORS)}")
