"""The run directory: which one a run trains in, what it resumes from, which config it continued with, and
the hold on it (runlock), decided before anything is written. Rank 0 decides; every rank takes its answer.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch.distributed as dist
import yaml

from ganscale import checkpoint, runlock
from ganscale.config import Config, ConfigError, settings_in
from ganscale.fault import error_of_rank, report_of, told_by

RUNS_ROOT = Path("runs")
RESUMED_CONFIG = re.compile(r"^config\.resumed-(\d{8,})\.yaml$")  # a resume's config, where it differed
# What a run writes into its directory (train, eval); a new run may start over them when no checkpoint is there.
RUN_FILES = re.compile(r"^(checkpoints|samples|tensorboard|diagnostics|k8s|config\.yaml|config\.resumed-\d{8,}\.yaml"
                       r"|metrics\.jsonl|fingerprints\.jsonl|summary\.json|eval\.json|slurm|profile"
                       r"|run\.lock(\.stale-[0-9a-f]+)?)$")


CONFIG_BYTES = 1 << 20  # far above any resolved config (a few KiB)


class AlreadyTrained(Exception):
    """The resume point is the run's last step (`train.steps`): nothing to train, nothing to write."""


def resolve_run(cfg: Config, run_dir: str | None, resume: str | None, report: bool = True
                ) -> tuple[Path, Path | None]:
    """(run directory, checkpoint to resume from or None). Raises ConfigError; writes nothing. `report`: say
    which newer checkpoints are passed over (`checkpoint.newest_valid`)."""
    if resume not in (None, "auto"):
        source = Path(resume)
        if not source.exists():
            raise ConfigError("--resume", f"no checkpoint at '{resume}'",
                              "pass a checkpoint file, a run directory holding checkpoints/, or 'auto'")
        if source.is_file() and source.suffix == ".json":
            raise ConfigError("--resume", f"{source} is a checkpoint's completion marker, not the checkpoint",
                              "pass the checkpoint beside it (the .pt file, or .dcp or .tf folder, of the same name)")
        if source.is_dir() and source.name == "checkpoints" and checkpoint.checkpoint_dir(source.parent) == source:
            source = source.parent  # a run's checkpoints/ folder: that run
        is_run = source.is_dir() and not checkpoint.is_folder(source)  # a step-N.dcp or .tf folder is one checkpoint
        found = _resumable(source, report) if is_run else source
        if not is_run and checkpoint.problem(source):
            raise ConfigError("--resume", f"{source}: {checkpoint.problem(source)}", "pass an intact checkpoint")
        if not is_run and run_dir is None and not checkpoint.PATTERN.match(source.name):
            raise ConfigError("--run-dir", f"{source} is not a run's checkpoints/step-N file, so it names no run "
                              "directory to train on in", "pass --run-dir (a new folder) for the run it continues")
        target = Path(run_dir) if run_dir else (source if is_run else source.parent.parent)
        _refuse_two_histories(target, found)
        return target, _left_to_train(cfg, found)
    if run_dir is None and resume == "auto":
        own = re.compile(rf"^{re.escape(cfg.name)}-\d{{8}}-\d{{6}}(-\d+)?$")  # not another recipe's prefix
        candidates = sorted((p for p in RUNS_ROOT.glob(f"{cfg.name}-*") if own.match(p.name) and checkpoint.latest(p)),
                            key=lambda p: checkpoint.latest(p).stat().st_mtime)
        run_dir = str(candidates[-1]) if candidates else None
        if run_dir is None:  # said once: rank 0 decides, and decides again with the new run's directory
            print(f"ganscale: --resume auto: no run of '{cfg.name}' with a checkpoint under {RUNS_ROOT}/, so this is "
                  "a new run", file=sys.stderr, flush=True)
    if run_dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = RUNS_ROOT / f"{cfg.name}-{stamp}"
        suffix = 1
        while path.exists():
            path, suffix = RUNS_ROOT / f"{cfg.name}-{stamp}-{suffix}", suffix + 1
        return path, None
    path = run_folder(run_dir)
    newest = checkpoint.latest(path)
    if newest is not None and resume is None:
        raise ConfigError("--run-dir", f"'{path}' already holds a run (checkpoints/{newest.name})",
                          "pass --resume auto to continue it, or choose a new --run-dir")
    foreign = sorted(p.name for p in path.iterdir() if not _own_file(p)) if path.is_dir() else []
    if newest is None and foreign:  # a fresh run replaces a failed run's own files, and nothing else
        raise ConfigError("--run-dir", f"'{path}' holds files that are not a ganscale run's ({', '.join(foreign[:3])})",
                          "choose a new or empty --run-dir (keep your own files, a YAML config too, outside it)")
    return path, (_left_to_train(cfg, _resumable(path, report)) if newest is not None else None)


