"""Batch statistics over all ranks.

On CUDA this is torch's `SyncBatchNorm`. torch's does not run on CPU (2.11-2.13), so on CPU/gloo
`CrossRankBatchNorm` does the same: one all-reduce of (sum, sum of squares, count) per channel in
the forward, one of (sum dy, sum dy * x_hat) in the backward. Every train-mode forward is a
collective: all ranks must run it the same number of times (the trainer's control flow ensures it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.nn.modules.batchnorm import _BatchNorm


class _CrossRankBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float):
        channels = x.shape[1]
        dims = [0, *range(2, x.dim())]
        x64 = x.double()  # E[x^2] - E[x]^2 in float64: no cancellation against torch's two-pass BN
        stats = torch.cat([x64.sum(dims), x64.square().sum(dims),
                           torch.tensor([x.numel() // channels], dtype=torch.float64, device=x.device)])
        dist.all_reduce(stats)
        count = stats[-1]
        mean = stats[:channels] / count
        var = (stats[channels:2 * channels] / count - mean.square()).clamp_min(0)
        invstd = (var + eps).rsqrt()
        shape = [1, channels] + [1] * (x.dim() - 2)
        x_hat = ((x64 - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        ctx.save_for_backward(x_hat, invstd.to(x.dtype), weight)
        ctx.count = count
        mean, var = mean.to(x.dtype), var.to(x.dtype)
        ctx.mark_non_differentiable(mean, var, count)
        out = x_hat
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        return out, mean, var, count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, _mean, _var, _count):
        x_hat, invstd, weight = ctx.saved_tensors
        channels = x_hat.shape[1]
        dims = [0, *range(2, x_hat.dim())]
        shape = [1, channels] + [1] * (x_hat.dim() - 2)
        local = torch.cat([grad_out.sum(dims), (grad_out * x_hat).sum(dims)])
        grad_weight = local[channels:].clone() if weight is not None else None
        grad_bias = local[:channels].clone() if weight is not None else None
        dist.all_reduce(local)  # the batch statistics couple every rank's samples
        mean_dy = (local[:channels] / ctx.count).view(shape)
        mean_dy_xhat = (local[channels:] / ctx.count).view(shape)
        scale = invstd.view(shape) * (weight.view(shape) if weight is not None else 1)
        grad_x = scale * (grad_out - mean_dy - x_hat * mean_dy_xhat)
        return grad_x, grad_weight, grad_bias, None


class CrossRankBatchNorm(_BatchNorm):
    """Drop-in for BatchNorm1d/2d/3d whose train-mode statistics span all ranks (CPU/gloo)."""

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input, got {x.dim()}D")

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or not dist.is_initialized() or dist.get_world_size() == 1:
            return super().forward(x)
        out, mean, var, count = _CrossRankBatchNormFn.apply(x, self.weight, self.bias, self.eps)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
                unbiased = var * (count / (count - 1).clamp_min(1))
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        return out


def convert_batchnorm(module: nn.Module, use_cuda: bool) -> nn.Module:
    """Every BatchNorm in `module` -> a cross-rank one (torch's on CUDA, ours on CPU); state kept."""
    if use_cuda:
        return nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return _convert_cpu(module)


def _convert_cpu(module: nn.Module) -> nn.Module:
    if isinstance(module, _BatchNorm) and not isinstance(module, CrossRankBatchNorm):
        new = CrossRankBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                 module.track_running_stats)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new
    for name, child in module.named_children():
        module.add_module(name, _convert_cpu(child))
    return module


@torch.no_grad()
def average_batchnorm_stats(*modules: nn.Module) -> None:
    """All-reduce-average BatchNorm running statistics (collective: every rank calls it).

    Needed before evaluation, sampling or saving when batch statistics are per rank.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    stats = [b for m in modules for layer in m.modules() if isinstance(layer, _BatchNorm)
             for b in (layer.running_mean, layer.running_var) if b is not None]
    if not stats:
        return
    flat = torch.cat([s.reshape(-1).double() for s in stats])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for s in stats:
        s.copy_(flat[offset:offset + s.numel()].view_as(s))
        offset += s.numel()


__all__ = ["CrossRankBatchNorm", "convert_batchnorm", "average_batchnorm_stats"]
