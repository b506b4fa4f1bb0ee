"""Command line: `ganscale` train, recipes, export, sample, eval, doctor, bench, make-facades and
fit-digits-features.

Configuration errors exit with code 2 and one message naming the key and the fix, before any
process starts or anything is written.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from pathlib import Path

import click

from ganscale import config as config_mod
from ganscale.config import ConfigError
from ganscale.fault import (EXIT_CONFIG, EXIT_FILE_REFUSED, EXIT_PEER_FAILED, REFUSED_FILE_OPERATION,
                            NonFiniteTraining, Preempted, ReplicaDivergence, is_peer_failure, stop_grace_s,
                            told_elsewhere)


# A rank that leaves an error to another (told_by) exits this much later: a launcher stops every worker at the
# first exit, and must not stop the one that says it before it has.
SAID_GRACE_S = 2.0


def _fail(error: Exception) -> None:
    if told_elsewhere(error):
        time.sleep(SAID_GRACE_S)
    else:
        click.echo(f"ganscale: {error}", err=True)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a worker: leave at once, as on any error (the process
        sys.stderr.flush()                             # group's teardown could wait on peers that left)
        os._exit(EXIT_CONFIG)
    sys.exit(EXIT_CONFIG)




def _known_failure(error: BaseException) -> tuple[str, int] | None:
    """(one-line message, exit code) for failures a user can fix without a traceback: an image of the data set
    that does not decode (bad input, exit 2), a checkpoint write or another file operation the system refused
    (permissions, a full or read-only disk: exit 7). None for anything else."""
    from ganscale.checkpoint import CheckpointWriteError
    from ganscale.data.folder import UnreadableImage

    if isinstance(error, UnreadableImage):
        return f"ganscale: {ConfigError('data.path', error.problem(), 'remove or replace the file')}", EXIT_CONFIG
    if isinstance(error, (CheckpointWriteError, NonFiniteTraining)):  # its own message names the file and the fix
        return f"ganscale: {error}", error.exit_code
    if isinstance(error, OSError) and error.errno in REFUSED_FILE_OPERATION:
        where = f": {error.filename}" if error.filename else ""
        return (f"ganscale: {error.strerror}{where}. Fix: check that path's permissions and free space, or choose "
                "another location (--run-dir, --out)"), EXIT_FILE_REFUSED
    return None


class _Commands(click.Group):
    """Every command: a failure from `_known_failure` ends with its one line instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Exception as e:  # noqa: BLE001 - re-raised unless known
            known = _known_failure(e)
            if known is None:
                raise
            click.echo(known[0], err=True)
            sys.exit(known[1])


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Train GANs on one process or many, with the same config and the same result."""


@main.command()
@click.argument("recipe", required=False)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value, e.g. --set train.steps=500 (repeatable).")
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Start N local worker processes through torch's elastic launcher.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (default: runs/<recipe>-<time>).")
@click.option("--resume", default=None, metavar="auto|PATH",
              help="Continue from the newest checkpoint ('auto') or a given checkpoint/run directory.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0,
              help="Restart all workers up to N times after one dies; they resume from the newest intact checkpoint.")
def train(recipe: str | None, overrides: tuple[str, ...], nproc: int | None, run_dir: str | None,
          resume: str | None, max_restarts: int) -> None:
    """Train RECIPE (a shipped recipe name or a YAML file; default: digits)."""
    import os

    import torch

    from ganscale import launch, memory, rundir
    from ganscale.runtime import environment_world_size

    worker = launch.under_launcher()
    if worker and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and run_dir is None:
        _fail(ConfigError("--run-dir", "torchrun --max-restarts restarts the workers, and they must find the run "
                          "they were training", "pass --run-dir (the same on every node) with torchrun --max-restarts"))
    if worker and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # restarted by torchrun
        resume = rundir.resume_after_restart(run_dir, resume)
    if max_restarts and not nproc and not worker:
        nproc = 1  # restarts need a launcher
    launching = bool(nproc) and not worker
    # Not in a torchrun worker: each node would decide alone, from what its own disk shows (the CLI's parent
    # decides for its --nproc workers, and passes the recipe on).
    if recipe is None and resume is not None and not worker and (own := rundir.own_config(run_dir, resume)):
        recipe = str(own)  # continue the run as it was configured, not with the default recipe; --set still applies
        if launch.rank_from_environment() == 0:
            click.echo(f"ganscale: resuming with the run's own config, {own} (give a RECIPE to use another)")
    try:
        cfg = config_mod.load(recipe, overrides)
        world = environment_world_size() if worker else (nproc or 1)
        config_mod.check(cfg, world, torch.cuda.is_available())
        if launching:  # refused here, before any worker starts; the workers then decide on rank 0 (decide_run)
            launch.check_gpus(cfg, nproc, torch.cuda.device_count())
            memory.check_before_launch(cfg, nproc)  # each worker checks again, before deciding the run
            run_dir, resume, held = rundir.claim_run(cfg, run_dir, resume)
    except ConfigError as e:
        _fail(e)
    except rundir.AlreadyTrained as e:  # a finished run resumed (a requeued job, say): leave it as it is
        click.echo(f"ganscale: {e}")
        return
    if launching:
        args = ["train", *([recipe] if recipe else []), *sum((["--set", o] for o in overrides), [])]
        grace = stop_grace_s(cfg.fault.exit_timeout_s)  # the workers' longest exit after a stop signal
        with held or contextlib.nullcontext():  # the run directory is this run's through every restart of the workers
            sys.exit(launch.launch_local(nproc, args, run_dir, max_restarts, str(resume) if resume else None, held,
                                         grace))
    try:
        resolved_dir, summary = launch.run_worker(cfg, run_dir, resume)
    except ConfigError as e:
        _fail(e)
    except rundir.AlreadyTrained as e:
        if launch.rank_from_environment() == 0:
            click.echo(f"ganscale: {e}")
        return
    except (Preempted, NonFiniteTraining, ReplicaDivergence) as e:  # every rank alike: one line, its own code
        click.echo(f"ganscale: {e}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        # Leave without tearing down: freeing DDP's process group can deadlock (torch 2.13: ~ProcessGroupGloo joins
        # its work thread, holding the GIL that thread needs), and a worker whose launcher died has no one to kill it.
        os._exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - any error of this rank's own
        if isinstance(e, RuntimeError) and is_peer_failure(e):
            click.echo(f"ganscale: rank {launch.rank_from_environment()} stopped because another rank failed first "
                       f"({str(e).splitlines()[0][:200]})", err=True)
            sys.exit(EXIT_PEER_FAILED)
        if not worker:
            raise  # _Commands shows a known failure in one line
        # Show the error, then leave at once, connections still open: this rank must exit before the peers
        # whose collectives its exit breaks, so the launcher names it, not them, as the root cause.
        known = _known_failure(e)
        if told_elsewhere(e):
            time.sleep(SAID_GRACE_S)
        elif known:
            click.echo(known[0], err=True)
        else:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(known[1] if known else 1)
    if launch.rank_from_environment() == 0:
        click.echo(f"done: {summary['steps']} steps, {summary['img_per_s']:.0f} img/s, run directory {resolved_dir}")


@main.command()
def recipes() -> None:
    """List the shipped recipes."""
    names = config_mod.recipe_names()
    width = max(map(len, names))
    for name in names:
        cfg = config_mod.load(name)
        marker = " (default)" if name == config_mod.DEFAULT_RECIPE else ""
        click.echo(f"{name:<{width}}  {cfg.description}{marker}")


@main.command(name="make-facades")
@click.argument("folder", type=click.Path(file_okay=False))
@click.option("--n", "count", type=click.IntRange(min=1), default=400, show_default=True, help="Pairs to write.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--size", default="512x256", show_default=True, help="WIDTHxHEIGHT of each A|B file.")
def make_facades(folder: str, count: int, seed: int, size: str) -> None:
    """Write a synthetic facades-shaped paired data set: photo | label map files, as facades' A|B (train BtoA)."""
    from ganscale.data.synthetic import parse_size, write_synthetic_facades

    try:
        written = write_synthetic_facades(Path(folder), count, seed, parse_size(size))
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {count} pairs to {written}; train with: ganscale train pix2pix --set data.path={written}")


