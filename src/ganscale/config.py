"""Typed, validated configuration.

A run is described by one `Config`: a shipped recipe or a YAML file, then `--set dotted.key=value`
overrides. Everything is checked before any process starts or anything is written; a bad value
raises `ConfigError`, which the CLI turns into exit code 2 with one message naming the key and the fix.
"""

from __future__ import annotations

import difflib
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A user error in the configuration: names the key and how to fix it."""

    def __init__(self, key: str, problem: str, fix: str):
        self.key, self.problem, self.fix = key, problem, fix
        super().__init__(f"config error at '{key}': {problem}. Fix: {fix}")

    def __reduce__(self):  # picklable (sent between processes) although its arguments are not its message
        return ConfigError, (self.key, self.problem, self.fix)


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
    kind: Literal["dcgan", "mlp", "biggan", "pix2pix"] = "dcgan"
    """Architecture family of G and D: dcgan and mlp (unconditional), biggan (class-conditional ResNet G
    and projection D; needs data.labels), pix2pix (U-Net G and PatchGAN D on (input, target) pairs;
    needs data.kind=paired)."""
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
    """biggan only: number of classes (the digits have 10)."""
    shared_dim: int = Field(32, gt=0)
    """biggan only: size of G's shared class embedding."""
    attn_resolution: int = Field(8, ge=0)
    """biggan only: the one self-attention block sits at the feature map nearest this size (0: none)."""
    norm: Literal["batch", "instance", "none"] = "batch"
    """pix2pix only: normalisation in the U-Net and the PatchGAN (the reference uses batch at batch 1;
    with larger micro-batches use instance, or batch with parallel.sync_bn)."""


class DataConfig(Section):
    kind: Literal["digits", "ring8", "grid25", "folder", "paired"] = "digits"
    """digits: scikit-learn's bundled 8x8 digits; ring8/grid25: 2D Gaussian mixtures; folder: images;
    paired: a folder of A|B image pairs side by side (the pix2pix facades layout)."""
    path: str | None = None
    """folder: directory of images (searched recursively); paired: directory holding the A|B files."""
    labels: bool = False
    """digits only: also yield each image's class (0-9), for class-conditional models."""
    direction: Literal["AtoB", "BtoA"] = "AtoB"
    """paired only: AtoB translates the left half into the right one; facades trains BtoA."""
    load_size: int = Field(286, ge=4)
    """paired only: both halves are resized to this, then a shared random crop of data.resolution is taken."""
    resolution: int = Field(8, ge=4)
    """Image side length (images are resized to it). Ignored for 2D mixtures."""
    channels: int = Field(1, ge=1, le=4)
    """Image channels (1 grey, 3 RGB). Ignored for 2D mixtures."""
    size: int = Field(100_000, gt=0)
    """ring8/grid25: number of training points drawn once from the mixture."""
    workers: int = Field(0, ge=0, le=64)
    """DataLoader worker processes per rank (0: load in the training process). At most 64: each worker holds
    several file descriptors (queues, pipes, shared memory) in its rank, so hundreds push them past select()'s
    1024 and the usual open-files limit, and workers beyond the cores do not load any faster."""


class LossConfig(Section):
    kind: Literal["nonsaturating", "hinge", "wgan-gp", "lsgan"] = "nonsaturating"
    """Adversarial objective."""
    n_critic: int = Field(1, ge=1)
    """D steps per G step (each on a fresh global batch)."""
    r1_gamma: float = Field(0.0, ge=0)
    """R1 penalty weight on real data (0: off)."""
    r1_interval: int = Field(1, ge=1, le=MAX_STEPS)
    """Lazy R1: every k iterations, scaled by k, in that iteration's D loss (no extra optimizer step, no lr
    correction)."""
    gp_weight: float = Field(10.0, ge=0)
    """wgan-gp only: gradient-penalty weight."""
    l1_weight: float = Field(0.0, ge=0)
    """pix2pix only: weight of the L1 distance between G's output and the target in G's loss (pix2pix: 100)."""


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
    channels_last: bool = False
    """Image networks' weights (hence their activations) in NHWC layout: faster convolutions on GPUs."""
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = "off"
    """torch.compile G and D (the mode): reduce-overhead and max-autotune also capture CUDA graphs on GPU (what a
    batch-1 step needs). Not with R1 or the gradient penalty (no double backward), FSDP2 strategies or pipeline."""
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
FULLY_SHARDED = ("zero2", "fsdp", "hsdp")  # FSDP2-based strategies: parameters are DTensor shards


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
    what one process does and nothing forbids it (see Config.cross_rank_batchnorm); true or false: as set."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto = nccl on CUDA, gloo on CPU."""
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


