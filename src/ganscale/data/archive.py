"""StyleGAN's data set format (data.kind=zip), read and checked: an uncompressed zip of same-sized square images
with an optional `dataset.json` of class labels, as NVlabs' dataset_tool writes it and their loader reads it.

Layout: image i is `{i:08d}[:5]/img{i:08d}.png` (00000/img00000000.png), the images are taken in sorted name
order, and dataset.json is {"labels": [[name, class], ...]} or {"labels": null}.
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from ganscale.config import ConfigError
from ganscale.data.folder import UNDECODABLE, UnreadableImage, in_mode

# A member that is not a readable image: PIL's errors, a broken zip, an encrypted member (RuntimeError) or one
# compressed by a method zipfile lacks (NotImplementedError: Deflate64, for one).
UNREADABLE_MEMBER = (*UNDECODABLE, zipfile.BadZipFile, RuntimeError, NotImplementedError)
LABELS_FILE = "dataset.json"
ZIP_SUFFIXES = (".png", ".jpg", ".jpeg")
MODES = {1: "L", 2: "LA", 3: "RGB", 4: "RGBA"}  # data.channels -> PIL mode (the config allows 1..4)
CREATE = "make one with `ganscale dataset create SRC DEST.zip --resolution R`"


def member_name(index: int) -> str:
    """The name NVlabs' dataset_tool gives image `index` in the zip."""
    digits = f"{index:08d}"
    return f"{digits[:5]}/img{digits}.png"


def _problem(path: Path, problem: str, fix: str) -> ConfigError:
    return ConfigError("data.path", f"{path}: {problem}", fix)


def _why_unreadable(error: Exception) -> str:
    """Why a member is no image: Pillow's own text names the stream object it read from, not the member."""
    return "Pillow does not recognise its format" if isinstance(error, UnidentifiedImageError) else str(error)


def open_zip(path: Path) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise _problem(path, "not a zip file", f"point data.path at a StyleGAN data set zip, or {CREATE}") from None
    except OSError as e:
        raise _problem(path, f"cannot be read ({e.strerror or e})", "check the path and its permissions") from None


def image_names(archive: zipfile.ZipFile, path: Path) -> list[str]:
    names = sorted(n for n in archive.namelist() if n.lower().endswith(ZIP_SUFFIXES))
    if not names:
        raise _problem(path, f"the zip holds no images ({', '.join(ZIP_SUFFIXES)})", CREATE)
    return names


def image_side(archive: zipfile.ZipFile, path: Path, names: list[str]) -> int:
    """The one side length of every image (each header read, no pixels decoded)."""
    sizes: dict[tuple[int, int], str] = {}
    for name in names:
        try:
            with archive.open(name) as member, Image.open(member) as image:
                sizes.setdefault(image.size, name)
        except UNREADABLE_MEMBER as e:
            raise _problem(path, f"member {name} is not a readable image ({_why_unreadable(e)})",
                           "remove or replace it") from None
        if len(sizes) > 1:
            (first, first_name), (other, other_name) = sizes.items()
            raise _problem(path, f"images of mixed sizes: {first_name} is {first[0]}x{first[1]}, {other_name} is "
                           f"{other[0]}x{other[1]}", f"make every image the same size: {CREATE}")
    ((width, height), name), = sizes.items()
    if width != height:
        raise _problem(path, f"images are not square ({name} is {width}x{height})", f"crop them square: {CREATE}")
    return width


def read_labels(archive: zipfile.ZipFile, path: Path, names: list[str]) -> list[int] | None:
    """Each image's class from dataset.json, in `names` order; None when there is no file or its labels are null."""
    if LABELS_FILE not in archive.namelist():
        return None
    fix = f'write {LABELS_FILE} as {{"labels": [["00000/img00000000.png", 3], ...]}} naming every image once'
    try:
        labels = json.loads(archive.read(LABELS_FILE))["labels"]
    except (ValueError, KeyError, TypeError, zipfile.BadZipFile, RuntimeError, NotImplementedError) as e:
        raise _problem(path, f"{LABELS_FILE} is not a JSON object with a 'labels' list ({e})", fix) from None
    if labels is None:
        return None
    if not isinstance(labels, list) or not all(isinstance(x, list) and len(x) == 2 for x in labels):
        raise _problem(path, f"{LABELS_FILE}'s labels are not a list of [file name, class] pairs", fix)
    by_name = {str(name).replace("\\", "/"): label for name, label in labels}  # NVlabs' tool, run on Windows
    missing, extra = sorted(set(names) - set(by_name)), sorted(set(by_name) - set(names))
    if missing or extra or len(by_name) != len(labels):
        what = (f"no label for {missing[0]}" if missing else f"a label for {extra[0]}, which is not an image of the zip"
                if extra else "a file named twice")
        raise _problem(path, f"{LABELS_FILE}'s labels do not match the images ({len(labels)} labels, {len(names)} "
                       f"images; {what})", fix)
    classes = [by_name[name] for name in names]
    if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in classes):
        raise _problem(path, f"{LABELS_FILE}'s labels are not all class indices (integers >= 0)",
                       "ganscale trains on class indices, not label vectors: give each image its class number")
    return classes


