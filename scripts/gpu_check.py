"""Check ganscale on a machine with a CUDA GPU: the CUDA tests, a short run of each recipe, the benches.

Run through scripts/gpu-check.sh. Each item is recorded as pass, fail or not run (why), with its seconds, in
benchmarks/results/gpu-check-<date>-<machine>/results.json (or --out); summary.md is rewritten after every item,
so a call cut off by its time limit still leaves one, and parts run in separate calls add to the same folder.
A "not run" never replaces an earlier call's pass or fail; each result keeps the machine (GPU, driver, torch,
CUDA) of the call that produced it, and the summary names each row's machine where they differ. The exit status
is the folder's: 1 while any recorded fail stands, also one from an earlier call.

The items that only check correctness (the CUDA tests, the tensorflow engine, the recipes) run --jobs at a time,
side by side on the GPU; then the benches run one at a time on a quiet machine, the targets first: ganscale's
fast path against its eager baseline on a facades-shaped epoch, the throughput and MFU rows, then the pix2pix
table's other rows, one item each. --budget S stops starting items S seconds after the start and cuts off a
running one there ("not run: cut off by --budget"), so that one device call of limited time returns a
summary; --pending runs only the items that the folder's results.json has no pass or fail for, --only those whose
name holds one of the given words.

Only the standard library is imported here: this script runs before ganscale's dependencies are checked.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
# ganscale's dependencies but torch (pyproject.toml) and pytest: import name -> requirement.
DEPENDENCIES = {"numpy": "numpy>=1.24", "PIL": "pillow>=10", "safetensors": "safetensors>=0.4",
                "tensorboard": "tensorboard>=2.14", "sklearn": "scikit-learn>=1.3", "yaml": "pyyaml>=6",
                "pydantic": "pydantic>=2.5", "click": "click>=8.1", "tqdm": "tqdm>=4.66", "pytest": "pytest>=8"}
TMP = Path(os.environ.get("TMPDIR", "/tmp"))
# Wheels are installed here, not into the machine's python (which may be read-only).
SITE = TMP / "ganscale-gpu-site"
# Data sets and the runs' checkpoints (pix2pix's are ~0.9 GB): kept out of the result folder, which travels back.
SCRATCH = TMP / "ganscale-gpu-scratch"
CUDA_TESTS = [
    "tests/test_bench.py::test_throughput_on_cuda_reports_mfu_against_the_h100_bf16_peak",
    "tests/test_fastpath.py::test_cuda_graphs_batch_one_step_trains_like_eager",
    "tests/test_fastpath.py::test_pix2pix_fast_path_on_cuda_trains_like_eager",
    "tests/test_strategies.py::test_cpu_offload_keeps_shards_and_optimizer_state_in_host_memory",
    "tests/test_api.py::test_a_run_in_this_process_on_cuda_leaves_the_caller_s_cuda_random_numbers_as_it_found_them",
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
# Each took 18-30 s on an H100 (start-up included): a hang costs this much of a call, not its whole budget.
RECIPE_TIMEOUT_S = 120
DEVICE = "cuda"
# The speed targets of a facades-shaped epoch (400 x 256^2, batch 1) on one H100/H200 (issue 21).
FACADES_IMAGES = 400
TARGET_FAST_EPOCH_S = 4.0        # the document's 40.38 s / 10
TARGET_SPEEDUP = 3.0             # the fast path against ganscale's own eager fp32 baseline, same run
TARGET_DATA_WAIT_PERCENT = 5.0   # of the fast path's step time
# The pix2pix table's rows besides baseline and fast, one item each (the order they run in under --budget).
OTHER_PIX2PIX_ROWS = ["amp-bf16", "amp-fp16", "ddp", "accumulation-4", "clip-2", "zero1", "zero2", "fsdp",
                      "fsdp-offload"]
# Test hook: a comma-separated list of item names that fail on purpose (tests/test_gpu_check.py).
FAIL_ON_PURPOSE = "GANSCALE_GPU_CHECK_FAIL"
# time.monotonic() at which --budget runs out: no item starts after it, and running subprocesses are cut off there.
deadline = math.inf


def ganscale_env(**extra: str) -> dict:
    paths = [str(ROOT / "src"), str(SITE), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, paths)), **extra)
    env.pop(FAIL_ON_PURPOSE, None)
    return env


def run_logged(cmd: list[str], log: Path, timeout: float, **env: str) -> int:
    """Run cmd from the checkout, its output in log; the exit status (124 past timeout or the budget)."""
    timeout = min(timeout, deadline - time.monotonic())
    with open(log, "ab") as out:
        out.write(("$ " + " ".join([*(f"{k}={v}" for k, v in env.items()), *cmd]) + "\n").encode())
        out.flush()
        if timeout <= 0:
            out.write(b"not started: the --budget is spent\n")
            return 124
        try:
            return subprocess.run(cmd, cwd=ROOT, env=ganscale_env(**env), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\ntimed out after {timeout:.0f} s\n".encode())
            return 124


def probe_torch() -> dict:
    """Torch, CUDA and the GPU as seen by a child python (torch may be missing or broken)."""
    code = ("import json, torch; c = torch.cuda.is_available(); print(json.dumps({'torch': torch.__version__, "
            "'cuda': torch.version.cuda, 'cuda_available': c, "
            "'gpu': torch.cuda.get_device_name(0) if c else None}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"torch": None, "cuda": None, "cuda_available": False, "gpu": None,
                "torch_error": lines[-1] if lines else f"python exit {done.returncode}"}
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


# ---- items: each returns (status, detail); status is "pass", "fail" or "not run" ----

def cuda_test(test: str, out: Path) -> tuple[str, str]:
    log = out / f"cuda-test-{test.split('::')[-1]}.log"
    rc = run_logged([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", test], log, timeout=540)
    last = log.read_text().splitlines()[-1] if log.exists() else ""
    if rc == 0 and "skipped" not in last:
        return "pass", f"passed ({log.name})"
    return "fail", f"pytest exit {rc}{', skipped' if 'skipped' in last else ''} ({log.name})"


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


_facades_lock = threading.Lock()


def facades(pairs: int, out: Path) -> Path:
    """A synthetic facades-shaped set of `pairs` pairs in the scratch folder, written once for every item."""
    folder = SCRATCH / f"facades-{pairs}"
    with _facades_lock:  # the pix2pix items run side by side
        if not folder.is_dir():
            partial = folder.with_name(folder.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            run_logged([sys.executable, "-m", "ganscale", "make-facades", str(partial), "--n", str(pairs)],
                       out / f"make-facades-{pairs}.log", timeout=300)
            if partial.is_dir():
                partial.rename(folder)  # only a complete set is ever found under the final name
    return folder


def short_run_problems(run_dir: Path) -> tuple[dict, dict, list[str]]:
    """A short run's summary, its final losses, and what is wrong with them: a non-finite loss, missing steps."""
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = {k: v for k, v in summary["final"].items() if k.startswith("loss_")}
    problems = [f"{k}={v}" for k, v in losses.items() if not math.isfinite(v)]
    if summary["steps"] != RECIPE_STEPS:
        problems.append(f"{summary['steps']} steps of {RECIPE_STEPS}")
    return summary, losses, problems


