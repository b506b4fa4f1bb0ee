"""Numeric precision: autocast context, fp16 loss scaling, optimizer stepping.

fp32: plain. bf16: autocast only (no scaler needed). fp16: autocast + one GradScaler shared by G
and D; each loss is scaled, each optimizer stepped after the gradients were unscaled, `update()` after the
steps. The loss scale follows GradScaler's policy (halve after an overflow, double after GROWTH_INTERVAL updates
without one), but on the skips every rank agreed on (the trainer's one all-reduce a step) rather than on each
rank's own inf check, which under sharded gradients sees only its shard: so the scale is the same on every rank,
and known on the host, where reading it never waits for the GPU.
"""

from __future__ import annotations

import contextlib

import torch

INIT_SCALE, BACKOFF, GROWTH, GROWTH_INTERVAL = 2.0**16, 0.5, 2.0, 2000  # GradScaler's defaults
# Below this scale an overflow is no longer the scale's: the gradients themselves do not fit fp16.
LOWEST_BACKING_OFF_SCALE = 1.0


class Precision:
    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
        self.scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_factor=GROWTH,
                                           backoff_factor=BACKOFF, growth_interval=GROWTH_INTERVAL,
                                           enabled=mode == "fp16")
        self._scale = INIT_SCALE if self.scaler.is_enabled() else 1.0
        self._updates_without_skip = 0  # GradScaler's growth tracker
        self._skipped = False  # a step was skipped since the last update

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    @property
    def loss_scale(self) -> float:
        """The factor losses are multiplied by before backward (1 unless fp16)."""
        return self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """A step every rank agreed to take: its gradients are unscaled (unscale_) and finite."""
        optimizer.step()

    def skipped(self) -> None:
        """A step every rank agreed to skip: fp16's scale backs off at the next update."""
        self._skipped = True

    def backing_off(self, losses_finite: bool) -> bool:
        """Whether a skipped step is fp16's loss scale backing off (finite losses, a scale not yet below
        LOWEST_BACKING_OFF_SCALE) rather than training gone non-finite: a run may start with a dozen of them."""
        return self.scaler.is_enabled() and losses_finite and self._scale >= LOWEST_BACKING_OFF_SCALE

    def update(self) -> None:
        """After the optimizer steps since the last update: back off after a skipped one, grow after
        GROWTH_INTERVAL updates without."""
        if not self.scaler.is_enabled():
            return
        if self._skipped:
            self._scale, self._updates_without_skip = self._scale * BACKOFF, 0
        else:
            self._updates_without_skip += 1
            if self._updates_without_skip == GROWTH_INTERVAL:
                self._scale, self._updates_without_skip = self._scale * GROWTH, 0
        self._skipped = False
        self.scaler.update(self._scale)  # sets the scale the next scale() multiplies by; clears the inf checks

    def state_dict(self) -> dict:
        if not self.scaler.is_enabled():
            return {}
        return {"scale": self._scale, "growth_factor": GROWTH, "backoff_factor": BACKOFF,
                "growth_interval": GROWTH_INTERVAL, "_growth_tracker": self._updates_without_skip}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)
            self._scale, self._updates_without_skip = float(state["scale"]), int(state["_growth_tracker"])
