"""Drawing from and scoring a trained run's G_ema, outside training (one process).

The generator is rebuilt from the config stored in the checkpoint, so a run directory alone is enough.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml
from torch import nn

from ganscale import checkpoint
from ganscale.config import Config, ConfigError, build
from ganscale.metrics.modes2d import PROTOCOL_SAMPLES, score_named
from ganscale.models import build_networks
from ganscale.observe.samples import image_grid, scatter, write_png
from ganscale.trainer import MIXTURE_MODES


def load_generator(run_dir: Path, source: Path | None = None) -> tuple[Config, nn.Module, int]:
    """(config, G_ema in eval mode, step) from the newest intact checkpoint of a run (or `source`)."""
    source = source or checkpoint.newest_valid(run_dir)
    if source is None:
        raise ConfigError("RUN_DIR", f"no intact checkpoint under {run_dir}/checkpoints", "train first, or pass --checkpoint")
    state = checkpoint.load(source)
    cfg = build(yaml.safe_load(state["config"]))
    generator, _ = build_networks(cfg)
    generator.load_state_dict(state["G_ema"])
    return cfg, generator.eval(), int(state["step"])


@torch.no_grad()
def draw(generator: nn.Module, z_dim: int, n: int, seed: int) -> torch.Tensor:
    z = torch.randn(n, z_dim, generator=torch.Generator().manual_seed(seed))
    return generator(z).float()


def sample_picture(run_dir: Path, n: int, out: Path, seed: int = 0) -> Path:
    cfg, generator, _ = load_generator(run_dir)
    samples = draw(generator, cfg.model.z_dim, n, seed)
    modes = MIXTURE_MODES.get(cfg.data.kind)
    picture = scatter(samples, modes()) if modes else image_grid(samples)
    write_png(picture, out)
    return out


def evaluate(run_dir: Path, samples: int = PROTOCOL_SAMPLES, seed: int = 0) -> dict:
    """Score G_ema; writes RUN_DIR/eval.json. 2D mixtures only for now (image metrics: issue 5)."""
    cfg, generator, step = load_generator(run_dir)
    if cfg.data.kind not in MIXTURE_MODES:
        raise ConfigError("data.kind", f"no offline metric for data.kind={cfg.data.kind} yet",
                          "evaluate a ring8 or grid25 run (image metrics are not implemented yet)")
    result = {"step": step, "data": cfg.data.kind, "seed": seed,
              **score_named(cfg.data.kind, draw(generator, cfg.model.z_dim, samples, seed)).as_dict()}
    (Path(run_dir) / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
