"""A training's console, which may end before the training does.

`ganscale train`'s stdout and stderr are often a pipe (`| head`, `| tee log`, a pager) or a terminal that closes.
A write to one whose reader is gone raises BrokenPipeError (EPIPE; a hung-up terminal: EIO) wherever the training
happened to print, and the run ended there without a checkpoint. Once `drop_when_gone` is in place, such a stream
drops its output instead, said once on the other stream while that one still has a reader, and training goes on:
its record is in the run directory (metrics.jsonl, summary.json). Imports the standard library only.
"""

from __future__ import annotations

import errno
import os
import sys

GONE = (errno.EPIPE, errno.EIO)  # the reader of the pipe left; the terminal hung up


class DroppedWhenGone:
    """A text stream (sys.stdout, sys.stderr) whose writes are dropped once its reader is gone; otherwise the
    stream itself (every other attribute is the stream's)."""

    def __init__(self, stream, name: str):
        self.stream, self.name = stream, name
        self.gone = False
        self.other: DroppedWhenGone | None = None  # where the loss is said

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except OSError as e:
                self._lost(e)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except OSError as e:
                self._lost(e)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)

    def _lost(self, error: OSError) -> None:
        if error.errno not in GONE:
            raise error
        self.gone = True
        try:  # what is still buffered, and what C code writes to the descriptor, go nowhere from now on
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self.stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        if self.other is not None and os.environ.get("LOCAL_RANK", "0") == "0":  # said once a node
            self.other.write(f"ganscale: {self.name} has no reader any more ({os.strerror(error.errno)}): its output "
                             "is dropped from here; training goes on (metrics.jsonl and summary.json in the run "
                             "directory keep its record; stop it with SIGTERM or Ctrl-C)\n")
            self.other.flush()


def drop_when_gone() -> None:
    """Make this process's stdout and stderr drop their output once their reader is gone (once per process)."""
    if isinstance(sys.stdout, DroppedWhenGone) or sys.stdout is None or sys.stderr is None:
        return
    out, err = DroppedWhenGone(sys.stdout, "stdout"), DroppedWhenGone(sys.stderr, "stderr")
    out.other, err.other = err, out
    sys.stdout, sys.stderr = out, err
