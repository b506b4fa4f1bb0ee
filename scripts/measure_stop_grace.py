"""How long the checkpoint-on-signal path takes for each shipped recipe: `ganscale train RECIPE --nproc N` is
sent SIGTERM once it has logged a few steps, and timed until it exits (its workers finish the step, agree,
write the checkpoint and leave). What a scheduler's or torchrun's grace (SIGTERM, then SIGKILL) must cover.

    python scripts/measure_stop_grace.py [--repeats 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (recipe, ranks, extra settings): pix2pix's global batch of 1 fits one rank; its data is the synthetic facades.
RECIPES = [("ring8", 2, []), ("grid25", 2, []), ("digits", 2, []), ("digits-biggan", 2, []), ("pix2pix", 1, [])]
LOGGED_STEPS = 3


def measure(recipe: str, nproc: int, extra: list[str], root: Path) -> dict:
    run = root / f"{recipe}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "ganscale", "train", recipe, "--nproc", str(nproc), "--run-dir", str(run),
               "--set", "train.steps=1000000", "--set", "log.every=1", "--set", "log.tensorboard=false", *extra]
    with open(root / "output.txt", "w") as output:
        launcher = subprocess.Popen(command, cwd=root, stdout=output, stderr=subprocess.STDOUT)
    metrics = run / "metrics.jsonl"
    while not metrics.exists() or len(metrics.read_text().splitlines()) < LOGGED_STEPS:
        if launcher.poll() is not None:
            raise SystemExit(f"{recipe}: exited {launcher.returncode}: {(root / 'output.txt').read_text()[-2000:]}")
        time.sleep(0.1)
    step_ms = [sum(v for k, v in json.loads(line).items() if k.startswith("time_") and k.endswith("_ms"))
               for line in metrics.read_text().splitlines()[1:]]
    asked = time.monotonic()
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait()
    checkpoints = list((run / "checkpoints").glob("step-*"))
    return {"recipe": recipe, "nproc": nproc, "exit_code": code, "stop_s": round(time.monotonic() - asked, 2),
            "step_ms": round(statistics.median(step_ms), 1),
            "checkpoint_bytes": sum(p.stat().st_size for p in checkpoints if p.is_file())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="ganscale-stop-") as tmp:
        root = Path(tmp)
        facades = root / "facades"
        subprocess.run([sys.executable, "-m", "ganscale", "make-facades", str(facades)], check=True,
                       capture_output=True)
        for recipe, nproc, extra in RECIPES:
            extra = [*extra, "--set", f"data.path={facades}"] if recipe == "pix2pix" else extra
            for _ in range(args.repeats):
                rows.append(measure(recipe, nproc, extra, root))
                print(json.dumps(rows[-1]), flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    import torch

    machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
               "torch": torch.__version__, "load_average": os.getloadavg(), "command": " ".join(sys.argv)}
    out = Path(args.out)
    (out / f"stop-grace-{stamp}.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
    lines = [f"# SIGTERM to exit of `ganscale train RECIPE --nproc N` ({stamp})", "",
             f"machine: {machine}", "", "| recipe | nproc | exit codes | stop s (max of runs) | step ms (median) "
             "| checkpoint bytes |", "| --- | --- | --- | --- | --- | --- |"]
    for recipe, nproc, _ in RECIPES:
        mine = [r for r in rows if r["recipe"] == recipe]
        lines.append(f"| {recipe} | {nproc} | {sorted({r['exit_code'] for r in mine})} | "
                     f"{max(r['stop_s'] for r in mine)} | {statistics.median(r['step_ms'] for r in mine)} | "
                     f"{mine[-1]['checkpoint_bytes']} |")
    (out / f"stop-grace-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
