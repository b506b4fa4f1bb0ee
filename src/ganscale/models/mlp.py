"""MLP G and D for 2D data (the PacGAN/VEEGAN mixture benchmarks: 4 x 400 FC G with BN + ReLU)."""

from __future__ import annotations

from torch import Tensor, nn
from torch.nn.utils.parametrizations import spectral_norm


class MLPGenerator(nn.Module):
    def __init__(self, z_dim: int, out_dim: int = 2, width: int = 400, layers: int = 4, batchnorm: bool = True):
        super().__init__()
        self.z_dim = z_dim
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [nn.Linear(z_dim if i == 0 else width, width),
                       nn.BatchNorm1d(width) if batchnorm else nn.Identity(), nn.ReLU(inplace=True)]
        blocks.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*blocks)

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)


class MLPDiscriminator(nn.Module):
    def __init__(self, in_dim: int = 2, width: int = 200, layers: int = 3, spectral: bool = False):
        super().__init__()
        wrap = spectral_norm if spectral else (lambda m: m)
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [wrap(nn.Linear(in_dim if i == 0 else width, width)), nn.LeakyReLU(0.2, inplace=True)]
        blocks.append(wrap(nn.Linear(width, 1)))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
