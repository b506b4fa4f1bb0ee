"""Export G and G_ema weights from a checkpoint to safetensors."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file

from ganscale import checkpoint
from ganscale.config import ConfigError


def export_generator(run_dir: Path, out: Path, source: Path | None = None) -> Path:
    source = source or checkpoint.newest_valid(run_dir)
    if source is None:
        raise ConfigError("RUN_DIR", f"no intact checkpoint under {run_dir}/checkpoints",
                          "train first, or pass --checkpoint")
    state = checkpoint.load(source)
    tensors = {f"{net}.{key}": value.detach().contiguous().clone()
               for net in ("G", "G_ema") for key, value in state[net].items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    save_file(tensors, str(tmp), metadata={"step": str(state["step"]), "config": state["config"]})
    os.replace(tmp, out)
    return out
