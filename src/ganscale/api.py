"""The Python API: train from a script or a notebook, through the same path as `ganscale train` (which calls `run`).

    import ganscale
    summary = ganscale.train("config.yaml", overrides=["train.steps=500"], generator=Generator, nproc=2)

The config is a shipped recipe's name, a YAML file or a dict. The user's networks, data set and loss can be given
as Python objects instead of "module:attribute" names; they are recorded by their import path (see `train`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import math
import os
import re
import signal
import site
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from ganscale import config as config_mod
from ganscale.config import Config, ConfigError
from ganscale.fault import StopSignals

# The option each Python object fills in; the kinds it switches to custom.
OPTIONS = {"generator": "model.generator", "discriminator": "model.discriminator", "dataset": "data.dataset",
           "loss": "loss.kind"}
CUSTOM = {"generator": "model.kind=custom", "discriminator": "model.kind=custom", "dataset": "data.kind=custom"}
RESUME_NOTE_ENV = "GANSCALE_RESUME_NOTE"  # the --nproc parent's resume note, for its workers' rank 0 to say


class WorkersFailed(Exception):
    """`--nproc` workers ended with an error; they said it, and the launcher named the rank."""

    def __init__(self, exit_code: int):
        super().__init__(f"the workers failed with exit code {exit_code} (their output says why)")
        self.exit_code = exit_code


def train(config: str | os.PathLike | dict | Config | None = None, *, overrides: Sequence[str] = (),
          generator: Any = None, discriminator: Any = None, dataset: Any = None, loss: Any = None,
          nproc: int | None = None, run_dir: str | os.PathLike | None = None, resume: str | None = None,
          max_restarts: int = 0, workers: int | None = None) -> dict | None:
    """Train as `ganscale train` does, and return the summary (summary.json's content, with `run_dir` added).

    config: a shipped recipe's name, a YAML file, a dict holding what such a file holds, or a Config; None is the
    default recipe (or, with `resume`, the run's own config). overrides: "dotted.key=value" strings, as --set.
    generator, discriminator, dataset: a class or a function (returning G, D, a map-style Dataset), keyword
    arguments from model.generator_args, model.discriminator_args, data.dataset_args; loss: a class, or an instance
    bound to a name in its class's module, with d_loss(real, fake) and g_loss(fake). Each must be defined at the
    top level of an importable module (not in __main__, a notebook cell, a lambda or a closure): workers and
    resumes import it by its "module:qualname", which the saved config.yaml records (its folder in code_path).

    Runs in this process (one process), as one rank when started by torchrun or the elastic launcher (read from
    the environment, as the CLI does), or with `nproc` local worker processes (on the tensorflow engine: `nproc`
    replicas in this process, `workers` worker processes, as `--workers`). The same checks as the CLI, before
    anything is written: a bad config raises ConfigError naming the option and the fix; an error in training
    raises as it happened (`WorkersFailed` with the exit code under `nproc`). As a torchrun worker it ends an
    error as `ganscale train` does: one line and the exit code. None when the run is already trained to
    train.steps (it says so).
    """
    from ganscale import launch

    check_arguments(config, overrides, nproc, max_restarts, workers)
    launch.check_environment()  # own_config below may read RANK
    worker = launch.under_launcher()
    try:
        run_dir = None if run_dir is None else os.fspath(run_dir)
        source, note = own_config(source_name(config), run_dir, resume, worker)
        source, sets = command(config, overrides, {"generator": generator, "discriminator": discriminator,
                                                   "dataset": dataset, "loss": loss}, source)
        trained = run(source, sets, nproc, run_dir, resume, max_restarts, print, workers, note)
    except Exception as e:
        error = in_api_terms(e) if isinstance(e, ConfigError) else e
        if worker:
            from ganscale.cli import leave

            leave(error)  # a rank: one line and its exit code, as `ganscale train`'s workers
        if error is e:
            raise
        raise error from None
    return None if trained is None else {**trained[1], "run_dir": str(trained[0])}


# The CLI's options that a ConfigError may name (its key, its problem, its fix), as train's arguments: an option
# with its value ("--resume auto", "--nproc 2", "--set train.steps=500") or alone. Not torchrun's --nproc-per-node.
_CLI_OPTION = re.compile(r"(?<!torchrun )--(run-dir|resume|nproc|max-restarts|workers|set)(?![\w-])"
                         r"(?: (auto\b|N\b|\d+\b|(?<=set )[\w.\-]+=[\w.\-]+))?")


def in_api_terms(error: ConfigError) -> ConfigError:
    """`error` naming train's keyword arguments where it names the CLI's options (run_dir, not --run-dir); a
    command quoted in backticks (`ganscale train --resume auto`) stays as written."""
    def argument(found: re.Match) -> str:
        name, value = found[1].replace("-", "_"), found[2]
        if name == "set":
            return "overrides" if value is None else f"overrides=['{value}']"
        return name if value is None else f"{name}={value!r}" if value == "auto" else f"{name}={value}"

    def translated(text: str) -> str:
        parts = text.split("`")
        return "`".join(part if i % 2 else _CLI_OPTION.sub(argument, part) for i, part in enumerate(parts))

    if not any(_CLI_OPTION.search(text) for text in (error.key, error.problem, error.fix)):
        return error
    told = getattr(error, "told_by", None)
    error = ConfigError(translated(error.key), translated(error.problem), translated(error.fix))
    if told is not None:
        error.told_by = told
    return error


def check_arguments(config, overrides, nproc, max_restarts, workers) -> None:
    """The arguments the CLI's options check by type: a ConfigError naming the argument (a string of overrides
    was taken letter by letter, nproc=0 trained in this process, a string nproc was a TypeError)."""
    if config is not None and not isinstance(config, (str, os.PathLike, dict, Config)):
        raise ConfigError("config", f"a {type(config).__name__}", "pass a recipe name, a YAML file's path, a dict "
                          "or a Config (or None: the default recipe)")
    if isinstance(overrides, (str, bytes)) or not all(isinstance(o, str) for o in overrides):
        raise ConfigError("overrides", f"{overrides!r} is not a list of strings",
                          "pass a list of 'dotted.key=value' strings, e.g. overrides=['train.steps=500']")
    for name, value, least in (("nproc", nproc, 1), ("workers", workers, 1), ("max_restarts", max_restarts, 0)):
        if value is not None and (type(value) is not int or value < least):
            raise ConfigError(name, f"{value!r}", f"pass an int of at least {least}"
                              + (" (or None)" if name != "max_restarts" else ""))


def run(recipe: str | None, overrides: Sequence[str], nproc: int | None, run_dir: str | None, resume: str | None,
        max_restarts: int, say: Callable[[str], None], workers: int | None = None,
        note: str | None = None) -> tuple[Path, dict] | None:
    """`ganscale train`: (run directory, summary), or None where the run is already trained (said on rank 0).
    Raises ConfigError before anything is written, WorkersFailed when `nproc` workers fail, or a training's error.
    `note`: which config a resume without a recipe continues with, where the caller found it (`own_config`).
    A rank of a launched group refused before it joined the group (its config, data or code) tells every rank,
    which all raise it (fault.refused_before_start)."""
    from ganscale.fault import check_ins, refused_before_start

    before = check_ins()
    try:
        return _run(recipe, overrides, nproc, run_dir, resume, max_restarts, say, workers, note)
    except Exception as e:  # noqa: BLE001 - raised as every rank agreed on it
        agreed = refused_before_start(e, before)
        if agreed is e:
            raise
        raise agreed from None


def _run(recipe: str | None, overrides: Sequence[str], nproc: int | None, run_dir: str | None, resume: str | None,
         max_restarts: int, say: Callable[[str], None], workers: int | None, note: str | None
         ) -> tuple[Path, dict] | None:
    # A config refused before torch is imported (~2 s). Unless this resumes without a recipe: then the run
    # directory (own_config) says which config to load.
    cfg = config_mod.load(recipe, overrides) if recipe is not None or resume is None else None
    import torch

    from ganscale import launch, memory, preflight, rundir
    from ganscale.runtime import environment_world_size

    launch.adopt_slurm_task(nproc)
    launch.check_environment()  # here, where the launcher's variables (or Slurm's, just adopted) are first read
    worker = launch.under_launcher()
    if worker and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0 and run_dir is None:
        raise ConfigError("--run-dir", "torchrun --max-restarts restarts the workers, and they must find the run "
                          "they were training", "pass --run-dir (the same on every node) with torchrun --max-restarts")
    if worker and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:  # restarted by torchrun
        resume = rundir.resume_after_restart(run_dir, resume)
    if max_restarts and not nproc and not worker:
        nproc = 1  # restarts need a launcher
    launching = bool(nproc) and not worker
    recipe, found = own_config(recipe, run_dir, resume, worker)
    note = note or found or (os.environ.get(RESUME_NOTE_ENV) if worker else None)
    try:
        cfg = cfg or config_mod.load(recipe, overrides)
        if cfg.train.engine == "tensorflow":
            trained = _train_tensorflow(cfg, recipe, overrides, nproc, workers, run_dir, resume, max_restarts, worker,
                                        lambda: say(note) if note else None)
            if trained is not None and launch.rank_from_environment() == 0 and not (workers and not worker):
                say(f"done: {trained[1]['steps']} steps, {trained[1]['img_per_s']:.0f} img/s, "
                    f"run directory {trained[0]}")
            return trained
        if workers:
            raise ConfigError("--workers", "starts the tensorflow engine's worker processes",
                              "use --nproc N for N processes on the torch engine")
        world = environment_world_size() if worker else (nproc or 1)
        warnings = preflight.check(cfg, world, torch.cuda.is_available())
        if not launching and launch.rank_from_environment() == 0:  # said once: by rank 0, not also by its launcher
            for warning in warnings:
                print(f"ganscale: warning: {warning}", file=sys.stderr, flush=True)
        if launching:  # refused here, before any worker starts; the workers then decide on rank 0 (decide_run)
            launch.check_gpus(cfg, nproc, torch.cuda.device_count())
            launch.check_stop_grace(cfg)
            memory.check_before_launch(cfg, nproc)  # each worker checks again, before deciding the run
            run_dir, resume, held = rundir.claim_run(cfg, run_dir, resume)
            with held or contextlib.nullcontext():  # the run directory is this run's through every restart
                return _launch_workers(cfg, recipe, overrides, nproc, run_dir, resume, held, max_restarts, note)
        resolved_dir, summary = launch.run_worker(cfg, run_dir, resume, note)
    except rundir.AlreadyTrained as e:  # a finished run resumed (a requeued job, say): leave it as it is
        if launch.rank_from_environment() == 0:
            say(f"ganscale: {e}")
        return None
    if launch.rank_from_environment() == 0:
        say(f"done: {summary['steps']} steps, {summary['img_per_s']:.0f} img/s, run directory {resolved_dir}")
    return resolved_dir, summary


def _train_tensorflow(cfg: Config, recipe: str | None, overrides: Sequence[str], nproc: int | None,
                      workers: int | None, run_dir: str | None, resume: str | None, max_restarts: int,
                      worker: bool, starting: Callable[[], object]) -> tuple[Path, dict] | None:
    """`ganscale train` on the tensorflow engine: its refusals, then `nproc` replicas in this process, or `workers`
    local worker processes (MultiWorkerMirroredStrategy, started as the torch engine's), or this process as one
    such worker under a launcher (ganscale.tf). Raises ConfigError before anything is written. `starting` is
    called once the run directory is claimed, before training starts."""
    from ganscale import preflight, rundir
    from ganscale.tf import capabilities

    capabilities.check(cfg)
    if max_restarts:
        raise ConfigError("--max-restarts", "the tensorflow engine does not restart its workers",
                          "drop --max-restarts and continue a stopped run with --resume auto")
    if worker or workers:
        from ganscale.tf.workers import check_workers

        check_workers(cfg, nproc)
    capabilities.require_tensorflow()
    from ganscale.tf import devices, loop

    if workers and not worker:
        gpus = devices.worker_gpus(cfg.train.device)
        preflight.check(cfg, workers * max(gpus, 1), gpus > 0)  # refused here, before any worker starts
        path, source, held = rundir.claim_run(cfg, run_dir, resume)
        with held or contextlib.nullcontext():  # the workers run under this process's hold
            starting()
            return _launch_workers(cfg, recipe, overrides, workers, path, source, held, 0)
    if worker:
        from ganscale.tf import workers as tf_workers

        strategy, path, source, held, rank, workers = tf_workers.join(cfg, run_dir, resume)
        try:
            return path, loop.train(cfg, strategy, path, source, held, rank, workers)
        finally:
            if held is not None:
                held.release()
    strategy = devices.strategy(nproc, cfg.train.device)
    preflight.check(cfg, strategy.num_replicas_in_sync, devices.on_gpus(strategy))
    path, source, held = rundir.claim_run(cfg, run_dir, resume)
    with held or contextlib.nullcontext():
        starting()
        return path, loop.train(cfg, strategy, path, source, run_lock=held)


def own_config(recipe: str | None, run_dir: str | None, resume: str | None, worker: bool
               ) -> tuple[str | None, str | None]:
    """(The recipe to load, the line that says so or None): `recipe`, or for a resume without one the run's own
    config (`rundir.own_config`). Not in a torchrun worker: each node would decide alone, from what its own disk
    shows (the CLI's parent decides for its --nproc workers, and passes the recipe on).
    The line is said once the run starts: a refused command says only its refusal."""
    from ganscale import launch, rundir

    note = None
    if recipe is None and resume is not None and not worker and (own := rundir.own_config(run_dir, resume)):
        recipe = str(own)  # continue the run as it was configured, not with the default recipe; --set still applies
        if launch.rank_from_environment() == 0:
            note = f"ganscale: resuming with the run's own config, {own} (give a RECIPE to use another)"
    return recipe, note


def _launch_workers(cfg: Config, recipe: str | None, overrides: Sequence[str], nproc: int, run_dir: Path,
                    resume: Path | None, held, max_restarts: int, note: str | None = None
                    ) -> tuple[Path, dict] | None:
    """`nproc` local workers running `ganscale train RECIPE --set ...`: (run directory, rank 0's summary).
    `note`: said by the workers' rank 0 once the checkpoint has loaded (a worker's refusal is then said alone)."""
    from ganscale import launch
    from ganscale.fault import launched, stop_grace_s

    args = ["train", *([recipe] if recipe else []), *sum((["--set", o] for o in overrides), [])]
    grace = stop_grace_s(cfg.fault.exit_timeout_s)  # the workers' longest exit after a stop signal
    with _launcher_state_kept():
        if note:
            os.environ[RESUME_NOTE_ENV] = note
        try:  # a stop signal before torch's agent handles them: fault.StartupStops (StoppedBeforeTraining)
            code = launch.launch_local(nproc, args, run_dir, max_restarts, str(resume) if resume else None, held,
                                       grace)
        finally:
            launched()  # before _launcher_state_kept puts StartupStops' handlers back
    if code:
        raise WorkersFailed(code)
    summary = run_dir / "summary.json"
    return (run_dir, json.loads(summary.read_text())) if summary.is_file() else None


def source_name(config: str | os.PathLike | dict | Config | None) -> str | None:
    """The recipe or YAML file `config` names (None: the default); a dict or a Config replaces every setting of
    the default recipe (`command`)."""
    if isinstance(config, (dict, Config)):
        return config_mod.DEFAULT_RECIPE
    return None if config is None else os.fspath(config)


def command(config: str | os.PathLike | dict | Config | None, overrides: Sequence[str], objects: dict[str, Any],
            source: str | None) -> tuple[str | None, list[str]]:
    """What `ganscale train` is given for this call: (RECIPE, --set overrides). A dict or a Config becomes every
    setting as an override (so `--nproc` workers can be given it), and each Python object its import path.
    `source`: the recipe or YAML file the run loads (the run's own config for a resume without one)."""
    sets = list(overrides)
    if isinstance(config, (dict, Config)):
        raw = copy.deepcopy(config) if isinstance(config, dict) else config.model_dump(mode="json")
        for assignment in sets:
            config_mod.apply_override(raw, assignment)
        sets = list(settings(config_mod.build(raw)))  # every key, over the default recipe (source_name)
    named = {argument: import_path(obj, argument) for argument, obj in objects.items() if obj is not None}
    for argument in named:  # which would win is no one's guess: refused
        if any(assignment.partition("=")[0].strip() == OPTIONS[argument] for assignment in overrides):
            raise ConfigError(argument, f"{argument}= and overrides' {OPTIONS[argument]} both name it",
                              f"pass one of them: {argument}=... or '{OPTIONS[argument]}=module:attribute'")
    if not named:
        return source, sets
    folders = [folder for _, folder in named.values() if folder is not None]
    code_path = config_mod.load(source, sets).code_path
    sets += sorted({CUSTOM[argument] for argument in named if argument in CUSTOM})
    sets += [f"{OPTIONS[argument]}={_yaml_value(spec)}" for argument, (spec, _) in named.items()]
    if any(folder not in code_path for folder in folders):
        sets.append(f"code_path={_yaml_value(list(dict.fromkeys([*code_path, *folders])))}")
    return source, sets


def settings(section: BaseModel, prefix: str = "") -> Iterator[str]:
    """Every option of `section` as "dotted.key=value" (YAML), sections walked into, dict-valued options whole."""
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            yield from settings(value, f"{prefix}{name}.")
        else:
            _refuse_unwritable(f"{prefix}{name}", value)
            yield f"{prefix}{name}={_yaml_value(value)}"


PLAIN = (str, int, float, bool, type(None))  # what the run's config.yaml can hold (in lists and dicts)


def _refuse_unwritable(key: str, value: Any) -> None:
    """A ConfigError naming the first value inside `value` that the run's config.yaml cannot hold (a numpy number, a
    tensor, a generator), with its dotted key: workers and resumes read the config back from that file."""
    if isinstance(value, dict):
        for name, item in value.items():
            _refuse_unwritable(f"{key}.{name}", item)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _refuse_unwritable(f"{key}[{i}]", item)
    elif not isinstance(value, PLAIN):
        raise ConfigError(key, f"a {type(value).__module__}.{type(value).__qualname__} ({value!r:.60}), which the "
                          "run's config.yaml cannot hold", "give plain values: int(...), float(...), str, and lists "
                          "and dicts of them")


def _yaml_value(value: Any) -> str:
    """One value as YAML on one line, read back as the same value (strings that look like numbers stay quoted)."""
    text = yaml.safe_dump(to_jsonable_python(value), default_flow_style=True, width=math.inf).strip()
    return text.removesuffix("...").strip()  # a lone scalar ends its document


def import_path(obj: Any, argument: str) -> tuple[str, str | None]:
    """("module:qualname" of `obj`, the folder its top-level package imports from, or None where every process
    finds it already). ConfigError naming the argument where a worker could not import it by that name."""
    key = f"train({argument}=...)"
    fix = f"define it with def or class at the top level of a module file, import it, and pass that as {argument}="
    instance = not (inspect.isclass(obj) or inspect.isfunction(obj))
    if instance and argument != "loss":
        raise ConfigError(key, f"a {type(obj).__name__} is not a class or a function that builds the object",
                          f"pass the class, or a function returning it ({OPTIONS[argument]}_args: its arguments)")
    module_name = type(obj).__module__ if instance else obj.__module__
    module = sys.modules.get(module_name)
    if instance:  # a module-level instance: the name it is bound to in its class's module
        qualname = next((name for name, value in (vars(module) if module else {}).items() if value is obj), None)
        if qualname is None:
            raise ConfigError(key, f"this {type(obj).__name__} instance is not bound to a name at the top level of "
                              f"{module_name}, so workers and resumes cannot import it",
                              f"pass its class, or bind it to a name in {module_name}")
    else:
        qualname = obj.__qualname__
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise ConfigError(key, f"{qualname} is a lambda or is defined inside a function, so workers and resumes "
                          "cannot import it", fix)
    if module_name == "__main__" or module is None:
        raise ConfigError(key, f"{qualname} is defined in {module_name} (a script or a notebook), which workers and "
                          "resumes cannot import by name", fix)
    spec = f"{module_name}:{qualname}"
    from ganscale import usercode  # imports torch: not before `ganscale train` has checked its config

    if usercode.find(spec, key, network=argument in ("generator", "discriminator")) is not obj:
        raise ConfigError(key, f"{spec} names another object than the one given (redefined, or decorated "
                          "without functools.wraps)", fix)
    return spec, _import_folder(module_name, getattr(module, "__file__", None))


def _import_folder(module_name: str, file: str | None) -> str | None:
    """The folder `module_name` is imported from (its top package's parent), None where it is installed (site-packages,
    the standard library) or has no file. A PYTHONPATH folder is recorded too: a resume may run without it."""
    if file is None:
        return None
    depth = module_name.count(".") + (Path(file).name == "__init__.py")
    folder = Path(file).resolve().parents[depth]
    installed = {*site.getsitepackages(), site.getusersitepackages(), *sysconfig.get_paths().values()}
    return None if folder in {Path(p).resolve() for p in installed} else str(folder)


@contextlib.contextmanager
def _launcher_state_kept() -> Iterator[None]:
    """This process as it was after launching workers: their environment variables (a plain run in this process
    would take itself for a worker of its own launcher) and the agent's signal handlers."""
    environment, handlers = dict(os.environ), {sig: signal.getsignal(sig) for sig in StopSignals.SIGNALS}
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environment)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)

