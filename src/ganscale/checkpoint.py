"""Full training state on disk: atomic writes, checksums, keep-latest-k, resume.

A checkpoint holds G, D, G_ema, both optimizers, the loss scaler, the step, the data position and
every rank's RNG state. In the full format rank 0 writes `step-N.pt` under a temporary name and renames
it into place; in the sharded format (`checkpoint.format=sharded`) every rank writes its own shards with
torch.distributed.checkpoint into a temporary folder, rank 0 adds `meta.pt` (everything but the networks)
and renames the folder to `step-N.dcp`. Then rank 0 writes `step-N.json` (size and SHA-256 of every
file) the same way: that manifest is the completion marker. A checkpoint without its manifest, or whose
bytes do not match it, is reported and passed over. Both formats load under any strategy and world size.

Reading one runs no code a writer of its files could have put there: tensors and plain data only
(weights_only=True), and a sharded checkpoint's DCP metadata through an unpickler that admits only DCP's own
classes (`_shard_reader`). One that cannot be read so is reported and passed over like a damaged one.

A write that fails (e.g. a full disk) removes what it had written and raises CheckpointWriteError; the
checkpoints written before are untouched. Temporary files of writers that died (kill -9, a lost node) are
swept before each write.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import stat
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ganscale.config import ConfigError
from ganscale.fault import CheckpointWriteError, rank0_writes, told_by

PATTERN = re.compile(r"^step-(\d{8,})\.(pt|dcp|tf)$")  # zero-padded to 8 digits; step 10**8 and on take more
TEMPORARY = re.compile(r"^\.step-\d{8,}\.(pt|json)\.tmp-(\d+)$")  # a file being written by process PID
STAGING = re.compile(r"^\.step-\d{8,}\.(dcp|tf)\.tmp$")  # a sharded or TensorFlow checkpoint being written
TENSORFLOW = ".tf"  # a tf.train.Checkpoint folder, written by the tensorflow engine (ganscale.tf.loop)
META = "meta.pt"  # inside a sharded checkpoint: step, data position, RNG states, scaler, config

NETWORKS = ("G", "D", "G_ema")
GENERATOR_KEYS = ("G", "G_ema", "step", "config")  # what export, eval and sample read (of any engine's checkpoint)
CORE_KEYS = (*NETWORKS, "step", "config")  # in every ganscale checkpoint (sharded: meta.pt and the shards)
META_KEYS = ("step", "data_position", "skipped_steps", "scaler", "rng", "config")  # what a resume reads of meta.pt
RESUME_KEYS = (*NETWORKS, "opt_g", "opt_d", *META_KEYS)  # what a resume reads of a full checkpoint
RESUME_OPTIONAL = ("consecutive_skips", "pl_mean", "augment", "world_size")  # read where present: older ones lack them
RESUME_FIX = "resume from an intact one with --resume PATH, or start a new --run-dir"
LOAD_FIX = "use an intact checkpoint written by `ganscale train` (RUN_DIR/checkpoints/step-N.pt or step-N.dcp)"


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if PATTERN.match(p.name)),
                  key=lambda p: (int(PATTERN.match(p.name).group(1)), p.name))  # by step, not by name


def latest(run_dir: Path) -> Path | None:
    """The newest checkpoint file, complete or not (cheap: no checksum)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def step_of(path: Path) -> int | None:
    """The step of a checkpoint: from its name (step-N.pt, step-N.dcp), else from its completion marker (a copy
    renamed with its marker, best.pt); None when neither tells."""
    named = PATTERN.match(Path(path).name)
    if named:
        return int(named.group(1))
    try:
        step = json.loads(_read_marker(manifest_path(Path(path)))).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if type(step) is int else None


def remove_unfinished(run_dir: Path) -> list[Path]:
    """Remove RUN_DIR's checkpoints that are not intact, with their markers. Only for the launcher, before it
    restarts a group that left no intact checkpoint: every one there was then written by that group, which
    died writing it (an explicit --resume of another run into a directory holding checkpoints is refused)."""
    unfinished = [p for p in list_checkpoints(run_dir) if problem(p) is not None]
    for path in unfinished:
        remove_written(manifest_path(path))
        remove_written(path)
    return unfinished


def manifest_path(path: Path) -> Path:
    return path.with_suffix(".json")


def is_sharded(path: Path) -> bool:
    return Path(path).suffix == ".dcp"


def is_folder(path: Path) -> bool:
    """A checkpoint that is a folder (DCP's step-N.dcp, TensorFlow's step-N.tf), not a run directory."""
    return Path(path).suffix in (".dcp", TENSORFLOW)


def engine_of(path: Path) -> str:
    """The training engine (train.engine) that wrote a checkpoint."""
    return "tensorflow" if Path(path).suffix == TENSORFLOW else "torch"


def _files(path: Path) -> dict[str, Path]:
    """The files a checkpoint consists of, by name relative to it: every entry but folders, a FIFO or device
    included (`problem` names it rather than calling it missing)."""
    if not path.is_dir():
        return {path.name: path}
    return {str(p.relative_to(path)): p for p in sorted(path.rglob("*")) if not p.is_dir()}


def _not_regular(mode: int) -> str | None:
    """What a file of st_mode `mode` is when it is not a regular file, else None: reading a FIFO or a device such
    as /dev/zero would block or never end, and its size (0) would match any marker."""
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                                         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                                         (stat.S_ISSOCK, "a socket")) if test(mode)), "not a regular file")