class EvalConfig(Section):
    every: int = Field(0, ge=0, le=MAX_STEPS)
    """Score G_ema every this many steps and at the end (0: off): FD, KID, precision/recall and
    density/coverage of generated images against the training images' features, computed across ranks
    (each rank generates its share). Image runs only; 2D mixtures are scored at every sample grid."""
    samples: int = Field(2500, ge=6)
    """Generated images per evaluation (the reference is up to 10,000 training images)."""
    features: Literal["auto", "digits", "inception"] = "auto"
    """Feature extractor: auto is digits (the shipped classifier, FD-digits) for data.kind=digits and
    inception otherwise."""
    inception_weights: str | None = None
    """A local Inception-v3 weights file (pytorch-fid's or torch-fidelity's); never downloaded."""
    inception_preprocess: Literal["pytorch-fid", "torch-fidelity"] = "pytorch-fid"
    """How images reach Inception: pytorch-fid's (bilinear resize to 299, [-1, 1] as is) or torch-fidelity's and
    TensorFlow FID's (TF 1.x bilinear, (u - 128) / 128). FIDs compare only under the same preprocessing."""

    def extractor(self, data_kind: str) -> str:
        return ("digits" if data_kind == "digits" else "inception") if self.features == "auto" else self.features


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
    """Stop (exit 4) after this many consecutive steps in which D or G was skipped for non-finite values."""


class Config(Section):
    name: str = "run"
    """Recipe name, used for the default run directory runs/<name>-<time>: one path component."""
    description: str = ""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    parallel: ParallelConfig = ParallelConfig()
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

    def data_ranks(self, world_size: int) -> int:
        """Ranks that each take their own share of the global batch: all of them, or one per pipeline replica."""
        return world_size // self.parallel.pipeline_stages if self.parallel.pipelined else world_size

    def accumulation_steps(self, world_size: int) -> int:
        return self.train.batch_size // (self.data_ranks(world_size) * self.micro_batch(world_size))

    def micro_batch(self, world_size: int) -> int:
        """Samples per rank per micro-step (a pipeline replica's whole share: its micro-batches are the pipeline's)."""
        return self.train.micro_batch or self.train.batch_size // self.data_ranks(world_size)

    def cross_rank_batchnorm(self, world_size: int) -> bool:
        """Whether BatchNorm statistics span the ranks: parallel.sync_bn as set, or, unset, wherever one process
        normalises what the ranks hold together. Not with a set train.micro_batch (each rank normalises it as one
        process does), the pipeline (each of its micro-batches by design), or R1 / the gradient penalty through
        a D with BatchNorm (their double backward cannot pass a cross-rank BatchNorm)."""
        if world_size == 1:
            return False
        if self.parallel.sync_bn is not None:
            return self.parallel.sync_bn
        return self.train.micro_batch is None and not self.parallel.pipelined and not penalty_through_batchnorm(self)


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


