"""Sampling tools for a trained run's G_ema (one process): truncation, one class, latent walks as animated GIF
grids, and StyleGAN2's style-mixing grid.

Latents come from one seeded stream, drawn a grid of n at a time, so a walk's first keyframe is the latent that
`ganscale sample` draws with the same --n and --seed. StyleGAN2 walks move in w (linearly), every other G's in z
(spherically); a StyleGAN2 cell keeps its first keyframe's noise throughout, so only its styles move.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor, nn

from ganscale.config import Config, ConfigError
from ganscale.data.mixtures import MIXTURE_MODES
from ganscale.memory import check_animation, check_sampling
from ganscale.models.stylegan2 import StyleGAN2Generator
from ganscale.observe.samples import image_grid, write_png
from ganscale.outputs import write_output
from ganscale.randomness import sample_seeds
from ganscale.tasks import Unconditional, build_task

FRAME_MS = 50  # 20 frames a second
BLANK = -1.0  # the style-mixing grid's empty corner: black


def check_truncation(psi: float, cfg: Config) -> None:
    """psi in [0, 1], and other than 1 only for a G with a mapping network (stylegan2)."""
    if not 0 <= psi <= 1:
        raise ConfigError("--truncation", f"psi {psi} is outside [0, 1]",
                          "give a psi from 0 (every sample the average image) to 1 (no truncation)")
    if psi != 1 and cfg.model.kind != "stylegan2":
        raise ConfigError("--truncation", f"this run's model.kind={cfg.model.kind} has no mapping network, so no "
                          "average w to truncate towards", "drop --truncation (it applies to stylegan2 runs)")


def check_class(task: Unconditional, label: int | None) -> None:
    """`label` is one of the run's classes (or None)."""
    if label is not None and not 0 <= label < task.n_classes:
        problem = (f"class {label} is not one of this run's {task.n_classes} classes" if task.n_classes
                   else "this run's generator is not class-conditional")
        raise ConfigError("--class", problem, f"use 0 to {task.n_classes - 1}" if task.n_classes else "drop --class")


def truncated(generator: nn.Module, psi: float) -> Callable[..., Tensor]:
    """G drawing at truncation psi; G itself at psi 1, so every G samples as it always did."""
    return generator if psi == 1 else functools.partial(generator, psi=psi)


def check_images(cfg: Config, run_dir: Path, command: str) -> None:
    """`command` draws image grids from latents: refused for 2D mixtures (points) and paired G (no latents)."""
    if cfg.data.kind in MIXTURE_MODES:
        raise ConfigError("RUN_DIR", f"run {run_dir} draws 2D points ({cfg.data.kind}), not images, so there is no "
                          f"grid for {command}", "use `ganscale sample` for its scatter plot")
    if cfg.model.conditioning == "paired":
        raise ConfigError("RUN_DIR", f"run {run_dir} translates images ({cfg.model.kind}, image to image): its G "
                          f"takes no latents for {command}",
                          "use `ganscale sample` for its input | output | target rows")


def grid_latents(count: int, n: int, z_dim: int, seed: int) -> list[Tensor]:
    """`count` grids of n latents each, from one seeded stream: `ganscale sample` draws the first, a walk visits
    them all."""
    stream = torch.Generator().manual_seed(seed)
    return [torch.randn(n, z_dim, generator=stream) for _ in range(count)]


def slerp(a: Tensor, b: Tensor, t: float) -> Tensor:
    """Spherical interpolation from a (t=0, exactly) to b (t=1), row by row; linear where they are parallel."""
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1).clamp(-1, 1)[:, None]
    omega = torch.arccos(cos)
    sin = torch.sin(omega)
    parallel = sin.abs() < 1e-6
    safe = torch.where(parallel, torch.ones_like(sin), sin)
    # Weights first: at t=0 they are exactly 1 and 0, so the walk starts at the keyframe itself.
    spherical = torch.sin((1 - t) * omega) / safe * a + torch.sin(t * omega) / safe * b
    return torch.where(parallel, torch.lerp(a, b, t), spherical)


@torch.no_grad()
def walk(generator: nn.Module, task: Unconditional, keys: list[Tensor], steps: int, psi: float,
         label: int | None) -> Iterator[Tensor]:
    """Frames (n images each) visiting every keyframe in turn and back to the first: len(keys) x steps frames, the
    first at keys[0]."""
    if isinstance(generator, StyleGAN2Generator):
        labels = task.preview_labels(len(keys[0]), label)
        ws = [generator.truncate(generator.mapping(z, labels), psi) for z in keys]
        seeds = sample_seeds(keys[0])

        def frame(a: int, b: int, t: float) -> Tensor:
            return generator.synthesize(broadcast(generator, ws[a].lerp(ws[b], t)), seeds)
    else:
        def frame(a: int, b: int, t: float) -> Tensor:
            return task.preview(generator, slerp(keys[a], keys[b], t), label)

    for a in range(len(keys)):
        for step in range(steps):
            yield frame(a, (a + 1) % len(keys), step / steps).float()