def _open_regular(path: Path):
    """`path` opened for reading, never blocking: an OSError when it is not a regular file (a FIFO opened
    plainly waits for a writer; one swapped in after `problem` looked is refused here too)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        what = _not_regular(os.fstat(fd).st_mode)
        if what is not None:
            raise OSError(errno.EINVAL, f"{Path(path).name} is {what}, not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


MARKER_BYTES = 16 << 20  # a marker takes ~130 bytes a file: this is a checkpoint of over 100,000 files


def _read_marker(marker: Path) -> str:
    """A completion marker's text; an OSError or ValueError when it is no marker ganscale could have written
    (not a regular file, or over MARKER_BYTES: read whole, a sparse 1 TB file was a MemoryError)."""
    with _open_regular(marker) as f:
        text = f.read(MARKER_BYTES + 1)
    if len(text) > MARKER_BYTES:
        raise ValueError(f"over {MARKER_BYTES >> 20} MiB, larger than any marker ganscale writes")
    return text.decode()


def _manifest(path: Path, step: int) -> dict:
    return {"step": step, "file": path.name,
            "files": {name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for name, p in _files(path).items()}}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with _open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def problem(path: Path, content: bool = True) -> str | None:
    """Why this checkpoint cannot be trusted, or None when it is complete, intact and readable (`_unreadable`).
    `content=False` checks every file is there at its size but reads none (a rank whose peer has checked the
    content: see `load`)."""
    marker = manifest_path(path)
    if marker == Path(path):
        return "a completion marker, not a checkpoint: pass the checkpoint beside it (.pt, or .dcp when sharded)"
    if not marker.exists():  # one that is there but no file (a FIFO, a folder) is named below
        return (f"incomplete: no completion marker {marker.name} beside it (the write was interrupted, or the file "
                "was copied without it)")
    try:
        manifest = json.loads(_read_marker(marker))
    except (OSError, ValueError) as e:
        return f"unreadable completion marker {marker.name} ({os_reason(e) if isinstance(e, OSError) else e})"
    expected = _expected_files(manifest, path)
    if isinstance(expected, str):
        return f"malformed completion marker {marker.name} ({expected})"
    if path.is_dir() != is_folder(path):  # step-N.pt made a folder, or step-N.dcp a file: nothing in it is read
        return (f"{path.name} is a folder, not a checkpoint file" if path.is_dir() else
                f"{path.name} is not a folder, as a {path.suffix} checkpoint is")
    if not path.is_dir() and len(expected) == 1:  # one file, renamed with its marker (best.pt, best.json): by content
        expected = {path.name: next(iter(expected.values()))}
    try:
        present = _files(path)
        for name, want in expected.items():
            if name not in present or not present[name].exists():  # a symbolic link to nothing is missing too
                return f"incomplete: {name} is missing"
            status = present[name].stat()
            what = _not_regular(status.st_mode)
            if what is not None:
                return f"not a regular file: {name} is {what}"
            size = status.st_size
            if size != want["bytes"]:
                if size < want["bytes"]:
                    return f"truncated: {name} has {size} bytes, {want['bytes']} expected"
                return f"grown: {name} has {size} bytes, {want['bytes']} expected (written to after its marker)"
            if content and _sha256(present[name]) != want["sha256"]:
                return f"corrupted: the SHA-256 of {name} does not match its completion marker"
    except OSError as e:
        return f"unreadable ({os_reason(e)})"
    return _unreadable(path) if content else None


def _unreadable(path: Path) -> str | None:
    """Why a checkpoint whose files match its marker still cannot be read, or None. Anyone who can write a file can
    write its marker: what a load unpickles is read here too (a full checkpoint mapped, not its tensor data; a
    sharded one's .metadata and meta.pt), so a resume passes over a crafted or foreign file as over a truncated one."""
    if engine_of(path) == "tensorflow":  # tensors and a protobuf index, nothing unpickled: its marker checks it
        return None
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the one line below says it all
            warnings.simplefilter("ignore")
            if is_sharded(path):
                _check_items(path)
            read = path / META if is_sharded(path) else path
            with _open_regular(read) as f:
                if f.read(4) != ZIP_MAGIC:  # else torch's "mmap can only be used with files saved with ..."
                    return (f"unreadable: {read.name} is not a torch checkpoint file (torch.save writes a zip archive; "
                            "this is not one)")
            torch.load(read, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - whatever the file holds, it is named in one line
        return f"unreadable: {read_failure(e)}"
    return None


ZIP_MAGIC = b"PK\x03\x04"  # how every file torch.save writes begins (a zip archive's first local header)


# The lines of torch's weights_only error that are not about the file (one advises weights_only=False).
TORCH_ADVICE = ("Weights only load failed", "(1)", "(2)", "Please file an issue", "Check the documentation")


def read_failure(error: Exception) -> str:
    """One line for why a checkpoint file could not be read (torch's own text is many lines, and advises
    weights_only=False, which would run whatever the file holds)."""
    lines = [line.strip().removeprefix("WeightsUnpickler error:").strip() for line in str(error).splitlines()]
    lines = [line for line in lines if line and not line.startswith(TORCH_ADVICE)]
    if isinstance(error, pickle.UnpicklingError):
        detail = lines[0].split(". ")[0] if lines else type(error).__name__
        if "GLOBAL" in detail.upper():  # the pickle names a callable or class: refused, never called
            return (f"it holds more than tensors and plain data, refused as reading it could run code ({detail}): "
                    "it was not written by ganscale, or was altered")
        return f"not a pickle torch wrote ({detail})"
    return f"{type(error).__name__}: {lines[0].split('. ')[0] if lines else ''}"


def _expected_files(manifest, path: Path) -> dict[str, dict] | str:
    """{name: {"bytes", "sha256"}} from a completion marker, or what is wrong with it."""
    if not isinstance(manifest, dict):
        return f"a JSON {type(manifest).__name__}, not an object"
    if "files" in manifest:
        expected = manifest["files"]
        if not isinstance(expected, dict) or not expected:
            return "'files' is not an object naming at least one file"
    else:
        expected = {path.name: manifest}  # older full-format markers describe one file
    for name, want in expected.items():
        if not (isinstance(want, dict) and type(want.get("bytes")) is int and isinstance(want.get("sha256"), str)):
            return f"the entry of {name} has no 'bytes' and 'sha256'"
    return expected


def newest_valid(run_dir: Path, report: bool = True) -> Path | None:
    """The newest intact checkpoint; with `report`, every newer bad one is reported on stderr, naming the file and
    why, and then the one used instead."""
    skipped = False
    for path in reversed(list_checkpoints(run_dir)):
        reason = problem(path)
        if reason is None:
            if skipped and report:
                print(f"ganscale: using checkpoint {path}, the newest intact one", file=sys.stderr, flush=True)
            return path
        if report:
            print(f"ganscale: warning: skipping checkpoint {path}: {reason}", file=sys.stderr, flush=True)
        skipped = True
    return None


def newest_intact(run_dir: Path, key: str, fix: str, report: bool = True) -> Path:
    """`newest_valid`, or a ConfigError at `key` (the caller's option) saying why a run has none."""
    found = newest_valid(run_dir, report)
    if found is None:
        newest = latest(run_dir)
        raise ConfigError(key, f"no intact checkpoint under {run_dir}/checkpoints"
                          + (f" (newest: {newest.name}, {problem(newest)})" if newest else ""), fix)
    return found


def rng_state() -> dict:
    """This rank's RNG state, in tensors only (so checkpoints load with weights_only=True)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"torch": torch.get_rng_state(),
             "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
                       "gauss": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict, cuda: bool) -> None:
    """Restore `rng_state()`; its CUDA generator only in a run on CUDA (`cuda`): in a CPU run on a GPU machine,
    setting it would start a CUDA context on GPU 0 in every rank, for nothing."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if cuda and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def gather_rng_states() -> list[dict]:
    """Every rank's RNG state on every rank (collective)."""
    states: list[dict | None] = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state())
    return states  # type: ignore[return-value]


def _write_atomically(path: Path, write) -> None:
    """Write under a temporary name, then rename into place; on any failure the temporary file is removed."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_written(tmp)
        raise


def remove_written(path: Path) -> None:
    """Remove a file or folder we wrote, if it is there (best effort: this runs while handling a failure)."""
    try:
        shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)
    except OSError:
        pass


def writer_alive(pid: int) -> bool:
    """Process `pid`, which wrote a temporary file on this host, may still be writing it (this process is not:
    it removes such files only before writing its own)."""
    if pid <= 0 or pid == os.getpid():  # this process writes no checkpoint while it sweeps
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists, as another user
        return True
    return True


def sweep(run_dir: Path) -> list[Path]:
    """Remove what interrupted checkpoint writes left in RUN_DIR/checkpoints: `.step-N.pt.tmp-PID` and
    `.step-N.json.tmp-PID` files whose process is gone, and `.step-N.dcp.tmp` staging folders. Nothing else
    is touched. Called on rank 0 while no rank writes a checkpoint (save and save_sharded do it first)."""
    folder = checkpoint_dir(run_dir)
    if not folder.is_dir():
        return []
    removed = []
    for entry in sorted(folder.iterdir()):
        temporary = TEMPORARY.match(entry.name)
        if ((temporary and entry.is_file() and not entry.is_symlink() and not writer_alive(int(temporary.group(2))))
                or (STAGING.match(entry.name) and entry.is_dir() and not entry.is_symlink())):
            remove_written(entry)
            removed.append(entry)
    if removed:
        print(f"ganscale: removed {len(removed)} temporary file(s) of interrupted checkpoint writes in {folder} "
              f"({', '.join(p.name for p in removed)})", file=sys.stderr, flush=True)
    return removed


def os_error_behind(error: BaseException) -> OSError | None:
    """The OSError behind a failed write: torch.save reports ENOSPC as a RuntimeError from its zip writer
    (the OSError is its context), torch.distributed.checkpoint as a CheckpointException with each rank's error."""
    pending, seen = [error], set()
    while pending:
        e = pending.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        pending += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def os_reason(error: OSError) -> str:
    """The system's reason for a failed file operation, as a clause: 'no space left on device'."""
    text = error.strerror or str(error) or type(error).__name__
    return text[:1].lower() + text[1:]


def _write_failed(path: Path, error: BaseException, what: str = "") -> CheckpointWriteError:
    """The error to raise for a failed write of checkpoint `path`; re-raises `error` when no OSError is behind
    it (a bug, an interrupt: its own traceback is the useful one)."""
    cause = os_error_behind(error)
    if cause is None:
        raise error
    folder = path.parent
    if cause.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = (f"free space on the disk holding {folder} (a write needs room for one more checkpoint beside the "
               f"checkpoint.keep kept)")
    elif cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {folder} writable"
    else:
        fix = f"check the disk holding {folder}"
    fix += ", then continue with --resume auto; the checkpoints written before are untouched"
    return CheckpointWriteError(f"could not write checkpoint {path}{what}: {os_reason(cause)}. Fix: {fix}", cause.errno)


def save(state: dict, run_dir: Path, step: int, keep: int) -> Path:
    """Write atomically, then the completion marker; prune to the newest `keep`. Called on rank 0 only.
    Raises CheckpointWriteError when the disk refuses (full, read-only); nothing of this write is left."""
    folder = checkpoint_dir(run_dir)
    path = folder / f"step-{step:08d}.pt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        sweep(run_dir)
        _write_atomically(path, lambda f: torch.save(state, f))
    except BaseException as e:
        raise _write_failed(path, e) from e
    return _complete(path, run_dir, step, keep)


def _complete(path: Path, run_dir: Path, step: int, keep: int) -> Path:
    """Write the completion marker of a checkpoint that is in place, then prune to the newest `keep`.
    Without its marker the checkpoint is never used: when the marker cannot be written, it is removed."""
    try:
        manifest = _manifest(path, step)
        _write_atomically(manifest_path(path), lambda f: f.write(json.dumps(manifest).encode()))
    except BaseException as e:
        remove_written(manifest_path(path))  # one of an earlier write of this step would describe other bytes
        remove_written(path)
        raise _write_failed(path, e, f" (its completion marker {manifest_path(path).name})") from e
    # Among this one and older ones only: a newer one without its marker (a crash, then a resume from an older
    # checkpoint) must not push the one just written out.
    for old in [p for p in list_checkpoints(run_dir) if step_of(p) <= step][:-keep]:
        manifest_path(old).unlink(missing_ok=True)  # first: a half-removed checkpoint is then plainly incomplete
        shutil.rmtree(old) if old.is_dir() else old.unlink(missing_ok=True)
    return path


def save_folder(write: Callable[[Path], None], run_dir: Path, step: int, keep: int, suffix: str = TENSORFLOW) -> Path:
    """A checkpoint folder `step-N<suffix>`: `write` fills a staging folder, renamed into place, then marked complete
    and pruned to the newest `keep` (`_complete`). Raises CheckpointWriteError; nothing of this write is left."""
    folder = checkpoint_dir(run_dir)
    path = folder / f"step-{step:08d}{suffix}"
    staging = folder / f".{path.name}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        sweep(run_dir)  # an earlier staging folder of this step included
        staging.mkdir()
        write(staging)
        remove_written(path)  # an unmarked one of this step, left by a crash: never used
        os.replace(staging, path)
    except BaseException as e:
        remove_written(staging)
        raise _write_failed(path, e) from e
    return _complete(path, run_dir, step, keep)


def save_sharded(shards: dict, meta: dict, run_dir: Path, step: int, keep: int) -> Path | None:
    """Collective: every rank writes its shards of `shards` (torch.distributed.checkpoint), rank 0 the
    rest (`meta`), the folder is renamed into place and marked complete. Returns the path on rank 0."""
    import torch.distributed.checkpoint as dcp

    folder = checkpoint_dir(run_dir)
    path = folder / f"step-{step:08d}.dcp"
    staging = folder / f".{path.name}.tmp"  # the same name on every rank: one folder, written by all
    main = dist.get_rank() == 0
    with rank0_writes("checkpoint"):  # collective on leaving: one broadcast
        if main:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                sweep(run_dir)  # also the staging folder of an interrupted write, of this step or another
                staging.mkdir()
            except BaseException as e:
                raise _write_failed(path, e) from e
    try:
        dcp.save(shards, storage_writer=_shard_writer(staging))  # collective: each rank its files, rank 0 the metadata
    except BaseException as e:  # every rank gets the CheckpointException, after every rank stopped writing
        if main:
            remove_written(staging)
        raise told_by(0, _write_failed(path, e)) from e  # the same error on every rank: said once, by rank 0
    with rank0_writes("checkpoint"):  # collective on leaving: one broadcast
        if main:
            missing = _missing_shard_files(staging)
            if missing:  # the other ranks wrote theirs into a folder of the same name elsewhere: another node's
                remove_written(staging)
                raise CheckpointWriteError(
                    f"could not write checkpoint {path}: {len(missing)} shard file(s) other ranks wrote are not in "
                    f"{staging} ({missing[0]}): its run directory is not on a file system every node shares. Fix: "
                    "pass a --run-dir on a shared file system, or set checkpoint.format=full (rank 0 writes it)")
            try:
                _write_atomically(staging / META, lambda f: torch.save(meta, f))
                shutil.rmtree(path, ignore_errors=True)  # one of the same step (an interrupted write) is replaced
                os.replace(staging, path)
            except BaseException as e:
                remove_written(staging)
                raise _write_failed(path, e) from e
            return _complete(path, run_dir, step, keep)
    return None


def _shard_writer(folder: Path):
    """torch.distributed.checkpoint's file writer, except that a failed write raises the OSError behind it
    (a full disk shows as torch.save's RuntimeError otherwise): DCP pickles each rank's error to every rank,
    and the OSError's errno and text survive that where the RuntimeError's context does not."""
    from torch.distributed.checkpoint import FileSystemWriter

    def plainly(method):
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except Exception as e:
                cause = os_error_behind(e)
                if cause is None or cause is e:
                    raise
                raise OSError(cause.errno, cause.strerror or str(cause)) from e
        return call

    class Writer(FileSystemWriter):
        write_data = plainly(FileSystemWriter.write_data)
        finish = plainly(FileSystemWriter.finish)

    return Writer(folder)


def _missing_shard_files(staging: Path) -> list[str]:
    """The files a just-written sharded checkpoint's metadata names that are not in `staging` (rank 0's view)."""
    named = {info.relative_path for info in _shard_reader(staging).read_metadata().storage_data.values()}
    return sorted(name for name in named if not (staging / name).is_file())


# Every global the .metadata of a sharded checkpoint written by torch 2.11-2.14's DCP names (besides torch's dtypes):
# metadata.py and filesystem.py's _StorageInfo define the same classes in each (ganscale.versions).
METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch.strided & co. by name
    ("pathlib", "PosixPath"), ("pathlib._local", "PosixPath"),  # the writer's folder; pathlib._local from Python 3.13
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles a DCP .metadata file, admitting only METADATA_GLOBALS: a crafted one cannot name a callable
    that runs code (os.system, builtins.exec) when it is read."""

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                     torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unsupported GLOBAL {module}.{name} in .metadata")


def _checked_metadata(metadata):
    """DCP's Metadata as its reader uses it, or a ValueError: every shard file it names is a file of the folder."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    if not (isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict)
            and all(isinstance(key, str) and isinstance(info, (TensorStorageMetadata, BytesStorageMetadata))
                    for key, info in metadata.state_dict_metadata.items())):
        raise ValueError("its .metadata is not torch.distributed.checkpoint metadata")
    for info in metadata.storage_data.values():
        if not (isinstance(info, _StorageInfo) and isinstance(info.relative_path, str)
                and info.relative_path not in ("", ".", "..") and "/" not in info.relative_path
                and type(info.offset) is int and type(info.length) is int):
            raise ValueError(f"its .metadata names a shard outside the checkpoint, or malformed ({info!r:.100})")
    return metadata


