"""`ganscale bench throughput --engine tensorflow`: the tensorflow engine's DCGAN iteration, timed as the torch row's.

One iteration is the engine's own D step then G step (ganscale.tf.step.Steps on one replica: tf.function graphs,
the all-reduce, the host's finite check and Adam), on the torch row's model (DCGAN, z 100, RGB), batch and fixed
random reals.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import tensorflow as tf

from ganscale.tf import devices
from ganscale.tf.models import POLICIES, dcgan_discriminator, dcgan_generator
from ganscale.tf.step import Steps, adam

Z_DIM, CHANNELS = 100, 3  # bench.throughput's DCGAN


def use_threads(threads: int) -> None:
    """TensorFlow's CPU thread pools, as torch.set_num_threads; a runtime already started keeps its own."""
    try:
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
    except RuntimeError:
        pass


def measure(batch: int, resolution: int, width: int, device: str, precision: str, iters: int, warmup: int) -> dict:
    """images/s of `iters` timed iterations (median) after `warmup` untimed ones."""
    import keras

    strategy = devices.strategy(1, device)
    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy(POLICIES[precision])
    try:
        with strategy.scope():
            G = dcgan_generator(Z_DIM, CHANNELS, resolution, width, True, False)
            D = dcgan_discriminator(CHANNELS, resolution, width)
            steps = Steps(strategy, G, D, adam(1e-4, (0.0, 0.999)), adam(4e-4, (0.0, 0.999)), "nonsaturating",
                          batch, 0.0)
    finally:
        keras.config.set_dtype_policy("float32")
    rng = np.random.default_rng(0)

    def one(values: np.ndarray):  # (accumulation 1, batch, ...) on the one replica
        return strategy.experimental_distribute_values_from_function(lambda _: tf.constant(values[None]))

    reals = one(rng.uniform(-1, 1, (batch, resolution, resolution, CHANNELS)).astype(np.float32))
    z = one(rng.standard_normal((batch, Z_DIM)).astype(np.float32))

    def iteration() -> None:
        steps.discriminator(reals, z)
        steps.generator(z)

    for _ in range(warmup):
        iteration()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        iteration()  # each step reads its loss back on the host: the work is done when it returns
        times.append(time.perf_counter() - started)
    step = statistics.median(times)
    return {"engine": "tensorflow", "model": "dcgan", "resolution": resolution, "width": width, "batch": batch,
            "precision": precision, "params_G": _trainable(G), "params_D": _trainable(D),
            "iter_median_s": step, "iter_min_s": min(times), "iter_max_s": max(times), "img_per_s": batch / step}


def _trainable(net) -> int:
    """Trainable parameters, as the torch row counts them (not BatchNorm's moving statistics)."""
    return sum(int(np.prod(w.shape)) for w in net.trainable_weights)
