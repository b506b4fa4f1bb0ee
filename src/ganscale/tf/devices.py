"""The replicas: MirroredStrategy over the visible GPUs, or over N logical devices split from the CPU.

A CPU is split before TensorFlow's runtime starts (it cannot be split after), and the strategy is given the device
names: a default MirroredStrategy treats every CPU as one device (tensorflow#57743). TensorFlow's own tests split
a CPU the same way.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from ganscale.config import ConfigError


def _split_cpu(replicas: int) -> None:
    """At least `replicas` logical CPU devices; a runtime already started with fewer is a ConfigError."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    present = tf.config.get_logical_device_configuration(cpu)
    if present is not None and len(present) >= replicas:
        return
    try:
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
    except RuntimeError:  # the runtime already started in this process, with fewer devices
        raise ConfigError("--nproc", f"this process's TensorFlow runtime already runs with fewer than {replicas} "
                          "CPU devices", "start a new process for this run") from None


def strategy(replicas: int | None, device: str) -> tf.distribute.MirroredStrategy:
    """MirroredStrategy over `replicas` devices: the first GPUs (all visible ones when None), or logical CPUs on a
    machine without GPUs or with train.device=cpu."""
    gpus = [] if device == "cpu" else tf.config.list_physical_devices("GPU")
    if device == "cuda" and not gpus:
        raise ConfigError("train.device", "cuda, but TensorFlow sees no GPU", "set train.device=auto or cpu")
    if gpus:
        wanted = replicas or len(gpus)
        if wanted > len(gpus):
            raise ConfigError("--nproc", f"{wanted} replicas, but TensorFlow sees {len(gpus)} GPU(s)",
                              f"pass --nproc {len(gpus)} or fewer")
        return _mirrored(tuple(f"/gpu:{i}" for i in range(wanted)))
    wanted = replicas or 1
    _split_cpu(wanted)
    return _mirrored(tuple(f"/cpu:{i}" for i in range(wanted)))


@functools.cache
def _mirrored(devices: tuple[str, ...]) -> tf.distribute.MirroredStrategy:
    """One strategy per device set and process: a second one over the same devices numbers its collectives from the
    same keys, and TensorFlow takes them for the first's (a shape mismatch aborts both)."""
    return tf.distribute.MirroredStrategy(list(devices))


def on_gpus(strategy: tf.distribute.MirroredStrategy) -> bool:
    return any("GPU" in device.upper() for device in strategy.extended.worker_devices)


def worker_gpus(device: str) -> int:
    """The GPUs this worker trains on; train.device=cpu hides them from TensorFlow (before its runtime starts)."""
    if device == "cpu":
        tf.config.set_visible_devices([], "GPU")
        return 0
    gpus = len(tf.config.list_physical_devices("GPU"))
    if device == "cuda" and not gpus:
        raise ConfigError("train.device", "cuda, but TensorFlow sees no GPU", "set train.device=auto or cpu")
    return gpus


def multi_worker() -> tf.distribute.MultiWorkerMirroredStrategy:
    """MultiWorkerMirroredStrategy over the cluster TF_CONFIG describes (`workers.join` sets it): every worker's
    GPUs, or its CPU as one replica. It must exist before this process runs any TensorFlow op."""
    return tf.distribute.MultiWorkerMirroredStrategy()
