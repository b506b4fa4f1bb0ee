"""What a run leaves behind for people: metrics.jsonl, TensorBoard, progress, samples, summary.

Only rank 0 writes. Values handed in here are already global (reduced by the trainer). A write that fails
raises; the trainer then stops every rank with that error (Trainer.rank0_writes).
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

from tqdm import tqdm

from ganscale.outputs import to_json, write_output

# What a person reads on the console, in this order; every field goes to metrics.jsonl and TensorBoard.
CONSOLE_FIELDS = ("loss_d", "loss_g", "penalty_d", "l1_g", "grad_norm_d", "grad_norm_g", "img_per_s")
ONLY_WHEN_NONZERO = ("penalty_d", "l1_g", "skipped_steps")  # 0 where a run has no penalty, reconstruction or skip


def console_line(record: dict[str, float], seconds_left: float | None = None) -> str:
    """The step's fields for a person: losses, gradient norms, img/s, skipped steps if any, and the time left."""
    shown = [f"{k} {record[k]:.4g}" for k in (*CONSOLE_FIELDS, "skipped_steps")
             if k in record and not (k in ONLY_WHEN_NONZERO and record[k] == 0)]
    if seconds_left is not None:
        minutes, seconds = divmod(round(seconds_left), 60)
        shown.append(f"left {minutes // 60}:{minutes % 60:02d}:{seconds:02d}")
    return " ".join(shown)


def _summary_writer(folder: Path):
    """torch's TensorBoard writer, on TensorBoard's own file writer: where TensorFlow is installed, TensorBoard
    would import it (seconds, in every run's rank 0) only to write the same event files."""
    if "tensorboard.compat.notf" not in sys.modules:
        # TensorBoard's switch for its TensorFlow-free build: this module's presence selects its stub.
        sys.modules["tensorboard.compat.notf"] = types.ModuleType("tensorboard.compat.notf")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(folder))


class RunLog:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, tensorboard: bool, enabled: bool):
        self.enabled, self.run_dir, self.total_steps = enabled, Path(run_dir), total_steps
        self.writer = self.bar = None
        if not enabled:
            return
        metrics_file = self.run_dir / "metrics.jsonl"
        if metrics_file.exists():  # steps logged after the checkpoint (after step 0: a failed start) are redone
            drop_records_after(metrics_file, start_step)
        self.metrics = open(metrics_file, "a", buffering=1)
        if tensorboard:
            self.writer = _summary_writer(self.run_dir / "tensorboard")
        if sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self._last_step, self._last_time = start_step, time.perf_counter()

    def log(self, step: int, values: dict[str, float], images_per_step: int) -> dict[str, float]:
        if not self.enabled:
            return values
        now = time.perf_counter()
        steps = max(step - self._last_step, 1)
        record = {"step": step, **values, "img_per_s": images_per_step * steps / max(now - self._last_time, 1e-9)}
        seconds_left = (self.total_steps - step) * (now - self._last_time) / steps  # at this interval's pace
        self._last_step, self._last_time = step, now
        self._append(record)
        if self.writer is not None:
            for key, value in record.items():
                if key != "step":
                    self.writer.add_scalar(key, value, step)
        if self.bar is not None:  # the bar shows the step and the time left itself
            self.bar.set_postfix_str(console_line(record), refresh=False)
        else:
            print(f"step {step}/{self.total_steps} {console_line(record, seconds_left)}", flush=True)
        return record

    def log_extra(self, step: int, values: dict[str, float]) -> None:
        """A record of its own (e.g. image metrics at an evaluation step): metrics.jsonl and the console."""
        if not self.enabled:
            return
        self._append({"step": step, **values})
        line = " ".join(f"{k} {v:.4g}" for k, v in values.items())
        (self.bar.write if self.bar is not None else print)(f"step {step} {line}")

    def _append(self, record: dict) -> None:
        try:
            self.metrics.write(to_json(record) + "\n")  # a skipped step's NaN loss is null
        except OSError as e:  # a write error names no file: name it (a full disk, a file-size limit)
            raise OSError(e.errno, e.strerror, self.metrics.name) from e

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def add_scalars(self, prefix: str, values: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(f"{prefix}/{key}", value, step)

    def add_image(self, tag: str, image_hwc, step: int) -> None:
        if self.writer is not None:
            self.writer.add_image(tag, image_hwc, step, dataformats="HWC")

    def close(self, summary: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.close()
        self.metrics.close()
        text = to_json(summary, indent=2) + "\n"
        write_output(self.run_dir / "summary.json", lambda tmp: tmp.write_text(text), "--run-dir")


def drop_records_after(path: Path, step: int) -> None:
    """Keep the records up to `step`; one cut short by a failed write (a full disk) is dropped as well."""
    kept = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    # Whole or not at all: a refused write (a full disk) is an OSError naming `path`, and no temporary file is left.
    write_output(path, lambda tmp: tmp.write_text("".join(line + "\n" for line in kept)), "--run-dir")