FORCE = click.option("--force", is_flag=True, help="Replace --out if it exists (never a run's checkpoints or config).")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, help="Output .safetensors file.")
@FORCE
@click.option("--checkpoint", "checkpoint_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A specific checkpoint (default: the newest in RUN_DIR).")
def export(run_dir: str, out: str, force: bool, checkpoint_path: str | None) -> None:
    """Write G and G_ema weights of a run to a safetensors file."""
    from ganscale.export import export_generator
    from ganscale.outputs import check_output

    try:
        target = check_output(out, force)
        written = export_generator(Path(run_dir), target, Path(checkpoint_path) if checkpoint_path else None)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {written}")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--n", "count", type=click.IntRange(min=1), default=64, show_default=True, help="Samples to draw.")
@click.option("--out", required=True, help="Output PNG.")
@FORCE
@click.option("--seed", type=int, default=0, show_default=True, help="Noise seed.")
@click.option("--class", "label", type=int, default=None, help="Class to draw (class-conditional models only).")
def sample(run_dir: str, count: int, out: str, force: bool, seed: int, label: int | None) -> None:
    """Draw from a run's G_ema into a PNG grid (a scatter plot for 2D data)."""
    from ganscale.evaluate import sample_picture
    from ganscale.outputs import check_output

    try:
        target = check_output(out, force)
        if target.suffix.lower() != ".png":
            raise ConfigError("--out", f"'{out}' is not a .png file", "give --out a name ending in .png")
        written = sample_picture(Path(run_dir), count, target, seed, label)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {written}")