def keep_summary(run_dir: Path, out: Path) -> None:
    """The run's summary.json beside the logs (the run folder stays in the scratch folder)."""
    (out / "runs").mkdir(exist_ok=True)
    shutil.copyfile(run_dir / "summary.json", out / "runs" / f"{run_dir.name}.summary.json")


def recipe_run(recipe: str, precision: str, out: Path) -> tuple[str, str]:
    run_dir = SCRATCH / "runs" / f"{recipe}-{precision}"
    shutil.rmtree(run_dir, ignore_errors=True)  # what an earlier call left: this one starts afresh
    data = ["--set", f"data.path={facades(16, out)}"] if recipe == "pix2pix" else []  # it has no default set
    log = out / f"recipe-{recipe}-{precision}.log"
    rc = run_logged([sys.executable, "-m", "ganscale", "train", recipe, "--run-dir", str(run_dir),
                     "--set", f"train.steps={RECIPE_STEPS}", "--set", f"train.device={DEVICE}",
                     "--set", f"train.precision={precision}", *data], log, timeout=RECIPE_TIMEOUT_S)
    if rc != 0:
        return "fail", f"train exit {rc} ({log.name})"
    keep_summary(run_dir, out)
    summary, losses, problems = short_run_problems(run_dir)
    if not checkpoint_is_finite(summary["checkpoint"]):
        problems.append("non-finite weights, G_ema or optimizer state in the checkpoint")
    shutil.rmtree(run_dir, ignore_errors=True)
    detail = ", ".join(f"{k} {v:.4g}" for k, v in losses.items()) + f", {summary['img_per_s']:.0f} img/s"
    return ("fail", "; ".join(problems)) if problems else ("pass", detail)


