"""Exponential moving average of G with a half-life counted in images.

Counting in images (not steps) keeps the average the same whatever the world size or batch; the
ramp-up limits the half-life to a fraction of the images seen so far (StyleGAN2-ADA). Every rank
holds identical G weights, so every rank's G_ema is identical without communication.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ganscale.parallel import is_sharded, local


def make_ema(generator: nn.Module) -> nn.Module:
    ema = copy.deepcopy(generator).eval()
    ema.requires_grad_(False)
    return ema


def ema_beta(global_batch: int, images_seen: int, half_life_images: float, rampup: float) -> float:
    half_life = half_life_images
    if rampup > 0:
        half_life = min(half_life, images_seen * rampup)
    if half_life <= 0:
        return 0.0
    return 0.5 ** (global_batch / half_life)


@torch.no_grad()
def update_ema(ema: nn.Module, generator: nn.Module, beta: float) -> None:
    ema_params = [local(p) for p in ema.parameters()]  # shards, when G and G_ema are sharded alike
    params = [local(p) for p in generator.parameters()]  # no_grad: no detach needed
    torch._foreach_lerp_(ema_params, params, 1.0 - beta)
    for ema_buffer, buffer in zip(ema.buffers(), generator.buffers()):
        ema_buffer.copy_(buffer)


class EmaUpdate:
    """`update_ema(ema, generator, beta)` for one pair of networks, with their tensors listed once.

    Walking both module trees every step cost more than the update (~50 of ~65 us a step for the digits
    G on a CPU core). The lists hold the same tensor objects the training updates in place (optimizer
    steps, checkpoint loads). Sharded networks (FSDP2 DTensors) are listed afresh each call: their local
    shards are views made on demand.
    """

    def __init__(self, ema: nn.Module, generator: nn.Module):
        self.ema, self.generator = ema, generator
        tensors = [*ema.parameters(), *generator.parameters(), *ema.buffers(), *generator.buffers()]
        self.fixed = not any(is_sharded(t) for t in tensors)
        if self.fixed:
            self.pairs = (list(ema.parameters()), list(generator.parameters()))
            self.buffers = (list(ema.buffers()), list(generator.buffers()))

    @torch.no_grad()
    def __call__(self, beta: float) -> None:
        if not self.fixed:
            update_ema(self.ema, self.generator, beta)
            return
        torch._foreach_lerp_(*self.pairs, 1.0 - beta)
        if self.buffers[0]:
            torch._foreach_copy_(*self.buffers)
