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
            # No bias before BatchNorm: it subtracts it, and its gradient, zero up to rounding, Adam scales to steps of
            # the learning rate that differ with the summation order (1 vs N processes), moving the running mean.
            blocks += [nn.Linear(z_dim if i == 0 else width, width, bias=not batchnorm),
                       nn.BatchNorm1d(width) if batchnorm else nn.Identity(), nn.ReLU(inplace=True)]
        blocks.append(nn.Linear(width, out_dim))
        self.net = nn.Sequential(*blocks)

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)


class Maxout(nn.Module):
    """Max over `pieces` consecutive groups of features: (N, width * pieces) -> (N, width)."""

    def __init__(self, pieces: int):
        super().__init__()
        self.pieces = pieces

    def forward(self, x: Tensor) -> Tensor:
        return x.unflatten(1, (-1, self.pieces)).amax(2)


class MLPDiscriminator(nn.Module):
    """FC D. `pack` > 1 is PacGAN (Lin et al. 2018): D judges `pack` consecutive samples at once, its input
    (B, d) seen as (B / pack, pack * d), and returns B / pack logits. `maxout` > 0: maxout units with that many
    pieces (PacGAN's 2D D: 5) instead of LeakyReLU(0.2)."""

    def __init__(self, in_dim: int = 2, width: int = 200, layers: int = 3, spectral: bool = False, pack: int = 1,
                 maxout: int = 0):
        super().__init__()
        self.pack = pack
        wrap = spectral_norm if spectral else (lambda m: m)
        pieces = maxout or 1
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [wrap(nn.Linear(pack * in_dim if i == 0 else width, width * pieces)),
                       Maxout(maxout) if maxout else nn.LeakyReLU(0.2, inplace=True)]
        blocks.append(wrap(nn.Linear(width, 1)))
        self.net = nn.Sequential(*blocks)

    def forward(self, x: Tensor) -> Tensor:
        if self.pack > 1:
            if x.shape[0] % self.pack:
                raise ValueError(f"a batch of {x.shape[0]} does not split into packs of {self.pack} (model.pack)")
            x = x.reshape(x.shape[0] // self.pack, -1)
        return self.net(x)
