"""`ganscale dataset create`: a folder of images -> a StyleGAN data set zip in NVlabs' layout (archive.py).

Each image's centre square is resized to the resolution, in grey or RGB, and stored as an uncompressed PNG in an
uncompressed zip (what NVlabs' tool writes: the loader decodes without inflating twice). With every image in a
sub-folder, the sorted sub-folder names are the classes 0, 1, ... of dataset.json; otherwise its labels are null.
"""

from __future__ import annotations

import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

from PIL import Image
from tqdm import tqdm

from ganscale.config import ConfigError
from ganscale.data.archive import LABELS_FILE, member_name
from ganscale.data.folder import IMAGE_SUFFIXES, UNDECODABLE, in_mode
from ganscale.models import stylegan2
from ganscale.outputs import check_output, write_output

GREY_MODES = {"1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "I;16N", "F"}  # what PIL opens a grey image as
# StyleGAN2's largest layout, the largest any ganscale model is built for: beyond it one image alone can exhaust
# memory (--resolution 1048576 was OOM-killed at 20 GB).
MAX_RESOLUTION = stylegan2.RESOLUTIONS[-1]


@dataclass
class Source:
    files: list[Path]
    class_names: list[str] | None  # the sorted sub-folder names; None: no labels
    labels: list[int] | None


def find_source(src: Path) -> Source:
    if not src.is_dir():
        raise ConfigError("SRC", f"'{src}' is not a folder", "give the folder of images to convert")
    files = sorted(p for p in src.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise ConfigError("SRC", f"no images ({', '.join(sorted(IMAGE_SUFFIXES))}) under {src}",
                          "give a folder that holds them (searched recursively)")
    folders = [p.relative_to(src).parts[0] if len(p.relative_to(src).parts) > 1 else None for p in files]
    if None in folders:
        return Source(files, None, None)
    class_names = sorted(set(folders))
    return Source(files, class_names, [class_names.index(folder) for folder in folders])


def check_resolution(resolution: int) -> None:
    if resolution < 4 or resolution & (resolution - 1):
        raise ConfigError("--resolution", f"{resolution} is not a power of two >= 4, which StyleGAN data sets are",
                          "use 32, 64, 128, 256, ...")
    if resolution > MAX_RESOLUTION:
        raise ConfigError("--resolution", f"{resolution} is beyond {MAX_RESOLUTION}, the largest resolution "
                          "StyleGAN2 trains at", f"use a power of two from 4 to {MAX_RESOLUTION}")


def _open(path: Path) -> Image.Image:
    try:
        return Image.open(path)
    except UNDECODABLE as e:
        raise ConfigError("SRC", f"cannot read image {path}: {e}", "remove or replace the file") from None


def all_grey(files: list[Path]) -> bool:
    """Every image is grey. Reads every header, so a file that is no image is named before anything is written."""
    modes = set()
    for path in files:
        with _open(path) as image:
            modes.add(image.mode)
    return modes <= GREY_MODES


def square(path: Path, resolution: int, mode: str) -> Image.Image:
    """The image's centre square resized to resolution x resolution, in `mode` (L or RGB). Cropped first, as NVlabs'
    tool does: resizing the whole image would blend pixels from outside the square into its edges."""
    with _open(path) as image:
        try:
            image = in_mode(image, mode)
        except UNDECODABLE as e:
            raise ConfigError("SRC", f"cannot read image {path}: {e}", "remove or replace the file") from None
        side = min(image.size)
        left, top = (image.width - side) // 2, (image.height - side) // 2
        return image.crop((left, top, left + side, top + side)).resize((resolution, resolution),
                                                                        Image.Resampling.LANCZOS)


def write_zip(target: Path, source: Source, resolution: int, mode: str, progress: bool = True) -> None:
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_STORED) as archive:
        for index, path in enumerate(tqdm(source.files, unit="img", disable=not progress, dynamic_ncols=True)):
            png = io.BytesIO()
            square(path, resolution, mode).save(png, format="png", compress_level=0, optimize=False)
            archive.writestr(member_name(index), png.getbuffer())
        labels = None if source.labels is None else [[member_name(i), c] for i, c in enumerate(source.labels)]
        archive.writestr(LABELS_FILE, json.dumps({"labels": labels}))


def create(src: str, dest: str, resolution: int, grey: bool | None, force: bool, progress: bool = True) -> Source:
    """Write the zip `dest` from the folder `src` (grey: None decides from the images). Checked before anything is
    written; written whole or not at all (outputs.write_output), never over a run's own files (outputs.check_output)."""
    target = check_output(dest, force, "DEST", suffixes=(".zip",))
    check_resolution(resolution)
    source = find_source(Path(src))
    source_grey = all_grey(source.files)  # every header read: a file that is no image is named here
    mode = "L" if (source_grey if grey is None else grey) else "RGB"
    write_output(target, lambda tmp: write_zip(tmp, source, resolution, mode, progress), "DEST")
    return source
