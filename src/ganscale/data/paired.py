"""Aligned image pairs in the pix2pix/facades layout: each file holds A and B side by side.

Per sample: split at w/2 (A left, B right), resize both halves to `load_size` x `load_size`
(bicubic), take the same random `crop_size` crop and the same random horizontal flip of both,
scale to [-1, 1] and return (input, target): (A, B) for direction "AtoB", (B, A) for "BtoA"
(facades: A is the photo and B the label map, so pix2pix trains BtoA).

Reproducible augmentation, whatever the world size or the number of loader workers: the crop
and flip of a draw come from `derive_seed(seed, position, index)`, never from a global RNG. The
key passed to `__getitem__` is either

- `(index, position)`: `position` is the draw's place in the sample stream of
  `data/stream.py` (global batch b, micro-step m, rank r, row j of the micro-batch:
  position = b * global_batch + (m * world + r) * micro_batch + j). The stream is the same
  sequence of indices for every world size, so 1 rank x 2b and 2 ranks x b crop and flip
  every sample identically, and a sample revisited in a later epoch gets a fresh crop.
  `_RankSampler.indices` computes exactly these positions; it should yield
  `list(zip(indices, positions))` for a data set with `keyed_by_position = True`.
- a plain `index`: position 0, so the same crop and flip every time (deterministic, for
  inspection and tests).

`augment=False` resizes straight to `crop_size` without crop or flip (evaluation, sample grids).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ganscale.config import ConfigError
from ganscale.data.folder import IMAGE_SUFFIXES, UNDECODABLE, UnreadableImage, in_mode
from ganscale.seeds import derive_seed

DIRECTIONS = ("AtoB", "BtoA")
ASPECT_TOLERANCE = 0.1  # width / height may be 2 +- 10 %: pairs are side by side, not stacked or single


def _to_tensor(image: Image.Image) -> torch.Tensor:
    array = np.asarray(image, dtype=np.float32)
    pixels = torch.from_numpy(array).reshape(image.height, image.width, -1).permute(2, 0, 1)
    return pixels / 127.5 - 1.0


class PairedImages(Dataset):
    """A folder of A|B images (directly in `root`, not in sub-folders) -> (input, target) in [-1, 1]."""

    keyed_by_position = True  # the stream should pass (index, position) keys, see the module docstring

    def __init__(self, root: str | Path, load_size: int = 286, crop_size: int = 256, direction: str = "AtoB",
                 seed: int = 0, augment: bool = True, channels: int = 3):
        if direction not in DIRECTIONS:
            raise ConfigError("data.direction", f"unknown direction {direction!r}",
                              "use AtoB (left half is the input) or BtoA (right half is the input; facades)")
        if crop_size > load_size:
            raise ConfigError("data.crop_size", f"crop_size {crop_size} exceeds load_size {load_size}",
                              "set data.load_size >= data.crop_size (pix2pix: 286 and 256)")
        if channels not in (1, 3):
            raise ConfigError("data.channels", f"{channels} channels", "paired images are read as 1 (grey) or 3 (RGB)")
        self.root = Path(root)
        self.files = self._list_files(self.root)
        for path in self.files:
            self._check_pair_shape(path)
        self.load_size, self.crop_size, self.direction = load_size, crop_size, direction
        self.seed, self.augment, self.mode = seed, augment, "RGB" if channels == 3 else "L"

    @staticmethod
    def _list_files(root: Path) -> list[Path]:
        if not root.is_dir():
            raise ConfigError("data.path", f"folder {root} does not exist",
                              "point data.path at a folder of A|B images (e.g. facades/train)")
        files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            subfolders = sorted(p.name for p in root.iterdir() if p.is_dir())
            hint = f"; it has sub-folders {', '.join(subfolders)}: point data.path at one of them" if subfolders else ""
            raise ConfigError("data.path", f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) directly in {root}{hint}",
                              "point data.path at the folder that holds the A|B images (e.g. facades/train)")
        return files

    @staticmethod
    def _check_pair_shape(path: Path) -> None:
        try:
            with Image.open(path) as image:  # reads the header only
                width, height = image.size
        except UNDECODABLE as e:
            raise ConfigError("data.path", f"cannot read image {path}: {e}", "remove or replace the file") from None
        if abs(width / (2 * height) - 1) > ASPECT_TOLERANCE:
            raise ConfigError("data.path", f"{path} is {width}x{height}, but a paired image holds A and B side by "
                              "side, so its width should be twice its height",
                              "remove the file or point data.path at a folder of A|B pairs")

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        index, position = (int(key[0]), int(key[1])) if isinstance(key, (tuple, list)) else (int(key), 0)
        a, b = self._read_halves(self.files[index])
        if self.augment:
            rng = np.random.default_rng(derive_seed(self.seed, position, index))
            slack = self.load_size - self.crop_size
            left, top = (int(v) for v in rng.integers(0, slack + 1, size=2))
            flip = bool(rng.random() < 0.5)
            box = (left, top, left + self.crop_size, top + self.crop_size)
            a, b = (self._crop_flip(h, self.load_size, box, flip) for h in (a, b))
        else:
            a, b = (h.resize((self.crop_size, self.crop_size), Image.Resampling.BICUBIC) for h in (a, b))
        a, b = _to_tensor(a), _to_tensor(b)
        return (a, b) if self.direction == "AtoB" else (b, a)

    def _read_halves(self, path: Path) -> tuple[Image.Image, Image.Image]:
        try:
            with Image.open(path) as image:
                image = in_mode(image, self.mode)
        except UNDECODABLE as e:
            raise UnreadableImage(f"cannot read image {path}: {e}") from None
        half = image.width // 2  # an odd width leaves the extra column to B, as the reference does
        return image.crop((0, 0, half, image.height)), image.crop((half, 0, image.width, image.height))

    @staticmethod
    def _crop_flip(half: Image.Image, load_size: int, box: tuple[int, int, int, int], flip: bool) -> Image.Image:
        half = half.resize((load_size, load_size), Image.Resampling.BICUBIC).crop(box)
        return half.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else half