def load(source: str | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    raw = load_raw(source)
    raw.setdefault("name", source or DEFAULT_RECIPE)
    for assignment in overrides:
        apply_override(raw, assignment)
    return build(raw)


def check(cfg: Config, world_size: int, cuda_available: bool) -> None:
    """Combinations that cannot be right, checked once the world size is known."""
    t = cfg.train
    pipelined = cfg.parallel.pipelined
    if pipelined:
        _check_pipeline(cfg, world_size)  # first: the batch split below depends on stages and replicas
    elif t.micro_batch is not None and t.batch_size % (world_size * t.micro_batch):
        raise ConfigError("train.batch_size",
                          f"global batch {t.batch_size} is not divisible by world size {world_size} "
                          f"x micro_batch {t.micro_batch}",
                          f"make train.batch_size a multiple of {world_size * t.micro_batch}, "
                          "or change train.micro_batch")
    elif t.micro_batch is None and t.batch_size % world_size:
        raise ConfigError("train.batch_size",
                          f"global batch {t.batch_size} is not divisible by world size {world_size}",
                          f"make train.batch_size a multiple of {world_size}")
    on_cuda = t.device == "cuda" or (t.device == "auto" and cuda_available)
    if t.device == "cuda" and not cuda_available:
        raise ConfigError("train.device", "cuda requested but no CUDA device is visible",
                          "set train.device=cpu or auto")
    if t.precision == "fp16" and not on_cuda:
        raise ConfigError("train.precision", "fp16 with a GradScaler needs a CUDA device; this run is on the CPU",
                          "use train.precision=bf16 (or fp32) on the CPU")
    if cfg.parallel.backend == "nccl" and not on_cuda:
        raise ConfigError("parallel.backend", "nccl runs only on CUDA devices; this run is on the CPU",
                          "use parallel.backend=gloo or auto")
    _check_task(cfg)
    _check_reuse_fake(cfg, world_size)
    micro = cfg.micro_batch(world_size)
    if (not pipelined and cfg.model.kind in ("dcgan", "mlp") and cfg.model.g_batchnorm and micro == 1
            and not cfg.cross_rank_batchnorm(world_size)):
        raise ConfigError("train.micro_batch", "BatchNorm in G with one sample per rank has no batch statistics",
                          "raise train.micro_batch, set parallel.sync_bn=true, or model.g_batchnorm=false")
    if cfg.data.kind in ("folder", "paired") and not cfg.data.path:
        raise ConfigError("data.path", f"data.kind={cfg.data.kind} needs a directory", "set data.path=/path/to/images")
    if cfg.data.kind in ("folder", "paired") and not Path(cfg.data.path).is_dir():
        raise ConfigError("data.path", f"'{cfg.data.path}' is not a directory", "point data.path at a folder of images")
    if cfg.loss.kind == "wgan-gp" and cfg.loss.gp_weight == 0:
        raise ConfigError("loss.gp_weight", "wgan-gp without a gradient penalty is an unconstrained critic",
                          "set loss.gp_weight > 0 (10 is standard) or choose another loss.kind")
    _check_parallel(cfg.parallel, world_size, on_cuda)
    _check_eval(cfg)
    _check_compile(cfg)
    _check_channels_last(cfg)
    unsupported = sorted({s for s in cfg.parallel.strategies() if s in ("zero1", "pipeline")})
    if cfg.checkpoint.format == "sharded" and unsupported:
        raise ConfigError("checkpoint.format", f"sharded checkpoints are written through torch's state-dict API, "
                          f"which {', '.join(unsupported)} does not offer", "use checkpoint.format=full with "
                          f"{', '.join(unsupported)}, or zero2/fsdp/hsdp (which shard the optimizer state too)")
    sharded_d = cfg.parallel.discriminator in FULLY_SHARDED
    if sharded_d and (cfg.loss.r1_gamma > 0 or cfg.loss.kind == "wgan-gp"):
        raise ConfigError("parallel.discriminator",
                          f"{cfg.parallel.discriminator} cannot take the double backward of R1 / gradient penalty "
                          "(FSDP2 crashes, or silently leaves every D gradient empty)",
                          "keep D on ddp or zero1 (set parallel.discriminator=zero1 to still shard its optimizer "
                          "state), or drop the penalty")
    if cfg.parallel.sync_bn and world_size > 1 and penalty_through_batchnorm(cfg):
        raise ConfigError("parallel.sync_bn", "D has BatchNorm, and the double backward of R1 / the gradient penalty "
                          "cannot pass through a cross-rank BatchNorm",
                          "use a D without BatchNorm (model.norm=instance for pix2pix), drop the penalty "
                          "(loss.r1_gamma=0, a loss.kind other than wgan-gp), or leave parallel.sync_bn unset")
    is_2d = cfg.data.kind in ("ring8", "grid25")
    if is_2d != (cfg.model.kind == "mlp"):
        raise ConfigError("model.kind", f"model.kind={cfg.model.kind} does not fit data.kind={cfg.data.kind}",
                          "use model.kind=mlp for ring8/grid25 and model.kind=dcgan for images")
    _check_mlp_discriminator(cfg, micro)  # after model.kind vs data.kind, which is the real issue when both fail
    if cfg.model.kind == "dcgan" and (cfg.data.resolution & (cfg.data.resolution - 1)):
        raise ConfigError("data.resolution", f"DCGAN needs a power-of-two resolution, got {cfg.data.resolution}",
                          "use 8, 16, 32, 64, ...")


def _check_mlp_discriminator(cfg: Config, micro: int) -> None:
    m = cfg.model
    for key, value, default in (("model.pack", m.pack, 1), ("model.d_maxout", m.d_maxout, 0)):
        if value != default and m.kind != "mlp":
            raise ConfigError(key, f"{key}={value} applies to the mlp discriminator only, not model.kind={m.kind}",
                              f"set {key}={default}, or use model.kind=mlp (ring8/grid25)")
    if m.d_maxout == 1:
        raise ConfigError("model.d_maxout", "maxout with 1 piece is no non-linearity (a linear D)",
                          "set model.d_maxout=0 (LeakyReLU) or 2 or more pieces (PacGAN: 5)")
    if m.pack == 1:
        return
    if cfg.parallel.pipelined:
        raise ConfigError("model.pack", "a packed D reshapes its input before its layers, which the pipeline's "
                          "stages do not see", "set model.pack=1 with the pipeline strategy, or use ddp/zero1")
    if cfg.loss.kind == "wgan-gp":
        raise ConfigError("model.pack", "the gradient penalty is taken per sample, not per packed input",
                          "set model.pack=1 with loss.kind=wgan-gp, or use another loss.kind (R1 works with packing)")
    if micro % m.pack:
        how = "train.micro_batch" if cfg.train.micro_batch else "train.batch_size / world size"
        raise ConfigError("model.pack", f"each rank's micro-batch of {micro} samples ({how}) does not split into "
                          f"packs of {m.pack}", f"make model.pack a divisor of {micro}, or change {how.split(' ')[0]}")


def _check_task(cfg: Config) -> None:
    """The model, the data and the loss must agree on what G is given and what D judges."""
    m, d, loss = cfg.model, cfg.data, cfg.loss
    if (m.kind == "pix2pix") != (d.kind == "paired"):
        raise ConfigError("model.kind", f"model.kind={m.kind} with data.kind={d.kind}: pix2pix translates paired "
                          "images and only pix2pix takes them",
                          "use model.kind=pix2pix with data.kind=paired, or neither")
    if (m.kind == "biggan") != d.labels:
        raise ConfigError("data.labels", f"data.labels={d.labels} with model.kind={m.kind}: class labels are for the "
                          "class-conditional biggan model only",
                          "use model.kind=biggan with data.labels=true, or neither")
    if d.labels and d.kind != "digits":
        raise ConfigError("data.labels", f"data.kind={d.kind} has no class labels", "use data.kind=digits (10 classes)")
    if d.labels and m.n_classes != 10:
        raise ConfigError("model.n_classes", f"{m.n_classes} classes, but the digits have 10", "set model.n_classes=10")
    if loss.l1_weight > 0 and m.kind != "pix2pix":
        raise ConfigError("loss.l1_weight", f"an L1 term needs a target image; model.kind={m.kind} has none",
                          "set loss.l1_weight=0, or train model.kind=pix2pix on paired data")
    if loss.kind == "wgan-gp" and m.kind in ("biggan", "pix2pix"):
        raise ConfigError("loss.kind", f"wgan-gp interpolates real and generated inputs, which {m.kind} pairs with "
                          "conditions",
                          "use loss.kind=hinge (BigGAN) or nonsaturating (pix2pix), with loss.r1_gamma if needed")
    if m.kind == "pix2pix" and d.resolution < 32:
        raise ConfigError("data.resolution", f"{d.resolution}: the 70x70 PatchGAN reduces a crop by 2^3 and then "
                          "by its 4x4 convolutions, which leaves nothing to judge below 32 pixels",
                          "use data.resolution >= 32 (the reference crops 256)")
    if d.kind == "paired" and d.load_size < d.resolution:
        raise ConfigError("data.load_size", f"{d.load_size} is smaller than the crop data.resolution={d.resolution}",
                          "set data.load_size >= data.resolution (pix2pix: 286 and 256)")


def reuse_fake_conflict(cfg: Config, world_size: int) -> tuple[str, str] | None:
    """Why G's step cannot judge D's step's samples (one G forward per iteration), and the fix; None if it can.
    It needs D's one micro-batch of samples to be G's whole batch."""
    if cfg.loss.n_critic > 1:
        return (f"with loss.n_critic={cfg.loss.n_critic} the D steps judge {cfg.loss.n_critic} batches of samples "
                "and G's step one", "set loss.n_critic=1, or train.reuse_fake=false")
    if cfg.parallel.pipelined:
        return ("the pipeline's stages run G's forward inside each step",
                "set train.reuse_fake=false, or another strategy")
    if cfg.accumulation_steps(world_size) > 1:
        return (f"{cfg.accumulation_steps(world_size)} accumulation micro-steps would keep every micro-batch's G "
                "graph alive until G's step",
                "set train.reuse_fake=false, or raise train.micro_batch to batch_size / world size")
    return None


def _check_reuse_fake(cfg: Config, world_size: int) -> None:
    conflict = reuse_fake_conflict(cfg, world_size) if cfg.train.reuse_fake else None
    if conflict is not None:
        raise ConfigError("train.reuse_fake", *conflict)


def _check_pipeline(cfg: Config, world_size: int) -> None:
    """The pipeline strategy (parallel/pipeline.py): what it cannot compute like one process, refused."""
    p, t = cfg.parallel, cfg.train
    if p.generator != p.discriminator:
        raise ConfigError("parallel.discriminator",
                          f"pipeline for one network only ({p.generator}, {p.discriminator}): "
                          "the G step runs G's stages and then D's in one pipeline",
                          "set parallel.generator=pipeline and parallel.discriminator=pipeline, or neither")
    # Next, the networks themselves: for a model the pipeline cannot split (biggan, pix2pix), every other
    # setting below is moot, and a fix that one of them suggests (model.g_batchnorm) would not apply to it.
    from ganscale.models import meta_networks  # here: checking the stages against the layers builds both networks
    from ganscale.parallel.pipeline import split
    generator, discriminator = meta_networks(cfg)
    split(generator, p.pipeline_stages, "G")  # ConfigError: not a sequence of layers, or fewer layers than stages
    split(discriminator, p.pipeline_stages, "D")
    if world_size % p.pipeline_stages:
        raise ConfigError("parallel.pipeline_stages",
                          f"{p.pipeline_stages} stages do not divide the world size {world_size}",
                          f"use a number of stages that divides {world_size}, "
                          f"or {p.pipeline_stages} x replicas processes")
    replicas = world_size // p.pipeline_stages
    if p.mesh is not None and tuple(p.mesh) != (replicas, p.pipeline_stages):
        raise ConfigError("parallel.mesh", f"{list(p.mesh)} is not [pipeline replicas, pipeline_stages]",
                          f"set parallel.mesh=[{replicas}, {p.pipeline_stages}] or remove it")
    if t.batch_size % (replicas * p.microbatches):
        raise ConfigError("parallel.microbatches", f"global batch {t.batch_size} does not split into {replicas} "
                          f"pipeline replica(s) x {p.microbatches} micro-batches",
                          f"make train.batch_size a multiple of {replicas * p.microbatches}, "
                          "or change parallel.microbatches")
    if t.micro_batch is not None:
        raise ConfigError("train.micro_batch", "the pipeline's micro-batches replace train.micro_batch",
                          "remove train.micro_batch and set parallel.microbatches (micro-batches per pipeline replica)")
    if cfg.loss.r1_gamma > 0 or cfg.loss.kind == "wgan-gp":
        raise ConfigError("parallel.discriminator", "a pipelined D cannot take the double backward of R1 / gradient "
                          "penalty (the input gradient would have to flow back through every stage twice)",
                          "set loss.r1_gamma=0 and a loss.kind other than wgan-gp, or another strategy")
    if t.precision == "fp16":
        raise ConfigError("train.precision", "fp16's GradScaler would scale the loss on the last stage only and find "
                          "overflows in each stage's own gradients: after one overflow the stages would unscale by "
                          "different factors", "use train.precision=bf16 (no loss scale) or fp32 with the pipeline")
    if p.sync_bn:
        raise ConfigError("parallel.sync_bn", "with the pipeline, BatchNorm normalises each micro-batch of a stage; "
                          "statistics across ranks would mix stages and micro-batches",
                          "set parallel.sync_bn=false (raise parallel.microbatches' size instead), or another strategy")
    if cfg.model.g_batchnorm and t.batch_size == replicas * p.microbatches:
        raise ConfigError("parallel.microbatches", "BatchNorm in G with one sample per pipeline micro-batch has no "
                          "batch statistics",
                          "lower parallel.microbatches, raise train.batch_size, or model.g_batchnorm=false")


def penalty_through_batchnorm(cfg: Config) -> bool:
    """R1 / the gradient penalty through a D with BatchNorm: a cross-rank BatchNorm's backward is not differentiable
    again, so its double backward cannot pass one."""
    if not (cfg.loss.r1_gamma > 0 or cfg.loss.kind == "wgan-gp"):
        return False
    import torch

    from ganscale.models import meta_networks
    _, discriminator = meta_networks(cfg)
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in discriminator.modules())


