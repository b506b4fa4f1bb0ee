"""A folder of images (any PIL-readable format, searched recursively), resized and centre-cropped."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ganscale.config import ConfigError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff"}
# What PIL raises for a file it will not decode: OSError for most broken files, but its plugins also raise
# SyntaxError (a PNG chunk of a broken length), ValueError, EOFError, struct.error and zlib.error, and a header
# that claims more pixels than PIL's decompression-bomb limit (a 20000x20000 PNG) is none of those.
UNDECODABLE = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, Image.DecompressionBombError)


def in_mode(image: Image.Image, mode: str) -> Image.Image:
    """image.convert(mode), 16-bit grey (Pillow's I;16 and I modes) scaled into 8 bits first: convert clips it, so
    such an image came out all white. Floating-point pixels have no range to scale from: refused (OSError)."""
    if image.mode == "F":
        raise OSError("its pixels are floating-point numbers, which have no fixed range; save it with 8- or 16-bit "
                      "integer pixels")
    if image.mode.startswith("I"):
        wide = np.asarray(image, dtype=np.int64)
        if wide.size and (wide.min() < 0 or wide.max() > 65535):
            raise OSError("its 32-bit integer pixels go beyond 16 bits; save it with 8- or 16-bit pixels")
        image = Image.fromarray(np.round(wide / 257).astype(np.uint8), "L")  # 65535 -> 255
    return image.convert(mode)


class BadItem(Exception):
    """An item of the data set found bad while training reads it (bad input: exit 2, one line naming `key`).

    One message argument, so a DataLoader worker can raise it again in the main process; its text is then
    the worker's traceback, whose last line is the message. The key and the fix are the class's: they survive that."""

    key = "data.path"
    fix = "remove or replace the file"

    def problem(self) -> str:
        return str(self).strip().splitlines()[-1].split(f"{type(self).__name__}: ", 1)[-1]


class UnreadableImage(BadItem, OSError):
    """An image of the data set that does not decode."""


class ImageFolder(Dataset):
    def __init__(self, root: str | Path, resolution: int, channels: int = 3):
        self.root = Path(root)
        # Files only: a folder named like an image (holiday.jpg/) would fail to open mid-training (EISDIR).
        self.files = sorted(p for p in self.root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        if not self.files:
            raise ConfigError("data.path", f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {self.root}",
                              "point data.path at a folder that holds them")
        self.resolution, self.channels = resolution, channels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor]:
        path = self.files[index]
        try:
            with Image.open(path) as image:
                image = in_mode(image, {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}[self.channels])  # config allows 1..4
                side = min(image.size)
                left, top = (image.width - side) // 2, (image.height - side) // 2
                image = image.crop((left, top, left + side, top + side))
                image = image.resize((self.resolution, self.resolution), Image.Resampling.BICUBIC)
                array = np.asarray(image, dtype=np.float32)
        except UNDECODABLE as e:
            raise UnreadableImage(f"cannot read image {path}: {e}") from None
        pixels = torch.from_numpy(array).reshape(self.resolution, self.resolution, -1).permute(2, 0, 1)
        return (pixels / 127.5 - 1.0,)