def _own_file(path: Path) -> bool:
    """`path` (right inside a run directory) is one a run writes. A config file only as ganscale writes it
    (`config.to_yaml`, which loading and dumping give back unchanged): a user's own YAML file or a manifest under
    that name is not replaced."""
    if not RUN_FILES.match(path.name):
        return False
    if path.name != "config.yaml" and not RESUMED_CONFIG.match(path.name):
        return True
    try:  # only a regular file is read (a FIFO would block), and only one of a config's size
        if not path.is_file() or path.stat().st_size > CONFIG_BYTES:
            return False
        text = path.read_text()
        return yaml.safe_dump(yaml.safe_load(text), sort_keys=False) == text
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False


def own_config(run_dir: str | None, resume: str | None) -> Path | None:
    """The config a resume without a RECIPE continues with: the one the run it resumes (the run holding
    `--resume PATH`, or `--run-dir` with `--resume auto`) was training with at the checkpoint's step
    (`config_at`). None when there is nothing to resume (`--resume auto` without `--run-dir` looks for the default
    recipe's runs), or for a checkpoint outside a run (`best.pt`: the default recipe and --set, as given). A
    checkpoint of a run directory's checkpoints/ whose run has no config file is refused: the default recipe is no
    guess for it."""
    try:
        if resume not in (None, "auto"):
            source = Path(resume)
            run = source if source.is_dir() and not checkpoint.is_folder(source) else source.parent.parent
            if run.name == "checkpoints":  # a run's checkpoints/ folder: that run
                run, source = run.parent, run.parent
            newest = checkpoint.latest(run) if source == run else source
            in_run = source == run or source.parent.name == "checkpoints"
        elif run_dir is not None:
            run, in_run = Path(run_dir), True
            newest = checkpoint.latest(run)
        else:
            return None
        step = checkpoint.step_of(newest) if newest is not None else None
        found = config_at(run, step) if step is not None else None
    except OSError:  # a path the system refuses (too long, unreadable): resolve_run names it, on rank 0
        return None
    if step is not None and found is None and in_run:
        raise ConfigError("--resume", f"{newest} has no config file to continue with ({run / 'config.yaml'} is "
                          "missing)", "give the recipe or YAML file the run was trained with: ganscale train RECIPE "
                          "--resume ...")
    return found


def _newest_step(run: Path) -> int | None:
    newest = checkpoint.latest(run)
    return checkpoint.step_of(newest) if newest is not None else None


def config_at(run: Path, step: int) -> Path | None:
    """The config file a run was training with at `step`: its newest config.resumed-<K>.yaml with K <= step (a
    resume that changed the config writes one), else config.yaml; None when it has neither."""
    resumed = {int(m[1]): p for p in run.glob("config.resumed-*.yaml") if (m := RESUMED_CONFIG.match(p.name))}
    earlier = [k for k in resumed if k <= step]
    found = resumed[max(earlier)] if earlier else run / "config.yaml"
    return found if found.is_file() else None


def config_to_write(run: Path, step: int, resolved: str) -> Path | None:
    """Where a run starting (or resuming) at `step` records its resolved config: config.yaml for a new run (or a
    branch into a new folder); config.resumed-<step>.yaml, beside the original and never over it, for a resume
    that changed it (`config_at` then finds it); None for a resume that did not."""
    before = config_at(run, step) if step > 0 else None  # what trained until now
    if before is None:
        return run / "config.yaml"
    changed = settings_in(before.read_text()) != settings_in(resolved)  # an older version wrote more options
    return run / f"config.resumed-{step:08d}.yaml" if changed else None


def _refuse_two_histories(run_dir: Path, source: Path) -> None:
    """Resuming writes checkpoints and metrics into `run_dir`: refuse where that would interleave two trainings
    (another run's checkpoint, or one older than intact checkpoints the run already holds, which pruning and
    `--resume auto` would then mix up with the new ones)."""
    held = checkpoint.list_checkpoints(run_dir)
    if not held:
        return
    if source.resolve().parent != checkpoint.checkpoint_dir(run_dir).resolve():
        raise ConfigError("--run-dir", f"'{run_dir}' already holds another run (checkpoints/{held[-1].name}); "
                          f"resuming {source} there would mix the two", "pass a new --run-dir to continue from it")
    step = checkpoint.step_of(source)
    newer = [p for p in held if (checkpoint.step_of(p) or 0) > (step or 0) and not checkpoint.problem(p)]
    if newer:
        raise ConfigError("--resume", f"'{run_dir}' holds newer intact checkpoints than {source.name} (up to "
                          f"{newer[-1].name}); training on from the older one there would discard or mix them",
                          f"to branch from {source.name}, pass a new --run-dir; to continue, pass --resume auto")


def _left_to_train(cfg: Config, source: Path) -> Path:
    """`source`, if the run has steps left after it; AlreadyTrained at its last step; a ConfigError past it."""
    written_by = checkpoint.engine_of(source)
    if written_by != cfg.train.engine:
        raise ConfigError("train.engine", f"{source} was written by the {written_by} engine, and this run trains on "
                          f"the {cfg.train.engine} engine", f"resume it with --set train.engine={written_by}")
    step = checkpoint.step_of(source)
    if step is not None and step > cfg.train.steps:
        raise ConfigError("train.steps", f"{source} is at step {step}, past train.steps={cfg.train.steps}",
                          f"set train.steps above {step} to train on from it")
    if step == cfg.train.steps:
        raise AlreadyTrained(f"{source.parent.parent} is trained to step {step} (train.steps={cfg.train.steps}): "
                             "nothing to do; raise train.steps to train on")
    return source


