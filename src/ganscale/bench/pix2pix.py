"""`ganscale bench pix2pix-table`: the source document's pix2pix table, row by row, on one machine.

The document (seed 003) timed pix2pix on facades (400 images, 256x256, batch 1, one GPU): baseline 40.38 s
per epoch, "data parallel" 37.84, AMP 35.04, accumulation 34.22, clipping 34.91, ZeRO 271.41. Each row here
is one real `ganscale train pix2pix` run (a subprocess through the user's own launcher path) on the same
data, the same machine and the same number of epochs, so the rows compare with each other; the
document's numbers are printed beside them, not mixed in.

Rows:
- baseline: eager fp32, BCE + 100 L1, batch 1. Per iteration ganscale runs G once (D's step judges its output
  detached, G's step the same output, as the reference) and D twice (on the stacked [real, fake] pair, then for G).
- ddp: real DistributedDataParallel over `nproc` processes (every visible GPU, or CPU processes), one
  image per rank per step: an epoch is images / nproc steps.
- amp-bf16, amp-fp16 (GradScaler; CUDA only), accumulation-4 (global batch 4 in micro-batches of 1),
  clip-2 (both networks' gradient norms clipped at 2).
- zero1, zero2, fsdp over `nproc` processes; fsdp-offload (FSDP2 with parameters, gradients and Adam
  state in host memory; CUDA only, also on one GPU).
- fast: ganscale's fast path: channels_last weights and activations, fused Adam, torch.compile
  (reduce-overhead on CUDA, i.e. CUDA graphs for the batch-1 step; default mode on CPU), bf16 on CUDA;
  data from worker processes into pinned memory, copied without blocking.

An epoch's time is read from the run's own metrics: the trainer logs once per epoch, and each record's
images/s covers exactly the steps since the previous one. The first epoch carries the one-time work
(start-up, cuDNN autotuning, compilation) and is reported on its own; the median and spread are over the
later epochs. The data-wait share comes from the trainer's step-time breakdown (`time_data_ms`).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ganscale.bench.report import median, spread
from ganscale.bench.strategies import RunFailed, run_training

# The document's epoch times (seconds; its one GPU, batch 1), shown next to the rows they correspond to.
DOCUMENT_SECONDS = {"baseline": 40.38, "ddp": 37.84, "amp-bf16": 35.04, "amp-fp16": 35.04, "accumulation-4": 34.22,
                    "clip-2": 34.91, "zero1": 271.41, "zero2": 271.41, "fsdp": 271.41, "fsdp-offload": 271.41}


@dataclass
class Row:
    name: str
    overrides: list[str] = field(default_factory=list)
    distributed: bool = False   # over `nproc` processes (else one)
    batch: int = 1              # global batch
    cuda_only: str = ""         # why the row cannot run on the CPU, if it cannot


def rows(on_cuda: bool) -> list[Row]:
    fast_compile = "reduce-overhead" if on_cuda else "default"
    return [
        Row("baseline"),
        Row("ddp", distributed=True),
        Row("amp-bf16", ["train.precision=bf16"]),
        Row("amp-fp16", ["train.precision=fp16"], cuda_only="fp16 with a GradScaler needs CUDA"),
        Row("accumulation-4", ["train.micro_batch=1"], batch=4),
        Row("clip-2", ["train.grad_clip=2"]),
        Row("zero1", ["parallel.generator=zero1", "parallel.discriminator=zero1"], distributed=True),
        Row("zero2", ["parallel.generator=zero2", "parallel.discriminator=zero2"], distributed=True),
        Row("fsdp", ["parallel.generator=fsdp", "parallel.discriminator=fsdp"], distributed=True),
        Row("fsdp-offload", ["parallel.generator=fsdp", "parallel.discriminator=fsdp", "parallel.cpu_offload=true"],
            cuda_only="CPU offload moves shards from a GPU to host memory"),
        Row("fast", ["train.channels_last=true", "optim.fused=true", f"train.compile={fast_compile}",
                     *(["train.precision=bf16"] if on_cuda else [])]),
    ]


ROW_NAMES = [row.name for row in rows(on_cuda=True)]
OUTPUT_LINES = 40  # of a failed row's run, shown as it fails and kept in the JSON record
COLUMNS = ["row", "processes", "global batch", "steps/epoch", "first epoch s", "epoch median s", "epoch min s",
           "epoch max s", "img/s", "peak MiB", "data wait %", "loss_d", "loss_g", "document s/epoch", "status"]


def run_row(row: Row, data: Path, images: int, epochs: int, nproc: int, device: str, threads: int,
            scratch: Path, timeout_s: float) -> dict:
    """Train one row for `epochs` epochs of `images` images; its epoch times, memory, losses and data share."""
    world = nproc if row.distributed else 1
    batch = row.batch * world if row.distributed else row.batch
    steps_per_epoch = max(1, images // batch)
    overrides = [f"data.path={data}", f"train.device={device}", f"train.batch_size={batch}",
                 f"train.steps={steps_per_epoch * epochs}", f"log.every={steps_per_epoch}",
                 "optim.decay_start=1.0", *row.overrides]  # a constant lr: the schedule is no speed question
    base = {"row": row.name, "processes": world, "global batch": batch, "steps/epoch": steps_per_epoch,
            "document s/epoch": DOCUMENT_SECONDS.get(row.name)}
    if row.cuda_only and device != "cuda":
        return {**base, "status": f"skipped: {row.cuda_only}"}
    run_threads = threads if device == "cuda" else max(1, threads // world)
    try:
        summary, records = run_training("pix2pix", overrides, world, scratch / row.name, run_threads, timeout_s)
    except RunFailed as e:
        lines = str(e).splitlines()
        output = "\n".join([lines[0], *lines[1:][-OUTPUT_LINES:]])  # the command, then the tail of its output
        return {**base, "status": f"failed: {lines[-1][:200]}", "output": output}
    except subprocess.TimeoutExpired as e:
        tail = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part
                       for part in (e.stdout, e.stderr) if part)
        return {**base, "status": f"failed: timed out after {timeout_s:.0f} s",
                "output": "\n".join(tail.splitlines()[-OUTPUT_LINES:])}
    finally:
        shutil.rmtree(scratch / row.name, ignore_errors=True)  # its final checkpoint is ~0.9 GB
    epoch_s = [steps_per_epoch * batch / r["img_per_s"] for r in records]
    later = epoch_s[1:] or epoch_s
    timed = records[1:] or records  # later epochs
    parts = [sum(v for k, v in r.items() if k.startswith("time_") and k.endswith("_ms")) for r in timed]
    data_ms = [r.get("time_data_ms", 0.0) for r in timed]
    final = summary["final"]
    peak = summary.get("max_memory_allocated") or summary.get("max_rss_bytes")
    return {**base, "first epoch s": epoch_s[0], "epoch median s": median(later),
            "epoch min s": spread(later)[0], "epoch max s": spread(later)[1],
            "img/s": images / median(later) if later else None,
            "peak MiB": peak / 2**20 if peak else None,
            "peak kind": "CUDA allocated" if summary.get("max_memory_allocated") else "host RSS (rank 0)",
            "data wait %": 100 * sum(data_ms) / max(sum(parts), 1e-9),
            "loss_d": final.get("loss_d"), "loss_g": final.get("loss_g"), "epoch_s": epoch_s,
            "status": "ok" if world > 1 or not row.distributed else "ok, but 1 process: nothing shared or sharded"}


def table(data: Path | None, images: int, epochs: int, nproc: int, device: str, threads: int,
          names: list[str], timeout_s: float = 3600) -> list[dict]:
    """Every requested row on the same data (a synthetic facades-shaped set when `data` is None)."""
    from ganscale.data.synthetic import write_synthetic_facades

    with tempfile.TemporaryDirectory(prefix="ganscale-pix2pix-table-") as scratch:
        scratch = Path(scratch)
        data = data or write_synthetic_facades(scratch / "facades", images, seed=0)
        results = []
        for row in rows(on_cuda=device == "cuda"):
            if row.name in names:
                result = run_row(row, data, images, epochs, nproc, device, threads, scratch, timeout_s)
                results.append({column: None for column in COLUMNS} | result)  # skipped rows: empty cells
                if "output" in result:  # a failed run: its own words, not only the launcher's last line
                    print(f"{row.name}: {result['status']}; the run's output (last {OUTPUT_LINES} lines):\n"
                          + "\n".join(f"    {line}" for line in result["output"].splitlines()),
                          file=sys.stderr, flush=True)
                ok = results[-1]["epoch median s"] is not None
                print(f"{row.name}: {results[-1]['epoch median s'] if ok else results[-1]['status']}", flush=True)
        return results
