"""pix2pix (Isola et al. 2017): U-Net generator and 70x70 PatchGAN discriminator.

Matches the reference implementation's defaults (`unet_256`, `basic` D, ngf = ndf = 64):
54,413,955 parameters in G and 2,768,705 in D with BatchNorm. The U-Net is written flat, as
two lists of blocks and an explicit loop, instead of the reference's nested recursive block;
the arithmetic is the same. It takes any power-of-two resolution (log2(resolution) levels,
down to a 1x1 bottleneck), so small CPU tests can run it at 32 or 64 pixels; 256 is the
reference.

Top-level children, in execution order (for a later pipeline split into consecutive stages):
`down[0] .. down[n-1]`, then `up[0] .. up[n-1]` (up[0] is the innermost decoder block, up[n-1]
produces the image). Down block i's output is the skip consumed by up block n-1-i (for i < n-1;
the innermost output feeds up[0] directly), so a stage boundary must carry the current
activation plus every skip not yet consumed.

Dropout (0.5, in the non-innermost decoder blocks of width 8 * ngf: three at 256) is pix2pix's
only noise source; the reference keeps it on at test time as well. Its masks are a function of each
sample's seed (`ganscale.randomness`), which the trainer derives from the latents it draws per global sample
position: a sample gets the same mask on any rank and in any micro-step, so N ranks train as one process.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ganscale.config import ConfigError
from ganscale.models.layers import conv_bias, norm_layer, normal_init
from ganscale.randomness import SampleDropout

MAX_WIDTH_FACTOR = 8  # widths are ngf * min(2**level, 8): 64, 128, 256, 512, 512, ...


class DownBlock(nn.Module):
    """LeakyReLU(0.2) -> 4x4 stride-2 conv -> norm; the outermost has no activation, outer- and innermost no norm."""

    def __init__(self, c_in: int, c_out: int, norm: str, outermost: bool = False, innermost: bool = False):
        super().__init__()
        self.act = nn.Identity() if outermost else nn.LeakyReLU(0.2)
        self.conv = nn.Conv2d(c_in, c_out, 4, 2, 1, bias=conv_bias(norm))
        self.norm = nn.Identity() if outermost or innermost else norm_layer(norm, c_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.conv(self.act(x)))


class UpBlock(nn.Module):
    """ReLU -> 4x4 stride-2 transposed conv -> norm (-> dropout); the outermost ends with Tanh instead of norm."""

    def __init__(self, c_in: int, c_out: int, norm: str, outermost: bool = False, dropout: int | None = None):
        super().__init__()
        self.act = nn.ReLU()
        # The image-producing conv has no norm after it, so it keeps its bias whatever the norm.
        self.conv = nn.ConvTranspose2d(c_in, c_out, 4, 2, 1, bias=outermost or conv_bias(norm))
        self.norm = nn.Tanh() if outermost else norm_layer(norm, c_out)
        self.dropout = SampleDropout(0.5, salt=dropout) if dropout is not None else None  # `dropout`: its salt

    def forward(self, x: Tensor, seeds: Tensor | None = None) -> Tensor:
        x = self.norm(self.conv(self.act(x)))
        return self.dropout(x, seeds) if self.dropout is not None else x


def _levels(resolution: int, key: str) -> int:
    levels = int(math.log2(resolution)) if resolution > 0 else 0
    if levels < 3 or 2 ** levels != resolution:
        raise ConfigError(key, f"resolution {resolution} is not a power of two >= 8",
                          "use 256 (the reference) or another power of two such as 32, 64, 128")
    return levels


class UNetGenerator(nn.Module):
    """Image-to-image U-Net: log2(resolution) stride-2 levels, skips by channel concatenation, Tanh out."""

    def __init__(self, in_channels: int = 3, out_channels: int = 3, resolution: int = 256, ngf: int = 64,
                 norm: str = "batch"):
        super().__init__()
        levels = _levels(resolution, "data.crop_size")
        widths = [ngf * min(2 ** i, MAX_WIDTH_FACTOR) for i in range(levels)]  # encoder outputs, outer to inner
        self.down = nn.ModuleList(
            DownBlock(c_in, c_out, norm, outermost=i == 0, innermost=i == levels - 1)
            for i, (c_in, c_out) in enumerate(zip([in_channels, *widths], widths)))
        up: list[UpBlock] = [UpBlock(widths[-1], widths[-2], norm)]  # innermost: its input has no skip
        for level in reversed(range(1, levels - 1)):  # decoder block producing level-1's width
            c_out = widths[level - 1]
            dropout = len(up) if c_out == ngf * MAX_WIDTH_FACTOR else None  # salted with the block's index
            up.append(UpBlock(2 * widths[level], c_out, norm, dropout=dropout))
        up.append(UpBlock(2 * widths[0], out_channels, norm, outermost=True))
        self.up = nn.ModuleList(up)
        normal_init(self)

    def forward(self, x: Tensor, seeds: Tensor | None = None) -> Tensor:
        """`seeds`: one per sample, for the dropout masks (`sample_seeds`); None: the process's RNG stream."""
        skips: list[Tensor] = []
        for block in self.down:
            x = block(x)
            skips.append(x)
        x = self.up[0](skips.pop(), seeds)
        for block in self.up[1:]:
            x = block(torch.cat([skips.pop(), x], 1), seeds)  # [skip, decoded], the reference's order
        return x


class PatchDiscriminator(nn.Module):
    """PatchGAN: a grid of logits, each judging one receptive field (70x70 with n_layers 3).

    Input is the condition and the (real or generated) output concatenated on channels. Three
    stride-2 convs, one stride-1 conv, then a stride-1 conv to one logit per patch: 30x30 logits
    for a 256x256 input. Losses average over the patches.
    """

    def __init__(self, in_channels: int = 6, ndf: int = 64, n_layers: int = 3, norm: str = "batch"):
        super().__init__()
        bias = conv_bias(norm)
        layers: list[nn.Module] = [nn.Conv2d(in_channels, ndf, 4, 2, 1), nn.LeakyReLU(0.2)]
        width = ndf
        for n in range(1, n_layers + 1):
            stride = 2 if n < n_layers else 1  # the last widening conv keeps the resolution
            c_out = ndf * min(2 ** n, MAX_WIDTH_FACTOR)
            layers += [nn.Conv2d(width, c_out, 4, stride, 1, bias=bias), norm_layer(norm, c_out), nn.LeakyReLU(0.2)]
            width = c_out
        layers.append(nn.Conv2d(width, 1, 4, 1, 1))
        self.net = nn.Sequential(*layers)
        normal_init(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
