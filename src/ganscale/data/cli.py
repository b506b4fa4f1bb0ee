"""`ganscale dataset ...`: data set tools."""

from __future__ import annotations

import click

from ganscale.config import ConfigError


@click.group()
def dataset() -> None:
    """Data set tools: make a StyleGAN data set zip (data.kind=zip)."""


@dataset.command()
@click.argument("src")
@click.argument("dest")
@click.option("--resolution", type=int, required=True, help="Side length of the square images (a power of two).")
@click.option("--grayscale/--rgb", "grey", default=None,
              help="Grey or RGB images (default: grey when every source image is grey).")
@click.option("--force", is_flag=True, help="Replace DEST if it exists (never a run's checkpoints or config).")
def create(src: str, dest: str, resolution: int, grey: bool | None, force: bool) -> None:
    """Make the StyleGAN data set DEST.zip from the folder SRC (searched recursively), in NVlabs' layout.

    Each image's centre square is resized to --resolution. When every image lies in a sub-folder of SRC, the
    sub-folders are the classes (sorted names: 0, 1, ...) and dataset.json holds each image's class; train
    with data.kind=zip, data.path=DEST (and data.labels=true for a class-conditional model)."""
    from ganscale.cli import _fail
    from ganscale.data import create as creating

    try:
        source = creating.create(src, dest, resolution, grey, force)
    except ConfigError as e:
        _fail(e)
    classes = "no labels" if source.class_names is None else "classes " + ", ".join(
        f"{index}={name}" for index, name in enumerate(source.class_names))
    click.echo(f"wrote {dest}: {len(source.files)} images of {resolution}x{resolution}, {classes}")
