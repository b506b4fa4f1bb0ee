"""StyleGAN2 (Karras et al. 2020) in plain PyTorch, after the design of NVlabs' stylegan2-ada-pytorch.

G: a mapping network (z, and a label embedding when conditional, each normalised, then `mapping_layers` fully
connected layers at lr multiplier 0.01) gives w; a learned 4x4 constant is refined by modulated and demodulated
3x3 convolutions (one grouped convolution per layer, a weight per sample), each followed by per-pixel noise of
learned strength, a bias and leaky ReLU. Output architecture "skip": every resolution has a toRGB (a modulated 1x1
convolution without demodulation) and the images are upsampled and summed. Each layer takes its own w (`num_ws`
of them): style mixing switches samples, with probability `style_mixing`, to a second latent's w from a crossover
layer on. Truncation happens at sampling time: w_avg + psi (w - w_avg), w_avg a buffer that every training
forward refreshes from the mapping's current weights.
D: "resnet" architecture: fromRGB at full resolution, residual blocks halving the resolution down to 4x4 (skips
scaled by 1/sqrt 2), then minibatch standard deviation, a 3x3 convolution and two fully connected layers. A
conditional D projects its output onto a mapped label embedding (StyleGAN2-ADA's conditional mode).

Every weight is stored at unit scale and multiplied at run time by lr_multiplier / sqrt(fan_in) (equalised
learning rate). Channels at resolution r: min(channel_base // r, channel_max). Up- and downsampling are bilinear
interpolation and 2x2 average pooling rather than NVlabs' FIR-filtered (upfirdn2d) resampling.

Ranks equal one process: noise and style mixing draw per sample from `ganscale.randomness`, seeded by the sample's
latent (`sample_seeds(z)`), and the minibatch standard deviation takes groups of consecutive samples, which are
consecutive in the global batch as long as the group size divides every rank's micro-batch (preflight.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ganscale import randomness
from ganscale.config import ConfigError

RESOLUTIONS = tuple(2 ** k for k in range(3, 11))  # 8 .. 1024 pixels
MAPPING_LR = 0.01  # the mapping network learns 100x slower (StyleGAN's lr multiplier)
W_AVG_PROBE = 256  # latents whose mean w is w_avg (fixed, the same on every rank)
ACTIVATION_GAIN = math.sqrt(2)  # keeps leaky ReLU's output at unit variance
# randomness call sites: w_avg's latents, style mixing (two), noise (one salt per layer from here)
W_AVG_SALT, MIX_SALT, NOISE_SALT = 0x5345, 0x5346, 0x5348


def check_resolution(resolution: int) -> None:
    if resolution not in RESOLUTIONS:
        raise ConfigError("data.resolution", f"StyleGAN2 has no layout for resolution {resolution}",
                          f"use a power of two from {RESOLUTIONS[0]} to {RESOLUTIONS[-1]}")


def channels_at(resolution: int, channel_base: int, channel_max: int) -> int:
    return max(1, min(channel_base // resolution, channel_max))


def lrelu(x: Tensor) -> Tensor:
    return F.leaky_relu(x, 0.2) * ACTIVATION_GAIN


def normalize_2nd_moment(x: Tensor) -> Tensor:
    return x * (x.square().mean(dim=1, keepdim=True) + 1e-8).rsqrt()


class EqualLinear(nn.Module):
    """A fully connected layer with equalised learning rate: unit-scale weights times lr_mul / sqrt(fan_in)."""

    def __init__(self, in_features: int, out_features: int, bias_init: float = 0.0, lr_mul: float = 1.0,
                 activate: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) / lr_mul)
        self.bias = nn.Parameter(torch.full((out_features,), float(bias_init) / lr_mul))
        self.weight_gain, self.lr_mul, self.activate = lr_mul / math.sqrt(in_features), lr_mul, activate

    def forward(self, x: Tensor) -> Tensor:
        x = F.linear(x, self.weight * self.weight_gain, self.bias * self.lr_mul)
        return lrelu(x) if self.activate else x


class EqualConv2d(nn.Module):
    """A convolution with equalised learning rate; `down`: 2x2 average pooling after it."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, bias: bool = True, activate: bool = True,
                 down: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel, kernel))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        self.weight_gain, self.activate, self.down = 1 / math.sqrt(in_channels * kernel * kernel), activate, down

    def forward(self, x: Tensor) -> Tensor:
        x = F.conv2d(x, self.weight * self.weight_gain, self.bias, padding=self.weight.shape[-1] // 2)
        if self.down:
            x = F.avg_pool2d(x, 2)
        return lrelu(x) if self.activate else x


class MappingNetwork(nn.Module):
    """z (and a label's embedding) -> w. `z_dim=0`: labels only (the conditional D's label mapping)."""

    def __init__(self, z_dim: int, n_classes: int, w_dim: int, layers: int, lr_mul: float = MAPPING_LR):
        super().__init__()
        self.z_dim, self.n_classes = z_dim, n_classes
        self.embed = EqualLinear(n_classes, w_dim) if n_classes else None
        sizes = [z_dim + (w_dim if n_classes else 0)] + [w_dim] * layers
        self.layers = nn.Sequential(*(EqualLinear(a, b, lr_mul=lr_mul, activate=True) for a, b in zip(sizes, sizes[1:])))

    def forward(self, z: Tensor | None, labels: Tensor | None = None) -> Tensor:
        parts = [normalize_2nd_moment(z)] if self.z_dim else []
        if self.embed is not None:
            onehot = F.one_hot(labels.long(), self.n_classes).to(self.embed.weight.dtype)
            parts.append(normalize_2nd_moment(self.embed(onehot)))
        return self.layers(torch.cat(parts, dim=1))


class ModulatedConv2d(nn.Module):
    """A convolution whose weight each sample's style scales per input channel (modulation) and, with
    `demodulate`, rescales to unit output variance per output channel; run as one grouped convolution."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, w_dim: int, demodulate: bool = True,
                 up: bool = False):
        super().__init__()
        self.affine = EqualLinear(w_dim, in_channels, bias_init=1)  # styles start at 1: the plain convolution
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel, kernel))
        self.weight_gain = 1 / math.sqrt(in_channels * kernel * kernel)
        self.demodulate, self.up = demodulate, up

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        batch, in_channels, height, width = x.shape
        styles = self.affine(w)
        weight = self.weight[None] * self.weight_gain * styles[:, None, :, None, None]  # (N, out, in, k, k)
        if self.demodulate:
            weight = weight * (weight.square().sum(dim=(2, 3, 4), keepdim=True) + 1e-8).rsqrt()
        if self.up:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
            height, width = 2 * height, 2 * width
        out = F.conv2d(x.reshape(1, batch * in_channels, height, width), weight.flatten(0, 1),
                       padding=self.weight.shape[-1] // 2, groups=batch)
        return out.view(batch, -1, height, width)


class SynthesisLayer(nn.Module):
    """Modulated 3x3 convolution, per-pixel noise of learned strength (zero at start), bias, leaky ReLU."""

    def __init__(self, in_channels: int, out_channels: int, w_dim: int, salt: int, up: bool = False):
        super().__init__()
        self.conv = ModulatedConv2d(in_channels, out_channels, 3, w_dim, up=up)
        self.noise_strength = nn.Parameter(torch.zeros([]))
        self.bias = nn.Parameter(torch.zeros(out_channels))
        self.salt = salt

    def forward(self, x: Tensor, w: Tensor, seeds: Tensor) -> Tensor:
        x = self.conv(x, w)
        noise = randomness.normal(x, self.salt, (1, *x.shape[2:]), seeds)  # one map per sample, from its seed
        return lrelu(x + noise * self.noise_strength + self.bias[None, :, None, None])


class ToRGB(nn.Module):
    def __init__(self, in_channels: int, image_channels: int, w_dim: int):
        super().__init__()
        self.conv = ModulatedConv2d(in_channels, image_channels, 1, w_dim, demodulate=False)
        self.bias = nn.Parameter(torch.zeros(image_channels))

    def forward(self, x: Tensor, w: Tensor) -> Tensor:
        return self.conv(x, w) + self.bias[None, :, None, None]


class SynthesisBlock(nn.Module):
    """One resolution of the skip generator: (upsampling conv,) conv, toRGB; takes `num_ws` of the ws from
    `first_w` (the first block, 4x4, starts from the learned constant and has no upsampling conv)."""

    def __init__(self, in_channels: int, out_channels: int, resolution: int, image_channels: int, w_dim: int,
                 first_w: int):
        super().__init__()
        self.first_w, self.resolution = first_w, resolution
        salt = NOISE_SALT + 2 * resolution  # distinct per layer: resolutions are distinct powers of two
        if resolution == 4:
            self.const = nn.Parameter(torch.randn(out_channels, 4, 4))
            self.convs = nn.ModuleList([SynthesisLayer(out_channels, out_channels, w_dim, salt)])
        else:
            self.convs = nn.ModuleList([SynthesisLayer(in_channels, out_channels, w_dim, salt, up=True),
                                        SynthesisLayer(out_channels, out_channels, w_dim, salt + 1)])
        self.torgb = ToRGB(out_channels, image_channels, w_dim)
        self.num_ws = len(self.convs) + 1

    def forward(self, x: Tensor | None, image: Tensor | None, ws: Tensor, seeds: Tensor) -> tuple[Tensor, Tensor]:
        w = ws[:, self.first_w:self.first_w + self.num_ws].unbind(1)
        if x is None:
            # A copy, not a view: under no_grad a view of a parameter requires grad without a grad_fn, which
            # torch's module tracker (FlopCounterMode, bench throughput) cannot hook.
            x = self.const[None].repeat(ws.shape[0], 1, 1, 1)
        for conv, w_conv in zip(self.convs, w):
            x = conv(x, w_conv, seeds)
        rgb = self.torgb(x, w[-1])
        if image is not None:
            rgb = rgb + F.interpolate(image, scale_factor=2, mode="bilinear", align_corners=False)
        return x, rgb


class StyleGAN2Generator(nn.Module):
    """G(z, labels=None, psi=1.0) -> images in about [-1, 1] (in [-1, 1] with `output="tanh"`); labels only when
    `n_classes` > 0."""

    def __init__(self, resolution: int, z_dim: int, image_channels: int = 3, n_classes: int = 0,
                 mapping_layers: int = 8, channel_base: int = 32768, channel_max: int = 512,
                 style_mixing: float = 0.9, output: str = "linear"):
        super().__init__()
        check_resolution(resolution)
        self.z_dim, self.n_classes, self.style_mixing, self.output = z_dim, n_classes, style_mixing, output
        self.mapping = MappingNetwork(z_dim, n_classes, z_dim, mapping_layers)
        self.register_buffer("w_avg", torch.zeros(z_dim))
        blocks, first_w, in_channels = [], 0, 0
        for k in range(2, int(math.log2(resolution)) + 1):
            out_channels = channels_at(2 ** k, channel_base, channel_max)
            block = SynthesisBlock(in_channels, out_channels, 2 ** k, image_channels, z_dim, first_w)
            blocks.append(block)
            first_w += block.num_ws - 1  # a block's toRGB shares its w with the next block's first conv
            in_channels = out_channels
        self.blocks = nn.ModuleList(blocks)
        self.num_ws = first_w + 1

    def forward(self, z: Tensor, labels: Tensor | None = None, psi: float = 1.0, *,
                return_ws: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Images; with `return_ws`, (images, ws): the per-layer ws they were drawn from, (N, num_ws, w_dim),
        part of the graph (path length regularisation differentiates the images with respect to them)."""
        seeds = randomness.sample_seeds(z)
        w = self.mapping(z, labels)
        if self.training:
            self.track_w_avg()
        ws = self.truncate(w, psi)[:, None].expand(-1, self.num_ws, -1)
        if self.training and self.style_mixing > 0:
            ws = self.mix_styles(ws, z, labels, seeds)
        images = self.synthesize(ws, seeds)
        return (images, ws) if return_ws else images

    def synthesize(self, ws: Tensor, seeds: Tensor) -> Tensor:
        """Images from one w per layer, ws (N, num_ws, w_dim), with the noise drawn from `seeds` (`sample_seeds` of
        the latents): the synthesis network alone, for walks in w and style mixing at sampling time."""
        x = image = None
        for block in self.blocks:
            x, image = block(x, image, ws, seeds)
        return torch.tanh(image) if self.output == "tanh" else image

    @torch.no_grad()
    def track_w_avg(self) -> None:
        """w_avg follows the mapping's current weights: the mean w of fixed latents (and classes in turn).
        NVlabs track a moving average of each batch's mean w instead, which would differ between ranks and
        with the number of micro-batches; this estimate is the same on any number of ranks."""
        seeds = torch.arange(W_AVG_PROBE, device=self.w_avg.device)
        z = randomness.normal(self.w_avg.expand(W_AVG_PROBE, -1), W_AVG_SALT, (self.z_dim,), seeds)
        labels = seeds % self.n_classes if self.n_classes else None
        self.w_avg.copy_(self.mapping(z, labels).mean(0))

    def truncate(self, w: Tensor, psi: float) -> Tensor:
        """w pulled towards the tracked average: psi=1 leaves it, psi=0 gives w_avg."""
        return w if psi == 1 else self.w_avg.lerp(w, psi)

    def mix_styles(self, ws: Tensor, z: Tensor, labels: Tensor | None, seeds: Tensor) -> Tensor:
        """Each sample, with probability `style_mixing`, takes a second latent's w from a crossover layer on
        (drawn uniformly in 1 .. num_ws - 1); the draws come from the sample's seed."""
        draws = randomness.uniform(z, MIX_SALT, (2,), seeds)
        crossover = 1 + (draws[:, 1] * (self.num_ws - 1)).long()
        crossover = torch.where(draws[:, 0] < self.style_mixing, crossover, self.num_ws)
        second = self.mapping(randomness.normal(z, MIX_SALT + 1, (self.z_dim,), seeds), labels)
        later = torch.arange(self.num_ws, device=z.device)[None, :] >= crossover[:, None]
        return torch.where(later[:, :, None], second[:, None], ws)


class MinibatchStd(nn.Module):
    """Appends the standard deviation of features over groups of `group_size` consecutive samples (averaged to
    one value per group, broadcast as one channel). The caller's batch must split into whole groups."""

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size

    def forward(self, x: Tensor) -> Tensor:
        batch, channels, height, width = x.shape
        group = min(self.group_size, batch)
        if batch % group:
            raise ValueError(f"minibatch std: a batch of {batch} does not split into groups of {group}")
        y = x.view(batch // group, group, channels, height, width)
        std = (y.var(dim=1, unbiased=False) + 1e-8).sqrt().mean(dim=(1, 2, 3))  # one value per group
        return torch.cat([x, std.repeat_interleave(group).view(batch, 1, 1, 1).expand(-1, 1, height, width)], dim=1)


class DiscriminatorBlock(nn.Module):
    """Residual: two 3x3 convolutions (the second halving the resolution) plus a 1x1 downsampled skip,
    summed at 1/sqrt 2."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv0 = EqualConv2d(in_channels, in_channels, 3)
        self.conv1 = EqualConv2d(in_channels, out_channels, 3, down=True)
        self.skip = EqualConv2d(in_channels, out_channels, 1, bias=False, activate=False, down=True)

    def forward(self, x: Tensor) -> Tensor:
        return (self.skip(x) + self.conv1(self.conv0(x))) * math.sqrt(0.5)


class StyleGAN2Discriminator(nn.Module):
    """D(x, labels=None) -> (N, 1) logits; with `n_classes` > 0, projected onto the mapped label embedding."""

    def __init__(self, resolution: int, image_channels: int = 3, n_classes: int = 0, channel_base: int = 32768,
                 channel_max: int = 512, mbstd_group: int = 4, mapping_layers: int = 8):
        super().__init__()
        check_resolution(resolution)
        width = [channels_at(2 ** k, channel_base, channel_max) for k in range(int(math.log2(resolution)), 1, -1)]
        self.fromrgb = EqualConv2d(image_channels, width[0], 1)
        self.blocks = nn.Sequential(*(DiscriminatorBlock(a, b) for a, b in zip(width, width[1:])))
        self.mbstd = MinibatchStd(mbstd_group)
        self.conv = EqualConv2d(width[-1] + 1, width[-1], 3)
        self.fc = EqualLinear(width[-1] * 16, width[-1], activate=True)
        self.cmap_dim = width[-1] if n_classes else 0
        self.out = EqualLinear(width[-1], self.cmap_dim or 1)
        self.mapping = MappingNetwork(0, n_classes, self.cmap_dim, mapping_layers) if n_classes else None

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        x = self.conv(self.mbstd(self.blocks(self.fromrgb(x))))
        x = self.out(self.fc(x.flatten(1)))
        if self.mapping is None:
            return x
        cmap = self.mapping(None, labels)
        return (x * cmap).sum(dim=1, keepdim=True) / math.sqrt(self.cmap_dim)

