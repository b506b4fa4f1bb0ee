"""`ganscale bench strategies`: every parallel strategy in real training runs, side by side.

Each row is one `ganscale train --nproc N ...` started as a subprocess (the user's own launcher path:
torch's elastic agent, gloo on CPU), with `log.every=1`, samples, TensorBoard and periodic checkpoints
off, every worker on `--threads` threads (OMP_NUM_THREADS). What is read back:
- step time: the median (and the 10th percentile: on a shared machine, the least-contended steps) over
  logged steps of global batch / img_per_s from metrics.jsonl, leaving out
  the first `SETUP_STEPS` steps (one-time setup, the memory report after step 1, and step 3, whose
  collectives the trainer's traffic meter intercepts in Python);
- memory: `held_bytes` of summary.json, the bytes each rank holds between steps for parameters,
  gradients and optimizer state of G and D (what sharding changes; activations and the process
  itself are not in it), the largest over ranks; plus the CUDA peak when the summary records one;
- communicated bytes: summary.json's `communicated_bytes`, the payload bytes of every collective of one
  measured iteration (D step + G step), by kind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ganscale.bench.report import median, quantile, spread
from ganscale.config import FaultConfig
from ganscale.fault import run_training_process

SETUP_STEPS = 3
PAIRS = {"ddp": ("ddp", "ddp"), "zero1": ("zero1", "zero1"), "zero2": ("zero2", "zero2"), "fsdp": ("fsdp", "fsdp"),
         "G=fsdp,D=ddp": ("fsdp", "ddp")}
# (recipe, overrides): the 2D recipes' R1 penalty is refused on a zero2/fsdp D, so it is off for every row.
MODELS = {"dcgan": ("digits", []), "mlp": ("ring8", ["loss.r1_gamma=0"]), "biggan": ("digits-biggan", [])}
QUIET = ["log.every=1", "log.sample_every=0", "log.tensorboard=false", "checkpoint.every=0"]


class RunFailed(RuntimeError):
    """A benchmark's training run exited non-zero (its output tail is in the message)."""


def worker_env(threads: int) -> dict[str, str]:
    """This environment without launcher variables (the run starts its own), workers on `threads` threads."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def run_training(recipe: str, overrides: list[str], nproc: int, run_dir: Path, threads: int = 1,
                 timeout_s: float = 900) -> tuple[dict, list[dict]]:
    """`ganscale train --nproc` in a subprocess (outputs quiet unless `overrides` say otherwise);
    returns its summary.json and its metrics.jsonl records (training lines only, not eval lines)."""
    sets = [arg for override in [*QUIET, *overrides] for arg in ("--set", override)]
    command = [sys.executable, "-m", "ganscale", "train", recipe, *sets,
               "--nproc", str(nproc), "--run-dir", str(run_dir)]
    done = run_training_process(command, FaultConfig().exit_timeout_s, timeout_s, env=worker_env(threads),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise RunFailed(f"`{' '.join(command[1:])}` exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return summary, [r for r in records if "img_per_s" in r]


def train_run(recipe: str, overrides: list[str], nproc: int, run_dir: Path, threads: int = 1,
              timeout_s: float = 900) -> dict:
    """Train through `ganscale train --nproc` in a subprocess; returns its step times, memory and traffic."""
    summary, records = run_training(recipe, overrides, nproc, run_dir, threads, timeout_s)
    step_times = [summary["global_batch"] / r["img_per_s"] for r in records if r["step"] > SETUP_STEPS]
    held = [sum(sum(parts.values()) for parts in nets.values()) for nets in summary["held_bytes"]]
    optimizer = [sum(nets[net].get("optim", 0) for net in nets) for nets in summary["held_bytes"]]
    traffic = summary.get("communicated_bytes", {})
    per_kind: dict[str, int] = {}
    for kinds in traffic.values():
        for kind, n in kinds.items():
            if kind != "ops":
                per_kind[kind] = per_kind.get(kind, 0) + n
    return {"step_times_s": step_times, "step_median_s": median(step_times), "step_range_s": spread(step_times),
            "step_p10_s": quantile(step_times, 0.1),
            "held_bytes_max_rank": max(held), "optimizer_bytes_max_rank": max(optimizer),
            "comm_bytes_per_step": sum(per_kind.values()), "comm_bytes_by_kind": per_kind,
            "comm_ops_per_step": sum(kinds.get("ops", 0) for kinds in traffic.values()),
            "cuda_max_memory_allocated": summary.get("max_memory_allocated"),
            "world_size": summary["world_size"], "global_batch": summary["global_batch"]}


def run_config(model: str, steps: int, batch: int | None, device: str | None, pair: str) -> tuple[str, list[str]]:
    """(recipe, overrides) of the run of one strategy pair (QUIET is added when it is started)."""
    recipe, base = MODELS[model]
    generator, discriminator = PAIRS[pair]
    return recipe, [*base, f"train.steps={steps}", *([f"train.batch_size={batch}"] if batch else []),
                    *([f"train.device={device}"] if device else []),
                    f"parallel.generator={generator}", f"parallel.discriminator={discriminator}"]


def compare_strategies(model: str, nproc: int, steps: int, batch: int | None, pairs: list[str], threads: int,
                       device: str | None) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in pairs:
            generator, discriminator = PAIRS[name]
            recipe, overrides = run_config(model, steps, batch, device, name)
            run = train_run(recipe, overrides, nproc, Path(scratch) / name, threads)
            rows.append({"strategy": name, "generator": generator, "discriminator": discriminator, **run})
    return rows
