"""Class-conditional BigGAN-style ResNet GAN (Brock et al. 2019), with SAGAN self-attention.

G: z is split into one chunk per residual block plus one for the 4x4 input (hierarchical
latent). A shared class embedding, concatenated with a block's chunk, sets the gain and bias of
that block's conditional BatchNorms. Residual up-blocks double the resolution; one
self-attention block sits after the up-block whose output is nearest `attn_resolution`.
D: residual down-blocks to 4x4, one more block at 4x4, the same single self-attention, ReLU and
sum-pooling, then a linear logit plus the projection term <embed(y), pooled features>
(Miyato & Koyama 2018). Every convolution, linear layer and D's class embedding is spectrally
normalised (G's too, as BigGAN does); G's shared embedding is not.

Widths are `ch` times BigGAN's multipliers for 64, 128 and 256 pixels, and 4 x ch throughout at
8, 16 and 32 pixels (BigGAN's CIFAR layout). Resolution 8 (the bundled 8x8 digits) has a single
up-block in G and one down-block plus one 4x4 block in D.

Both networks take labels: `G(z, y)` and `D(x, y)`, y an int64 tensor of class indices. D returns
(N, 1) logits like the other discriminators, so any loss in `objectives` applies (hinge is
BigGAN's).

Intended conditional digits recipe (8x8 grey digits, 10 classes; not yet trained end to end):
    model: {kind: biggan, z_dim: 32, g_width: 32, d_width: 32, shared_dim: 32, attn_resolution: 8,
            n_classes: 10}
    data: {kind: digits, resolution: 8, channels: 1, labels: true}
    loss: {kind: hinge, n_critic: 2}
    optim: {g: {lr: 0.0001, betas: [0.0, 0.999]}, d: {lr: 0.0004, betas: [0.0, 0.999]}}
    train: {batch_size: 64, steps: 4000, ema_half_life_images: 10000}
G has 392,898 and D 466,178 parameters at ch 32. The learning rates are SAGAN's
two-time-scale pair (D 4x G), beta1 = 0 and two D steps per G step are BigGAN's; the samples
should be drawn per class (a fixed y per grid row) from G_ema. Measured cost: about 0.23 s per G
step (two D steps included) at batch 64 on 2 CPU cores, so about 15 minutes for 4000 steps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm

from ganscale.config import ConfigError
from ganscale.models.layers import ConditionalBatchNorm2d, SelfAttention, orthogonal_spectral

# Channel multipliers of ch, from the 4x4 input to the output resolution (G), and the outputs of
# D's blocks, from the first down-block to the final 4x4 block (D).
G_MULTIPLIERS = {8: [4, 4], 16: [4, 4, 4], 32: [4, 4, 4, 4], 64: [16, 16, 8, 4, 2],
                 128: [16, 16, 8, 4, 2, 1], 256: [16, 16, 8, 8, 4, 2, 1]}
D_MULTIPLIERS = {8: [4, 4], 16: [4, 4, 4], 32: [4, 4, 4, 4], 64: [1, 2, 4, 8, 16],
                 128: [1, 2, 4, 8, 16, 16], 256: [1, 2, 4, 8, 8, 16, 16]}
RESOLUTIONS = tuple(G_MULTIPLIERS)
BOTTOM = 4  # G starts from, and D ends at, 4x4 maps


def check_resolution(resolution: int) -> None:
    if resolution not in G_MULTIPLIERS:
        raise ConfigError("data.resolution", f"BigGAN has no layout for resolution {resolution}",
                          f"use one of {', '.join(map(str, RESOLUTIONS))}")


def attention_block(levels: list[int], wanted: int) -> int | None:
    """Index of the first block whose output resolution is nearest `wanted` (in octaves); None when 0."""
    if wanted == 0:
        return None
    distances = [abs(math.log2(level) - math.log2(wanted)) for level in levels]
    return distances.index(min(distances))


def _conv(c_in: int, c_out: int, kernel: int, bias: bool = True) -> nn.Module:
    return orthogonal_spectral(nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, bias=bias))


class GBlock(nn.Module):
    """cBN -> ReLU -> 2x nearest upsample -> 3x3 conv -> cBN -> ReLU -> 3x3 conv, plus upsample -> 1x1 conv shortcut.

    No convolution here has a bias: each output reaches a BatchNorm (conv1 the next cBN; conv2 and
    the shortcut the next block's, or G's last, perhaps through self-attention, whose keys, values
    and residual carry a per-channel constant unchanged into it), which subtracts it. Such a bias's
    gradient is zero up to rounding, and Adam turns that rounding into learning-rate-sized steps
    that differ between 1 and N processes (`ganscale verify` found it).
    """

    def __init__(self, c_in: int, c_out: int, cond_dim: int):
        super().__init__()
        self.norm1 = ConditionalBatchNorm2d(c_in, cond_dim)
        self.conv1 = _conv(c_in, c_out, 3, bias=False)
        self.norm2 = ConditionalBatchNorm2d(c_out, cond_dim)
        self.conv2 = _conv(c_out, c_out, 3, bias=False)
        self.shortcut = _conv(c_in, c_out, 1, bias=False)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        h = F.interpolate(F.relu(self.norm1(x, cond)), scale_factor=2, mode="nearest")
        h = self.conv2(F.relu(self.norm2(self.conv1(h), cond)))
        return h + self.shortcut(F.interpolate(x, scale_factor=2, mode="nearest"))


class DBlock(nn.Module):
    """(ReLU ->) 3x3 conv -> ReLU -> 3x3 conv (-> 2x2 avg-pool), plus a 1x1 conv shortcut where shapes change.

    The first block sees the image itself, so it has no leading ReLU and pools before its
    shortcut conv (cheaper, and the image is not rectified); later blocks convolve, then pool.
    """

    def __init__(self, c_in: int, c_out: int, first: bool, downsample: bool):
        super().__init__()
        self.first, self.downsample = first, downsample
        self.conv1 = _conv(c_in, c_out, 3)
        self.conv2 = _conv(c_out, c_out, 3)
        self.shortcut = _conv(c_in, c_out, 1) if c_in != c_out or downsample else None

    def _pool(self, x: Tensor) -> Tensor:
        return F.avg_pool2d(x, 2) if self.downsample else x

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(x if self.first else F.relu(x))
        h = self._pool(self.conv2(F.relu(h)))
        if self.shortcut is None:
            return h + x
        skip = self.shortcut(self._pool(x)) if self.first else self._pool(self.shortcut(x))
        return h + skip


class BigGANGenerator(nn.Module):
    """G(z, y): class-conditional ResNet generator with a hierarchical latent and a shared embedding."""

    def __init__(self, resolution: int = 128, ch: int = 64, z_dim: int = 120, n_classes: int = 1000,
                 channels: int = 3, shared_dim: int = 128, attn_resolution: int = 32):
        super().__init__()
        check_resolution(resolution)
        widths = [ch * m for m in G_MULTIPLIERS[resolution]]
        n_blocks = len(widths) - 1
        if z_dim < n_blocks + 1:
            raise ConfigError("model.z_dim", f"z_dim {z_dim} cannot give each of the {n_blocks + 1} slots "
                              "(4x4 input and every block) a chunk of z", f"use z_dim >= {n_blocks + 1}")
        chunk = z_dim // (n_blocks + 1)
        self.z_dim, self.n_classes = z_dim, n_classes
        self.z_chunks = [z_dim - chunk * n_blocks] + [chunk] * n_blocks  # the 4x4 input takes the remainder
        self.shared = nn.Embedding(n_classes, shared_dim)
        nn.init.orthogonal_(self.shared.weight)
        self.linear = orthogonal_spectral(nn.Linear(self.z_chunks[0], widths[0] * BOTTOM * BOTTOM))
        self.blocks = nn.ModuleList(GBlock(c_in, c_out, shared_dim + chunk) for c_in, c_out in zip(widths, widths[1:]))
        levels = [BOTTOM * 2 ** (i + 1) for i in range(n_blocks)]
        self.attention_after = attention_block(levels, attn_resolution)
        self.attention = SelfAttention(widths[self.attention_after + 1]) if self.attention_after is not None else None
        self.output = nn.Sequential(nn.BatchNorm2d(widths[-1]), nn.ReLU(), _conv(widths[-1], channels, 3), nn.Tanh())

    def forward(self, z: Tensor, y: Tensor) -> Tensor:
        first, *per_block = z.split(self.z_chunks, dim=1)
        shared = self.shared(y)
        x = self.linear(first).view(z.shape[0], -1, BOTTOM, BOTTOM)
        for i, (block, z_block) in enumerate(zip(self.blocks, per_block)):
            x = block(x, torch.cat([shared, z_block], dim=1))
            if i == self.attention_after:
                x = self.attention(x)
        return self.output(x)


class BigGANDiscriminator(nn.Module):
    """D(x, y): ResNet discriminator with a projection head; returns (N, 1) logits."""

    def __init__(self, resolution: int = 128, ch: int = 64, n_classes: int = 1000, channels: int = 3,
                 attn_resolution: int = 32):
        super().__init__()
        check_resolution(resolution)
        widths = [ch * m for m in D_MULTIPLIERS[resolution]]
        downsamplings = int(math.log2(resolution // BOTTOM))
        self.blocks = nn.ModuleList(
            DBlock(c_in, c_out, first=i == 0, downsample=i < downsamplings)
            for i, (c_in, c_out) in enumerate(zip([channels, *widths], widths)))
        levels = [max(BOTTOM, resolution // 2 ** (i + 1)) for i in range(len(widths))]
        self.attention_after = attention_block(levels, attn_resolution)
        self.attention = SelfAttention(widths[self.attention_after]) if self.attention_after is not None else None
        self.linear = orthogonal_spectral(nn.Linear(widths[-1], 1))
        embed = nn.Embedding(n_classes, widths[-1])
        nn.init.orthogonal_(embed.weight)
        self.embed = spectral_norm(embed)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == self.attention_after:
                x = self.attention(x)
        features = F.relu(x).sum(dim=(2, 3))
        projection = (self.embed(y) * features).sum(dim=1, keepdim=True)
        return self.linear(features) + projection
