"""Export G and G_ema weights from a checkpoint to safetensors."""

from __future__ import annotations

import sys
from pathlib import Path

import yaml
from safetensors.torch import save as safetensors_bytes

from ganscale import checkpoint
from ganscale.config import settings_in
from ganscale.evaluate import fitted_generator, run_config
from ganscale.finite import refuse_non_finite_checkpoint
from ganscale.outputs import write_output
from ganscale.rundir import config_at

EXPORTED = checkpoint.GENERATOR_KEYS  # what an export reads of a checkpoint


def export_generator(run_dir: Path, out: Path, source: Path | None = None) -> Path:
    if source is None:
        source = checkpoint.newest_intact(run_dir, "RUN_DIR", "train first, or pass an intact checkpoint with "
                                          "--checkpoint")
        fix = "pass an older checkpoint of this run with --checkpoint"
    else:
        fix = "pass another file with --checkpoint, or leave it out to use RUN_DIR's newest intact checkpoint"
    state = checkpoint.load(source, require=EXPORTED, fix=fix)
    refuse_non_finite_checkpoint(state, ("G", "G_ema"), source, fix)
    if run_config(run_dir, source, state):  # refused where sample, eval and a resume of the run refuse it
        fitted_generator(run_dir, source, state, nets=("G", "G_ema"))
    else:
        note = foreign_checkpoint(run_dir, source, state)
        if note:
            print(f"ganscale: note: {note}", file=sys.stderr, flush=True)
    tensors = {f"{net}.{key}": value.detach().contiguous().clone()
               for net in ("G", "G_ema") for key, value in state[net].items()}
    metadata = {"step": str(state["step"]), "config": state["config"]}
    # The bytes written by Python: a refused write is then an OSError (exit 7); save_file's is a SafetensorError.
    return write_output(out, lambda tmp: tmp.write_bytes(safetensors_bytes(tensors, metadata=metadata)))


def foreign_checkpoint(run_dir: Path, source: Path, state: dict) -> str | None:
    """What to tell of a --checkpoint outside RUN_DIR's checkpoints/ that another config wrote: it is exported with
    the config it was written with, not RUN_DIR's. None when it is RUN_DIR's config (a checkpoint copied elsewhere)."""
    own = config_at(run_dir, int(state["step"]))
    written = yaml.safe_load(state["config"])
    if own is not None and settings_in(own.read_text()) == settings_in(state["config"]):
        return None
    by = f"a '{written.get('name')}' run" if isinstance(written, dict) else "another run"
    if own is None:  # nothing to compare with: whose checkpoint it is cannot be told
        return (f"{run_dir} has no config file; {source}, written by {by}, is exported with the config it was "
                "written with")
    return (f"{source} is not a checkpoint of {run_dir}; written by {by} with another config than its own, it is "
            "exported with the config it was written with")