def run_folder(run_dir: str | Path) -> Path:
    """`run_dir` as a path, refused where it is a file, as the CLI's option type refuses it (the Python API's run_dir
    reaches here). A file above it is the file operation the system refuses (exit 7, as any path's)."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError("--run-dir", f"'{path}' is a file, not a folder", "choose a new or empty --run-dir")
    return path


def _resumable(run_dir: Path, report: bool = True) -> Path:
    """The newest intact checkpoint of a run (newer bad ones are reported), or a ConfigError."""
    return checkpoint.newest_intact(run_dir, "--resume", "pass a checkpoint file, a run directory holding intact "
                                    "checkpoints, or start a new --run-dir", report)


def claim_run(cfg: Config, run_dir: str | None, resume: str | None
              ) -> tuple[Path, Path | None, runlock.RunLock | None]:
    """`resolve_run`, holding the run directory: (run directory, resume point, this process's hold on it, None
    under the `--nproc` parent's). A directory another run holds is refused first, naming that run; the
    decision is made again once held, so it is made on what no other run can change any more."""
    parent_holds = run_dir is not None and runlock.held_by_parent(run_folder(run_dir))
    if run_dir is not None and not parent_holds:
        runlock.refuse_if_held(Path(run_dir))
    # Decided again once held (below), which says what it passes over: said once.
    path, source = resolve_run(cfg, run_dir, resume, report=parent_holds)
    if runlock.held_by_parent(path):
        return path, source, None
    held = runlock.hold(path)
    try:
        return (*resolve_run(cfg, str(path), resume), held)
    except BaseException:
        held.release(abandon=True)  # refused (or nothing to do): nothing of this run stays behind
        raise


def decide_run(cfg: Config, run_dir: str | None, resume: str | None
               ) -> tuple[Path, Path | None, runlock.RunLock | None]:
    """Collective: rank 0 decides the run directory and resume point and takes the run directory (`claim_run`,
    its refusals included); every rank takes that answer, or raises the same ConfigError or AlreadyTrained (told
    by rank 0, which alone says it). A rank whose view of the run directory differs (another node, a stale network
    file system) follows rank 0 instead of deciding alone and leaving its peers waiting at the next collective.
    The hold (rank 0's) is released by the caller when the run ends."""
    answer: list = [None]
    failure = held = None
    if dist.get_rank() == 0:
        try:
            path, source, held = claim_run(cfg, run_dir, resume)
            answer = [("run", str(path), str(source) if source else None, runlock.token_of(path))]
        except ConfigError as e:
            failure, answer = e, [("refused", e.key, e.problem, e.fix)]
        except AlreadyTrained as e:
            failure, answer = e, [("done", str(e))]
        except Exception as e:  # noqa: BLE001 - e.g. an unreadable --run-dir: told to the peers, raised here
            failure, answer = e, [("failed", report_of(e))]
    try:
        dist.broadcast_object_list(answer, src=0)
        kind, *fields = answer[0]
        if failure is not None:
            raise failure
        if kind == "failed":
            raise error_of_rank(0, "decide the run directory", fields[0])
        if kind == "refused":
            raise told_by(0, ConfigError(*fields))
        if kind == "done":
            raise AlreadyTrained(fields[0])
        path, source, token = Path(fields[0]), (Path(fields[1]) if fields[1] else None), fields[2]
        sees: list = [None] * dist.get_world_size()
        dist.all_gather_object(sees, _sees_hold(path, token))  # one collective: does every rank see rank 0's folder?
        blind = [rank for rank, seen in enumerate(sees) if not seen]
        if blind:
            error = ConfigError("--run-dir", f"rank(s) {', '.join(map(str, blind))} do not see "
                                f"{path / runlock.LOCK_NAME}, which rank 0 holds there: the run directory is not on "
                                "storage every node shares",
                                "put --run-dir on a file system every node mounts at the same path (NFS, Lustre, ...)")
            raise error if dist.get_rank() == 0 else told_by(0, error)
    except BaseException:  # the blind ranks above, or a stop signal (fault.StoppedBeforeTraining) before the caller
        if held is not None:  # holds it: nothing of this run stays behind
            held.release(abandon=True)
        raise
    return path, source, held


def _sees_hold(run_dir: Path, token: str | None, patience_s: float = 5.0) -> bool:
    """Whether this rank sees rank 0's hold on `run_dir`; a network file system may show a new file a moment late."""
    deadline = time.monotonic() + patience_s
    while runlock.token_of(run_dir) != token:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def resume_after_restart(run_dir: str | Path, resume: str | None) -> str | None:
    """What a restarted worker group resumes from: its run directory's newest intact checkpoint ('auto') once
    it holds one; before its first intact checkpoint, what the first start resumed from (a branch's source, or
    None)."""
    return "auto" if checkpoint.newest_valid(Path(run_dir)) is not None else resume
