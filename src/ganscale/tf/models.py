"""Keras G and D mirroring ganscale.models.mlp and ganscale.models.dcgan: the same layers and widths.

Images are channels-last here (N, H, W, C); the feed and the samples convert at the boundary. BatchNorm keeps
PyTorch's momentum (0.1, Keras' 0.9) and eps (1e-5); `synchronized=True` pools its statistics over every replica's
micro-batch (parallel.sync_bn). DCGAN's initialisation is the paper's, as in dcgan.py.
train.precision=bf16 is Keras' mixed_bfloat16 policy on every layer (fp32 weights, bf16 compute, as torch's autocast),
fp16 its mixed_float16 (with loss scaling: step.py); G's output and D's logits are fp32 either way: the losses and
the reals D sees stay fp32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import keras
from keras import layers

from ganscale.config import Config



def dcgan_init(mean: float = 0.0) -> keras.initializers.Initializer:
    """A new N(mean, 0.02) initializer per layer: Keras seeds one when it is made, from the Python RNG that
    keras.utils.set_random_seed seeds (one made at import would draw another seed in each process, and every layer
    sharing it the same values)."""
    return keras.initializers.RandomNormal(mean, 0.02)


def _batchnorm(synchronized: bool, gamma: keras.initializers.Initializer | str = "ones") -> layers.Layer:
    return layers.BatchNormalization(momentum=0.9, epsilon=1e-5, synchronized=synchronized,
                                     gamma_initializer=gamma)


def mlp_generator(z_dim: int, out_dim: int, width: int, hidden: int, batchnorm: bool, sync: bool) -> keras.Model:
    net = [keras.Input((z_dim,))]
    for _ in range(hidden):
        net += [layers.Dense(width), _batchnorm(sync) if batchnorm else layers.Identity(), layers.ReLU()]
    return keras.Sequential([*net, layers.Dense(out_dim)], name="G")


def mlp_discriminator(in_dim: int, width: int, hidden: int) -> keras.Model:
    net = [keras.Input((in_dim,))]
    for _ in range(hidden):
        net += [layers.Dense(width), layers.LeakyReLU(0.2)]
    return keras.Sequential([*net, layers.Dense(1)], name="D")


def dcgan_generator(z_dim: int, channels: int, resolution: int, width: int, batchnorm: bool,
                    sync: bool) -> keras.Model:
    """From a 4x4 map (a 4x4 transposed convolution of z), doubled per layer up to `resolution`."""
    doublings = int(math.log2(resolution)) - 2
    widths = [width * 2 ** i for i in reversed(range(doublings))]  # e.g. [256, 128, 64]

    def block(filters: int, strides: int, padding: str) -> list[layers.Layer]:
        return [layers.Conv2DTranspose(filters, 4, strides, padding, use_bias=not batchnorm,
                                       kernel_initializer=dcgan_init()),
                _batchnorm(sync, dcgan_init(1.0)) if batchnorm else layers.Identity(), layers.ReLU()]

    net = [keras.Input((z_dim,)), layers.Reshape((1, 1, z_dim)), *block(widths[0], 1, "valid")]
    for filters in widths[1:]:
        net += block(filters, 2, "same")
    net += [layers.Conv2DTranspose(channels, 4, 2, "same", kernel_initializer=dcgan_init()),
            layers.Activation("tanh")]
    return keras.Sequential(net, name="G")


def dcgan_discriminator(channels: int, resolution: int, width: int) -> keras.Model:
    """Strided 4x4 convolutions halving down to 4x4, then a 4x4 convolution to one logit."""
    halvings = int(math.log2(resolution)) - 2
    net: list = [keras.Input((resolution, resolution, channels))]
    for i in range(halvings):
        net += [layers.Conv2D(width * 2 ** i, 4, 2, "same", kernel_initializer=dcgan_init()), layers.LeakyReLU(0.2)]
    net += [layers.Conv2D(1, 4, 1, "valid", kernel_initializer=dcgan_init()), layers.Flatten()]
    return keras.Sequential(net, name="D")


POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}


def build_generator(cfg: Config, sync_bn: bool, name: str = "G") -> keras.Model:
    m, d = cfg.model, cfg.data
    with _policy(cfg.train.precision):
        if m.kind == "mlp":
            net = mlp_generator(m.z_dim, 2, m.g_width, m.g_layers, m.g_batchnorm, sync_bn)
        else:
            net = dcgan_generator(m.z_dim, d.channels, d.resolution, m.g_width, m.g_batchnorm, sync_bn)
    net.name = name
    return _fp32_output(net, name)


def build_discriminator(cfg: Config) -> keras.Model:
    m, d = cfg.model, cfg.data
    with _policy(cfg.train.precision):
        if m.kind == "mlp":
            net = mlp_discriminator(2, m.d_width, m.d_layers)
        else:
            net = dcgan_discriminator(d.channels, d.resolution, m.d_width)
    return _fp32_output(net, "D")


@contextlib.contextmanager
def _policy(precision: str) -> Iterator[None]:
    """Layers built inside take train.precision's dtype policy (Keras reads the global one when a layer is made)."""
    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(POLICIES[precision])
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


def _fp32_output(net: keras.Model, name: str) -> keras.Model:
    if net.compute_dtype == "float32":
        return net
    return keras.Sequential([net, layers.Activation("linear", dtype="float32")], name=name)
