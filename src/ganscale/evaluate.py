"""Drawing from and scoring a trained run's G_ema, outside training (one process).

The generator is rebuilt from the config stored in the checkpoint, so a run directory alone is enough.
2D mixtures are scored by the VEEGAN/PacGAN protocol; image runs by FD, KID, precision/recall and
density/coverage on the features of a chosen extractor, against the run's own training data.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import yaml
from torch import nn

from ganscale import checkpoint
from ganscale.config import Config, ConfigError, auto_features, build, load_raw
from ganscale.data import build_dataset
from ganscale.data.mixtures import MIXTURE_MODES
from ganscale.finite import refuse_non_finite_checkpoint
from ganscale.memory import FP32, check_sampling, check_scoring
from ganscale.metrics.features import build_extractor
from ganscale.metrics.images import (FEWEST_REFERENCES, REFERENCE_LIMIT, check_reference_count, image_metrics,
                                     reference_features)
from ganscale.metrics.modes2d import PROTOCOL_SAMPLES, score_named
from ganscale.models import build_networks, changed_networks, changed_settings
from ganscale.observe.samples import image_grid, scatter, write_png
from ganscale.outputs import to_json, write_output
from ganscale.rundir import config_at
from ganscale.sampling import check_class, check_truncation, grid_latents, truncated
from ganscale.tasks import build_task


def load_generator(run_dir: Path, source: Path | None = None) -> tuple[Config, nn.Module, int]:
    """(config, G_ema in eval mode, step) from the newest intact checkpoint of a run (or `source`)."""
    source = source or checkpoint.newest_intact(run_dir, "RUN_DIR", "train that run to its first checkpoint, or "
                                                "give a run directory that has one")
    state = checkpoint.load(source, require=checkpoint.GENERATOR_KEYS)
    refuse_non_finite_checkpoint(state, ("G_ema",), source, "nothing was drawn; continue training from an earlier "
                                 "checkpoint of the run (train --resume PATH)")
    cfg, generator = fitted_generator(run_dir, source, state)
    return cfg, generator.eval(), int(state["step"])


def fitted_generator(run_dir: Path, source: Path, state: dict, nets: tuple[str, ...] = ("G_ema",)
                     ) -> tuple[Config, nn.Module]:
    """(config, generator holding `state[net]` for each of `nets`, the last one kept). A checkpoint of RUN_DIR's own
    checkpoints/ is loaded into the generator RUN_DIR is configured with at its step (`run_config`), as a resume
    builds it: one whose weights do not fit (another recipe's, copied in) is refused, as a resume refuses it."""
    configured = run_config(run_dir, source, state)
    cfg = configured_as(configured) if configured else build(yaml.safe_load(state["config"]))
    generator, _ = build_networks(cfg)
    for net in nets:
        try:
            generator.load_state_dict(state[net])
        except RuntimeError:
            changed = changed_networks(cfg, state["config"], ("generator",))
            if changed:
                raise ConfigError(str(source), f"its {net} does not fit the generator this run builds: {changed}",
                                  "restore the code the run was trained with") from None
            if configured:  # the run's config file edited since, or another run's checkpoint copied in
                settings = changed_settings(cfg, state["config"])
                raise ConfigError(str(source), f"its {net} does not fit the generator of {configured}"
                                  + (f": {settings}" if settings else ""),
                                  (f"set those back in {configured} as the checkpoint's config has them, or " if
                                   settings else "") + "give the run directory that wrote it") from None
            raise ConfigError(str(source), f"its {net} does not fit the generator its own config describes",
                              "give the run directory that wrote it (a resume of this run refuses it too)") from None
    return cfg, generator


def configured_as(config_file: Path) -> Config:
    """A run's config file, refused as a resume refuses it: one line naming the file."""
    raw = load_raw(str(config_file))
    try:
        return build(raw)
    except ConfigError as e:
        raise ConfigError(str(config_file), f"{e.key}: {e.problem}" if e.key else e.problem,
                          "correct that setting in the file (a resume of the run reads it too)") from None


def run_config(run_dir: Path, source: Path, state: dict) -> Path | None:
    """RUN_DIR's config file at the step of `source` when it is one of RUN_DIR's checkpoints, else None."""
    own = Path(source).resolve().parent == checkpoint.checkpoint_dir(run_dir).resolve()
    return config_at(Path(run_dir), int(state["step"])) if own else None


@torch.no_grad()
def draw(generator: nn.Module, z_dim: int, n: int, seed: int) -> torch.Tensor:
    z = torch.randn(n, z_dim, generator=torch.Generator().manual_seed(seed))
    return generator(z).float()


SAMPLES = 64  # `ganscale sample`'s default --n (pix2pix: at most the pairs there are)


def sample_picture(run_dir: Path, n: int | None, out: Path, seed: int = 0, label: int | None = None,
                   psi: float = 1.0) -> Path:
    """A grid of n (default SAMPLES) samples (one class per row for a class-conditional G, or all of class
    `label`; for pix2pix, input | output | target rows of n pairs of the run's data, chosen by `seed`), or a
    scatter plot for 2D data; StyleGAN2 at truncation `psi`."""
    cfg, generator, _ = load_generator(run_dir)
    if cfg.model.conditioning == "paired":
        # G_ema translates in eval mode (its dropout off): the seed can only choose the pairs shown.
        try:
            task = build_task(cfg, choose=lambda count: chosen_pairs(count, n, seed))
        except ConfigError as e:
            raise run_data_moved(cfg, e, "the run's pairs, which sample draws its rows from") from None
        n = len(task.preview_pairs)
    else:
        n, task = n or SAMPLES, build_task(cfg)
    check_class(task, label)
    check_truncation(psi, cfg)
    note = check_sampling(cfg, lambda net, z: task.preview(truncated(net, psi), z, label), n, task.grid_columns)
    if note:
        print(f"ganscale: warning: {note}", file=sys.stderr, flush=True)
    z = grid_latents(1, n, cfg.model.z_dim, seed)[0]
    with torch.no_grad():
        samples = task.preview(truncated(generator, psi), z, label).float()
    modes = MIXTURE_MODES.get(cfg.data.kind)
    picture = scatter(samples, modes()) if modes else image_grid(samples, cols=task.grid_columns)
    return write_output(out, lambda tmp: write_png(picture, tmp))


def run_data_moved(cfg: Config, error: ConfigError, what: str) -> ConfigError:
    """`error` of reading a finished run's data, told as such: these commands have no data.path option (the loaders'
    fix, "point data.path at ...", cannot be followed), the run's config.yaml has it. Other errors as they are."""
    if error.key != "data.path":
        return error
    return ConfigError("data.path", f"{what}: {error.problem}", f"put them back at {cfg.data.path}, or set data.path "
                       "in the run's config.yaml to where they are now")


def chosen_pairs(count: int, n: int | None, seed: int) -> list[int]:
    """`sample`'s pix2pix rows: n (default: SAMPLES, or all `count` pairs if fewer) of the `count` pairs, a seeded
    random choice in a seeded order."""
    if n is not None and n > count:
        raise ConfigError("--n", f"{n} pairs asked for, and the run's data holds {count}",
                          f"use --n {count} at most (each row is one pair: input | output | target)")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed))
    return order[:min(n or SAMPLES, count)].tolist()