def tensorflow_run(precision: str, out: Path) -> tuple[str, str]:
    """The digits recipe on the tensorflow engine: finite losses, all its steps, and an export of its G and G_ema
    (converted to the torch layout) whose tensors are finite."""
    if subprocess.run([sys.executable, "-c", "import tensorflow"], env=ganscale_env(),
                      capture_output=True).returncode != 0:
        return "not run", "TensorFlow does not import: bring its GPU wheel with --wheels (README, TensorFlow engine)"
    run_dir = SCRATCH / "runs" / f"tensorflow-digits-{precision}"
    export = run_dir.with_suffix(".safetensors")
    shutil.rmtree(run_dir, ignore_errors=True)  # what an earlier call left: this one starts afresh
    export.unlink(missing_ok=True)
    log = out / f"tensorflow-digits-{precision}.log"
    # TensorFlow takes nearly all of a GPU's memory at start by default; the items beside it need theirs.
    rc = run_logged([sys.executable, "-m", "ganscale", "train", "digits", "--run-dir", str(run_dir),
                     "--set", "train.engine=tensorflow", "--set", f"train.steps={RECIPE_STEPS}",
                     "--set", f"train.precision={precision}"], log, timeout=300, TF_FORCE_GPU_ALLOW_GROWTH="true")
    if rc != 0:
        return "fail", f"train exit {rc} ({log.name})"
    rc = run_logged([sys.executable, "-m", "ganscale", "export", str(run_dir), "--out", str(export)],
                    out / f"tensorflow-digits-{precision}-export.log", timeout=120)
    if rc != 0:
        return "fail", f"export exit {rc} (tensorflow-digits-{precision}-export.log)"
    keep_summary(run_dir, out)
    summary, losses, problems = short_run_problems(run_dir)
    code = ("import sys, torch; from safetensors.torch import load_file\n"
            "ts = load_file(sys.argv[1]).values()\n"
            "sys.exit(0 if ts and all(bool(torch.isfinite(t).all()) for t in ts) else 1)")
    if subprocess.run([sys.executable, "-c", code, str(export)], env=ganscale_env(), capture_output=True).returncode:
        problems.append("non-finite tensors in the export of G and G_ema")
    detail = ", ".join(f"{k} {v:.4g}" for k, v in losses.items()) + f", {summary['img_per_s']:.0f} img/s, " \
        f"{summary['world_size']} replica(s)"
    return ("fail", "; ".join(problems)) if problems else ("pass", detail)


def bench(label: str, name: str, args: list[str], out: Path) -> tuple[str, str, dict | None]:
    """`ganscale bench NAME ARGS` into bench/LABEL/: status, detail, and the bench's JSON record."""
    bench_dir = out / "bench" / label
    log = out / f"bench-{label}.log"
    rc = run_logged([sys.executable, "-m", "ganscale", "bench", name, *args, "--out-dir", str(bench_dir)],
                    log, timeout=570)
    records = sorted(bench_dir.glob(f"bench-{name}-*.json"))
    record = json.loads(records[-1].read_text()) if records else None
    if rc != 0:
        return "fail", f"bench exit {rc} ({log.name})", record
    notes = [line for line in log.read_text().splitlines() if re.search(r"MFU|fast path|peak", line)]
    return "pass", "; ".join(notes[-3:]) or f"results in bench/{label}/", record


def pix2pix_rows(rows: list[str], out: Path) -> tuple[str, str, dict | None]:
    data = facades(FACADES_IMAGES, out)
    return bench(f"pix2pix-{'-'.join(rows)}", "pix2pix-table",
                 ["--device", "cuda", "--data", str(data), "--rows", ",".join(rows)], out)