def _classes_named(classes: list[int]) -> str:
    """'3', '3 and 4', '3 to 9' or '1, 4 and 6'."""
    if len(classes) > 2 and classes == list(range(classes[0], classes[-1] + 1)):
        return f"{classes[0]} to {classes[-1]}"
    return str(classes[0]) if len(classes) == 1 else ", ".join(map(str, classes[:-1])) + f" and {classes[-1]}"


class ImageZip(Dataset):
    """A StyleGAN data set zip: (image,) or, with `classes` (model.n_classes), (image, class). Images in [-1, 1],
    converted to `channels`. Everything is checked here, before training; each process (every DataLoader worker)
    opens the zip for itself on its first read, so no open file is shared across a fork."""

    def __init__(self, path: str | Path, resolution: int, channels: int, classes: int | None = None):
        self.path, self.channels = Path(path), channels
        with open_zip(self.path) as archive:
            self.names = image_names(archive, self.path)
            side = image_side(archive, self.path, self.names)
            labels = read_labels(archive, self.path, self.names) if classes is not None else None
        if side != resolution:
            raise _problem(self.path, f"the images are {side}x{side}, not data.resolution={resolution}",
                           f"set data.resolution={side}, or make a zip of {resolution} px with "
                           f"`ganscale dataset create SRC DEST.zip --resolution {resolution}`")
        self.labels = None if classes is None else self._classes(labels, classes)
        self._archive: zipfile.ZipFile | None = None
        self._opened_by: int | None = None

    def _classes(self, labels: list[int] | None, classes: int) -> torch.Tensor:
        if labels is None:
            raise _problem(self.path, f"data.labels=true, but the zip has no class labels ({LABELS_FILE} missing or "
                           "its labels null)", "set data.labels=false (and an unconditional model), or make the zip "
                           "from a folder with one sub-folder per class")
        if max(labels) >= classes:
            raise ConfigError("model.n_classes", f"{self.path} has class {max(labels)}, but model.n_classes={classes}",
                              f"set model.n_classes={max(labels) + 1}")
        # G draws every class uniformly: one without real images is a class D learns to call fake whatever G does.
        missing = sorted(set(range(classes)) - set(labels))
        if missing:
            fix = (f"set model.n_classes={max(labels) + 1}" if missing[0] > max(labels) else
                   f"number the zip's classes 0 to {len(set(labels)) - 1} without gaps (one sub-folder per class)")
            raise ConfigError("model.n_classes", f"{self.path} has no images of class {_classes_named(missing)} of "
                              f"model.n_classes={classes}, which G would be trained to draw", fix)
        return torch.tensor(labels, dtype=torch.int64)

    def __getstate__(self) -> dict:  # a spawned worker gets no open file; it opens its own
        return {**self.__dict__, "_archive": None, "_opened_by": None}

    def _zip(self) -> zipfile.ZipFile:
        if self._opened_by != os.getpid():  # first read in this process (a forked worker inherits the parent's)
            self._archive, self._opened_by = zipfile.ZipFile(self.path), os.getpid()
        return self._archive

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        name = self.names[index]
        try:
            with Image.open(io.BytesIO(self._zip().read(name))) as image:
                array = np.asarray(in_mode(image, MODES[self.channels]), dtype=np.float32)
        except UNREADABLE_MEMBER as e:
            raise UnreadableImage(f"cannot read image {name} of {self.path}: {_why_unreadable(e)}") from None
        pixels = torch.from_numpy(array).reshape(*array.shape[:2], -1).permute(2, 0, 1) / 127.5 - 1.0
        return (pixels,) if self.labels is None else (pixels, self.labels[index])