def evaluate(run_dir: Path, samples: int | None = None, seed: int | None = None, features: str | None = None,
             inception_weights: Path | None = None, reference_limit: int | None = REFERENCE_LIMIT,
             pairs: Path | None = None, inception_preprocess: str | None = None) -> dict:
    """Score G_ema; writes RUN_DIR/eval.json and returns the same dict (in which a non-finite score stays a float;
    in eval.json it is null).

    2D mixtures: modes captured, % high quality, reverse KL. Images: FD, KID, precision/recall and
    density/coverage of `samples` (default PROTOCOL_SAMPLES) generated images against (at most `reference_limit`, a
    seeded random subset of) the run's training images, on `features` (default: digits or mnist for those runs, else
    inception). pix2pix: L1 over the run's pairs or `pairs`. An option (not None) the run's scoring does not read is
    refused, naming it.
    """
    cfg, generator, step = load_generator(run_dir)
    options = {"--samples": samples, "--seed": seed, "--features": features, "--inception-weights": inception_weights,
               "--inception-preprocess": inception_preprocess, "--pairs": pairs}
    samples, seed = PROTOCOL_SAMPLES if samples is None else samples, seed or 0
    if cfg.data.kind in MIXTURE_MODES:
        _refuse_unread(options, ("--samples", "--seed"), "2D mixture runs are scored by modes captured")
        check_sampling(cfg, lambda net, z: net(z), samples, None, "--samples")  # drawn at once
        result = {"step": step, "data": cfg.data.kind, "seed": seed,
                  **score_named(cfg.data.kind, draw(generator, cfg.model.z_dim, samples, seed)).as_dict()}
    elif cfg.data.kind == "paired":
        # G_ema translates in eval mode (no dropout): nothing is drawn, so neither a count nor a seed applies.
        _refuse_unread(options, ("--pairs",), "pix2pix runs are scored by the L1 of G_ema's translation of every pair")
        result = {"step": step, "data": cfg.data.kind, **score_pairs(cfg, generator, pairs)}
    else:
        features = features or auto_features(cfg.data.kind)
        reads = ("--samples", "--seed", "--features")
        if features == "inception":
            reads += ("--inception-weights", "--inception-preprocess")
        inception_only = {} if features == "inception" else {
            option: ", or add --features inception" for option in ("--inception-weights", "--inception-preprocess")}
        _refuse_unread(options, reads, f"image runs are scored on {features} features of generated samples",
                       inception_only)
        result = {"step": step, "data": cfg.data.kind, "seed": seed,
                  **score_images(cfg, generator, samples, seed, features, inception_weights, reference_limit,
                                 inception_preprocess or cfg.eval.inception_preprocess)}
    text = to_json(result, indent=2) + "\n"  # a non-finite score (reverse KL of a collapsed G) is null
    write_output(Path(run_dir) / "eval.json", lambda tmp: tmp.write_text(text), "RUN_DIR")  # whole or not at all
    return result


