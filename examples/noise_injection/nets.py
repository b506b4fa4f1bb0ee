"""A StyleGAN-like G with noise injection and a D with dropout, whose randomness is the same on N ranks as on
one process: both draw it per sample through `ganscale.randomness`, not from torch's RNG.

G gets latents, so it seeds its noise from them (`sample_seeds(z)`): the same in training, in sample grids and in
metrics. D gets images, so its dropout takes the seeds the trainer sets for each row of its input (`batch_seeds`,
through `SampleDropout`); outside the trainer's steps it is off (eval mode) or draws from torch's RNG.

For the 8x8 digits: G(z_dim=32, channels=1, resolution=8) and D(channels=1, resolution=8).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ganscale.randomness import SampleDropout, normal, sample_seeds


class NoiseInjection(nn.Module):
    """StyleGAN's: one noise map per sample, shared by the channels, scaled by a learned weight per channel."""

    def __init__(self, channels: int, salt: int):
        super().__init__()
        self.salt = salt  # distinct per layer: each layer its own noise
        self.weight = nn.Parameter(torch.zeros(1, channels, 1, 1))

    def forward(self, x: Tensor, seeds: Tensor) -> Tensor:
        return x + self.weight * normal(x, self.salt, shape=(1, *x.shape[2:]), seeds=seeds)


class UpBlock(nn.Module):
    """2x nearest upsampling, 3x3 conv, noise, LeakyReLU(0.2)."""

    def __init__(self, c_in: int, c_out: int, salt: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.noise = NoiseInjection(c_out, salt)

    def forward(self, x: Tensor, seeds: Tensor) -> Tensor:
        x = self.conv(F.interpolate(x, scale_factor=2, mode="nearest"))
        return F.leaky_relu(self.noise(x, seeds), 0.2)


class NoiseInjectionGenerator(nn.Module):
    """z -> a 4x4 map -> doublings up to `resolution`, noise after every conv -> Tanh."""

    def __init__(self, z_dim: int = 32, channels: int = 1, resolution: int = 8, width: int = 64):
        super().__init__()
        self.z_dim, self.width = z_dim, width
        self.start = nn.Linear(z_dim, width * 16)
        self.start_noise = NoiseInjection(width, salt=0)
        self.blocks = nn.ModuleList(UpBlock(width, width, salt=i + 1) for i in range(int(math.log2(resolution)) - 2))
        self.to_image = nn.Conv2d(width, channels, 1)

    def forward(self, z: Tensor) -> Tensor:
        seeds = sample_seeds(z)  # per sample, from its latent: the same whichever rank draws it
        x = F.leaky_relu(self.start_noise(self.start(z).view(-1, self.width, 4, 4), seeds), 0.2)
        for block in self.blocks:
            x = block(x, seeds)
        return torch.tanh(self.to_image(x))


class DropoutDiscriminator(nn.Module):
    """Strided 4x4 convs down to 4x4, dropout after each, then one logit per sample."""

    def __init__(self, channels: int = 1, resolution: int = 8, width: int = 64, dropout: float = 0.2):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = channels
        for i in range(int(math.log2(resolution)) - 2):
            layers += [nn.Conv2d(c_in, width, 4, 2, 1), nn.LeakyReLU(0.2), SampleDropout(dropout, salt=i)]
            c_in = width
        self.features = nn.Sequential(*layers)
        self.logit = nn.Conv2d(c_in, 1, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.logit(self.features(x)).flatten(1)