def _check_compile(cfg: Config) -> None:
    """torch.compile where it computes what eager does: no double backward, no FSDP2 hooks or pipeline stages."""
    if cfg.train.compile == "off":
        return
    if cfg.loss.r1_gamma > 0 or cfg.loss.kind == "wgan-gp":
        raise ConfigError("train.compile", "compiled networks cannot take the double backward of R1 or the gradient "
                          "penalty (aot_autograd does not support it)",
                          "set train.compile=off, or loss.r1_gamma=0 with a loss other than wgan-gp")
    eager_only = sorted({s for s in cfg.parallel.strategies() if s in (*FULLY_SHARDED, "pipeline")})
    if eager_only:
        raise ConfigError("train.compile", f"compiling {', '.join(eager_only)} networks is not supported by ganscale "
                          "(their communication runs in hooks and stages the compiled graph would have to cross)",
                          "set train.compile=off, or use ddp or zero1 for both networks")


def _check_channels_last(cfg: Config) -> None:
    """FSDP2 shards only contiguous parameters, and channels-last 4-D weights are not (torch 2.13)."""
    sharded = sorted({s for s in cfg.parallel.strategies() if s in FULLY_SHARDED})
    if cfg.train.channels_last and sharded:
        raise ConfigError("train.channels_last", f"{', '.join(sharded)} networks cannot hold channels-last weights "
                          "(FSDP2 shards only contiguous parameters)",
                          "set train.channels_last=false, or use ddp or zero1 for both networks")


