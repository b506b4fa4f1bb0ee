"""Full training state on disk: atomic writes, keep-latest-k, resume.

A checkpoint holds G, D, G_ema, both optimizers, the loss scaler, the step, the data position and
every rank's RNG state. It is written by rank 0 under a temporary name and renamed into place, so a
crash mid-write never leaves a half file under a real name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ganscale.config import ConfigError

PATTERN = re.compile(r"^step-(\d{8})\.pt$")


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if PATTERN.match(p.name)), key=lambda p: p.name)


def latest(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    """This rank's RNG state, in tensors only (so checkpoints load with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
                       "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states() -> list[dict]:
    """Every rank's RNG state on every rank (collective)."""
    states: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states  # type: ignore[return-value]


def save(state: dict, run_dir: Path, step: int, keep: int) -> Path:
    """Write atomically and prune to the newest `keep`. Called on rank 0 only."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    tmp = folder / f".{path.name}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
    return path


def load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ConfigError(str(path), f"cannot read this checkpoint ({type(e).__name__}: {e})",
                          "resume from another file with --resume PATH, or start a new --run-dir") from None
