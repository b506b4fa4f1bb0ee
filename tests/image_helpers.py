"""Image files that tests need to be hostile."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from PIL import Image


def write_decompression_bomb_png(path: Path, side: int = 20000) -> None:
    """A small PNG whose header claims side x side pixels (20000 x 20000 is over PIL's decompression-bomb limit):
    an 8x8 image with its IHDR's size (and CRC) rewritten, so nothing large is ever written or decoded."""
    Image.new("RGB", (8, 8)).save(path)
    data = bytearray(path.read_bytes())
    ihdr = data.index(b"IHDR")  # 4-byte type, 13-byte body, then its CRC over type and body
    data[ihdr + 4:ihdr + 12] = struct.pack(">II", side, side)
    data[ihdr + 17:ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr:ihdr + 17])))
    path.write_bytes(bytes(data))


def write_noise_pngs(folder: Path, n: int, side: int = 16) -> Path:
    """n seeded RGB noise PNGs of side x side in `folder` (made if missing): a data set too small for some uses."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    for index in range(n):
        pixels = np.random.default_rng(index).integers(0, 256, (side, side, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index}.png")
    return folder


def write_nvlabs_zip(path: Path, images: list[Image.Image], labels: list[int] | None = None) -> list[str]:
    """A StyleGAN data set zip laid out as NVlabs' dataset_tool writes one (uncompressed zip, uncompressed PNGs
    named 00000/img00000000.png, dataset.json last), built here without ganscale. Returns the member names."""
    import io
    import json
    import zipfile

    names = []
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as archive:
        for index, image in enumerate(images):
            digits = f"{index:08d}"
            names.append(f"{digits[:5]}/img{digits}.png")
            png = io.BytesIO()
            image.save(png, format="png", compress_level=0, optimize=False)
            archive.writestr(names[-1], png.getbuffer())
        entries = None if labels is None else [[name, label] for name, label in zip(names, labels)]
        archive.writestr("dataset.json", json.dumps({"labels": entries}))
    return names
