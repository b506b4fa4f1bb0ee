"""A class-conditional G (the class's embedding joins the latent) and a projection D (Miyato & Koyama 2018: the
logit gets the inner product of the class's embedding and D's features), for 8x8 grey images.

ganscale calls G(z, labels) and D(x, labels) for model.task=class-conditional.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.utils import spectral_norm


class ConditionalGenerator(nn.Module):
    """[z, embedding(label)] -> a 4x4 map -> 8x8 -> Tanh."""

    def __init__(self, z_dim: int = 32, n_classes: int = 10, width: int = 64, channels: int = 1):
        super().__init__()
        self.width = width
        self.embed = nn.Embedding(n_classes, z_dim)
        self.start = nn.Linear(2 * z_dim, width * 16)
        self.body = nn.Sequential(nn.LeakyReLU(0.2), nn.Upsample(scale_factor=2),
                                  nn.Conv2d(width, width // 2, 3, padding=1), nn.LeakyReLU(0.2),
                                  nn.Conv2d(width // 2, channels, 3, padding=1), nn.Tanh())

    def forward(self, z: Tensor, labels: Tensor) -> Tensor:
        h = self.start(torch.cat([z, self.embed(labels)], 1)).view(-1, self.width, 4, 4)
        return self.body(h)


class ProjectionDiscriminator(nn.Module):
    """Spectrally normalised strided convs to features h; logit = w.h + <embedding(label), h>."""

    def __init__(self, n_classes: int = 10, width: int = 64, channels: int = 1):
        super().__init__()
        self.features = nn.Sequential(spectral_norm(nn.Conv2d(channels, width // 2, 4, 2, 1)), nn.LeakyReLU(0.2),
                                      spectral_norm(nn.Conv2d(width // 2, width, 4, 2, 1)), nn.LeakyReLU(0.2),
                                      nn.Flatten(), spectral_norm(nn.Linear(width * 4, width)), nn.LeakyReLU(0.2))
        self.logit = spectral_norm(nn.Linear(width, 1))
        self.embed = spectral_norm(nn.Embedding(n_classes, width))

    def forward(self, x: Tensor, labels: Tensor) -> Tensor:
        h = self.features(x)
        return self.logit(h).squeeze(1) + (self.embed(labels) * h).sum(1)
