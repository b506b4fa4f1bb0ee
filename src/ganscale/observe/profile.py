"""`log.profile_steps`: where a few steps' time goes, op by op, from torch.profiler.

Every rank profiles the same steps (the window is a function of the step; nothing here changes what the
ranks run together) and writes RUN_DIR/profile/rank<R>.txt: per step, the wall time, and on CUDA the
kernels' time (the GPU's busy share), kernel and CUDA-graph launches and host synchronisations; then the
ops with the most time of their own on the host and, on CUDA, on the device. A step bound by the host shows
a low busy share and many launches or synchronisations; one bound by the GPU, its kernels. A compiled run also
gets torch.compile's counts: graphs, graph breaks and CUDA graphs inductor skipped, and the graphs compiled inside
the window, each a recompile that a steady step should not have; with CUDA graphs (compile reduce-overhead), the
graphs their trees recorded and the compiled calls they ran outside a graph, inside the window too: a steady step
replays graphs and does neither (inductor falls back to plain kernels without counting a skip where the trees
stay in warm-up or re-record).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

GRAPH_LAUNCH = "cudaGraphLaunch"  # one CUDA graph replayed
COMPILED_REGION = "Torch-Compiled Region"  # torch.compile's mark around each call of a compiled frame
LAUNCHES = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", GRAPH_LAUNCH}
SYNCHRONISATIONS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"}
ROWS = 30  # of each table


class StepProfiler:
    """Profiles steps [after, after + steps) (0-based, as the trainer counts before a step runs): `step(step)`
    before each step, `close()` when training ends (a run that ends inside the window writes what it has)."""

    def __init__(self, steps: int, after: int, run_dir: Path, rank: int, device: torch.device):
        self.first, self.end, self.path = after, after + steps, Path(run_dir) / "profile" / f"rank{rank}.txt"
        self.cuda = device.type == "cuda"
        self.enabled = steps > 0
        self._profile: profile | None = None
        self._started_at, self._from_step = 0.0, 0
        # torch.compile's counters are the process's: this run's are the differences from here on.
        self._compiled_at_start = compile_counts() if self.enabled else {}
        self._compiled_before: dict[str, int] = {}
        self.window: dict[str, float] = {}  # once written: the window's compile counts and, on CUDA, graph replays

    def step(self, step: int) -> None:
        if not self.enabled:
            return
        if self._profile is None and self.first <= step < self.end:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profile = profile(activities=activities)
            self._profile.start()
            self._started_at, self._from_step = time.perf_counter(), step
            self._compiled_before = compile_counts()
        elif self._profile is not None and step >= self.end:
            self._finish(step)

    def close(self, step: int) -> None:
        if self._profile is not None:
            self._finish(step)

    def _finish(self, step: int) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # the window's kernels belong to its wall time
        wall = time.perf_counter() - self._started_at
        self._profile.stop()
        events, self._profile, self.enabled = self._profile.key_averages(), None, False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        now = compile_counts()
        run, within = ({key: now[key] - since[key] for key in now} for since in (self._compiled_at_start,
                                                                                  self._compiled_before))
        within["compiled calls"] = sum(e.count for e in events if e.key.startswith(COMPILED_REGION))
        self.path.write_text(report(events, self._from_step, step, wall, self.cuda, (run, within)))
        self.window = {**within, "CUDA graph replays": sum(e.count for e in events if e.key == GRAPH_LAUNCH)}


def compile_counts() -> dict[str, int]:
    """torch.compile's counts in this process so far (torch._dynamo's counters)."""
    from torch._dynamo.utils import counters

    return {"graphs": counters["stats"]["unique_graphs"], "graph breaks": sum(counters["graph_break"].values()),
            "CUDA graphs skipped": counters["inductor"]["cudagraph_skips"], **cuda_graph_tree_counts()}


def cuda_graph_tree_counts() -> dict[str, int]:
    """CUDA-graph trees on this process's GPU: graphs recorded, and compiled calls run outside a graph (warm-up
    runs, and the trees' fallback to plain kernels). Read from torch's private tree manager, which counts both by
    id counters: zeros without CUDA, without trees, or where the manager's form differs."""
    zeros = {"CUDA graphs recorded": 0, "calls outside CUDA graphs": 0}
    if not torch.cuda.is_available():
        return zeros
    try:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        recorded, next_warmup = _next_of(manager.graph_counter), _next_of(manager.warmup_node_counter)
    except Exception:  # noqa: BLE001 - private torch internals: no trees yet, or another torch's form
        return zeros
    if recorded is None or next_warmup is None:
        return zeros
    return {"CUDA graphs recorded": recorded, "calls outside CUDA graphs": -1 - next_warmup}  # warm-up ids: -1, -2, ...