def _shard_reader(folder: Path):
    """torch.distributed.checkpoint's file reader, except that it unpickles nothing a writer of the folder could
    have crafted to run code: .metadata through `_MetadataUnpickler`, and non-tensor items (DCP's planner reads
    them with weights_only=False) checked with weights_only=True first."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class WeightsOnlyBytes:
        """The load planner, whose load_bytes gets the item only once weights_only=True could read it."""

        def __init__(self, planner):
            self.planner = planner

        def __getattr__(self, name):
            return getattr(self.planner, name)

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            checked = io.BytesIO()
            torch.save(torch.load(value, map_location="cpu", weights_only=True), checked)  # raises on a crafted item
            checked.seek(0)
            self.planner.load_bytes(read_item, checked)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _checked_metadata(_MetadataUnpickler(f).load())
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            return super().read_data(plan, WeightsOnlyBytes(planner))

    return Reader(str(folder))


def _check_items(path: Path) -> None:
    """Read a sharded checkpoint's .metadata and every non-tensor item it names (optimizer settings: a few small
    pickles) as a load would, through `_shard_reader`: a crafted item is refused here, by `problem`, so that a
    resume passes over the checkpoint instead of failing in the middle of its DCP load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = _shard_reader(path)
    items = {key: None for key, info in reader.read_metadata().state_dict_metadata.items()
             if isinstance(info, BytesStorageMetadata)}  # by their dotted names: DCP reads a flat dict as it is
    if items:
        try:
            dcp.load(items, storage_reader=reader, no_dist=True)  # this process alone: `problem` is not collective
        except CheckpointException as e:  # a BaseException, with each rank's error inside
            raise _first_cause(e) or RuntimeError(str(e)) from None


