"""Check ganscale on a machine with a CUDA GPU: the CUDA tests, a short run of each recipe, the benches.

Run through scripts/gpu-check.sh. Each item is recorded as pass, fail or not run (why) in
benchmarks/results/gpu-check-<date>-<machine>/results.json; summary.md is rewritten after every part, so
parts run in separate device calls append to the same folder.

Parts are sized for one device call of at most 10 minutes each on an H100, from CPU timings and the benches'
own numbers: part 1 (the CUDA tests, mostly torch.compile warm-up, ~3 min; the tensorflow engine's digits in 3
precisions where TensorFlow is installed, ~1.5 min) ~5 min; part 2 (6 recipes x up to 3 precisions, 30 steps
each, ~25 s of process start and model build per run) ~8 min; part 3 (pix2pix table, all rows on 400 pairs,
about 40 s per row with compile, plus throughput of DCGAN, BigGAN and StyleGAN2) ~9 min.

Only the standard library is imported here: this script runs before ganscale's dependencies are checked.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# ganscale's dependencies but torch (pyproject.toml) and pytest: import name -> requirement.
DEPENDENCIES = {"numpy": "numpy>=1.24", "PIL": "pillow>=10", "safetensors": "safetensors>=0.4",
                "tensorboard": "tensorboard>=2.14", "sklearn": "scikit-learn>=1.3", "yaml": "pyyaml>=6",
                "pydantic": "pydantic>=2.5", "click": "click>=8.1", "tqdm": "tqdm>=4.66", "pytest": "pytest>=8"}
# Wheels are installed here, not into the machine's python (which may be read-only).
SITE = Path(os.environ.get("TMPDIR", "/tmp")) / "ganscale-gpu-site"
CUDA_TESTS = [
    "tests/test_bench.py::test_throughput_on_cuda_reports_mfu_against_the_h100_bf16_peak",
    "tests/test_fastpath.py::test_cuda_graphs_batch_one_step_trains_like_eager",
    "tests/test_fastpath.py::test_pix2pix_fast_path_on_cuda_trains_like_eager",
    "tests/test_strategies.py::test_cpu_offload_keeps_shards_and_optimizer_state_in_host_memory",
]
# Precisions each recipe is run in: fp16 only where a GradScaler applies (image GANs with conv nets).
RECIPE_PRECISIONS = {
    "ring8": ["fp32", "bf16"],
    "grid25": ["fp32", "bf16"],
    "digits": ["fp32", "bf16", "fp16"],
    "digits-biggan": ["fp32", "bf16", "fp16"],
    "pix2pix": ["fp32", "bf16", "fp16"],
    "digits-stylegan2": ["fp32", "bf16"],
}
# The tensorflow engine (MirroredStrategy over every visible GPU), where TensorFlow is installed.
TENSORFLOW_PRECISIONS = ["fp32", "bf16", "fp16"]
RECIPE_STEPS = 30
DEVICE = "cuda"
# Test hook: a comma-separated list of item names that fail on purpose (tests/test_gpu_check.py).
FAIL_ON_PURPOSE = "GANSCALE_GPU_CHECK_FAIL"


def ganscale_env() -> dict:
    paths = [str(ROOT / "src"), str(SITE), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)))
    env.pop(FAIL_ON_PURPOSE, None)
    return env


def run_logged(cmd: list[str], log: Path, timeout: int) -> int:
    """Run cmd from the checkout, its output in log; the exit status (124 past timeout)."""
    with open(log, "ab") as out:
        out.write(("$ " + " ".join(cmd) + "\n").encode())
        out.flush()
        try:
            return subprocess.run(cmd, cwd=ROOT, env=ganscale_env(), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return 124


def probe_torch() -> dict:
    """Torch, CUDA and the GPU as seen by a child python (torch may be missing or broken)."""
    code = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
            "'cuda': torch.version.cuda, 'cuda_available': c, "
            "'gpu': torch.cuda.get_device_name(0) if c else None}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        return {"torch": None, "cuda": None, "cuda_available": False, "gpu": None,
                "torch_error": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout)


def driver_version() -> str | None:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def describe_machine() -> dict:
    machine = probe_torch()
    machine.update(driver=driver_version(), python=platform.python_version(), host=platform.node(),
                   cpus=os.cpu_count())
    return machine


def missing_dependencies() -> list[str]:
    """Import names of the dependencies the machine's python cannot find."""
    code = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if not importlib.util.find_spec(m)))"
    done = subprocess.run([sys.executable, "-c", code, *DEPENDENCIES], env=ganscale_env(), capture_output=True,
                          text=True, check=True)
    return done.stdout.split()