def broadcast(generator: StyleGAN2Generator, w: Tensor) -> Tensor:
    """One w per sample as the same w for every layer: (N, num_ws, w_dim)."""
    return w[:, None].expand(-1, generator.num_ws, -1)


def write_gif(frames: Iterator[np.ndarray], out: Path, grey: bool) -> Path:
    """An endlessly looping GIF of `frames` (H, W, 3 uint8), made one at a time. Identical consecutive frames are
    stored once, for their combined time (pillow does)."""
    pictures = (Image.fromarray(frame[..., 0] if grey else frame) for frame in frames)  # grey: exact, no palette
    first = next(pictures)
    return write_output(out, lambda tmp: first.save(tmp, save_all=True, append_images=pictures, duration=FRAME_MS,
                                                    loop=0))


def interpolation(run_dir: Path, out: Path, n: int, count: int, steps: int, seed: int = 0, psi: float = 1.0,
                  label: int | None = None) -> Path:
    """`ganscale interpolate`: a GIF of a grid of n latent walks through `count` keyframes, `steps` frames each."""
    from ganscale.evaluate import load_generator

    cfg, generator, _ = load_generator(run_dir)
    check_images(cfg, run_dir, "interpolate")
    task = build_task(cfg, previews=False)
    check_class(task, label)
    check_truncation(psi, cfg)
    check_sampling(cfg, lambda net, z: task.preview(truncated(net, psi), z, label), n, task.grid_columns)
    check_animation(cfg, n, count, steps, task.grid_columns)
    keys = grid_latents(count, n, cfg.model.z_dim, seed)
    frames = (image_grid(images, cols=task.grid_columns) for images in walk(generator, task, keys, steps, psi, label))
    return write_gif(frames, out, cfg.data.channels < 3)


def source_labels(task: Unconditional, n: int, label: int | None) -> Tensor | None:
    """The classes of n style-mixing sources: `label` for all, else each source the next class."""
    if not task.n_classes:
        return None
    return torch.full((n,), label) if label is not None else torch.arange(n) % task.n_classes


@torch.no_grad()
def mixed_styles(generator: StyleGAN2Generator, z_rows: Tensor, z_cols: Tensor, crossover: int, psi: float,
                 labels: tuple[Tensor | None, Tensor | None]) -> Tensor:
    """The style-mixing grid's images, row by row: a blank corner and the column sources, then each row source
    followed by its mixes (its styles before layer `crossover`, each column source's from it on, its own noise)."""
    w_rows, w_cols = (generator.truncate(generator.mapping(z, y), psi) for z, y in zip((z_rows, z_cols), labels))
    seeds_rows = sample_seeds(z_rows)
    sources_rows = generator.synthesize(broadcast(generator, w_rows), seeds_rows)
    sources_cols = generator.synthesize(broadcast(generator, w_cols), sample_seeds(z_cols))
    cells = [torch.full_like(sources_cols[:1], BLANK), sources_cols]
    fine = torch.arange(generator.num_ws)[None, :, None] >= crossover
    for row, w in enumerate(w_rows):
        ws = torch.where(fine, broadcast(generator, w_cols), w.expand(len(w_cols), generator.num_ws, -1))
        cells += [sources_rows[row:row + 1], generator.synthesize(ws, seeds_rows[row].expand(len(w_cols)))]
    return torch.cat(cells).float()


def style_mixing(run_dir: Path, out: Path, rows: int, cols: int, seed: int = 0, psi: float = 1.0,
                 crossover: int | None = None, label: int | None = None) -> Path:
    """`ganscale style-mix`: a PNG grid of (rows + 1) x (cols + 1) cells (see `mixed_styles`)."""
    from ganscale.evaluate import load_generator

    cfg, generator, _ = load_generator(run_dir)
    if not isinstance(generator, StyleGAN2Generator):
        raise ConfigError("RUN_DIR", f"run {run_dir} trains model.kind={cfg.model.kind}, which has no per-layer "
                          "styles to mix", "give a stylegan2 run")
    task = build_task(cfg, previews=False)
    check_class(task, label)
    check_truncation(psi, cfg)
    crossover = generator.num_ws // 2 if crossover is None else crossover
    if not 1 <= crossover < generator.num_ws:
        raise ConfigError("--crossover", f"layer {crossover} is not between the first and the last of this G's "
                          f"{generator.num_ws} styles", f"use 1 to {generator.num_ws - 1}")
    z_rows, z_cols = grid_latents(1, rows + cols, cfg.model.z_dim, seed)[0].split([rows, cols])
    labels = source_labels(task, rows + cols, label)
    by_source = (None, None) if labels is None else tuple(labels.split([rows, cols]))
    images = mixed_styles(generator, z_rows, z_cols, crossover, psi, by_source)
    return write_output(out, lambda tmp: write_png(image_grid(images, cols=cols + 1), tmp))
