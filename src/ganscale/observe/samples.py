"""PNG pictures of G's output: image grids, or scatter plots for 2D data."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw


def image_grid(images: torch.Tensor, min_cell: int = 32, cols: int | None = None) -> np.ndarray:
    """(N, C, H, W) in [-1, 1] -> (H', W', 3) uint8 grid (`cols` wide, default square), cells upscaled
    to at least `min_cell` pixels."""
    n, c, h, w = images.shape
    cols, rows, zoom = _layout(images.shape, cols, min_cell)
    pixels = ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    if c < 3:  # grey (and grey + alpha): show the grey channel
        pixels = pixels[:, :1].expand(-1, 3, -1, -1)
    pixels = pixels[:, :3]
    pixels = pixels.repeat_interleave(zoom, 2).repeat_interleave(zoom, 3)
    h, w = h * zoom, w * zoom
    grid = torch.zeros(3, rows * (h + 2) + 2, cols * (w + 2) + 2, dtype=torch.uint8)
    for i in range(n):
        r, col = divmod(i, cols)
        grid[:, 2 + r * (h + 2):2 + r * (h + 2) + h, 2 + col * (w + 2):2 + col * (w + 2) + w] = pixels[i]
    return grid.permute(1, 2, 0).numpy()


def _layout(shape: torch.Size, cols: int | None, min_cell: int) -> tuple[int, int, int]:
    """(columns, rows, zoom) of the grid of `shape` (N, C, H, W) images."""
    n, _, h, w = shape
    # Never wider than its images: 4 samples of a class-conditional G (8 a row) are one row of 4, not 4 blank cells.
    cols = min(cols or math.ceil(math.sqrt(n)), max(n, 1))
    return cols, math.ceil(n / cols), max(1, math.ceil(min_cell / max(h, w)))


def grid_pixels(shape: torch.Size, cols: int | None = None, min_cell: int = 32) -> int:
    """Pixels of the picture `image_grid` makes of `shape` images."""
    _, _, h, w = shape
    cols, rows, zoom = _layout(shape, cols, min_cell)
    return (rows * (h * zoom + 2) + 2) * (cols * (w * zoom + 2) + 2)


def grid_bytes(shape: torch.Size, cols: int | None = None, min_cell: int = 32) -> int:
    """Bytes `image_grid` holds at once for `shape` images: the zoomed cells (twice, in the making), the grid."""
    n, _, h, w = shape
    zoom = _layout(shape, cols, min_cell)[2]
    return 2 * n * 3 * h * zoom * w * zoom + 3 * grid_pixels(shape, cols, min_cell)


def scatter(points: torch.Tensor, reference: torch.Tensor | None = None, size: int = 384) -> np.ndarray:
    """2D points (N, 2) as a white PNG canvas; optional reference points (mode centres) in red."""
    pts = points.float().cpu()
    extent = float(pts.abs().max().clamp(min=1.0)) * 1.15
    if reference is not None:
        extent = max(extent, float(reference.abs().max()) * 1.15)
    canvas = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(canvas)

    def to_px(p: torch.Tensor) -> tuple[float, float]:
        return ((float(p[0]) / extent + 1) * size / 2, (1 - float(p[1]) / extent) * size / 2)

    for p in pts:
        x, y = to_px(p)
        draw.point((x, y), fill=(30, 60, 160))
    for p in reference if reference is not None else []:
        x, y = to_px(p)
        draw.ellipse((x - 3, y - 3, x + 3, y + 3), outline=(200, 30, 30))
    return np.asarray(canvas)


def write_png(array: np.ndarray, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)
