"""Single-device networks. Parallelism is applied to them later, never inside them."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import nn

from ganscale import usercode
from ganscale.config import Config, ConfigError, settings_in
from ganscale.models.biggan import BigGANDiscriminator, BigGANGenerator
from ganscale.models.dcgan import DCGANDiscriminator, DCGANGenerator
from ganscale.models.mlp import MLPDiscriminator, MLPGenerator
from ganscale.models.pix2pix import PatchDiscriminator, UNetGenerator
from ganscale.models.stylegan2 import StyleGAN2Discriminator, StyleGAN2Generator


def build_networks(cfg: Config) -> tuple[nn.Module, nn.Module]:
    """G and D for a config, initialised from `train.seed` (identical on every rank)."""
    m, d = cfg.model, cfg.data
    torch.manual_seed(cfg.train.seed)
    if m.kind == "mlp":
        G = MLPGenerator(m.z_dim, 2, m.g_width, m.g_layers, m.g_batchnorm)
        D = MLPDiscriminator(2, m.d_width, m.d_layers, m.d_spectral_norm, m.pack, m.d_maxout)
    elif m.kind == "biggan":
        G = BigGANGenerator(d.resolution, m.g_width, m.z_dim, m.n_classes, d.channels, m.shared_dim, m.attn_resolution)
        D = BigGANDiscriminator(d.resolution, m.d_width, m.n_classes, d.channels, m.attn_resolution)
    elif m.kind == "stylegan2":
        n_classes = m.n_classes if m.conditional else 0
        G = StyleGAN2Generator(d.resolution, m.z_dim, d.channels, n_classes, m.mapping_layers, m.channel_base,
                               m.channel_max, m.style_mixing, m.g_output)
        D = StyleGAN2Discriminator(d.resolution, d.channels, n_classes, m.channel_base, m.channel_max, m.mbstd_group,
                                   m.mapping_layers)
    elif m.kind == "custom":
        G = user_network(m.generator, m.generator_args, "model.generator", cfg.code_path)
        D = user_network(m.discriminator, m.discriminator_args, "model.discriminator", cfg.code_path)
    elif m.kind == "pix2pix":
        G = UNetGenerator(d.channels, d.channels, d.resolution, m.g_width, m.norm)
        D = PatchDiscriminator(2 * d.channels, m.d_width, norm=m.norm)
    else:
        G = DCGANGenerator(m.z_dim, d.channels, d.resolution, m.g_width, m.g_batchnorm)
        D = DCGANDiscriminator(d.channels, d.resolution, m.d_width, m.d_spectral_norm)
    return G, D


NETWORK_SHAPE = ("resolution", "channels")  # the data settings the networks are built from


def changed_settings(cfg: Config, written_config: str) -> str | None:
    """The model settings (and data resolution and channels) in which `cfg` differs from the config a checkpoint was
    written with (its YAML), the first three: "model.g_width is 64 here, 32 in the checkpoint's config"; None where
    they are alike or that config is unreadable."""
    written = settings_in(written_config)
    if not isinstance(written, dict):
        return None
    now = cfg.model_dump(mode="json")
    was_model, was_data = written.get("model") or {}, written.get("data") or {}
    differ = [(f"model.{key}", now["model"].get(key), value) for key, value in was_model.items()
              if now["model"].get(key) != value]
    differ += [(f"data.{key}", now["data"][key], was_data.get(key)) for key in NETWORK_SHAPE
               if key in was_data and was_data[key] != now["data"][key]]
    return "; ".join(f"{key} is {here!r} here, {there!r} in the checkpoint's config"
                     for key, here, there in differ[:3]) or None


def changed_networks(cfg: Config, written_config: str, networks: tuple[str, ...] = ("generator", "discriminator")
                     ) -> str | None:
    """Why a checkpoint written with `written_config` (its YAML) no longer fits the networks `cfg` builds although
    both configure them alike (model settings, data resolution and channels): their code changed; None where the
    configs differ (then the config is what to fix)."""
    written = settings_in(written_config)
    if not isinstance(written, dict):
        return None
    now = cfg.model_dump(mode="json")
    if written.get("model") != now["model"] or any(written.get("data", {}).get(k) != now["data"][k]
                                                   for k in NETWORK_SHAPE):
        return None
    m = cfg.model
    if m.kind == "custom":  # `networks`: the ones that were loaded
        code = " or ".join(f"model.{net} ({getattr(m, net)})" for net in networks)
        return f"its model settings are this run's, so the code of {code} changed since it was written"
    return f"its model settings are this run's, so ganscale's {m.kind} networks changed since (another version)"


# Share of pixels at exactly -1 from which a linear-output StyleGAN2 G is warned: MNIST at 32 px (85%) collapsed a
# small one (benchmarks/results/mnist-stylegan2-collapse-20261126.md); the digits at 16 px (29%) train.
BLANK_SHARE_WARNED = 0.5
BLANK_SAMPLES = 64


def output_warning(cfg: Config, dataset) -> str | None:
    """Why G's output layer may not suit the data: a linear-output StyleGAN2 G on images mostly at exactly -1
    (a blank background), which it can hold only by ceasing to vary with its latent; None otherwise."""
    if cfg.model.kind != "stylegan2" or cfg.model.g_output != "linear" or len(dataset) == 0:
        return None
    picked = torch.linspace(0, len(dataset) - 1, min(BLANK_SAMPLES, len(dataset))).long().tolist()
    # Read on rank 0 alone: a user's data set that draws random numbers must leave every rank's RNG as it was.
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        with torch.random.fork_rng(devices=[]):
            images = torch.stack([dataset[i][0] for i in picked])
    except Exception:  # noqa: BLE001 - only advice: a bad item fails where training reads it, on every rank
        return None
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    blank = float((images == -1).float().mean())
    if blank <= BLANK_SHARE_WARNED:
        return None
    return (f"{blank:.0%} of the data's pixels are exactly -1 (a blank background): a small StyleGAN2 G with a linear "
            "output collapsed to a few modes on such data (MNIST). Fix: set model.g_output=tanh")


def user_network(spec: str, args: dict, key: str, code_path: list[str]) -> nn.Module:
    """The user's network from its factory (model.kind=custom)."""
    network = usercode.build(spec, args, key, code_path, network=True)
    if not isinstance(network, nn.Module):
        raise ConfigError(key, f"{spec} returned a {type(network).__name__}, not a torch.nn.Module",
                          "return an nn.Module from the factory")
    return network


def meta_networks(cfg: Config) -> tuple[nn.Module, nn.Module]:
    """G and D on torch's meta device: their shapes without memory, and without touching the global RNG. A user's
    network whose __init__ needs real values (`.item()`, a seeded draw) is built on the CPU, then moved there."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return build_networks(cfg)
        except ConfigError:  # the user's factory failed: if it fails on the CPU too, that error is raised
            if cfg.model.kind != "custom":
                raise
        return tuple(network.to("meta") for network in build_networks(cfg))
