"""Full training state on disk: atomic writes, checksums, keep-latest-k, resume.

A checkpoint holds G, D, G_ema, both optimizers, the loss scaler, the step, the data position and
every rank's RNG state. Rank 0 writes `step-N.pt` under a temporary name and renames it into place,
then writes `step-N.json` (size and SHA-256) the same way: that manifest is the completion marker.
A checkpoint without its manifest, or whose bytes do not match it, is reported and passed over.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
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
    """The newest checkpoint file, complete or not (cheap: no checksum)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def manifest_path(path: Path) -> Path:
    return path.with_suffix(".json")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def problem(path: Path) -> str | None:
    """Why this checkpoint cannot be trusted, or None when it is complete and intact."""
    marker = manifest_path(path)
    if not marker.is_file():
        return "incomplete: no completion marker (the write was interrupted)"
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError) as e:
        return f"unreadable completion marker {marker.name} ({e})"
    if path.stat().st_size != manifest.get("bytes"):
        return f"truncated: {path.stat().st_size} bytes, {manifest.get('bytes')} expected"
    if _sha256(path) != manifest.get("sha256"):
        return "corrupted: SHA-256 does not match its completion marker"
    return None


def newest_valid(run_dir: Path) -> Path | None:
    """The newest intact checkpoint; every newer bad one is reported on stderr, naming the file and why."""
    for path in reversed(list_checkpoints(run_dir)):
        reason = problem(path)
        if reason is None:
            return path
        print(f"ganscale: warning: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
    return None


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


def _write_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(state: dict, run_dir: Path, step: int, keep: int) -> Path:
    """Write atomically, then the completion marker; prune to the newest `keep`. Called on rank 0 only."""
    folder = checkpoint_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:08d}.pt"
    _write_atomically(path, lambda f: torch.save(state, f))
    manifest = {"step": step, "file": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
    _write_atomically(manifest_path(path), lambda f: f.write(json.dumps(manifest).encode()))
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
        manifest_path(old).unlink(missing_ok=True)
    return path


def load(path: Path) -> dict:
    reason = problem(path)
    if reason is not None:
        raise ConfigError(str(path), f"this checkpoint cannot be used ({reason})",
                          "resume from an intact one with --resume PATH, or start a new --run-dir")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ConfigError(str(path), f"cannot read this checkpoint ({type(e).__name__}: {e})",
                          "resume from another file with --resume PATH, or start a new --run-dir") from None