def ensure_dependencies(wheels: Path | None) -> list[str]:
    """Install what is missing from the local wheel folder into SITE; the names still missing afterwards.

    SITE comes first on PYTHONPATH, so a wheel in the folder shadows the machine's own copy: the folder should
    hold only what the machine lacks (gpu-wheels.sh with package names)."""
    missing = missing_dependencies()
    if missing and wheels is not None:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                        "--target", str(SITE), *(DEPENDENCIES[name] for name in missing)], check=False)
        missing = missing_dependencies()
    return missing


# ---- items: each returns (status, detail); status is "pass" or "fail" ----

def cuda_tests(out: Path) -> tuple[str, str]:
    log = out / "cuda-tests.log"
    rc = run_logged([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *CUDA_TESTS],
                    log, timeout=540)
    skipped = "skipped" in log.read_text().splitlines()[-1] if log.exists() else False
    if rc == 0 and not skipped:
        return "pass", f"{len(CUDA_TESTS)} tests passed (cuda-tests.log)"
    return "fail", f"pytest exit {rc}{', some skipped' if skipped else ''} (cuda-tests.log)"


def checkpoint_is_finite(path: str) -> bool:
    """Every floating tensor of the run's last checkpoint (G, D, G_ema, optimizers) is finite."""
    code = ("import sys, torch; s = torch.load(sys.argv[1], map_location='cpu', weights_only=True)\n"
            "def walk(x):\n"
            "    if torch.is_tensor(x): return [x] if x.is_floating_point() else []\n"
            "    if isinstance(x, dict): return [t for v in x.values() for t in walk(v)]\n"
            "    if isinstance(x, (list, tuple)): return [t for v in x for t in walk(v)]\n"
            "    return []\n"
            "ts = walk(s); sys.exit(0 if ts and all(bool(torch.isfinite(t).all()) for t in ts) else 1)")
    return subprocess.run([sys.executable, "-c", code, path], env=ganscale_env(), capture_output=True).returncode == 0


def recipe_data(recipe: str, out: Path) -> list[str]:
    """Overrides giving a recipe its data: pix2pix has no default set, so a small synthetic facades one."""
    if recipe != "pix2pix":
        return []
    facades = out / "facades"
    if not facades.is_dir():
        run_logged([sys.executable, "-m", "ganscale", "make-facades", str(facades), "--n", "16"],
                   out / "make-facades.log", timeout=120)
    return ["--set", f"data.path={facades}"]


def short_run_problems(run_dir: Path) -> tuple[dict, dict, list[str]]:
    """A short run's summary, its final losses, and what is wrong with them: a non-finite loss, missing steps."""
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = {k: v for k, v in summary["final"].items() if k.startswith("loss_")}
    problems = [f"{k}={v}" for k, v in losses.items() if not math.isfinite(v)]
    if summary["steps"] != RECIPE_STEPS:
        problems.append(f"{summary['steps']} steps of {RECIPE_STEPS}")
    return summary, losses, problems


