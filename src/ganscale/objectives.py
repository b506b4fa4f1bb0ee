"""Adversarial losses and penalties: pure functions of logits and inputs (no communication).

Every loss is a mean over the micro-batch; the trainer divides by the accumulation steps and
DDP averages over ranks, so the optimized quantity is the mean over the global batch.
Losses take logits (never probabilities): BCE on probabilities is unsafe under autocast.
A loss.kind "module:attribute" names the user's object (or class of one) with the same two terms,
`d_loss(real, fake)` and `g_loss(fake)`, given float32 logits.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ganscale import usercode
from ganscale.config import SHIPPED_LOSSES, ConfigError


def d_loss(kind: str, real: Tensor, fake: Tensor) -> Tensor:
    real, fake = real.float(), fake.float()
    if kind not in SHIPPED_LOSSES:
        return user_loss(kind).d_loss(real, fake)
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
    if kind not in SHIPPED_LOSSES:
        return user_loss(kind).g_loss(fake)
    if kind == "nonsaturating":
        return F.softplus(-fake).mean()
    if kind in ("hinge", "wgan-gp"):
        return -fake.mean()
    if kind == "lsgan":
        return 0.5 * (fake - 1).square().mean()
    raise ValueError(f"unknown loss.kind {kind!r}")


@functools.cache
def user_loss(kind: str) -> Any:
    """The user's loss object named by loss.kind (its module found on the search path usercode.search set up)."""
    found = usercode.find(kind, "loss.kind")
    if inspect.isclass(found):
        try:
            inspect.signature(found).bind()
        except TypeError as e:  # the config has no loss arguments
            raise ConfigError("loss.kind", f"{kind} is a class built with no arguments, but it needs some ({e})",
                              "give its __init__ arguments defaults, or bind a configured instance to a name in its "
                              f"module (e.g. loss = {found.__name__}(...)) and name that in loss.kind") from None
        except ValueError:  # no signature to read
            pass
    loss = found() if inspect.isclass(found) else found
    if not all(callable(getattr(loss, term, None)) for term in ("d_loss", "g_loss")):
        raise ConfigError("loss.kind", f"'{kind}' has no d_loss(real_logits, fake_logits) and g_loss(fake_logits)",
                          "name an object or class with both methods (see objectives.py), or a shipped loss.kind")
    return loss


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


def path_lengths(images: Tensor, ws: Tensor, noise: Tensor, grad_scale: float = 1.0) -> Tensor:
    """StyleGAN2's path lengths, per sample: ||J_w^T y|| for random images y (`noise`), the gradient of
    (images * y).sum() w.r.t. the per-layer ws (N, num_ws, w_dim), its squared norm summed over w's values and
    averaged over the layers; kept differentiable. `grad_scale` as in `input_gradient_sq_norm`."""
    (grad,) = torch.autograd.grad((images.float() * noise).sum() * grad_scale, ws, create_graph=True)
    grad = grad.float() / grad_scale
    return grad.square().sum(2).mean(1).sqrt()


def path_length_penalty(lengths: Tensor, pl_mean: float) -> Tensor:
    """Mean (length - pl_mean)^2 over samples (weight and lazy interval applied by the caller)."""
    return (lengths - pl_mean).square().mean()