def pix2pix_targets(out: Path) -> tuple[str, str]:
    """The fast path against the eager fp32 baseline on a facades-shaped epoch, and the targets they must meet."""
    status, detail, record = pix2pix_rows(["baseline", "fast"], out)
    if status != "pass":
        return status, detail
    rows = {row["row"]: row for row in record["rows"]}
    base, fast = rows["baseline"]["epoch median s"], rows["fast"]["epoch median s"]
    wait = rows["fast"]["data wait %"]
    if base is None or fast is None:
        return "fail", f"a row did not train: baseline {rows['baseline']['status']}, fast {rows['fast']['status']}"
    measured = (f"fast path {fast:.2f} s/epoch (target <= {TARGET_FAST_EPOCH_S:g}), {base / fast:.2f}x the eager "
                f"baseline's {base:.2f} s (target >= {TARGET_SPEEDUP:g}x), data wait {wait:.1f}% "
                f"(target < {TARGET_DATA_WAIT_PERCENT:g}%)")
    met = fast <= TARGET_FAST_EPOCH_S and base / fast >= TARGET_SPEEDUP and wait < TARGET_DATA_WAIT_PERCENT
    return ("pass" if met else "fail"), measured + ("" if met else ": missed")


# The fast path's options, as the pix2pix table's "fast" row on CUDA sets them (ganscale.bench.pix2pix).
FAST_PATH = ["train.channels_last=true", "optim.fused=true", "train.compile=reduce-overhead", "train.precision=bf16"]


def pix2pix_profile(label: str, overrides: list[str], out: Path) -> tuple[str, str]:
    """20 steps of pix2pix on the facades-shaped set, profiled after 30 (log.profile_steps): where a step goes.
    The run goes on 10 steps past the window: its last step (final checkpoint, outputs) is not a steady one."""
    run_dir = SCRATCH / "runs" / f"profile-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)
    log = out / f"profile-pix2pix-{label}.log"
    sets = [f"data.path={facades(FACADES_IMAGES, out)}", f"train.device={DEVICE}", "train.steps=60", "log.every=60",
            "log.sample_every=0", "checkpoint.every=0", "log.profile_after=30", "log.profile_steps=20", *overrides]
    rc = run_logged([sys.executable, "-m", "ganscale", "train", "pix2pix", "--run-dir", str(run_dir),
                     *(word for option in sets for word in ("--set", option))], log, timeout=300,
                    # the log says why a CUDA graph was skipped or a graph recompiled, and (cudagraphs) each
                    # compiled call the CUDA-graph trees ran in warm-up, recorded or re-recorded, and why
                    TORCH_LOGS="perf_hints,recompiles,cudagraphs")
    profile = run_dir / "profile" / "rank0.txt"
    if rc != 0 or not profile.exists():
        return "fail", f"train exit {rc} ({log.name})"
    shutil.copy(profile, out / f"profile-pix2pix-{label}.txt")
    return "pass", "; ".join(profile.read_text().splitlines()[:3]) + f" (profile-pix2pix-{label}.txt)"


def pix2pix_row(row: str, out: Path) -> tuple[str, str]:
    status, detail, record = pix2pix_rows([row], out)
    if record is None:
        return status, detail
    result = record["rows"][0]
    if result["epoch median s"] is None:
        return ("not run" if result["status"].startswith("skipped") else "fail"), result["status"]
    return status, (f"{result['epoch median s']:.2f} s/epoch (document {result['document s/epoch']} s), "
                    f"peak {result['peak MiB']:.0f} MiB, data wait {result['data wait %']:.1f}%")


def throughput(label: str, args: list[str], out: Path) -> tuple[str, str]:
    status, detail, _ = bench(label, "throughput", ["--device", "cuda", *args], out)
    return status, detail


@dataclass(frozen=True)
class Item:
    part: int
    name: str
    check: Callable[[Path], tuple[str, str]]
    timed: bool = False  # measures speed: runs alone on the machine, after the others


