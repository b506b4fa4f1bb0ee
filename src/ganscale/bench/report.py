"""Where a benchmark's numbers go: a Markdown table and a JSON record, with the machine and the command.

A number without its machine and command cannot be compared with anything, so every result file
names both. File names carry the command and the time: `bench-<command>-<YYYYMMDD-HHMMSS>.{md,json}`.
"""

from __future__ import annotations

import itertools
import os
import platform
import statistics
import time
from pathlib import Path

RESULTS_DIR = Path("benchmarks/results")


def machine() -> dict:
    """CPU model, cores (all, and those this process may use), load, torch version, CUDA device if any."""
    import torch

    cpu_model = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info = {"cpu": cpu_model, "cores": os.cpu_count(), "usable_cores": usable, "torch": torch.__version__,
            "python": platform.python_version(), "cuda_device": None,
            "load_average_1min": os.getloadavg()[0]}
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1): on a shared machine a low quantile is the least-contended steps' time."""
    if len(values) < 2:
        return median(values)
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def spread(values: list[float]) -> tuple[float, float]:
    """(min, max): what a median hides."""
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


def markdown_table(columns: list[str], rows: list[dict]) -> str:
    def cell(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(command: str, command_line: str, columns: list[str], rows: list[dict], notes: list[str],
                  extra: dict | None = None, out_dir: Path = RESULTS_DIR) -> tuple[Path, Path]:
    """Write the table as Markdown and JSON; returns (markdown path, json path)."""
    from ganscale.outputs import to_json, write_output  # it imports torch: not at `ganscale --help`

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    base = out_dir / f"bench-{command}-{stamp}"
    for n in itertools.count(2):  # a second run in the same second gets its own files: no result is replaced
        if not (base.with_suffix(".json").exists() or base.with_suffix(".md").exists()):
            break
        base = out_dir / f"bench-{command}-{stamp}-{n}"
    host = machine()
    record = {"command": command, "command_line": command_line, "date_utc": stamp, "machine": host,
              "columns": columns, "rows": rows, "notes": notes, **(extra or {})}
    json_path = base.with_suffix(".json")
    json_text = to_json(record, indent=2) + "\n"
    write_output(json_path, lambda tmp: tmp.write_text(json_text), "--out-dir")
    cuda = f", CUDA device: {host['cuda_device']}" if host["cuda_device"] else ", no CUDA device"
    text = [f"# ganscale bench {command} ({stamp} UTC)", "",
            f"Command: `{command_line}`", "",
            f"Machine: {host['cpu']}, {host['cores']} cores ({host['usable_cores']} usable), "
            f"torch {host['torch']}, Python {host['python']}{cuda}; load average {host['load_average_1min']:.2f} "
            "at the end (the machine may be shared)", "",
            markdown_table(columns, rows), ""]
    if notes:
        text += [*(f"- {note}" for note in notes), ""]
    md_path = base.with_suffix(".md")
    write_output(md_path, lambda tmp: tmp.write_text("\n".join(text)), "--out-dir")
    return md_path, json_path
