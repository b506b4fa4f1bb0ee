"""Single-device networks. Parallelism is applied to them later, never inside them."""

from __future__ import annotations

import torch
from torch import nn

from ganscale.config import Config
from ganscale.models.dcgan import DCGANDiscriminator, DCGANGenerator
from ganscale.models.mlp import MLPDiscriminator, MLPGenerator


def build_networks(cfg: Config) -> tuple[nn.Module, nn.Module]:
    """G and D for a config, initialised from `train.seed` (identical on every rank)."""
    m, d = cfg.model, cfg.data
    torch.manual_seed(cfg.train.seed)
    if m.kind == "mlp":
        G = MLPGenerator(m.z_dim, 2, m.g_width, m.g_layers, m.g_batchnorm)
        D = MLPDiscriminator(2, m.d_width, m.d_layers, m.d_spectral_norm)
    else:
        G = DCGANGenerator(m.z_dim, d.channels, d.resolution, m.g_width, m.g_batchnorm)
        D = DCGANDiscriminator(d.channels, d.resolution, m.d_width, m.d_spectral_norm)
    return G, D
