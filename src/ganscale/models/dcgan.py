"""DCGAN (Radford et al. 2015): transposed-conv G with BatchNorm, strided-conv D.

Resolution is any power of two >= 8: G starts from a 4x4 map and doubles it, D halves it
down to 4x4 and ends with a 4x4 convolution to one logit.
"""

from __future__ import annotations

import math

from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm


def _dcgan_init(module: nn.Module) -> None:
    # N(0, 0.02) for convolutions, N(1, 0.02) for BatchNorm scale (the DCGAN paper's init).
    for layer in module.modules():
        if isinstance(layer, (nn.Conv2d, nn.ConvTranspose2d, nn.Linear)):
            nn.init.normal_(layer.weight, 0.0, 0.02)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)
        elif isinstance(layer, nn.BatchNorm2d):
            nn.init.normal_(layer.weight, 1.0, 0.02)
            nn.init.zeros_(layer.bias)


class DCGANGenerator(nn.Module):
    def __init__(self, z_dim: int, channels: int, resolution: int, width: int = 64, batchnorm: bool = True):
        super().__init__()
        self.z_dim = z_dim
        doublings = int(math.log2(resolution)) - 2
        widths = [width * 2 ** i for i in reversed(range(doublings))]  # e.g. [256, 128, 64]

        def norm(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if batchnorm else nn.Identity()

        layers: list[nn.Module] = [nn.ConvTranspose2d(z_dim, widths[0], 4, 1, 0, bias=not batchnorm),
                                   norm(widths[0]), nn.ReLU(inplace=True)]
        for c_in, c_out in zip(widths, widths[1:]):
            layers += [nn.ConvTranspose2d(c_in, c_out, 4, 2, 1, bias=not batchnorm), norm(c_out), nn.ReLU(inplace=True)]
        layers += [nn.ConvTranspose2d(widths[-1], channels, 4, 2, 1), nn.Tanh()]
        self.net = nn.Sequential(*layers)
        _dcgan_init(self)

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z.view(z.shape[0], self.z_dim, 1, 1))


class DCGANDiscriminator(nn.Module):
    def __init__(self, channels: int, resolution: int, width: int = 64, spectral: bool = False):
        super().__init__()
        halvings = int(math.log2(resolution)) - 2
        widths = [width * 2 ** i for i in range(halvings)]  # e.g. [64, 128, 256]
        wrap = spectral_norm if spectral else (lambda m: m)
        layers: list[nn.Module] = []
        for c_in, c_out in zip([channels, *widths], widths):
            layers += [wrap(nn.Conv2d(c_in, c_out, 4, 2, 1)), nn.LeakyReLU(0.2, inplace=True)]
        layers += [wrap(nn.Conv2d(widths[-1], 1, 4, 1, 0))]
        self.net = nn.Sequential(*layers)
        _dcgan_init(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x).flatten(1)
