"""Adversarial losses and penalties: pure functions of logits and inputs (no communication).

Every loss is a mean over the micro-batch; the trainer divides by the accumulation steps and
DDP averages over ranks, so the optimized quantity is the mean over the global batch.
Losses take logits (never probabilities): BCE on probabilities is unsafe under autocast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def d_loss(kind: str, real: Tensor, fake: Tensor) -> Tensor:
    real, fake = real.float(), fake.float()
    if kind == "nonsaturating":
        return F.softplus(-real).mean() + F.softplus(fake).mean()
    if kind == "hinge":
        return F.relu(1 - real).mean() + F.relu(1 + fake).mean()
    if kind == "wgan-gp":
        return fake.mean() - real.mean()
    if kind == "lsgan":
        return 0.5 * ((real - 1).square().mean() + fake.square().mean())
    raise ValueError(f"unknown loss.kind {kind!r}")


def g_loss(kind: str, fake: Tensor) -> Tensor:
    fake = fake.float()
    if kind == "nonsaturating":
        return F.softplus(-fake).mean()
    if kind in ("hinge", "wgan-gp"):
        return -fake.mean()
    if kind == "lsgan":
        return 0.5 * (fake - 1).square().mean()
    raise ValueError(f"unknown loss.kind {kind!r}")


def input_gradient_sq_norm(output: Tensor, inputs: Tensor, grad_scale: float = 1.0) -> Tensor:
    """Per-sample squared norm of d(sum output)/d(inputs), kept differentiable (for R1 and GP).

    `grad_scale` is the fp16 loss scale: the gradient is taken of the scaled output (so it does not
    underflow) and unscaled afterwards.
    """
    (grad,) = torch.autograd.grad(output.float().sum() * grad_scale, inputs, create_graph=True)
    grad = grad.float() / grad_scale
    return grad.square().flatten(1).sum(1)


def r1_penalty(real_logits: Tensor, real: Tensor, grad_scale: float = 1.0) -> Tensor:
    """R1 (Mescheder et al. 2018): mean ||grad_x D(x)||^2 over real samples (weight gamma/2 applied by the caller)."""
    return input_gradient_sq_norm(real_logits, real, grad_scale).mean()


def gradient_penalty(interp_logits: Tensor, interp: Tensor, grad_scale: float = 1.0) -> Tensor:
    """WGAN-GP (Gulrajani et al. 2017): mean (||grad D(x_hat)|| - 1)^2 on interpolates."""
    norm = (input_gradient_sq_norm(interp_logits, interp, grad_scale) + 1e-12).sqrt()
    return (norm - 1).square().mean()