def recipe_run(recipe: str, precision: str, out: Path) -> tuple[str, str]:
    run_dir = out / "runs" / f"{recipe}-{precision}"
    rc = run_logged([sys.executable, "-m", "ganscale", "train", recipe, "--run-dir", str(run_dir),
                     "--set", f"train.steps={RECIPE_STEPS}", "--set", f"train.device={DEVICE}",
                     "--set", f"train.precision={precision}", *recipe_data(recipe, out)],
                    out / f"recipe-{recipe}-{precision}.log", timeout=300)
    if rc != 0:
        return "fail", f"train exit {rc} (recipe-{recipe}-{precision}.log)"
    summary, losses, problems = short_run_problems(run_dir)
    if not checkpoint_is_finite(summary["checkpoint"]):
        problems.append("non-finite weights, G_ema or optimizer state in the checkpoint")
    detail = ", ".join(f"{k} {v:.4g}" for k, v in losses.items()) + f", {summary['img_per_s']:.0f} img/s"
    return ("fail", "; ".join(problems)) if problems else ("pass", detail)


def tensorflow_run(precision: str, out: Path) -> tuple[str, str]:
    """The digits recipe on the tensorflow engine: finite losses, all its steps, and an export of its G and G_ema
    (converted to the torch layout) whose tensors are finite."""
    if subprocess.run([sys.executable, "-c", "import tensorflow"], env=ganscale_env(),
                      capture_output=True).returncode != 0:
        return "not run", "TensorFlow does not import: bring its GPU wheel with --wheels (README, TensorFlow engine)"
    run_dir = out / "runs" / f"tensorflow-digits-{precision}"
    export = run_dir.with_suffix(".safetensors")
    log = out / f"tensorflow-digits-{precision}.log"
    rc = run_logged([sys.executable, "-m", "ganscale", "train", "digits", "--run-dir", str(run_dir),
                     "--set", "train.engine=tensorflow", "--set", f"train.steps={RECIPE_STEPS}",
                     "--set", f"train.precision={precision}"], log, timeout=300)
    if rc != 0:
        return "fail", f"train exit {rc} ({log.name})"
    rc = run_logged([sys.executable, "-m", "ganscale", "export", str(run_dir), "--out", str(export)],
                    out / f"tensorflow-digits-{precision}-export.log", timeout=120)
    if rc != 0:
        return "fail", f"export exit {rc} (tensorflow-digits-{precision}-export.log)"
    summary, losses, problems = short_run_problems(run_dir)
    code = ("import sys, torch; from safetensors.torch import load_file\n"
            "ts = load_file(sys.argv[1]).values()\n"
            "sys.exit(0 if ts and all(bool(torch.isfinite(t).all()) for t in ts) else 1)")
    if subprocess.run([sys.executable, "-c", code, str(export)], env=ganscale_env(), capture_output=True).returncode:
        problems.append("non-finite tensors in the export of G and G_ema")
    detail = ", ".join(f"{k} {v:.4g}" for k, v in losses.items()) + f", {summary['img_per_s']:.0f} img/s, " \
        f"{summary['world_size']} replica(s)"
    return ("fail", "; ".join(problems)) if problems else ("pass", detail)


def bench(name: str, args: list[str], out: Path) -> tuple[str, str]:
    bench_dir = out / "bench"
    bench_dir.mkdir(exist_ok=True)
    rc = run_logged([sys.executable, "-m", "ganscale", "bench", name, *args, "--out-dir", str(bench_dir)],
                    out / f"bench-{name}.log", timeout=570)
    if rc != 0:
        return "fail", f"bench exit {rc} (bench-{name}.log)"
    notes = [line for line in (out / f"bench-{name}.log").read_text().splitlines()
             if re.search(r"MFU|fast path|peak", line)]
    return "pass", "; ".join(notes[-3:]) or f"results in bench/ (bench-{name}.log)"