def items() -> list[Item]:
    """Every item, in the order they start."""
    listed = [Item(1, f"cuda test {test.split('::')[-1]}", lambda out, t=test: cuda_test(t, out))
              for test in CUDA_TESTS]
    listed += [Item(1, f"tensorflow engine digits {precision}", lambda out, p=precision: tensorflow_run(p, out))
               for precision in TENSORFLOW_PRECISIONS]
    listed += [Item(2, f"recipe {recipe} {precision}", lambda out, r=recipe, p=precision: recipe_run(r, p, out))
               for recipe, precisions in RECIPE_PRECISIONS.items() for precision in precisions]
    listed += [
        # The profiles first: where a step goes is what a fix of the missed targets needs (1.12x on an H100).
        Item(3, "pix2pix profile: fast path", lambda out: pix2pix_profile("fast", FAST_PATH, out), True),
        Item(3, "pix2pix profile: eager fp32", lambda out: pix2pix_profile("eager", [], out), True),
        # Whether CUDA-graph trees pay for themselves on this torch and CUDA (they cost host time of their own).
        Item(3, "pix2pix profile: fast path without CUDA graphs (train.compile=default)",
             lambda out: pix2pix_profile("fast-no-graphs", [*FAST_PATH, "train.compile=default"], out), True),
        Item(3, f"pix2pix targets: fast path vs eager fp32 baseline, {FACADES_IMAGES} pairs", pix2pix_targets, True),
        Item(3, "bench throughput dcgan, biggan (MFU against the GPU's dense peak)",
             lambda out: throughput("throughput", [], out), True),
        Item(3, "bench throughput stylegan2 (its 256 px config's widths, 64 px, batch 32; MFU as above)",
             lambda out: throughput("throughput-stylegan2", ["--model", "stylegan2", "--batch", "32"], out), True)]
    listed += [Item(3, f"pix2pix row {row}", lambda out, r=row: pix2pix_row(r, out), True)
               for row in OTHER_PIX2PIX_ROWS]
    return listed


def run_item(name: str, function, out: Path, blocker: str | None) -> dict:
    """One item's record; an exception is a fail, never the end of the check."""
    if name in os.environ.get(FAIL_ON_PURPOSE, "").split(","):
        return {"item": name, "status": "fail", "detail": f"failed on purpose ({FAIL_ON_PURPOSE})", "seconds": 0}
    if blocker:
        return {"item": name, "status": "not run", "detail": blocker, "seconds": 0}
    if time.monotonic() >= deadline:
        return {"item": name, "status": "not run", "detail": "the --budget was spent before it started",
                "seconds": 0}
    start = time.monotonic()
    try:
        status, detail = function(out)
    except Exception as error:  # noqa: BLE001 - recorded, and the next item still runs
        status, detail = "fail", f"{type(error).__name__}: {error}"
    if status == "fail" and time.monotonic() >= deadline:
        status, detail = "not run", f"cut off by --budget ({detail})"
    return {"item": name, "status": status, "detail": detail, "seconds": round(time.monotonic() - start, 1)}


def result_folder(machine: dict) -> Path:
    gpu = machine["gpu"] or "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return ROOT / "benchmarks" / "results" / f"gpu-check-{datetime.date.today():%Y%m%d}-{slug}"


STATUSES = ("pass", "fail", "not run")


class DamagedRecord(Exception):
    """results.json in --out is not a record this script wrote (truncated, edited, another file)."""


def load_record(path: Path) -> dict:
    """The folder's record of earlier calls, or an empty one; DamagedRecord saying what is wrong with it.

    A record holds the calls into the folder (command, machine) and each item's standing result, with the index
    of the call that produced it."""
    if not path.exists():
        return {"calls": [], "items": {}}
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise DamagedRecord(f"{type(error).__name__}: {error}") from None
    items = record.get("items") if isinstance(record, dict) else None
    if not isinstance(items, dict):
        raise DamagedRecord("no \"items\" object")
    if "calls" not in record:  # written before calls were kept: one machine and command stood for every row
        record["calls"] = [{"command": record.pop("command", None), "machine": record.pop("machine", None) or {}}]
    calls = record["calls"]
    if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("machine"), dict)
                                            for c in calls)):
        raise DamagedRecord("\"calls\" is not a list of calls with their machine")
    for name, row in items.items():
        if not (isinstance(row, dict) and row.get("status") in STATUSES and isinstance(row.get("detail"), str)):
            raise DamagedRecord(f"item {name!r} has no status of {'/'.join(STATUSES)} with a detail")
        row.setdefault("call", len(calls) - 1)
        if not (isinstance(row["call"], int) and 0 <= row["call"] < len(calls)):
            raise DamagedRecord(f"item {name!r} names no recorded call")
    return record


