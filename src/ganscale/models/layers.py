"""Building blocks shared by the image GANs: initialisation, norm choice, conditional BN, self-attention.

Kept free of any parallelism: the strategies wrap whole networks later. Every normalisation here
is (or contains) a plain `nn.BatchNorm2d`, so synchronised BatchNorm can replace it by type.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm

from ganscale.config import ConfigError

NORMS = ("batch", "instance", "none")


def normal_init(module: nn.Module, std: float = 0.02) -> None:
    """N(0, std) for convolutions and linear layers, N(1, std) for BatchNorm scale, zero biases.

    The DCGAN/pix2pix initialisation. Instance norm without affine parameters has nothing to set.
    """
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
            nn.init.normal_(layer.weight, 0.0, std)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
        elif isinstance(layer, nn.BatchNorm2d) and layer.affine:
            nn.init.normal_(layer.weight, 1.0, std)
            nn.init.zeros_(layer.bias)


def norm_layer(kind: str, channels: int) -> nn.Module:
    """The normalisation named by `model.norm`.

    "instance" is pix2pix's: no affine parameters and no running statistics, so train and eval
    behave the same and the batch size does not change what a sample sees.
    """
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "instance":
        return nn.InstanceNorm2d(channels, affine=False, track_running_stats=False)
    if kind == "none":
        return nn.Identity()
    raise ConfigError("model.norm", f"unknown normalisation {kind!r}", f"use one of {', '.join(NORMS)}")


def conv_bias(norm: str) -> bool:
    """Whether a convolution followed by `norm` needs its own bias.

    BatchNorm subtracts the mean and adds its own shift, so a conv bias before it is dead weight
    (pix2pix drops it). Instance norm without affine parameters and no norm at all keep it.
    """
    return norm != "batch"


def orthogonal_spectral(layer: nn.Module) -> nn.Module:
    """Orthogonal init (BigGAN's choice), then spectral normalisation of the weight."""
    nn.init.orthogonal_(layer.weight)
    if getattr(layer, "bias", None) is not None:
        nn.init.zeros_(layer.bias)
    return spectral_norm(layer)


class ConditionalBatchNorm2d(nn.Module):
    """BatchNorm whose scale and shift are linear functions of a conditioning vector.

    The statistics come from a plain `BatchNorm2d` without affine parameters (so SyncBN
    conversion still finds it); gain = 1 + W_g c and bias = W_b c, with spectrally normalised
    W_g, W_b and no bias, as in BigGAN, where c is the shared class embedding concatenated with
    this block's chunk of z.
    """

    def __init__(self, channels: int, cond_dim: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(channels, affine=False)
        self.gain = orthogonal_spectral(nn.Linear(cond_dim, channels, bias=False))
        self.bias = orthogonal_spectral(nn.Linear(cond_dim, channels, bias=False))

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        gain = 1 + self.gain(cond)[:, :, None, None]
        bias = self.bias(cond)[:, :, None, None]
        return self.norm(x) * gain + bias


class SelfAttention(nn.Module):
    """SAGAN self-attention (Zhang et al. 2018) as BigGAN uses it.

    Queries at every position attend to keys and values max-pooled 2x2 (a quarter of the
    positions, a quarter of the cost). The residual weight `gamma` starts at 0, so the block is
    the identity at initialisation and the network learns how much non-local evidence to use.
    It has shape (1,), not (): FSDP2 cannot shard a 0-d parameter. Weights saved while it was 0-d
    still load: checkpoint.py reads old checkpoints as (1,), and `_gamma_of_old_checkpoints` does
    for a state dict given to `load_state_dict` directly (weights exported by an older version).
    """

    def __init__(self, channels: int, spectral: bool = True):
        super().__init__()
        wrap = orthogonal_spectral if spectral else (lambda m: m)
        key_dim, value_dim = max(1, channels // 8), max(1, channels // 2)
        self.query = wrap(nn.Conv2d(channels, key_dim, 1, bias=False))
        self.key = wrap(nn.Conv2d(channels, key_dim, 1, bias=False))
        self.value = wrap(nn.Conv2d(channels, value_dim, 1, bias=False))
        self.out = wrap(nn.Conv2d(value_dim, channels, 1, bias=False))
        self.gamma = nn.Parameter(torch.zeros(1))  # broadcasts over (n, c, h, w) exactly as a 0-d one did
        self.register_load_state_dict_pre_hook(_gamma_of_old_checkpoints)

    def forward(self, x: Tensor) -> Tensor:
        n, _, h, w = x.shape
        pool = (lambda t: F.max_pool2d(t, 2)) if min(h, w) >= 2 else (lambda t: t)
        query = self.query(x).flatten(2)                       # (n, k, hw)
        key = pool(self.key(x)).flatten(2)                     # (n, k, hw/4)
        value = pool(self.value(x)).flatten(2)                 # (n, v, hw/4)
        attention = torch.softmax(query.transpose(1, 2) @ key, dim=-1)  # (n, hw, hw/4)
        attended = (value @ attention.transpose(1, 2)).view(n, -1, h, w)
        return x + self.gamma * self.out(attended)


def _gamma_of_old_checkpoints(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """SelfAttention's load pre-hook: a 0-d `gamma` (checkpoints before it became (1,)) is read as (1,)."""
    gamma = state_dict.get(prefix + "gamma")
    if isinstance(gamma, Tensor) and gamma.dim() == 0:
        state_dict[prefix + "gamma"] = gamma.reshape(1)
