"""Synthetic facades: label-map / photo pairs in the facades file layout, made offline from a seed.

Each file is A|B side by side (default 512x256 JPEG, like facades): B is a label map of flat
colours (wall, windows on a grid of floors, balconies, a door, a cornice), A a "photo" that is a
deterministic function of B: every label gets a material colour plus shading and texture laid
out relative to its own rectangle (window frames and glazing bars, door panels, balcony bars,
the cornice's shadow, daylight fading down the wall). So B -> A is learnable exactly, as
facades' labels -> photo is approximately, and pix2pix's L1 falls within a short run.

The set is written into a temporary sibling folder and renamed into place, with a marker file
recording (n, seed, size), so a failure leaves nothing half-written and a second call with the
same arguments (another rank, a rerun) finds the set complete and returns at once. A previous set
with other arguments is replaced only while the folder holds nothing but that set's own files:
a file someone else put there is never deleted (the call is refused instead).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from ganscale.config import ConfigError
from ganscale.data.paired import ASPECT_TOLERANCE

MARKER = ".ganscale-synthetic-facades.json"
FORMAT_VERSION = 1

# label -> (flat colour in B, material colour in A)
WALL, WINDOW, DOOR, CORNICE, BALCONY = range(5)
LABEL_COLOURS = np.array([(30, 60, 200), (0, 200, 255), (200, 120, 0), (255, 80, 80), (80, 255, 120)], np.uint8)
MATERIAL_COLOURS = np.array([(196, 164, 132), (52, 70, 92), (92, 56, 32), (222, 216, 204), (38, 38, 44)], np.float32)
FRAME_COLOUR = np.array((236, 234, 226), np.float32)

MIN_HEIGHT, MAX_HEIGHT = 16, 4096  # the layout needs a few rows per floor; each file is painted in memory
SIZE_FIX = (f"use WIDTHxHEIGHT with an even width twice the height, height {MIN_HEIGHT} to {MAX_HEIGHT} "
            "(e.g. --size 512x256, facades' own; --size 128x64 for a quick set)")


def parse_size(text: str) -> tuple[int, int]:
    """`--size WIDTHxHEIGHT` of make-facades as (width, height), checked as `check_size` does."""
    width, sep, height = text.strip().lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit()):
        raise ConfigError("--size", f"{text!r} is not WIDTHxHEIGHT", SIZE_FIX)
    return check_size((int(width), int(height)))


def check_size(size: tuple[int, int]) -> tuple[int, int]:
    """Refuse, naming why, a size whose A|B files `PairedImages` (pix2pix's loader) would not take."""
    width, height = size
    shown = f"{width}x{height}"
    if width % 2:
        raise ConfigError("--size", f"{shown}: the width {width} is odd, but each file holds A and B side by side, "
                          "two halves of equal width", SIZE_FIX)
    if abs(width / (2 * max(height, 1)) - 1) > ASPECT_TOLERANCE:
        raise ConfigError("--size", f"{shown}: the paired loader (ganscale train pix2pix) takes only files about "
                          f"twice as wide as high (A|B, each half square), width/height "
                          f"{2 * (1 - ASPECT_TOLERANCE):.1f} to {2 * (1 + ASPECT_TOLERANCE):.1f}", SIZE_FIX)
    if height < MIN_HEIGHT:
        raise ConfigError("--size", f"{shown}: a height of {height} is too small for the facade layout", SIZE_FIX)
    if height > MAX_HEIGHT:
        raise ConfigError("--size", f"{shown}: a height of {height} is too large (each file is painted in memory; "
                          "pix2pix trains on 256x256 crops anyway)", SIZE_FIX)
    return width, height


def _rectangles(rng: np.random.Generator, width: int, height: int) -> list[tuple[int, int, int, int, int]]:
    """A facade layout: (label, top, left, bottom, right) rectangles that never overlap."""
    cornice = int(height * rng.uniform(0.05, 0.1))
    ground = int(height * rng.uniform(0.18, 0.25))
    floors, columns = int(rng.integers(3, 6)), int(rng.integers(2, 6))
    floor_h, column_w = (height - cornice - ground) / floors, width / columns
    window_h, window_w = floor_h * rng.uniform(0.45, 0.65), column_w * rng.uniform(0.35, 0.6)
    rects = [(CORNICE, 0, 0, cornice, width)]
    for floor in range(floors):
        top = cornice + floor * floor_h + (floor_h - window_h) / 2
        balcony = rng.random() < 0.3
        for column in range(columns):
            left = column * column_w + (column_w - window_w) / 2
            rects.append((WINDOW, round(top), round(left), round(top + window_h), round(left + window_w)))
            if balcony:  # a railing strip just below the window, a little wider than it
                rects.append((BALCONY, round(top + window_h) + 1, max(0, round(left) - 2),  # inside small canvases
                              round(top + window_h + floor_h * 0.12) + 1, min(width, round(left + window_w) + 2)))
    door_column = int(rng.integers(0, columns))
    door_w, door_h = column_w * rng.uniform(0.3, 0.55), ground * rng.uniform(0.65, 0.85)
    door_left = door_column * column_w + (column_w - door_w) / 2
    rects.append((DOOR, round(height - door_h), round(door_left), height, round(door_left + door_w)))
    return rects


def _paint_pair(rects: list[tuple[int, int, int, int, int]], width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """(photo A, label map B) as uint8 arrays; A depends only on the rectangles that B shows."""
    labels = np.full((height, width), WALL, np.uint8)
    rows = np.arange(height, dtype=np.float32)[:, None]
    daylight = 1.08 - 0.18 * rows / height  # the wall darkens towards the street
    photo = np.broadcast_to(MATERIAL_COLOURS[WALL] * daylight[..., None], (height, width, 3)).copy()
    for label, top, left, bottom, right in rects:
        labels[top:bottom, left:right] = label
        h, w = bottom - top, right - left
        v = np.linspace(0.0, 1.0, h, dtype=np.float32)[:, None, None]   # 0 at the rectangle's top
        u = np.linspace(0.0, 1.0, w, dtype=np.float32)[None, :, None]   # 0 at its left
        patch = np.broadcast_to(MATERIAL_COLOURS[label], (h, w, 3)).copy()
        if label == WINDOW:
            patch += 45 * (1 - v) * (1 - np.abs(2 * u - 1))  # sky reflection, strongest at the top centre
            frame = np.zeros((h, w), bool)
            frame[:2], frame[-2:], frame[:, :2], frame[:, -2:] = True, True, True, True
            frame[:, w // 2 - 1:(w + 1) // 2 + 1] = True          # vertical glazing bar, symmetric
            frame[int(h * 0.4):int(h * 0.4) + 2] = True           # transom
            patch[frame] = FRAME_COLOUR
        elif label == DOOR:
            patch *= 0.8 + 0.2 * v                                # shadowed under the lintel
            patch[:, w // 2 - 1:(w + 1) // 2 + 1] *= 0.6          # the seam between the two leaves
            patch[:3], patch[:, :2], patch[:, -2:] = FRAME_COLOUR * 0.7, FRAME_COLOUR * 0.7, FRAME_COLOUR * 0.7
        elif label == BALCONY:
            bars = (np.abs(np.arange(w) - (w - 1) / 2) % 4) < 1.5   # bars symmetric about the centre
            patch[:, ~bars] = MATERIAL_COLOURS[WALL] * 0.55          # the wall, in shadow, between bars
            patch[:2] = MATERIAL_COLOURS[BALCONY]                    # top rail
        elif label == CORNICE:
            patch *= 1.0 - 0.25 * v                                 # moulding lit from above
        photo[top:bottom, left:right] = patch
        if label == CORNICE and bottom + 4 <= height:
            photo[bottom:bottom + 4] *= 0.7                         # the cornice's shadow on the wall
    return np.clip(photo, 0, 255).round().astype(np.uint8), LABEL_COLOURS[labels]


def _write_pair(path: Path, seed: int, index: int, size: tuple[int, int]) -> None:
    width, height = size
    rng = np.random.default_rng(np.random.SeedSequence([seed, index]))  # image i is the same whatever n
    photo, labels = _paint_pair(_rectangles(rng, width // 2, height), width // 2, height)
    Image.fromarray(np.concatenate([photo, labels], axis=1)).save(path, "JPEG", quality=95, subsampling=0)


def _marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _wrote(marker: dict | None, name: str) -> bool:
    """Whether the synthetic set that left `marker` wrote the file `name` (its marker, 0000.jpg ... n-1)."""
    n = marker.get("n") if isinstance(marker, dict) and marker.get("kind") == "synthetic-facades" else None
    if not isinstance(n, int):
        return False
    stem, _, suffix = name.partition(".")
    return name == MARKER or (suffix == "jpg" and stem.isdigit() and name == f"{int(stem):04d}.jpg" and int(stem) < n)


def _refuse_foreign_files(folder: Path, previous: dict | None) -> None:
    """A previous set is replaced whole (its folder renamed away and deleted): refuse if anything else is in it."""
    foreign = sorted(p.name for p in folder.iterdir() if not (p.is_file() and _wrote(previous, p.name)))
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError("data.path", f"{folder} holds an earlier synthetic set and also files make-facades did not "
                          f"write ({shown}); replacing the set would delete them",
                          "move those files out, or choose another (empty or new) folder: nothing there is deleted")


ROOM_MARGIN = 1.2  # JPEG sizes vary from pair to pair: the first pair's size x n, and this much more


def _check_room(staging: Path, n: int) -> None:
    """Refuse (at --n) n pairs whose estimated size, from the first pair written, exceeds the disk's free space:
    --n 100000000 wrote until the disk was full."""
    pair = next(staging.iterdir()).stat().st_size
    needed, free = n * pair * ROOM_MARGIN, shutil.disk_usage(staging).free
    if needed > free:
        fits = max(1, int(free / (pair * ROOM_MARGIN)))
        raise ConfigError("--n", f"{n:,} pairs of about {pair:,} bytes need about {needed / 2**30:,.2f} GiB, more "
                          f"than the {free / 2**30:,.2f} GiB free on the disk of {staging.parent}",
                          f"write at most about {fits:,} (--n {fits}), or free space on that disk")


def write_synthetic_facades(folder: str | Path, n: int, seed: int, size: tuple[int, int] = (512, 256)) -> Path:
    """Write n synthetic A|B pairs `0000.jpg`, ... into `folder` (created); returns the folder.

    An existing set with the same (n, seed, size) is kept as it is; a previous synthetic set with
    other arguments is replaced when the folder holds nothing else; any other non-empty folder is refused.
    """
    folder = Path(folder)
    if n < 1:
        raise ConfigError("n", f"{n} pairs requested", "ask for at least one pair")
    width, height = check_size(size)
    wanted = {"kind": "synthetic-facades", "version": FORMAT_VERSION, "n": n, "seed": seed, "size": [width, height]}
    if folder.exists():
        if not folder.is_dir():
            raise ConfigError("data.path", f"{folder} is a file", "choose a folder path for the synthetic set")
        previous = _marker(folder)
        if previous == wanted:
            return folder
        if previous is None and any(folder.iterdir()):
            raise ConfigError("data.path", f"{folder} is not empty and holds no synthetic set ({MARKER} missing)",
                              "choose an empty or new folder: nothing there is overwritten")
        if previous is not None:
            _refuse_foreign_files(folder, previous)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.writing-", dir=folder.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's folder is private (0700); the set is a folder like any other
        for index in range(n):
            _write_pair(staging / f"{index:04d}.jpg", seed, index, (width, height))
            if index == 0:
                _check_room(staging, n)
        (staging / MARKER).write_text(json.dumps(wanted))  # last: its presence means the set is complete
        _move_into_place(staging, folder, wanted)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful rename
    return folder


def _move_into_place(staging: Path, folder: Path, wanted: dict) -> None:
    """Rename the finished set onto `folder`: absent, empty, or a previous synthetic set.

    Several processes (ranks) may write the same set at once: whoever finds it already in place
    keeps it, so a reader never sees the folder vanish.
    """
    previous = _marker(folder)
    if previous == wanted:
        return
    if previous is not None:
        _refuse_foreign_files(folder, previous)  # again: a file may have been added while the set was painted
        retired = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=folder.parent))
        os.replace(folder, retired / folder.name)
        shutil.rmtree(retired)
    try:
        os.replace(staging, folder)  # replaces an empty directory atomically
    except OSError:
        if _marker(folder) != wanted:  # another process may have finished the same set first
            raise