@main.command(name="eval")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--samples", type=click.IntRange(min=1), default=2500, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Noise seed.")
@click.option("--features", type=click.Choice(["digits", "inception"]), default=None,
              help="Image runs: feature extractor (default: digits for data.kind=digits, else inception).")
@click.option("--inception-weights", type=click.Path(dir_okay=False), default=None,
              help="Local Inception-v3 weights file (pytorch-fid's or torch-fidelity's); never downloaded.")
@click.option("--inception-preprocess", type=click.Choice(["pytorch-fid", "torch-fidelity"]), default=None,
              help="pytorch-fid's resize and scaling, or torch-fidelity's (= TensorFlow FID's); default: the run's "
                   "eval.inception_preprocess.")
@click.option("--pairs", type=click.Path(exists=True, file_okay=False), default=None,
              help="pix2pix runs: a folder of held-out A|B pairs (default: the run's data.path).")
def evaluate_run(run_dir: str, samples: int, seed: int, features: str | None, inception_weights: str | None,
                 inception_preprocess: str | None, pairs: str | None) -> None:
    """Score a run's G_ema; writes RUN_DIR/eval.json.

    2D mixtures: modes captured, % high quality, reverse KL. Images: FD, KID, precision/recall,
    density/coverage against the run's training images (FD-digits with --features digits).
    pix2pix: mean L1 to the targets, next to the input's own L1 (identity baseline).
    """
    import json

    from ganscale.evaluate import evaluate

    try:
        weights = Path(inception_weights) if inception_weights else None
        result = evaluate(Path(run_dir), samples, seed, features, weights, pairs=Path(pairs) if pairs else None,
                          inception_preprocess=inception_preprocess)
    except ConfigError as e:
        _fail(e)
    click.echo(json.dumps(result))


@main.command(name="fit-digits-features")
@click.option("--out", required=True, help="Output .safetensors file.")
@FORCE
@click.option("--seed", type=int, default=0, show_default=True, help="Split, initialisation and batch-order seed.")
@click.option("--epochs", type=click.IntRange(min=1), default=20, show_default=True)
def fit_digits_features(out: str, force: bool, seed: int, epochs: int) -> None:
    """Train the digits classifier whose features give FD-digits (the package ships one: seed 0)."""
    import json

    from ganscale.metrics import digits_classifier
    from ganscale.outputs import check_output

    try:
        target = check_output(out, force)  # before the minutes of fitting
        model, record = digits_classifier.fit(seed, epochs)
        written = digits_classifier.save(model, record, target)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {written}: {json.dumps(record)}")


@main.command()
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Ranks to test with (default: every visible GPU on a CUDA run, else 2).")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto", show_default=True,
              help="Process-group backend to check; auto = nccl on CUDA, gloo on CPU (as training chooses).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Device to check; auto = CUDA when a GPU is visible.")
def doctor(nproc: int | None, backend: str, device: str) -> None:
    """Check this machine for multi-process training (run it before, or after, a failed job).

    Prints one line per check: versions (python, torch, CUDA, cuDNN, NCCL, driver, gloo), GPUs
    against the ranks, the backend for the hardware, distributed-related environment variables
    (explained), then starts N workers through torch's elastic launcher (as `train --nproc N` does),
    checks an all_reduce bit for bit, measures all_reduce bandwidth, and trains a tiny GAN for 2 steps
    with a replica check.

    \b
    PASS  fine.
    WARN  works but slow or surprising; cause and fix printed. Does not fail the doctor.
    FAIL  a run like this would fail; cause and fix printed.
    SKIP  could not run because of a FAIL above.
    Exit code 0 when nothing FAILed or was SKIPped, 1 otherwise.
    """
    from ganscale.doctor import run

    sys.exit(run(nproc, backend, device, echo=click.echo))


from ganscale.bench.cli import bench  # noqa: E402 - the group lives with its benchmarks

main.add_command(bench)
