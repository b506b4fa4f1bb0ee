"""A tensorflow engine checkpoint as the torch engine's generators: what `ganscale export`, `eval` and `sample` read.

The Keras G and G_ema (ganscale.tf.models) have the torch models' layers in the same order, so each Keras layer
with weights fills the next torch module with weights: Dense -> Linear (kernel transposed), Conv2DTranspose ->
ConvTranspose2d (Keras' (h, w, out, in) kernel as torch's (in, out, h, w)), BatchNormalization -> BatchNorm
(gamma, beta, moving mean and variance; its step counter 0). The names are the torch engine's own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ganscale import checkpoint
from ganscale.config import ConfigError
from ganscale.rundir import config_at

GENERATORS = ("G", "G_ema")
TORCH_LAYERS = (nn.Linear, nn.ConvTranspose2d, nn.BatchNorm1d, nn.BatchNorm2d)


def torch_state(path: Path, fix: str) -> dict:
    """{"G", "G_ema": torch state dicts, "step", "config": the run's config text at that step} of the tensorflow
    checkpoint folder `path` (RUN_DIR/checkpoints/step-N.tf). ConfigError without TensorFlow or the run's config."""
    from ganscale.tf.capabilities import require_tensorflow

    require_tensorflow()
    import tensorflow as tf

    from ganscale.models import build_networks
    from ganscale.tf.loop import CHECKPOINT_PREFIX
    from ganscale.tf.models import build_generator

    path = Path(path)
    step = checkpoint.step_of(path)
    configured = config_at(path.parent.parent, step) if step is not None else None
    if configured is None:
        raise ConfigError(str(path), "a tensorflow checkpoint holds no config, and its run directory's config.yaml "
                          "is not beside its checkpoints/ folder", f"put back {path.parent.parent / 'config.yaml'}, "
                          "the config the run was trained with (the checkpoint cannot be read without it)")
    from ganscale.evaluate import configured_as

    text, cfg = configured.read_text(), configured_as(configured)  # a broken file: one line naming it
    nets = {name: build_generator(cfg, False, name=name) for name in GENERATORS}
    try:
        tf.train.Checkpoint(**nets).read(str(path / CHECKPOINT_PREFIX)).expect_partial().assert_existing_objects_matched()
    except (tf.errors.OpError, AssertionError, ValueError) as e:
        raise ConfigError(str(path), f"its generators do not fit {configured} ({str(e).splitlines()[0][:200]})",
                          fix) from None
    template = build_networks(cfg)[0]
    return {**{name: _as_torch(net, template, path, configured, fix) for name, net in nets.items()}, "step": step,
            "config": text}


def _as_torch(net, template: nn.Module, path: Path, configured: Path, fix: str) -> dict[str, torch.Tensor]:
    """The Keras generator `net`'s weights under the names of `template`'s state dict (the same model kind); a
    ConfigError naming the checkpoint `path` where the two do not pair up layer for layer."""
    keras_layers = [layer for layer in _flat(net) if layer.weights]
    torch_layers = [(name, module) for name, module in template.named_modules() if isinstance(module, TORCH_LAYERS)]
    if len(keras_layers) != len(torch_layers):
        raise ConfigError(str(path), f"its generator {net.name} has {len(keras_layers)} layers with weights, the torch "
                          f"model {configured} describes has {len(torch_layers)}: they are not the same model",
                          f"restore the model section of {configured} the run was trained with; {fix}")
    state = {}
    for layer, (prefix, module) in zip(keras_layers, torch_layers):
        for key, value in _tensors(layer, module).items():
            state[f"{prefix}.{key}"] = torch.from_numpy(np.ascontiguousarray(value))
    return state


def _tensors(layer, module: nn.Module) -> dict[str, np.ndarray]:
    values = [w.numpy() for w in layer.weights]
    if isinstance(module, nn.Linear):
        return {"weight": values[0].T, **({"bias": values[1]} if len(values) > 1 else {})}
    if isinstance(module, nn.ConvTranspose2d):
        return {"weight": values[0].transpose(3, 2, 0, 1), **({"bias": values[1]} if len(values) > 1 else {})}
    gamma, beta, mean, variance = (v.numpy() for v in (layer.gamma, layer.beta, layer.moving_mean,
                                                          layer.moving_variance))
    return {"weight": gamma, "bias": beta, "running_mean": mean, "running_var": variance,
            "num_batches_tracked": np.array(0, dtype=np.int64)}


def _flat(net):
    """The layers of `net`, a Sequential nested in another (bf16's fp32 output wrapper) walked into."""
    for layer in net.layers:
        yield from (_flat(layer) if hasattr(layer, "layers") else (layer,))