def _refuse_unread(options: dict, reads: tuple[str, ...], scored: str, other_fixes: dict[str, str] | None = None
                   ) -> None:
    """The first given option (not None) of `options` that this run's scoring does not `read`, refused by name
    (`other_fixes`: what else makes an option read, after "drop OPTION")."""
    for option, value in options.items():
        if value is not None and option not in reads:
            raise ConfigError(option, f"{scored}, which does not read {option}",
                              f"drop {option}{(other_fixes or {}).get(option, '')}")


def score_images(cfg: Config, generator: nn.Module, samples: int, seed: int, features: str,
                 inception_weights: Path | None = None, reference_limit: int | None = REFERENCE_LIMIT,
                 inception_preprocess: str = "pytorch-fid") -> dict:
    """Image metrics of an eval-mode generator against the features of its config's training data (all of the
    source when data.max_images trains on a subset: ADA's protocol)."""
    if samples < 6:
        raise ConfigError("--samples", f"{samples} samples are too few for density/coverage (k = 5)",
                          "use at least 6 (thousands for stable numbers)")
    try:
        training_images = build_dataset(cfg, whole=True)
    except ConfigError as e:
        raise run_data_moved(cfg, e, "the run's training images, which eval compares its samples with") from None
    check_reference_count(cfg, len(training_images), f"score a run trained on at least {FEWEST_REFERENCES} "
                          "images (thousands for stable numbers)")
    extractor = build_extractor(features, "cpu", inception_weights, inception_preprocess=inception_preprocess)
    width = extractor(torch.zeros(1, *cfg.data.sample_shape)).shape[1]  # the features' width
    # The noise (and its padded copy), the float32 features and the scores' float64 copies of them, all n rows.
    check_scoring(samples, 2 * cfg.model.z_dim * FP32 + width * (FP32 + 2 * 8))
    reference = reference_features(training_images, extractor, reference_limit, seed)
    task = build_task(cfg)
    return image_metrics(lambda z: task.from_noise(generator, z).float(), cfg.model.z_dim, samples, seed, extractor,
                         reference)


@torch.no_grad()
def score_pairs(cfg: Config, generator: nn.Module, folder: Path | None = None) -> dict:
    """pix2pix: mean L1 between G_ema(input) and the target over un-augmented pairs (the run's data, or
    `folder`, e.g. held-out pairs), next to the L1 of the input itself (the identity baseline)."""
    from ganscale.data.paired import PairedImages

    d = cfg.data
    try:
        pairs = PairedImages(folder or d.path, d.load_size, d.resolution, d.direction, augment=False,
                             channels=d.channels)
    except ConfigError as e:  # the loader names data.path and how to set it, which eval does with --pairs
        if folder is not None:
            raise ConfigError("--pairs", e.problem, "pass --pairs a folder of A|B pair images") from None
        raise ConfigError("data.path", f"the run's pairs: {e.problem}", "pass the pairs to score with --pairs FOLDER, "
                          "or put the run's back where its config.yaml says") from None
    l1 = identity = 0.0
    for index in range(len(pairs)):
        source, target = (t.unsqueeze(0) for t in pairs[index])
        l1 += float((generator(source).float() - target).abs().mean())
        identity += float((source - target).abs().mean())
    return {"l1": l1 / len(pairs), "l1_identity": identity / len(pairs), "pairs": len(pairs),
            "pairs_from": str(folder or d.path)}
