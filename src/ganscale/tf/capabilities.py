"""What the tensorflow engine can take: every option it refuses, in one table, checked before anything starts.

Imports no framework: `ganscale train` refuses such a config (exit 2, the key and the alternative named) before
TensorFlow is imported or anything is written.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ganscale.config import SHIPPED_LOSSES, Config, ConfigError

MODELS = ("mlp", "dcgan")
DATA = ("digits", "mnist", "ring8", "grid25", "folder", "zip")  # the torch engine's readers (tf/feed.py)
LOSSES = tuple(kind for kind in SHIPPED_LOSSES if kind != "wgan-gp")
TORCH = "--set train.engine=torch"
TENSORFLOW_BUILDS = ("tensorflow", "tensorflow-cpu")  # one package each, installing the same `tensorflow` module


@dataclass(frozen=True)
class Refusal:
    key: str
    refused: Callable[[Config], bool]
    problem: str
    fix: str


REFUSALS = (
    Refusal("model.kind", lambda c: c.model.kind not in MODELS,
            f"the tensorflow engine has only the {' and '.join(MODELS)} models", f"use one of them, or {TORCH}"),
    Refusal("data.kind", lambda c: c.data.kind not in DATA,
            f"the tensorflow engine reads only {', '.join(DATA)}", f"use one of them, or {TORCH}"),
    Refusal("data.labels", lambda c: c.data.labels, "the tensorflow engine trains unconditional models only",
            f"set data.labels=false, or {TORCH}"),
    Refusal("data.workers", lambda c: c.data.workers > 0,
            "the tensorflow engine has no loader processes: it reads each global batch in the training process",
            f"set data.workers=0, or {TORCH} to decode large image sets in parallel"),
    Refusal("parallel.generator", lambda c: c.parallel.generator != "ddp",
            "the tensorflow engine replicates G on every device (MirroredStrategy); sharded and pipelined "
            "strategies exist on the torch engine only", f"set parallel.generator=ddp, or {TORCH}"),
    Refusal("parallel.discriminator", lambda c: c.parallel.discriminator != "ddp",
            "the tensorflow engine replicates D on every device (MirroredStrategy); sharded and pipelined "
            "strategies exist on the torch engine only", f"set parallel.discriminator=ddp, or {TORCH}"),
    Refusal("parallel.cpu_offload", lambda c: c.parallel.cpu_offload, "FSDP2's CPU offload is a torch feature",
            "set parallel.cpu_offload=false"),
    Refusal("loss.kind", lambda c: c.loss.kind not in LOSSES,
            "the tensorflow engine has the shipped losses without a gradient penalty",
            f"use one of {', '.join(LOSSES)}, or {TORCH}"),
    Refusal("loss.gradient_penalty", lambda c: c.loss.with_gradient_penalty,
            "the tensorflow engine has no gradient penalty", f"set loss.gradient_penalty=false, or {TORCH}"),
    Refusal("loss.r1_gamma", lambda c: c.loss.r1_gamma > 0, "the tensorflow engine has no R1 penalty",
            f"set loss.r1_gamma=0, or {TORCH}"),
    Refusal("model.d_spectral_norm", lambda c: c.model.d_spectral_norm,
            "the tensorflow engine has no spectral normalisation", f"set model.d_spectral_norm=false, or {TORCH}"),
    Refusal("model.pack", lambda c: c.model.pack > 1, "the tensorflow engine has no PacGAN packing",
            f"set model.pack=1, or {TORCH}"),
    Refusal("model.d_maxout", lambda c: c.model.d_maxout > 0, "the tensorflow engine has no maxout D",
            f"set model.d_maxout=0, or {TORCH}"),
    Refusal("augment.kind", lambda c: c.augment.kind != "none", "the tensorflow engine has no augmentation",
            f"set augment.kind=none, or {TORCH}"),
    Refusal("train.compile", lambda c: c.train.compile != "off",
            "torch.compile modes are a torch feature (the tensorflow engine always runs tf.function graphs)",
            "set train.compile=off"),
    Refusal("train.channels_last", lambda c: c.train.channels_last,
            "channels_last is a torch memory format (Keras images are channels-last already)",
            "set train.channels_last=false"),
    Refusal("train.cudnn_benchmark", lambda c: not c.train.cudnn_benchmark,
            "cuDNN's heuristic choice is a torch setting (TensorFlow autotunes its convolutions itself)",
            "leave train.cudnn_benchmark=true"),
    Refusal("train.reuse_fake", lambda c: bool(c.train.reuse_fake),
            "the tensorflow engine generates fresh samples for G's step", "leave train.reuse_fake unset"),
    Refusal("optim.fused", lambda c: c.optim.fused, "fused Adam is a torch kernel", "set optim.fused=false"),
    Refusal("optim.g.weight_decay", lambda c: c.optim.g.weight_decay > 0,
            "the tensorflow engine has no L2 weight decay", f"set optim.g.weight_decay=0, or {TORCH}"),
    Refusal("optim.d.weight_decay", lambda c: c.optim.d.weight_decay > 0,
            "the tensorflow engine has no L2 weight decay", f"set optim.d.weight_decay=0, or {TORCH}"),
    Refusal("checkpoint.format", lambda c: c.checkpoint.format != "full",
            "the tensorflow engine writes tf.train.Checkpoint folders", "set checkpoint.format=full"),
    Refusal("log.fingerprints", lambda c: c.log.fingerprints,
            "fingerprints (`ganscale verify`) are a torch engine feature", "set log.fingerprints=false"),
    Refusal("log.profile_steps", lambda c: c.log.profile_steps > 0,
            "the step profile (torch.profiler) is a torch engine feature", "set log.profile_steps=0"),
)


def check(cfg: Config) -> None:
    """ConfigError for the first option the tensorflow engine refuses (the rest is preflight.check's)."""
    for refusal in REFUSALS:
        if refusal.refused(cfg):
            raise ConfigError(refusal.key, refusal.problem, refusal.fix)


def require_tensorflow() -> None:
    """Import TensorFlow, or a ConfigError saying how to install it."""
    both = [name for name in TENSORFLOW_BUILDS if _installed(name)]
    if len(both) > 1:
        raise ConfigError("train.engine", f"both {' and '.join(both)} are installed; they write the same files and "
                          "break each other", f"pip uninstall -y {' '.join(both)}, then install one of them")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # its C++ start-up lines (oneDNN, CPU features) are noise here
    try:
        with _start_up_lines_dropped():
            import tensorflow  # noqa: F401
    except ImportError:
        raise ConfigError("train.engine", "tensorflow, but TensorFlow is not installed in this environment",
                          "pip install 'ganscale[tensorflow]' (a GPU machine: see README, \"TensorFlow engine\"), "
                          "or set train.engine=torch") from None


# What TensorFlow's C++ side writes to stderr at import whatever TF_CPP_MIN_LOG_LEVEL says (TensorFlow 2.21: twice).
START_UP_LINES = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
                  "oneDNN custom operations are on")


@contextlib.contextmanager
def _start_up_lines_dropped() -> Iterator[None]:
    """The process's stderr (file descriptor 2, where C++ writes) kept aside while TensorFlow imports, then written
    back without its start-up lines: anything else it said (an error) is still shown."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable stderr: nothing to tidy
        yield
        return
    with tempfile.TemporaryFile() as said:
        os.dup2(said.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            said.seek(0)
            kept = [line for line in said.read().decode(errors="replace").splitlines(keepends=True)
                    if not any(part in line for part in START_UP_LINES)]
            sys.stderr.write("".join(kept))
            sys.stderr.flush()


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
