"""A small CNN classifier of scikit-learn's 8x8 digits; its penultimate layer gives the features of FD-digits.

Domain-specific Frechet distance (features of a classifier trained on the same domain, as TF-GAN's
MNIST Frechet distance uses) needs no download: `ganscale fit-digits-features --out PATH` trains it
in seconds on the CPU, deterministically from a seed, and the package ships the result
(`ganscale/assets/digits_classifier.safetensors`, with its held-out accuracy in the metadata).
"""

from __future__ import annotations

import json
import time
from importlib import resources
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ganscale.config import ConfigError

FORMAT = "ganscale-digits-classifier-v1"
SHIPPED = "assets/digits_classifier.safetensors"  # inside the ganscale package
CLASSES = 10


class DigitsClassifier(nn.Module):
    """(N, 1, 8, 8) in [-1, 1] -> 10 logits; `features` is the `feature_dim` ReLU layer before them."""

    def __init__(self, width: int = 16, feature_dim: int = 128):
        super().__init__()
        self.width, self.feature_dim = width, feature_dim
        self.body = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 4x4
            nn.Conv2d(2 * width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 2x2
            nn.Flatten(), nn.Linear(2 * width * 4, feature_dim), nn.ReLU(),
        )
        self.head = nn.Linear(feature_dim, CLASSES)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        return self.body(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))


def labelled_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits scaled to [-1, 1] exactly as the `digits` data source scales them, and their labels."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 8.0 - 1.0
    return images, torch.tensor(bunch.target, dtype=torch.long)


def held_out_split(n: int, seed: int, test_fraction: float = 0.2) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_test = round(n * test_fraction)
    return order[n_test:], order[:n_test]


@torch.no_grad()
def accuracy(model: DigitsClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    return float((model.eval()(images).argmax(1) == labels).double().mean())


def fit(seed: int = 0, epochs: int = 20, batch_size: int = 64, lr: float = 1e-3) -> tuple[DigitsClassifier, dict]:
    """Train on 80% of the digits (a seeded split); returns the model and its record (held-out accuracy, ...).

    Runs on one CPU thread: the result is then the same bit for bit whatever the machine's thread count
    (multi-threaded kernels sum in another order), and this tiny network is no faster on more threads.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _fit(seed, epochs, batch_size, lr)
    finally:
        torch.set_num_threads(threads)


def _fit(seed: int, epochs: int, batch_size: int, lr: float) -> tuple[DigitsClassifier, dict]:
    started = time.perf_counter()
    images, labels = labelled_digits()
    train_idx, test_idx = held_out_split(len(labels), seed)
    torch.manual_seed(seed)  # initialisation
    model = DigitsClassifier()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    order = torch.Generator().manual_seed(seed + 1)
    for _ in range(epochs):
        model.train()
        for batch in train_idx[torch.randperm(len(train_idx), generator=order)].split(batch_size):
            loss = F.cross_entropy(model(images[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    record = {"format": FORMAT, "seed": seed, "epochs": epochs, "batch_size": batch_size, "lr": lr,
              "width": model.width, "feature_dim": model.feature_dim, "train_images": len(train_idx),
              "test_images": len(test_idx), "train_accuracy": accuracy(model, images[train_idx], labels[train_idx]),
              "test_accuracy": accuracy(model, images[test_idx], labels[test_idx]),
              "fit_seconds": round(time.perf_counter() - started, 2)}
    return model.eval(), record


def save(model: DigitsClassifier, record: dict, path: Path) -> Path:
    from ganscale.outputs import write_output

    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    metadata = {k: json.dumps(v) for k, v in record.items()}
    return write_output(Path(path), lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def shipped_path() -> Path:
    return Path(str(resources.files("ganscale").joinpath(SHIPPED)))


def load(path: Path | None = None) -> tuple[DigitsClassifier, dict]:
    """The classifier (eval mode) and its record, from `path` or the file shipped with the package."""
    path = Path(path) if path else shipped_path()
    if not path.is_file():
        raise ConfigError("--digits-weights", f"digits classifier weights not found at {path}",
                          f"write them with `ganscale fit-digits-features --out {path}`")
    with safe_open(str(path), framework="pt") as f:
        record = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if record.get("format") != FORMAT:
        raise ConfigError("--digits-weights", f"{path} is not a ganscale digits classifier (format "
                          f"{record.get('format')!r}, expected {FORMAT!r})",
                          "write one with `ganscale fit-digits-features --out PATH`")
    model = DigitsClassifier(record["width"], record["feature_dim"])
    model.load_state_dict(tensors)
    return model.eval(), record
