"""Per-step fingerprints of a training (log.fingerprints): what `ganscale verify` compares between a run on N
processes and one on a single process.

Rank 0 appends one JSON record per optimizer step (its global mean losses, the L2 norm and sum of each gradient as
the optimizer gets it, and in D's steps those of G's samples D judged, over the global batch) and one per iteration
(the same of every parameter and floating buffer of G, D and G_ema after the step) to RUN_DIR/fingerprints.jsonl.
Steps are counted from 1, as the logs count them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ganscale.observe import drop_records_after
from ganscale.outputs import to_json
from ganscale.parallel import is_sharded

FILE = "fingerprints.jsonl"
# A gradient element below this share of its network's largest is zero up to fp32 rounding (terms that cancel):
# N processes round it otherwise than one, and Adam scales it up to a step of the learning rate.
ROUNDING_NOISE = 1e-6
NOISE_ELEMENTS = 8  # recorded per tensor, the first by index


def summary(tensor: Tensor) -> list[float]:
    """[L2 norm, sum] of a tensor, in float64."""
    values = tensor.detach().double()
    return [float(values.norm()), float(values.sum())]


def rounding_noise(gradients: dict[str, Tensor]) -> dict[str, list[list[float]]]:
    """Per tensor, its first NOISE_ELEMENTS nonzero gradient elements below ROUNDING_NOISE of the network's largest,
    as [flat index, value] (tensors without any left out)."""
    flats = {name: g.detach().flatten().double() for name, g in gradients.items() if g.numel()}
    largest = max((float(flat.abs().max()) for flat in flats.values()), default=0.0)
    found = {}
    for name, flat in flats.items():
        at = ((flat != 0) & (flat.abs() <= ROUNDING_NOISE * largest)).nonzero().flatten()[:NOISE_ELEMENTS]
        if len(at):
            found[name] = [[int(i), float(flat[i])] for i in at]
    return found


def _full(tensor: Tensor) -> Tensor:
    return tensor.full_tensor() if is_sharded(tensor) else tensor  # collective when sharded


def _drawn_state(device: torch.device) -> list[Tensor]:
    """The RNG states a network's own randomness (torch.randn, dropout) draws from on this rank."""
    return [torch.get_rng_state(), *([torch.cuda.get_rng_state(device)] if device.type == "cuda" else [])]


class StepFingerprints:
    """Writes the fingerprints of every step of a run. Every rank calls it (gathering a sharded tensor is a
    collective); rank 0 writes."""

    def __init__(self, run_dir: Path, is_main: bool, device: torch.device, networks: dict[str, nn.Module],
                 start_step: int = 0):
        self.path, self.is_main, self.device, self.networks = Path(run_dir) / FILE, is_main, device, networks
        self.start_step = start_step
        self.rng = _drawn_state(device)
        self.fakes: Tensor | None = None  # [sum of squares, sum] of the samples G made for this D step, this rank's
        self.file = None

    def judged(self, fake: Tensor) -> None:
        """In a D step: G's samples of one micro-batch, before D judges them (summed on their device; no sync)."""
        values = fake.detach().double()
        part = torch.stack([values.square().sum(), values.sum()])
        self.fakes = part if self.fakes is None else self.fakes + part

    def optimizer_step(self, step: int, net: str, gradients: nn.Module, losses: list[float]) -> None:
        """Before the optimizer steps `net` in iteration `step` (0-based): its losses and gradients, and whether
        this rank drew from its own RNG stream since the last record (a network's randomness does)."""
        rng, self.rng = self.rng, _drawn_state(self.device)
        drawn = any(not torch.equal(a, b) for a, b in zip(rng, self.rng))
        full = {name: _full(p.grad) for name, p in gradients.named_parameters() if p.grad is not None}
        grads = {name: summary(g) for name, g in full.items()}
        record = {"step": step + 1, "net": net, "losses": losses, "rng_drawn": drawn, "grads": grads,
                  "rounding_noise": rounding_noise(full)}
        if self.fakes is not None:  # a D step (the pipeline's makes its samples inside its stages: none there)
            fakes, self.fakes = self.fakes, None
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(fakes)  # collective: every rank's share of the global batch
            squares, total = fakes.tolist()
            record["fakes"] = [math.sqrt(squares), total]
        self._write(record)

    def after_step(self, step: int) -> None:
        """After iteration `step` (0-based), its EMA update included: every parameter and floating buffer."""
        record = {"step": step + 1, "net": "after"}
        for kind in ("parameters", "buffers"):
            record[kind] = {f"{prefix}.{name}": summary(_full(t)) for prefix, module in self.networks.items()
                            for name, t in getattr(module, f"named_{kind}")() if t.is_floating_point()}
        self._write(record)

    def _write(self, record: dict) -> None:
        if not self.is_main:
            return
        if self.file is None:
            if self.path.exists():  # as metrics.jsonl: a resume redoes the steps after its checkpoint, keeps the rest
                drop_records_after(self.path, self.start_step)
            self.file = open(self.path, "a", buffering=1)
        self.file.write(to_json(record) + "\n")  # strict JSON: a non-finite value is null


class NoFingerprints:
    """log.fingerprints off: nothing is measured or written."""

    def judged(self, fake: Tensor) -> None:
        pass

    def optimizer_step(self, step: int, net: str, gradients: nn.Module, losses: list[float]) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass


def fingerprints_for(enabled: bool, run_dir: Path, is_main: bool, device: torch.device,
                     networks: dict[str, nn.Module], start_step: int) -> StepFingerprints | NoFingerprints:
    return StepFingerprints(run_dir, is_main, device, networks, start_step) if enabled else NoFingerprints()


def read(run_dir: Path) -> list[dict]:
    """The records of a run's fingerprints.jsonl, in order; a non-finite value (written as null) is NaN."""
    return [_nan_for_null(json.loads(line)) for line in (Path(run_dir) / FILE).read_text().splitlines()
            if line.strip()]


def _nan_for_null(value):
    """Every null in a record is a number that was not finite (no field of a record is optional)."""
    if isinstance(value, dict):
        return {key: _nan_for_null(v) for key, v in value.items()}
    if isinstance(value, list):
        return [_nan_for_null(v) for v in value]
    return math.nan if value is None else value