class UnreadableCheckpoint(RuntimeError):
    """A sharded checkpoint's .metadata or item that `_shard_reader` refused: the file's fault, not the run's config."""


def load_sharded(path: Path, shards: dict) -> None:
    """Collective: fill this rank's `shards` (same structure as saved, any strategy and world size) from `path`.
    A failure is a RuntimeError naming the first rank's cause (UnreadableCheckpoint for a refused .metadata or
    item): DCP's own CheckpointException is a BaseException, which no `except Exception` catches."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        swapped = _swap_in_scalars(path, shards)
        dcp.load(shards, storage_reader=_shard_reader(path))
    except CheckpointException as e:
        cause = os_error_behind(e)
        if cause is not None:  # the disk's error (EIO, ESTALE): not a mismatch of the run's config
            raise cause from None
        refused = isinstance(_first_cause(e), pickle.UnpicklingError)  # a non-tensor item `_shard_reader` refused
        raise (UnreadableCheckpoint if refused else RuntimeError)(_first_failure(e)) from None
    except (pickle.UnpicklingError, ValueError) as e:  # its .metadata, refused by `_shard_reader`
        raise UnreadableCheckpoint(read_failure(e)) from None
    _swap_back_as_vectors(swapped)


def _first_cause(error: BaseException) -> BaseException | None:
    """The first rank's error inside a CheckpointException."""
    first = next(iter((getattr(error, "failures", None) or {}).values()), None)
    return first[0] if isinstance(first, tuple) else first