def items() -> list[tuple[int, str, object]]:
    """(part, item name, function of the result folder)."""
    listed = [(1, "cuda-tests", cuda_tests)]
    for precision in TENSORFLOW_PRECISIONS:
        listed.append((1, f"tensorflow engine digits {precision}", lambda out, p=precision: tensorflow_run(p, out)))
    for recipe, precisions in RECIPE_PRECISIONS.items():
        for precision in precisions:
            listed.append((2, f"recipe {recipe} {precision}",
                           lambda out, r=recipe, p=precision: recipe_run(r, p, out)))
    listed.append((3, "bench pix2pix-table (400 pairs, all rows, fast vs eager)",
                   lambda out: bench("pix2pix-table", ["--device", "cuda", "--images", "400"], out)))
    listed.append((3, "bench throughput (MFU against the bench's default peak, H100 SXM dense)",
                   lambda out: bench("throughput", ["--device", "cuda"], out)))
    listed.append((3, "bench throughput stylegan2 (its 256 px config's widths, 64 px, batch 32; MFU as above)",
                   lambda out: bench("throughput", ["--device", "cuda", "--model", "stylegan2", "--batch", "32"], out)))
    return listed


def run_item(name: str, function, out: Path, blocker: str | None) -> dict:
    """One item's record; an exception is a fail, never the end of the check."""
    if name in os.environ.get(FAIL_ON_PURPOSE, "").split(","):
        return {"item": name, "status": "fail", "detail": f"failed on purpose ({FAIL_ON_PURPOSE})"}
    if blocker:
        return {"item": name, "status": "not run", "detail": blocker}
    try:
        status, detail = function(out)
    except Exception as error:  # noqa: BLE001 - recorded, and the next item still runs
        status, detail = "fail", f"{type(error).__name__}: {error}"
    return {"item": name, "status": status, "detail": detail}


def result_folder(machine: dict) -> Path:
    gpu = machine["gpu"] or "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return ROOT / "benchmarks" / "results" / f"gpu-check-{datetime.date.today():%Y%m%d}-{slug}"


def write_summary(out: Path, record: dict) -> None:
    m = record["machine"]
    lines = ["# GPU check", "", "## Machine", "",
             f"- GPU: {m['gpu'] or 'none (no CUDA GPU)'}", f"- driver: {m['driver'] or 'none'}",
             f"- torch: {m['torch']}", f"- CUDA: {m['cuda']}", f"- python: {m['python']}, {m['cpus']} CPUs", "",
             "## Items", "", "| part | item | status | detail |", "|---|---|---|---|"]
    for part, name, _ in items():
        row = record["items"].get(name, {"status": "not run", "detail": f"part {part} not run yet"})
        lines.append(f"| {part} | {name} | {row['status']} | {row['detail']} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["1", "2", "3", "all"], default="all")
    parser.add_argument("--wheels", type=Path, help="folder of wheels for missing dependencies (gpu-wheels.sh)")
    parser.add_argument("--requirements", action="store_true", help="print the requirements and stop")
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results/gpu-check-DATE-GPU)")
    args = parser.parse_args(argv)
    if args.requirements:
        print("\n".join(DEPENDENCIES.values()))
        return 0
    if args.wheels is not None and not args.wheels.is_dir():
        print(f"error: --wheels {args.wheels}: no such folder; build it with scripts/gpu-wheels.sh", file=sys.stderr)
        return 2

    missing = ensure_dependencies(args.wheels)
    machine = describe_machine()
    out = args.out or result_folder(machine)
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / "results.json"
    record = json.loads(record_path.read_text()) if record_path.exists() else {"items": {}}
    record["machine"] = machine

    blocker = (f"dependencies missing: {' '.join(missing)}; pass --wheels" if missing
               else "torch does not import" if machine["torch"] is None
               else None if machine["cuda_available"] else "no CUDA GPU")
    for part, name, function in items():
        if args.part in ("all", str(part)):
            print(f"[part {part}] {name} ...", flush=True)
            record["items"][name] = run_item(name, function, out, blocker)
            print(f"[part {part}] {name}: {record['items'][name]['status']}", flush=True)
            record_path.write_text(json.dumps(record, indent=2) + "\n")
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    write_summary(out, record)
    print(f"results: {out / 'summary.md'}")
    return 1 if any(row["status"] == "fail" for row in record["items"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