def _next_of(counter) -> int | None:
    """The value an itertools.count gives next, from its repr ("count(5)", "count(-3, -1)"), without taking it."""
    found = re.fullmatch(r"count\((-?\d+)(?:, -?\d+)?\)", repr(counter))
    return int(found.group(1)) if found else None


def compile_line(compiled: dict[str, int], within: dict[str, int]) -> str | None:
    """The report's line on torch.compile: `compiled`, the run's counts, `within`, the profiled steps' (None when
    the run compiled nothing)."""
    if not compiled["graphs"]:
        return None
    line = (f"torch.compile in this run: {compiled['graphs']} graphs, {compiled['graph breaks']} graph breaks, "
            f"{compiled['CUDA graphs skipped']} CUDA graphs skipped (TORCH_LOGS=perf_hints says why); in the profiled "
            f"steps: {within['graphs']} graphs compiled (recompiles: TORCH_LOGS=recompiles says why)")
    if "compiled calls" in within:  # read from the profile: 0 where the compiled networks ran eagerly
        line += f", {within['compiled calls']} calls of compiled code"
    trees = ("CUDA graphs recorded", "calls outside CUDA graphs")
    if any(compiled.get(key) for key in trees):  # a run whose CUDA-graph trees did anything
        line += (f"; CUDA-graph trees: {compiled['CUDA graphs recorded']} graphs recorded and "
                 f"{compiled['calls outside CUDA graphs']} compiled calls run outside a graph in this run, "
                 f"{within['CUDA graphs recorded']} and {within['calls outside CUDA graphs']} in the profiled steps "
                 "(a steady step replays: both 0)")
    return line


def report(events, first: int, end: int, wall: float, cuda: bool,
           compilation: tuple[dict[str, int], dict[str, int]] | None = None) -> str:
    """The text of a profile of steps [first, end) that took `wall` seconds; `compilation`: torch.compile's
    counts in the run and inside the window (compile_counts), where known."""
    n = max(end - first, 1)
    lines = [f"steps {first + 1}-{end} as logged ({n}), {1e3 * wall / n:.2f} ms a step (wall, profiler on)"]
    kernels = [e for e in events if e.device_type == DeviceType.CUDA]
    if cuda:
        kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / n
        count = {e.key: e.count for e in events}
        lines += [f"CUDA kernels {kernel_ms:.2f} ms a step: the GPU busy {100 * kernel_ms / (1e3 * wall / n):.0f}% "
                  "of the wall time",
                  f"launches a step: {sum(count.get(k, 0) for k in LAUNCHES) / n:.0f} "
                  f"(of them CUDA graph replays: {count.get(GRAPH_LAUNCH, 0) / n:.0f}); host synchronisations "
                  f"a step: {sum(count.get(k, 0) for k in SYNCHRONISATIONS) / n:.1f}, device-to-host copies "
                  f"{sum(e.count for e in kernels if 'DtoH' in e.key) / n:.1f}"]
    said = compile_line(*compilation) if compilation else None
    lines += [said] if said else []
    lines += ["", "Host: ops by their own time", table(events, "self_cpu_time_total", n)]
    if cuda:
        lines += ["", "Device: kernels by their time", table(kernels, "self_device_time_total", n)]
    return "\n".join(lines) + "\n"


def table(events, field: str, steps: int) -> str:
    ranked = sorted(events, key=lambda e: getattr(e, field), reverse=True)[:ROWS]
    rows = [f"{'ms a step':>10} {'calls a step':>12}  name"]
    rows += [f"{getattr(e, field) / 1e3 / steps:10.3f} {e.count / steps:12.1f}  {e.key[:110]}" for e in ranked]
    return "\n".join(rows)
