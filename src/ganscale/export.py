"""Export G and G_ema weights from a checkpoint to safetensors."""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import save_file

from ganscale import checkpoint
from ganscale.config import ConfigError
from ganscale.fault import REFUSED_FILE_OPERATION
from ganscale.finite import refuse_non_finite_checkpoint

EXPORTED = ("G", "G_ema", "step", "config")  # what an export reads of a checkpoint


def export_generator(run_dir: Path, out: Path, source: Path | None = None) -> Path:
    if source is None:
        source = checkpoint.newest_intact(run_dir, "RUN_DIR", "train first, or pass an intact checkpoint with "
                                          "--checkpoint")
        fix = "pass an older checkpoint of this run with --checkpoint"
    else:
        fix = "pass another file with --checkpoint, or leave it out to use RUN_DIR's newest intact checkpoint"
    state = checkpoint.load(source, require=EXPORTED, fix=fix)
    refuse_non_finite_checkpoint(state, ("G", "G_ema"), source, fix)
    tensors = {f"{net}.{key}": value.detach().contiguous().clone()
               for net in ("G", "G_ema") for key, value in state[net].items()}
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"step": str(state["step"]), "config": state["config"]})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors writes 0600 (a private temporary file): as any new file instead
        os.replace(tmp, out)
    except Exception as e:  # noqa: BLE001 - OSError, or safetensors' own error for a failed write
        checkpoint.remove_written(tmp)
        cause = checkpoint.os_error_behind(e)
        if cause is not None and cause.errno in REFUSED_FILE_OPERATION:  # shown as every command shows it: exit 7
            raise OSError(cause.errno, os.strerror(cause.errno), cause.filename or str(out)) from None
        reason = checkpoint.os_reason(cause) if cause is not None else str(e).splitlines()[0]
        raise ConfigError("--out", f"could not write {out}: {reason}",
                          "choose another --out, or make room on its disk") from None
    return out
