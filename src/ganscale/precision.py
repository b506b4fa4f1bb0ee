"""Numeric precision: autocast context, fp16 loss scaling, optimizer stepping.

fp32: plain. bf16: autocast only (no scaler needed). fp16: autocast + one GradScaler shared by G
and D; each loss is scaled, each optimizer stepped through the scaler, `update()` once per
iteration after both steps.
"""

from __future__ import annotations

import contextlib

import torch


class Precision:
    def __init__(self, mode: str, device: torch.device):
        self.mode, self.device = mode, device
        self.dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]
        self.scaler = torch.amp.GradScaler(device.type, enabled=mode == "fp16")

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss)

    @property
    def loss_scale(self) -> float:
        """The factor losses are multiplied by before backward (1 unless fp16)."""
        return self.scaler.get_scale() if self.scaler.is_enabled() else 1.0

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        self.scaler.step(optimizer)

    def update(self) -> None:
        self.scaler.update()

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.scaler.load_state_dict(state)