def _check_eval(cfg: Config) -> None:
    e = cfg.eval
    if not e.every:
        return
    if cfg.data.kind in ("ring8", "grid25", "paired"):
        how = ("2D mixtures are scored (modes, % high quality) at every sample grid: set log.sample_every"
               if cfg.data.kind != "paired" else "score pix2pix runs with `ganscale eval RUN --pairs HELD_OUT_DIR`")
        raise ConfigError("eval.every", f"image metrics do not apply to data.kind={cfg.data.kind}",
                          f"set eval.every=0; {how}")
    if cfg.parallel.pipelined:
        raise ConfigError("eval.every", "periodic image metrics are not wired to the pipeline yet (each rank would "
                          "need its own noise through the shared stages)",
                          "set eval.every=0 and run `ganscale eval RUN`")
    if e.extractor(cfg.data.kind) == "inception" and not (e.inception_weights and Path(e.inception_weights).is_file()):
        raise ConfigError("eval.inception_weights",
                          f"Inception features need a local weights file; got {e.inception_weights!r}",
                          "set eval.inception_weights to pytorch-fid's pt_inception-2015-12-05 .pth file "
                          "(or torch-fidelity's), or eval.every=0")


def _check_parallel(p: ParallelConfig, world_size: int, on_cuda: bool) -> None:
    uses_mesh = "hsdp" in p.strategies() or "pipeline" in p.strategies()
    if p.mesh is not None and not uses_mesh:
        raise ConfigError("parallel.mesh",
                          f"a mesh is set but no network uses it (strategies {p.generator}, {p.discriminator})",
                          "set parallel.generator or parallel.discriminator to hsdp (or both to pipeline), "
                          "or remove parallel.mesh")
    if p.mesh is not None and (min(p.mesh) < 1 or p.mesh[0] * p.mesh[1] != world_size):
        raise ConfigError("parallel.mesh", f"{list(p.mesh)} does not multiply to the world size {world_size}",
                          f"use two positive sizes whose product is {world_size}, "
                          f"e.g. [{max(world_size // 2, 1)}, {min(2, world_size)}]")
    if p.cpu_offload and not any(s in FULLY_SHARDED for s in p.strategies()):
        raise ConfigError("parallel.cpu_offload",
                          f"only zero2/fsdp/hsdp networks can offload; these are {p.generator}, {p.discriminator}",
                          "set parallel.generator=fsdp (or zero2/hsdp), or parallel.cpu_offload=false")
    if p.cpu_offload and not on_cuda:
        raise ConfigError("parallel.cpu_offload", "FSDP2's CPU offload moves shards between a GPU and host memory; "
                          "this run is on the CPU, where everything already lives in host memory",
                          "set parallel.cpu_offload=false on CPU runs")


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