def write_atomically(path: Path, text: str) -> None:
    """A reader, or a later call after this one is killed at its time limit, finds the old file or the new one."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(text)
    os.replace(partial, path)


def machine_key(machine: dict) -> tuple:
    """What makes results from two calls not alike: the GPU and the software stack (not the host's name)."""
    return tuple(machine.get(key) for key in ("gpu", "driver", "torch", "cuda"))


def torch_error(machine: dict) -> str:
    error = machine.get("torch_error")
    return "; ".join(error) if isinstance(error, list) else str(error)  # a list in records from before


def machine_lines(m: dict) -> list[str]:
    if not m:
        return ["- not recorded"]
    if m.get("torch") is None and m.get("torch_error"):  # without torch there was no asking for a GPU
        return [f"- torch: could not be imported ({torch_error(m)})", f"- driver: {m.get('driver') or 'none'}",
                f"- python: {m.get('python')}, {m.get('cpus')} CPUs"]
    return [f"- GPU: {m.get('gpu') or 'none (no CUDA GPU)'}", f"- driver: {m.get('driver') or 'none'}",
            f"- torch: {m.get('torch')}", f"- CUDA: {m.get('cuda')}",
            f"- python: {m.get('python')}, {m.get('cpus')} CPUs"]


def write_summary(out: Path, record: dict) -> None:
    calls, rows = record["calls"], record["items"]
    standing = sorted({row["call"] for row in rows.values()}) or [len(calls) - 1]
    # machine number -> the calls of the standing rows that ran on it, in call order
    machines: dict[tuple, list[int]] = {}
    for call in standing:
        machines.setdefault(machine_key(calls[call]["machine"]), []).append(call)
    number = {call: n for n, on_it in enumerate(machines.values(), 1) for call in on_it}
    mixed = len(machines) > 1
    lines = ["# GPU check", ""]
    if mixed:
        lines += ["## Machines", "", f"The results come from {len(machines)} machines (GPU, driver, torch or CUDA "
                  "differ); the table's last column names each row's.", ""]
        for n, on_it in enumerate(machines.values(), 1):
            lines += [f"### Machine {n}", "", *machine_lines(calls[on_it[-1]]["machine"]),
                      "- calls: " + "; ".join(f"`{calls[call]['command']}`" for call in on_it), ""]
    else:
        lines += ["## Machine", "", *machine_lines(calls[standing[-1]]["machine"]), ""]
    lines += ["## Items", "", f"Last call: `{calls[-1]['command']}`", "",
              "| part | item | status | s | detail |" + (" machine |" if mixed else ""),
              "|---|---|---|---|---|" + ("---|" if mixed else "")]
    for item in items():
        row = rows.get(item.name, {"status": "not run", "detail": f"part {item.part} not run yet"})
        line = f"| {item.part} | {item.name} | {row['status']} | {row.get('seconds', '')} | {row['detail']} |"
        lines.append(line + (f" {number.get(row.get('call'), '')} |" if mixed else ""))
    write_atomically(out / "summary.md", "\n".join(lines) + "\n")


def out_problem(out: Path) -> str | None:
    """Why --out cannot be the result folder (it or a folder above it is a file), checked before anything runs."""
    for path in (out, *out.parents):
        if path.exists():
            return None if path.is_dir() else f"{path} is a file, not a folder"
    return None


def open_record(out: Path) -> dict | None:
    """The record in out (empty where there is none), or None after one error line saying it is damaged."""
    path = out / "results.json"
    try:
        return load_record(path)
    except DamagedRecord as error:
        print(f"error: {path} is damaged ({error}); give a new --out, or move that file aside to start the "
              f"folder's record afresh", file=sys.stderr)
        return None


def missing_line(missing: list[str], wheels: Path | None) -> str:
    if wheels is None:
        return f"dependencies missing: {' '.join(missing)}; pass --wheels"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    fill = shlex.join(["scripts/gpu-wheels.sh", str(wheels), python, *(DEPENDENCIES[name] for name in missing)])
    return f"dependencies missing: {' '.join(missing)}; --wheels {wheels} has no wheel for them: {fill}"


def main(argv: list[str] | None = None) -> int:
    global deadline
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["1", "2", "3", "all"], default="all")
    parser.add_argument("--wheels", type=Path, help="folder of wheels for missing dependencies (gpu-wheels.sh)")
    parser.add_argument("--requirements", action="store_true", help="print the requirements and stop")
    parser.add_argument("--out", type=Path, help="result folder (default benchmarks/results/gpu-check-DATE-GPU)")
    parser.add_argument("--budget", type=float, help="seconds: start no item after them, cut a running one off there")
    parser.add_argument("--jobs", type=int, help="correctness items run side by side (default: CPUs / 2, at most 6)")
    parser.add_argument("--pending", action="store_true", help="only items with no pass or fail in --out's record")
    parser.add_argument("--only", help="comma-separated parts of item names: only the items whose name holds one "
                                       "(e.g. 'pix2pix profile,fp16')")
    args = parser.parse_args(argv)
    if args.requirements:
        print("\n".join(DEPENDENCIES.values()))
        return 0
    if args.wheels is not None and not args.wheels.is_dir():
        print(f"error: --wheels {args.wheels}: no such folder; build it with scripts/gpu-wheels.sh", file=sys.stderr)
        return 2
    for option, value in (("--budget", args.budget), ("--jobs", args.jobs)):
        if value is not None and not value > 0:
            print(f"error: {option} {value:g}: give a number above 0", file=sys.stderr)
            return 2
    wanted = [part.strip() for part in args.only.split(",") if part.strip()] if args.only is not None else []

    def asked_for(item: Item) -> bool:
        return not wanted or any(part in item.name for part in wanted)

    if args.only is not None and not any(wanted and asked_for(item) for item in items()):
        print(f"error: --only {args.only!r}: no item's name holds any of these (summary.md lists the names)",
              file=sys.stderr)
        return 2
    problem = out_problem(args.out.resolve()) if args.out is not None else None
    if problem:
        print(f"error: --out {args.out}: {problem}; give a new folder or an earlier check's", file=sys.stderr)
        return 2
    # A given --out's record is checked before anything runs; the default folder is named after the probe's GPU.
    record = open_record(args.out.resolve()) if args.out is not None else {}
    if record is None:
        return 2
    if args.budget is not None:
        deadline = time.monotonic() + args.budget
    jobs = args.jobs or max(1, min(6, (os.cpu_count() or 2) // 2))

    missing = ensure_dependencies(args.wheels)
    machine = describe_machine()
    out = (args.out or result_folder(machine)).resolve()
    if args.out is None and (record := open_record(out)) is None:
        return 2
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # e.g. no permission: out_problem has ruled out a file in the way
        print(f"error: --out {out}: cannot create it ({error.strerror}); give a folder you can write",
              file=sys.stderr)
        return 2
    SCRATCH.mkdir(parents=True, exist_ok=True)
    record_path = out / "results.json"
    call = len(record["calls"])
    # quoted as a shell needs it, so that the summary's "Last call:" can be pasted back
    command = shlex.join(["scripts/gpu-check.sh", *(sys.argv[1:] if argv is None else argv)])
    started = datetime.datetime.now().isoformat(timespec="seconds")
    record["calls"].append({"command": command, "machine": machine, "started": started})
    blocker = (missing_line(missing, args.wheels) if missing
               else f"torch does not import: {torch_error(machine)}" if machine["torch"] is None
               else None if machine["cuda_available"] else "no CUDA GPU")

    chosen = [item for item in items() if args.part in ("all", str(item.part))
              and not (args.pending and record["items"].get(item.name, {}).get("status") in ("pass", "fail"))
              and asked_for(item)]
    lock = threading.Lock()

    def save() -> None:
        write_atomically(record_path, json.dumps(record, indent=2) + "\n")
        write_summary(out, record)

    def check(item: Item) -> None:
        print(f"[part {item.part}] {item.name} ...", flush=True)
        row = run_item(item.name, item.check, out, blocker)
        with lock:  # items finish in any order; the record and summary always hold every finished one
            earlier = record["items"].get(item.name, {"status": "not run"})
            if row["status"] == "not run" and earlier["status"] != "not run":
                # a result that did not come about never hides one that did (another machine's, or before a
                # --budget ran out)
                print(f"[part {item.part}] {item.name}: not run ({row['detail']}); its earlier "
                      f"{earlier['status']} stands", flush=True)
                return
            record["items"][item.name] = row = {**row, "call": call}
            save()
        print(f"[part {item.part}] {item.name}: {row['status']} ({row['seconds']} s)", flush=True)

    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(check, [item for item in chosen if not item.timed]))
    for item in chosen:  # the benches, one at a time on a quiet machine
        if item.timed:
            check(item)
    save()  # this call, also where it changed no result
    print(f"results: {out / 'summary.md'}")
    # The exit status is the folder's: a fail recorded by an earlier call and not since passed still fails.
    fails = [row for row in record["items"].values() if row["status"] == "fail"]
    earlier = sum(row["call"] != call for row in fails)
    if fails:
        print(f"{len(fails)} item(s) fail in the record" + (f", {earlier} of them from earlier calls" if earlier
                                                          else ""))
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
