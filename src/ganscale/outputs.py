"""Files written whole or not at all, and where a command may write one the user names (--out).

Never over a run's own files, not even with --force: its checkpoints/ and config files (a resume reads them), the
records its training writes and reads back or appends to (metrics.jsonl, fingerprints.jsonl, summary.json, run.lock,
anything in samples/, tensorboard/, diagnostics/, profile/), and what `ganscale eval` (eval.json) and `ganscale slurm`
(slurm/) write there (RUN_RECORDS). Any other file in a run directory may be written (RUN/grid.png), k8s/ included:
`ganscale k8s` writes its manifest there by this rule. Never over a directory, device or other non-regular file, and
over an existing file only with --force. Every such file (and a run's config and sample pictures) is written under a
temporary name beside it and renamed into place: a failed write (a full disk) leaves nothing, and its error names
the file.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ganscale import checkpoint
from ganscale.config import ConfigError
from ganscale.fault import REFUSED_FILE_OPERATION, terminate_unwinds
from ganscale.rundir import RESUMED_CONFIG
from ganscale.runlock import LOCK_NAME

# A run's own files beside its checkpoints and config (of rundir.RUN_FILES), with the one command that writes each.
# k8s/ is left out: `ganscale k8s` writes its manifest there through check_output (replaced with --force).
RUN_RECORDS = {"metrics.jsonl": "train", "fingerprints.jsonl": "train", "summary.json": "train", LOCK_NAME: "train",
               "samples": "train", "tensorboard": "train", "diagnostics": "train", "profile": "train",
               "eval.json": "eval", "slurm": "slurm"}


def _is_run(folder: Path) -> bool:
    """A ganscale run directory: it holds the run's config.yaml, its checkpoints or its lock. The lock is all a run
    holds until its data and networks are built and its config.yaml written (all, where it was killed before)."""
    return ((folder / "config.yaml").is_file() or os.path.lexists(folder / LOCK_NAME)
            or bool(checkpoint.list_checkpoints(folder)))


def _record(name: str) -> str | None:
    """The RUN_RECORDS key of `name`, a file or folder right inside a run directory (a stale lock, set aside by a
    takeover, is the lock's), else None."""
    return LOCK_NAME if name.startswith(f"{LOCK_NAME}.stale-") else name if name in RUN_RECORDS else None


def _run_file(path: Path) -> tuple[str, str] | None:
    """(what of a run `path` (absolute) is, the only command that writes it) when it is one of a run's own files."""
    for folder in (path, *path.parents):
        if folder == checkpoint.checkpoint_dir(folder.parent) and _is_run(folder.parent):
            return f"inside the checkpoints of run {folder.parent}", "train"
    if (path.name == "config.yaml" or RESUMED_CONFIG.match(path.name)) and _is_run(path.parent):
        return f"the config of run {path.parent}", "train"
    for run in path.parents:  # every folder above: a record's name is the first below its run directory
        name = path.relative_to(run).parts[0]
        record = _record(name)
        if record is not None and _is_run(run):
            what = f"the {name}" if run / name == path else f"inside the {name}/"
            return f"{what} of run {run}", RUN_RECORDS[record]
    return None


def _not_regular(path: Path) -> bool:
    """There is something at `path` that is not a regular file (or a link to one): a folder, a device, a FIFO."""
    return os.path.lexists(path) and not path.is_file()


def check_output(out: str, force: bool, option: str = "--out", suffixes: tuple[str, ...] = ()) -> Path:
    """`out` as a Path when a command may write it (its folder is made when missing) and, where `suffixes` are
    given, names a file of one of those kinds; else a ConfigError at `option` (the command's name for the file)."""
    another = f"choose another {option}"
    if not out:
        raise ConfigError(option, "the file name is empty", f"give {option} the file to write")
    path = Path(out)
    for where in {Path(os.path.abspath(path)), path.resolve()}:  # the name given, and where a link leads
        run_file = _run_file(where)
        if run_file:
            what, writer = run_file
            raise ConfigError(option, f"'{out}' is {what}, which no command but {writer} writes (not even with "
                              "--force)", another)
    # The nearest existing folder above: a file there made mkdir fail as "File exists" (exit 7, blaming permissions).
    above = next((p for p in path.parents if os.path.lexists(p)), None)
    if above is not None and not above.is_dir():
        raise ConfigError(option, f"'{above}' in '{out}' is a file, not a folder",
                          f"{another}, in a folder (or move that file away)")
    if _not_regular(path):
        raise ConfigError(option, f"'{out}' exists and is not a regular file (a folder, a device or the like)",
                          f"{another}, naming a file")
    if os.path.lexists(path) and not force:
        raise ConfigError(option, f"'{out}' already exists", f"pass --force to replace it, or {another}")
    if suffixes and path.suffix.lower() not in suffixes:
        raise ConfigError(option, f"'{out}' is not a {' or '.join(suffixes)} file",
                          f"give {option} a name ending in {suffixes[0]}")
    return path


def finite_json(value: Any) -> Any:
    """`value` with every non-finite float (NaN, +-inf) as None: json.dumps writes those as NaN / Infinity, which
    are not JSON (JavaScript's JSON.parse and jq refuse the file). null thus means "not a finite number"."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


def to_json(value: Any, **dumps_options: Any) -> str:
    """json.dumps of `value` that is valid JSON: non-finite numbers are null (finite_json)."""
    return json.dumps(finite_json(value), allow_nan=False, **dumps_options)


def _first_line(error: BaseException) -> str:
    """The first line of `error`'s message, or its type's name when it has none (Pillow raises a bare MemoryError())."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def _launcher_stop(error: BaseException) -> bool:
    """torch elastic's SignalException: the `--nproc` launcher's SIGTERM, which it turns into a preemption (exit 3),
    not a failed write."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    return isinstance(error, SignalException)


def _temporary_prefix(out: Path, host: str) -> str:
    """The start of the temporary names `write_output` writes `out` under on `host` (the writer's pid and `out`'s
    suffix follow)."""
    return f".{out.stem}.tmp-{host}-"


def _remove_abandoned(out: Path) -> None:
    """Remove what a killed write of `out` on this host left (SIGKILL runs no cleanup): a temporary name of a
    process that is gone. Another host's are left alone: its processes cannot be seen from here."""
    prefix = _temporary_prefix(out, socket.gethostname())
    for tmp in out.parent.glob(f"{glob.escape(prefix)}*{glob.escape(out.suffix)}"):
        pid = tmp.name[len(prefix):len(tmp.name) - len(out.suffix)]
        if pid.isdigit() and not checkpoint.writer_alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def write_output(out: Path, write: Callable[[Path], None], option: str = "--out") -> Path:
    """`write(temporary)` writes the file beside `out`, which is then renamed into place (with the permissions of
    any new file). A refused write is an OSError naming `out` (the CLI's one line and exit 7); another failure a
    ConfigError at `option`. Either way nothing of this write is left, and what was at `out` is untouched."""
    # out's suffix last: it picks the format
    tmp = out.with_name(f"{_temporary_prefix(out, socket.gethostname())}{os.getpid()}{out.suffix}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(out)
        with terminate_unwinds():  # a SIGTERM (or Ctrl-C) lands in the except below: the temporary file is removed
            write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # e.g. safetensors writes 0600 (a private temporary file)
        # A rename would replace a device node (as root) or a FIFO found there now; over a folder it fails by itself.
        if _not_regular(out) and not out.is_dir():
            raise ConfigError(option, f"'{out}' is not a regular file", f"choose another {option}")
        os.replace(tmp, out)
    except BaseException as e:  # noqa: BLE001 - OSError, a writer's own error, or a SIGTERM / Ctrl-C
        checkpoint.remove_written(tmp)
        if isinstance(e, ConfigError) or not isinstance(e, Exception) or _launcher_stop(e):
            raise
        cause = checkpoint.os_error_behind(e)
        if cause is not None and cause.errno in REFUSED_FILE_OPERATION:  # shown as every command shows it: exit 7
            raise OSError(cause.errno, os.strerror(cause.errno), str(out)) from None
        reason = checkpoint.os_reason(cause) if cause is not None else _first_line(e)
        raise ConfigError(option, f"could not write {out}: {reason}",
                          f"choose another {option}, or make room on its disk") from None
    return out