def _first_failure(error: BaseException) -> str:
    """'Type: message' of the first rank's error inside a CheckpointException (its own text lists ranks)."""
    cause = _first_cause(error)
    if isinstance(cause, pickle.UnpicklingError):  # a non-tensor item `_shard_reader` refused
        return read_failure(cause)
    return f"{type(cause).__name__}: {cause}" if cause is not None else str(error)


def _full_networks(path: Path) -> dict[str, dict]:
    """One process: G, D and G_ema as full tensors from a sharded checkpoint (whoever wrote which shard)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = _shard_reader(path)
    wanted = {"G.model.": "G", "D.model.": "D", "G.ema.": "G_ema"}
    nested: dict[str, dict] = {"G": {"model": {}, "ema": {}}, "D": {"model": {}}}
    for key, info in reader.read_metadata().state_dict_metadata.items():
        prefix = next((p for p in wanted if key.startswith(p)), None)
        if prefix is not None and isinstance(info, TensorStorageMetadata):
            net, part = prefix[:-1].split(".")
            nested[net][part][key[len(prefix):]] = torch.empty(info.size, dtype=info.properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(nested, storage_reader=reader, no_dist=not dist.is_initialized())
        except CheckpointException as e:  # a BaseException: `load`'s handler would miss it
            raise RuntimeError(_first_failure(e)) from None
    return {"G": nested["G"]["model"], "D": nested["D"]["model"], "G_ema": nested["G"]["ema"]}


def load_meta(path: Path, require: tuple[str, ...] = META_KEYS, fix: str = RESUME_FIX, verify: bool = True) -> dict:
    """A sharded checkpoint's step, data position, RNG states, scaler and config (checked like `load`;
    used by a resume, hence its fix text)."""
    path = Path(path)
    _check_intact(path, fix, verify)
    try:
        state = torch.load(path / META, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ConfigError(str(path), f"cannot read this checkpoint ({read_failure(e)})", fix) from None
    _check_contents(path, state, require, fix)
    return state


def load(path: Path, require: tuple[str, ...] = CORE_KEYS, fix: str = LOAD_FIX, verify: bool = True) -> dict:
    """The state in a checkpoint (of a sharded one: meta.pt and the full networks, no optimizers), checked:
    intact against its completion marker, readable, and holding `require`. Otherwise a ConfigError naming
    the file, whose fix is `fix` (the caller's options: a resume passes RESUME_FIX). `verify=False` skips
    the SHA-256 of its content (files and sizes are still checked): for ranks whose rank 0 verifies it, so a
    resume reads a checkpoint once per rank, not twice."""
    path = Path(path)
    if engine_of(path) == "tensorflow":
        return _tensorflow_generators(path, require, fix, verify)
    _check_intact(path, fix, verify)
    try:
        if is_sharded(path):  # everything but the optimizers, which only a training run's DCP load restores
            state = {**torch.load(path / META, map_location="cpu", weights_only=True), **_full_networks(path)}
        else:  # read, not mapped: a CPU run's optimizer state would alias the file's pages for the whole run
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
        raise ConfigError(str(path), f"cannot read this checkpoint ({read_failure(e)})", fix) from None
    _check_contents(path, state, require, fix)
    _gamma_as_vector(state)
    return state


def _tensorflow_generators(path: Path, require: tuple[str, ...], fix: str, verify: bool) -> dict:
    """A tensorflow engine checkpoint's G and G_ema in the torch engine's layout (ganscale.tf.convert), for readers
    that need no more (`require`): export, eval, sample."""
    beyond = [key for key in require if key not in GENERATOR_KEYS]
    if beyond:
        raise ConfigError(str(path), f"a checkpoint of the tensorflow engine: only its generators are read outside "
                          f"training on that engine, not {', '.join(beyond)}", "use a checkpoint of a torch engine run")
    reason = problem(path, verify)
    if reason is not None:
        raise ConfigError(str(path), f"this checkpoint cannot be used ({reason})", fix)
    from ganscale.tf.convert import torch_state

    return torch_state(path, fix)


def _check_intact(path: Path, fix: str, content: bool = True) -> None:
    if engine_of(path) != "torch":  # what reads it here is torch's
        raise ConfigError(str(path), "a checkpoint of the tensorflow engine, which only training on that engine "
                          "reads yet (not export, eval or sample)", "use a checkpoint of a torch engine run")
    reason = problem(path, content)
    if reason is not None:
        raise ConfigError(str(path), f"this checkpoint cannot be used ({reason})", fix)


def _check_contents(path: Path, state, require: tuple[str, ...], fix: str) -> None:
    """A file that is intact but not what ganscale writes (another program's, or edited and its marker rewritten) is
    named with the field that is wrong, not a KeyError or TypeError where it is used: every field its reader reads
    (`require`, and for a resume RESUME_OPTIONAL where present) has the type and structure ganscale writes, checked
    here once, when the checkpoint is loaded."""
    def refuse(what: str) -> None:
        raise ConfigError(str(path), f"this is not a ganscale checkpoint: {what}", fix)

    if not isinstance(state, dict):
        refuse(f"it holds a {type(state).__name__}, not a dict")
    missing = [key for key in require if key not in state
               or (key in NETWORKS and isinstance(state[key], dict) and not state[key])]  # sharded: no such shards
    if missing:
        refuse("no " + ", ".join(repr(key) for key in missing))
    read = [*require, *(key for key in RESUME_OPTIONAL if "rng" in require and key in state)]
    for key in read:
        wrong = FIELDS[key](state[key]) if key in FIELDS else None
        if wrong is not None:
            refuse(f"{key!r} {wrong}")
    named = step_of(Path(path))
    if "step" in read and named is not None and state["step"] != named:
        where = "name" if PATTERN.match(Path(path).name) else "completion marker"
        refuse(f"'step' is {state['step']}, but its {where} says step {named}")
    if "data_position" in read:  # ganscale writes step * loss.n_critic (>= 1): a resume checks the n_critic
        step, position = state["step"], state["data_position"]
        if (position != 0) if step == 0 else (position < step or position % step):
            refuse(f"'data_position' is {position}, not a multiple of its step {step} (step x loss.n_critic)")
    if "world_size" in read and len(state["rng"]) != state["world_size"]:
        refuse(f"'rng' holds {len(state['rng'])} rank(s)' RNG states, but 'world_size' is {state['world_size']}")


def _a(value) -> str:
    """`value` as a message shows it: a scalar itself, a container or tensor by its kind."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value) if len(repr(value)) <= 40 else f"a {type(value).__name__}"
    kind = (f"{str(value.dtype).removeprefix('torch.')} tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor) else type(value).__name__)
    return f"{'an' if kind[:1] in 'aeio' else 'a'} {kind}"  # a uint8 tensor


def _is_count(value, least: int = 0) -> bool:
    return type(value) is int and value >= least


def _is_number(value) -> bool:
    return type(value) is int or (type(value) is float and np.isfinite(value))  # an int of any size: no float


def _count(value) -> str | None:
    return None if _is_count(value) else f"is {_a(value)}, not a count (an int >= 0)"


def _number(value) -> str | None:
    return None if _is_number(value) else f"is {_a(value)}, not a finite number"


def _tensors(value) -> str | None:
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in value.items()):
        return None
    return f"is {_a(value)}, not a dict of tensors"


def _config(value) -> str | None:
    if not isinstance(value, str):
        return f"is {_a(value)}, not YAML text"
    import yaml

    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError as e:
        return f"is not YAML text ({' '.join(str(e).split())[:120]})"
    return None if isinstance(parsed, dict) else f"is YAML of {_a(parsed)}, not of a config"


def _fields(value, wanted: dict[str, Callable[[object], bool]], what: str, empty_ok: bool = False) -> str | None:
    """None when `value` is a dict holding every key of `wanted`, each passing its check (or, `empty_ok`, is {});
    else what is wrong, as a predicate ("is not fp16's loss scaler state: its 'scale' is None")."""
    if not isinstance(value, dict):
        return f"is {_a(value)}, not {what}"
    if empty_ok and not value:
        return None
    for key, ok in wanted.items():
        if key not in value:
            return f"is not {what}: it has no {key!r}"
        if not ok(value[key]):
            return f"is not {what}: its {key!r} is {_a(value[key])}"
    return None


def _scaler(value) -> str | None:  # {} unless fp16 (precision.Precision.state_dict)
    positive = lambda v: _is_number(v) and v > 0  # noqa: E731
    return _fields(value, {"scale": positive, "growth_factor": positive, "backoff_factor": positive,
                           "growth_interval": lambda v: _is_count(v, 1), "_growth_tracker": _is_count},
                   "fp16's loss scaler state", empty_ok=True)


def _augment(value) -> str | None:  # {} unless augment.kind=ada (augment.AdaptiveAugmentation.state_dict)
    return _fields(value, {"p": lambda v: _is_number(v) and 0 <= v <= 1, "sign_sum": _is_number,
                           "d_steps": _is_count}, "ADA's state", empty_ok=True)


def _optimizer(value) -> str | None:
    """An optimizer state by parameter name (parallel.Wrapped.optimizer_state). Which parameters it holds and the
    shapes of their moments are torch's load_state_dict's to check: a misfit of the config (`Checkpointer`)."""
    def setting(v) -> bool:  # Adam's hyperparameters: numbers, flags, betas, None
        return v is None or type(v) is bool or _is_number(v) or isinstance(v, torch.Tensor) or (
            isinstance(v, (tuple, list)) and all(_is_number(x) for x in v))

    what = "an optimizer state by parameter name"
    wrong = _fields(value, {"state": lambda v: isinstance(v, dict),
                            "param_groups": lambda v: isinstance(v, list) and bool(v)}, what)
    if wrong is not None:
        return wrong
    for name, moments in value["state"].items():
        if not (isinstance(name, str) and isinstance(moments, dict)
                and all(isinstance(m, torch.Tensor) or _is_number(m) for m in moments.values())):
            return f"is not {what}: its state of {_a(name)} is {str(moments)[:80]}"
    for group in value["param_groups"]:
        if not (isinstance(group, dict) and isinstance(group.get("params"), list)
                and all(isinstance(n, str) for n in group["params"])):
            return f"is not {what}: a parameter group is {_a(group)} without a list of parameter names"
        wrong = next((key for key, v in group.items() if key != "params" and not setting(v)), None)
        if wrong is not None:
            return f"is not {what}: a parameter group's {wrong!r} is {_a(group[wrong])}"
    return None


NUMPY_STATE = {  # np.random.get_state()'s MT19937 fields, its keys as int64 (`rng_state`)
    "keys": lambda k: (isinstance(k, torch.Tensor) and k.dtype == torch.int64 and tuple(k.shape) == (624,)
                       and bool(((k >= 0) & (k < 2**32)).all())),
    "pos": lambda p: type(p) is int and 0 <= p <= 624, "has_gauss": lambda g: type(g) is int and g in (0, 1),
    "gauss": _is_number}


def _is_bytes(value, count: int | None) -> bool:
    """A CPU byte tensor of `count` bytes (None: any number but 0)."""
    return (isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1
            and value.device.type == "cpu" and (value.numel() == count if count is not None else value.numel() > 0))


def _cuda_state_bytes() -> int | None:
    """The size of torch's CUDA RNG state where this process already uses CUDA (a resume on a GPU, whose
    set_rng_state then takes it); None elsewhere, where it is not read and starting CUDA to ask would cost."""
    return torch.cuda.get_rng_state().numel() if torch.cuda.is_available() and torch.cuda.is_initialized() else None


def _rng(value) -> str | None:
    """Every rank's `rng_state()`, in rank order, as torch's and numpy's set_state take them."""
    what = "every rank's RNG state"
    if not isinstance(value, list) or not value:
        return f"is {_a(value)}, not a list of {what}"
    cpu_bytes = torch.get_rng_state().numel()
    for rank, state in enumerate(value):
        wanted = {"torch": lambda t: _is_bytes(t, cpu_bytes), "numpy": lambda n: isinstance(n, dict),
                  **({"cuda": lambda t: _is_bytes(t, _cuda_state_bytes())} if isinstance(state, dict)
                     and "cuda" in state else {})}  # only where the writer's CUDA generator had started
        wrong = _fields(state, wanted, "a dict of 'torch' and 'numpy' states")
        if wrong is not None:
            return f"is not {what}: rank {rank}'s state {wrong}"
        wrong = _fields(state["numpy"], NUMPY_STATE, "numpy's MT19937 state")
        if wrong is not None:
            return f"is not {what}: rank {rank}'s 'numpy' state {wrong}"
    return None


# What a reader may read of a checkpoint, and why each would not be one ganscale wrote (None: it is).
FIELDS: dict[str, Callable[[object], str | None]] = {
    **dict.fromkeys(NETWORKS, _tensors), "opt_g": _optimizer, "opt_d": _optimizer,
    "step": _count, "data_position": _count, "skipped_steps": _count, "consecutive_skips": _count,
    "world_size": lambda v: None if _is_count(v, 1) else f"is {_a(v)}, not a number of ranks",
    "pl_mean": _number, "scaler": _scaler, "augment": _augment, "rng": _rng, "config": _config}


# ------------------------------------------------------------------------------ earlier checkpoints
# BigGAN's SelfAttention.gamma was a 0-d parameter until it became (1,), since FSDP2 cannot shard a 0-d one.
# Checkpoints written before hold it, and Adam's moments of it, 0-d: they are read as (1,), the same number.

def _gamma_as_vector(state: dict) -> None:
    """A full checkpoint's (or sharded one's full networks') 0-d gamma and Adam moments, reshaped in place.
    Anything else passes unchanged: a malformed entry is for `_check_contents` to name, not for this to trip on."""
    def old_gamma(name, value) -> bool:
        return (isinstance(name, str) and name.rsplit(".", 1)[-1] == "gamma" and isinstance(value, torch.Tensor)
                and value.dim() == 0)

    for net in NETWORKS:
        weights = state.get(net)
        for name, value in (weights.items() if isinstance(weights, dict) else ()):
            if old_gamma(name, value):
                weights[name] = value.reshape(1)
    for optimizer in ("opt_g", "opt_d"):
        saved = state.get(optimizer)
        per_parameter = saved.get("state") if isinstance(saved, dict) else None
        for name, moments in (per_parameter.items() if isinstance(per_parameter, dict) else ()):
            if isinstance(moments, dict):  # Adam's step counter is 0-d for every parameter: left as it is
                per_parameter[name] = {key: value.reshape(1) if key != "step" and old_gamma(name, value) else value
                                       for key, value in moments.items()}


def _swap_in_scalars(path: Path, shards: dict) -> list[tuple[dict, str, torch.Tensor]]:
    """Entries of `shards` that the sharded checkpoint holds 0-d where this run holds (1,): replaced by 0-d
    tensors for DCP to fill (it refuses to read across shapes). Returns (where, key, the run's tensor) of each."""
    saved = _shard_reader(path).read_metadata().state_dict_metadata
    swapped = []

    def walk(tree: dict, prefix: str) -> None:  # DCP names a nested entry by its keys joined with "."
        for key, value in list(tree.items()):
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif (isinstance(value, torch.Tensor) and value.shape == (1,)
                  and getattr(saved.get(f"{prefix}{key}"), "size", None) == torch.Size([])):
                tree[key] = torch.zeros((), dtype=value.dtype)
                swapped.append((tree, key, value))
    walk(shards, "")
    return swapped


def _swap_back_as_vectors(swapped: list[tuple[dict, str, torch.Tensor]]) -> None:
    """The values read into `_swap_in_scalars`' 0-d tensors, as (1,) tensors placed like the run's."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for tree, key, like in swapped:
        value = tree[key].reshape(1).to(like.device)
        tree[key] = (distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)  # every rank
                     if isinstance(like, DTensor) else value)                                         # read it all
