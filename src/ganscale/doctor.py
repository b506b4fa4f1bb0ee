"""`ganscale doctor`: check this machine for multi-process training, before (or after) a failed job.

    ganscale doctor [--nproc N] [--backend auto|gloo|nccl] [--device auto|cpu|cuda]

One line per check, `STATUS  name  detail`, in this order:

1. Versions: python, torch (against the supported range of ganscale.versions, naming the features an older
   torch lacks; older than the range is a FAIL), CUDA runtime of the torch build, cuDNN, NCCL, GPU driver, gloo.
2. Devices: the visible GPUs (name, memory) against the N ranks of a CUDA run (one GPU per rank;
   more ranks than GPUs is a FAIL), CUDA_VISIBLE_DEVICES repeating a device (CUDA then shows no GPU
   at all), and N ranks against the CPU cores of a CPU run.
3. Backend for the hardware: nccl without CUDA is a FAIL, gloo on GPUs a WARN.
4. Environment variables that change how distributed runs behave, each printed with a one-line
   explanation when set (`ENV_EXPLANATIONS`), plus OMP_NUM_THREADS against N x cores. A launcher variable
   `ganscale train` refuses (MASTER_PORT not a port, RANK not below WORLD_SIZE, ...) is a FAIL.
5. A real collective: N workers started through torch's elastic launcher exactly as
   `ganscale train --nproc N` starts them (c10d rendezvous on 127.0.0.1, the same OMP_NUM_THREADS
   default), each on the same runtime (`ganscale.runtime.start`) as training. Each rank all-reduces a
   known pattern and checks the result bit for bit, then times an all-reduce of 16 MiB (3 warm-up, 10
   timed; the slowest rank counts) and reports algorithm and bus bandwidth (busbw = algbw x 2(n-1)/n,
   the nccl-tests convention), and the time of a 4 KiB all-reduce (50 timed): the fixed cost a DDP step
   pays once per network, which decides whether a small model gains from more processes.
6. One tiny GAN step (2 steps of the default recipe, width 8) on the same workers, then the
   replica check (`ganscale.checkpointer.check_replicas`: G, D and G_ema bitwise identical on every rank).

Statuses: PASS. WARN: it works but is slow or surprising (each WARN prints its cause and the fix;
WARN does NOT fail the doctor). FAIL: a run like this would fail (cause and fix printed). SKIP: the
check could not run because of a FAIL above (the reason is printed). Exit code 0 when nothing
FAILed or was SKIPped, 1 otherwise.

The workers' own output goes to log files in a temporary directory, not to the screen; when a
worker fails its exception (or the tail of its stderr) is shown in the FAIL line. Checks 5 and 6
take about 10 s on 2 CPU cores (most of it starting the workers).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ganscale import versions

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"

BANDWIDTH_BYTES = 16 * 2**20     # all-reduce size for the bandwidth measurement
WARMUP_ITERS, TIMED_ITERS = 3, 10
LATENCY_BYTES, LATENCY_ITERS = 4096, 50  # a small all-reduce: what a collective costs whatever its size
PATTERN_ELEMENTS = 2**20 + 3     # correctness tensor: odd size, so chunking across ranks is uneven
PATTERN_PERIOD = 1021            # values (i % 1021 + 1) x (rank + 1): sums stay exact in float32
TIMEOUT_S = 60.0                 # process-group timeout and hang timeout in the workers
LOW_FREE_GPU_BYTES = 2**30       # a GPU with less free memory than this is probably busy

# What each environment variable does, printed when it is set. Any other NCCL_* / TORCH_NCCL_* variable
# is printed too, with a generic line.
ENV_EXPLANATIONS: dict[str, str] = {
    "NCCL_DEBUG": "NCCL log level (WARN, INFO, TRACE); INFO prints the topology and transports chosen at init",
    "NCCL_DEBUG_SUBSYS": "which NCCL subsystems log with NCCL_DEBUG (INIT, COLL, P2P, NET, GRAPH, ...)",
    "NCCL_P2P_DISABLE": "1 turns off direct GPU-to-GPU (NVLink/PCIe peer) copies within a node",
    "NCCL_P2P_LEVEL": "the farthest topology distance (NVL, PIX, PXB, PHB, SYS) at which NCCL still uses P2P",
    "NCCL_SHM_DISABLE": "1 turns off NCCL's shared-memory transport between processes of one node",
    "NCCL_IB_DISABLE": "1 turns off InfiniBand/RoCE: traffic between nodes uses TCP sockets "
                       "(no effect within one node)",
    "NCCL_IB_HCA": "which InfiniBand adapters (and ports) NCCL uses",
    "NCCL_SOCKET_IFNAME": "network interface(s) NCCL uses for bootstrap and socket traffic (eth0; ^docker0 excludes)",
    "NCCL_NET_GDR_LEVEL": "the farthest distance between NIC and GPU at which NCCL uses GPUDirect RDMA",
    "NCCL_ALGO": "forces NCCL's collective algorithm(s) (Ring, Tree, ...) instead of its own tuning",
    "NCCL_PROTO": "forces NCCL's protocol(s) (LL, LL128, Simple) instead of its own tuning",
    "NCCL_NVLS_ENABLE": "NVLink SHARP (in-switch reductions on NVSwitch systems): 0 off, 1 on",
    "NCCL_CUMEM_ENABLE": "whether NCCL allocates its buffers with the CUDA cuMem* API",
    "NCCL_ASYNC_ERROR_HANDLING": "old name of TORCH_NCCL_ASYNC_ERROR_HANDLING (torch reads the new name)",
    "NCCL_BLOCKING_WAIT": "old name of TORCH_NCCL_BLOCKING_WAIT (torch reads the new name)",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "what a rank does when an NCCL collective fails or times out: "
                                       "3 (default) or 1 abort it and stop the process, 0 leaves it waiting",
    "TORCH_NCCL_BLOCKING_WAIT": "1: the calling thread waits for each NCCL collective and raises on timeout",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1: write NCCL's flight-recorder trace (last collectives) when one times out",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "how many collectives NCCL's flight recorder keeps (0: off)",
    "TORCH_DISTRIBUTED_DEBUG": "OFF, INFO or DETAIL: DETAIL checks every collective's shapes across ranks "
                               "and reports DDP's unused parameters (slow; for debugging)",
    "TORCH_CPP_LOG_LEVEL": "log level of torch's C++ side (INFO shows process-group setup)",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1: workers open their own TCP store instead of sharing the elastic "
                                          "agent's rendezvous store (torch 2.13: restarted gloo workers under "
                                          "torchrun --max-restarts hang without it)",
    "GLOO_SOCKET_IFNAME": "network interface gloo uses (set it when the default one cannot reach the other nodes)",
    "CUDA_VISIBLE_DEVICES": "which GPUs (indices or UUIDs) the processes see, renumbered from 0; empty hides all",
    "CUDA_LAUNCH_BLOCKING": "1 makes every CUDA kernel launch synchronous: exact error locations, much slower",
    "OMP_NUM_THREADS": "CPU threads per process for math; ganscale train --nproc sets cores/N when unset, "
                       "torchrun sets 1",
    "MASTER_ADDR": "address of rank 0's TCP store for env:// init; launchers set it per worker",
    "MASTER_PORT": "port of rank 0's TCP store for env:// init; launchers set it per worker",
    "RANK": "this process's global rank; set by a launcher for each worker",
    "WORLD_SIZE": "number of processes in the group; set by a launcher for each worker",
    "LOCAL_RANK": "this process's rank on its node (its GPU index); set by a launcher for each worker",
    "LOCAL_WORLD_SIZE": "number of processes on this node; set by a launcher for each worker",
    "TORCHELASTIC_RUN_ID": "the elastic launcher's job id; set for each worker",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "seconds torch's elastic agent waits after passing a stop signal on, "
                                      "before SIGKILL (default 30); train --nproc lengthens it to "
                                      "fault.exit_timeout_s's needs",
    "GANSCALE_INJECT_FAULT": "test-only fault injection: a rank raises, sleeps or adds noise at a given step on purpose",
}
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@dataclass
class Check:
    status: str
    name: str
    detail: str
    cause: str = ""
    fix: str = ""

    def lines(self) -> list[str]:
        out = [f"{self.status}  {self.name:<16}  {self.detail}"]
        if self.status != PASS:
            out += [f"      cause: {self.cause or '-'}", f"      fix:   {self.fix or '-'}"]
        return out


# ------------------------------------------------------------------------------------ pure helpers
def algorithm_bandwidth(nbytes: int, seconds: float) -> float:
    """Bytes per second of one all-reduce of `nbytes` (the payload size over the time)."""
    return nbytes / seconds


def bus_bandwidth(algbw: float, world: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce: algbw x 2(n-1)/n, comparable with the link speed."""
    return algbw * 2 * (world - 1) / world


def _strtoul(text: str) -> int:
    """The leading unsigned integer of `text` as CUDA reads it, or -1."""
    match = re.match(r"[+-]?\d+", text)
    return int(match.group()) if match else -1


def visible_device_duplicates(value: str) -> list[str]:
    """Entries of a CUDA_VISIBLE_DEVICES value that repeat an earlier one (CUDA then shows no GPU).

    Parsed the way CUDA (and torch.cuda) read it: indices like strtoul ("1gpu" is 1), UUIDs
    (GPU-..., MIG-...) as strings; a negative or unparsable entry ends the list.
    """
    seen: list[object] = []
    duplicates: list[str] = []
    prefix = "GPU-" if value.startswith("GPU-") else "MIG-" if value.startswith("MIG-") else None
    for raw in value.split(","):
        entry = raw.strip()
        if prefix:
            if not entry.startswith(prefix):
                break
            key: object = entry
        else:
            key = _strtoul(entry)
            if key < 0:
                break
        if key in seen:
            duplicates.append(entry)
        else:
            seen.append(key)
    return duplicates


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def resolve(device: str, backend: str, cuda_available: bool) -> tuple[bool, str]:
    """(runs on CUDA, backend) as `ganscale.runtime.start` would choose them."""
    from ganscale.runtime import backend_for

    on_cuda = device == "cuda" or (device == "auto" and cuda_available)
    return on_cuda, backend_for(backend, on_cuda)


@dataclass
class Gpu:
    name: str
    total_bytes: int
    free_bytes: int | None = None


def _ranks(n: int) -> str:
    return f"{n} rank" + "s" * (n != 1)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def device_checks(nproc: int, device: str, on_cuda: bool, cuda_available: bool, cuda_build: str | None,
                  gpus: list[Gpu], environ: Mapping[str, str], cores: int, cuda_warning: str = "") -> list[Check]:
    checks = []
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    duplicates = visible_device_duplicates(visible) if visible else []
    if duplicates:
        checks.append(Check(FAIL, "visible devices",
                            f"CUDA_VISIBLE_DEVICES={visible!r} lists {', '.join(duplicates)} twice",
                            "CUDA treats a device list with a repeated entry as empty: no GPU is visible at all",
                            "list each GPU once, e.g. CUDA_VISIBLE_DEVICES=0,1,2,3"))
    if not on_cuda:
        gpu_note = f"{len(gpus)} GPU(s) present but not used (--device {device})" if gpus else "no GPU visible"
        if nproc > cores:
            checks.append(Check(WARN, "devices", f"cpu run: {nproc} ranks on {cores} cores; {gpu_note}",
                                "more processes than CPU cores: they take turns on the cores, every collective waits "
                                "for the slowest", f"use --nproc {cores} or fewer on this machine"))
        else:
            checks.append(Check(PASS, "devices", f"cpu run: {_ranks(nproc)} on {cores} cores; {gpu_note}"))
        return checks
    if not cuda_available:
        if cuda_build is None:
            cause, fix = ("this torch is a CPU build (torch.version.cuda is None)",
                          f"install the CUDA build of torch {versions.DEFAULT_INSTALL} (README: GPU machines), or use --device cpu")
        elif visible is not None and (visible.strip() == "" or duplicates):
            cause, fix = (f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU",
                          "unset CUDA_VISIBLE_DEVICES or list the GPUs to use, each once")
        else:
            cause = (f"no GPU found by the CUDA driver (driver missing, too old for CUDA {cuda_build}, or no GPU "
                     "in this machine/container)" + (f": {cuda_warning}" if cuda_warning else ""))
            fix = "check nvidia-smi; install a driver that supports this CUDA version, or use --device cpu"
        checks.append(Check(FAIL, "devices", "cuda requested but no CUDA device is visible", cause, fix))
        return checks
    listing = "; ".join(f"{i}: {g.name}, {_gib(g.total_bytes)}"
                        + (f" ({_gib(g.free_bytes)} free)" if g.free_bytes is not None else "")
                        for i, g in enumerate(gpus))
    if nproc > len(gpus):
        checks.append(Check(FAIL, "devices", f"cuda run: {nproc} ranks but {len(gpus)} GPU(s) visible ({listing})",
                            "one GPU per rank: ranks past the last GPU get no device (invalid device ordinal), "
                            "and ranks sharing a GPU make NCCL fail with 'Duplicate GPU detected'",
                            f"use --nproc {len(gpus)} or fewer, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"))
    else:
        checks.append(Check(PASS, "devices", f"cuda run: {_ranks(nproc)} on {len(gpus)} GPU(s): {listing}"))
    for i, gpu in enumerate(gpus[:nproc]):
        if gpu.free_bytes is not None and gpu.free_bytes < LOW_FREE_GPU_BYTES:
            checks.append(Check(WARN, f"gpu {i} memory", f"{_gib(gpu.free_bytes)} free of {_gib(gpu.total_bytes)}",
                                "another process holds most of this GPU's memory (a leftover worker of a failed run?)",
                                "find it with nvidia-smi and stop it, or hide this GPU with CUDA_VISIBLE_DEVICES"))
    return checks


def backend_checks(requested: str, backend: str, on_cuda: bool, nccl_available: bool,
                   gloo_available: bool, cuda_build: bool = True) -> list[Check]:
    where = "cuda" if on_cuda else "cpu"
    how = f"{backend} on {where}" + (" (auto)" if requested == "auto" else "")
    if backend == "nccl" and not on_cuda:
        return [Check(FAIL, "backend", f"{how}: NCCL needs CUDA devices; use gloo or --backend auto",
                      "NCCL only moves CUDA tensors; this run has no GPU (CPU device, or no GPU visible)",
                      "use --backend gloo or --backend auto (set parallel.backend=gloo or auto for training)")]
    if backend == "nccl" and not cuda_build:  # CPU builds carry no NCCL: the build is the cause, not the platform
        return [Check(FAIL, "backend", f"{how}: this torch is a CPU build, without CUDA or NCCL",
                      "torch's CPU build (a '+cpu' version, torch.version.cuda is None) cannot run on GPUs",
                      "install the CUDA build of torch for your driver (README: GPU machines), or use --device cpu")]
    if backend == "nccl" and not nccl_available:
        return [Check(FAIL, "backend", f"{how}: this torch build has no NCCL",
                      "torch was built without NCCL (e.g. Windows or macOS builds)",
                      "install a Linux CUDA build of torch, or use --backend gloo (slow on GPUs)")]
    if backend == "gloo" and not gloo_available:
        return [Check(FAIL, "backend", f"{how}: this torch build has no gloo", "torch was built without gloo",
                      "install an official torch build (they include gloo)")]
    if backend == "gloo" and on_cuda:
        return [Check(WARN, "backend", f"{how}: works but slow",
                      "gloo copies every GPU tensor through host memory and reduces on the CPU",
                      "use --backend nccl or auto (parallel.backend=nccl or auto for training)")]
    return [Check(PASS, "backend", how)]


def environment_checks(environ: Mapping[str, str], nproc: int, cores: int, backend: str) -> list[Check]:
    """One line per distributed-related variable that is set, and OMP_NUM_THREADS against the cores."""
    from ganscale.fault import INJECT_ENV
    from ganscale.launch import environment_errors

    malformed = environment_errors(environ)  # what `ganscale train` refuses
    names = [n for n in ENV_EXPLANATIONS if n in environ]
    names += sorted(n for n in environ if (n.startswith("NCCL_") or n.startswith("TORCH_NCCL_")) and n not in names)
    checks = []
    for name in names:
        value = environ[name]
        explanation = ENV_EXPLANATIONS.get(name, "an NCCL setting (see NCCL's / torch's environment variable docs)")
        shown = value if value and not re.search(r"\s", value) else repr(value)
        label, detail = f"env {name}={shown}", explanation
        unused = " (no effect on this gloo run, but on every NCCL run from this shell)" if backend != "nccl" else ""
        if name in malformed:
            checks.append(Check(FAIL, label, detail, f"{malformed[name].problem}: `ganscale train` refuses it",
                                malformed[name].fix))
        elif name == "NCCL_P2P_DISABLE" and value.strip() not in ("", "0"):
            checks.append(Check(WARN, label, detail,
                                "P2P disabled: intra-node traffic goes through host memory" + unused,
                                "unset NCCL_P2P_DISABLE unless P2P is broken on this machine (then fix the "
                                "IOMMU/ACS settings or driver)"))
        elif name == "NCCL_SHM_DISABLE" and value.strip() not in ("", "0"):
            checks.append(Check(WARN, label, detail,
                                "intra-node traffic without P2P falls back to the network" + unused,
                                "unset NCCL_SHM_DISABLE (in containers, give /dev/shm enough space instead)"))
        elif name in ("NCCL_ALGO", "NCCL_PROTO"):
            checks.append(Check(WARN, label, detail, "forced NCCL tuning is usually slower than NCCL's own choice",
                                f"unset {name} unless you are debugging NCCL"))
        elif name in ("NCCL_ASYNC_ERROR_HANDLING", "NCCL_BLOCKING_WAIT"):
            checks.append(Check(WARN, label, detail, f"{name} is a deprecated name",
                                f"use TORCH_{name} instead"))
        elif name == "TORCH_NCCL_ASYNC_ERROR_HANDLING" and value.strip() == "0":
            checks.append(Check(WARN, label, detail, "a failed or timed-out NCCL collective leaves every rank waiting",
                                "unset it (default 3: abort and stop the process, so the launcher ends the job)"))
        elif name == "TORCH_DISTRIBUTED_DEBUG" and value.strip().upper() == "DETAIL":
            checks.append(Check(WARN, label, detail, "DETAIL adds a check to every collective: slower training",
                                "unset it (or INFO) outside debugging sessions"))
        elif name == "CUDA_LAUNCH_BLOCKING" and value.strip() not in ("", "0"):
            checks.append(Check(WARN, label, detail, "every CUDA kernel waits for the previous one",
                                "unset CUDA_LAUNCH_BLOCKING outside debugging sessions"))
        elif name == INJECT_ENV:
            checks.append(Check(WARN, label, detail, "training runs from this shell will fail on purpose",
                                f"unset {INJECT_ENV}"))
        elif name in _LAUNCHER_VARIABLES:
            as_worker = "RANK" in environ and "MASTER_ADDR" in environ
            checks.append(Check(WARN, label, detail,
                                "a launcher variable in an interactive shell" + (
                                    ": with RANK and MASTER_ADDR set, `ganscale train` (even with --nproc) acts as "
                                    "one worker of a group described by them instead of starting its own"
                                    if as_worker else ""),
                                f"unset {' '.join(n for n in _LAUNCHER_VARIABLES if n in environ)}"))
        elif name == "OMP_NUM_THREADS":
            checks.append(_omp_check(value, nproc, cores, label, detail))
        else:
            checks.append(Check(PASS, label, detail))
    if "OMP_NUM_THREADS" not in environ:
        if nproc > 1:
            checks.append(Check(WARN, "env OMP_NUM_THREADS", f"unset: {ENV_EXPLANATIONS['OMP_NUM_THREADS']}",
                                f"a process started by another launcher uses every core ({cores}) for math: "
                                f"{nproc} processes oversubscribe the CPU",
                                f"export OMP_NUM_THREADS={max(1, cores // nproc)} (cores / ranks)"))
        else:
            checks.append(Check(PASS, "env OMP_NUM_THREADS", "unset: one process uses every core"))
    return checks


def slurm_checks(environ: Mapping[str, str]) -> list[Check]:
    """Inside a Slurm allocation: its layout, and the classic mistakes with their fix; [] outside one."""
    from ganscale.launch import environment_errors, environment_integer
    from ganscale.config import ConfigError
    from ganscale.slurm import tasks_per_node, first_host

    if "SLURM_JOB_ID" not in environ:
        return []
    malformed = {name: e for name, e in environment_errors(environ).items() if name.startswith("SLURM_")}
    if malformed:  # no layout to report: the values it is made of are what `ganscale train` refuses
        return [Check(FAIL, "slurm layout", f"job {environ['SLURM_JOB_ID']}: {name}={environ[name]!r}",
                      f"{e.problem}: `ganscale train` refuses it", e.fix) for name, e in malformed.items()]
    tasks = environment_integer(environ, "SLURM_NTASKS", 1)
    per_node = tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", str(tasks)))
    gpus = environment_integer(environ, "SLURM_GPUS_ON_NODE", 0)
    nodelist = "SLURM_JOB_NODELIST" if environ.get("SLURM_JOB_NODELIST") else "SLURM_NODELIST"
    try:
        host = first_host(environ.get(nodelist) or "localhost", nodelist)
    except ConfigError as e:
        return [Check(FAIL, "slurm layout", f"job {environ['SLURM_JOB_ID']}: {nodelist}={environ[nodelist]!r}",
                      f"{e.problem}: `ganscale train` refuses it", e.fix)]
    layout = (f"job {environ['SLURM_JOB_ID']}: {environ.get('SLURM_NNODES', '1')} node(s), {tasks} task(s) "
              f"({per_node} per node), {gpus} GPU(s) per node, rendezvous on {host}")
    checks = [Check(PASS, "slurm layout", layout)]
    if tasks > 1 and "SLURM_STEP_ID" not in environ:
        checks.append(Check(WARN, "slurm srun", "this is the batch shell of a multi-task job",
                            "`ganscale train` here runs outside srun, and is refused",
                            "start it with `srun ganscale train ...` or submit with `ganscale slurm`"))
    if gpus and per_node > 1 and per_node != gpus:
        checks.append(Check(FAIL, "slurm tasks", f"{per_node} tasks per node on {gpus} GPUs per node",
                            "`srun ganscale train` starts one process per task and needs one per GPU",
                            f"ask for --ntasks-per-node={gpus}, or one task per node running torchrun (`ganscale slurm`)"))
    if gpus and per_node == 1 and tasks > 1:
        checks.append(Check(WARN, "slurm tasks", f"one task per node on {gpus} GPUs per node",
                            "`srun ganscale train` would use one GPU per node",
                            "run torchrun in the task (`ganscale slurm` writes that script)"))
    return checks


def _omp_check(value: str, nproc: int, cores: int, label: str, detail: str) -> Check:
    try:
        threads = int(value)
        if threads < 1:
            raise ValueError
    except ValueError:
        return Check(WARN, label, detail, f"{value!r} is not a positive integer: torch ignores it",
                     f"export OMP_NUM_THREADS={max(1, cores // nproc)} (cores / ranks)")
    if threads * nproc > cores:
        fewer = (f"export OMP_NUM_THREADS={cores // nproc} (cores / ranks)" if cores >= nproc
                 else f"run at most {cores} ranks on these {cores} cores (one thread each is the least)")
        return Check(WARN, label, f"{detail}; {threads} x {nproc} ranks = {threads * nproc} threads on {cores} cores",
                     "more threads than cores: they take turns, and every collective waits for the slowest rank", fewer)
    return Check(PASS, label, detail)


# ------------------------------------------------------------------------------------ versions
def parse_driver_version(text: str) -> str | None:
    """The driver version in /proc/driver/nvidia/version ("... Kernel Module [for x86_64]  550.54.15  ...")."""
    match = re.search(r"Kernel Module\s+(?:for\s+\S+\s+)?(\d+\.\d+(?:\.\d+)?)", text)
    return match.group(1) if match else None


def _driver_version() -> str | None:
    try:
        found = parse_driver_version(Path("/proc/driver/nvidia/version").read_text())
        if found:
            return found
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def torch_check(version: str) -> Check:
    """The torch version against ganscale's supported range (ganscale.versions), naming the features it lacks;
    older than the range is a FAIL (not supported)."""
    supported = versions.describe_range()
    lost = "; ".join(f"{name} ({versions.FEATURES[name].used_by})" for name in versions.lacking(version))
    if not versions.in_range(version):
        # a private API read only from the oldest supported release on: not known to be missing before it
        unread = ", ".join(versions.unread(version))
        return Check(FAIL, "torch", f"{version}: older than the supported range ({supported})",
                     "ganscale does not support it" + (f"; it lacks: {lost}" if lost else "")
                     + (f"; not checked whether it has: {unread}" if unread else ""),
                     f"install torch>={'.'.join(map(str, versions.OLDEST))} (the CUDA build on GPU machines)")
    if not versions.checked(version):
        return Check(WARN, "torch", f"{version}: newer than the checked range ({supported})",
                     "the private torch APIs ganscale overrides were not read in this version",
                     f"run `GANSCALE_VENV={shlex.quote(sys.prefix)} scripts/test.sh` in the ganscale checkout once "
                     "(it installs the test extras here and tests this torch); if it fails, install torch "
                     f"{'.'.join(map(str, versions.NEWEST))}")
    return Check(PASS, "torch", f"{version} (supported: {supported}; {f'lacks {lost}' if lost else 'all features'})")


def version_checks(backend: str, on_cuda: bool, cuda_available: bool, cuda_warning: str) -> list[Check]:
    import torch
    import torch.distributed as dist

    checks = [Check(PASS, "python", f"{platform.python_version()} ({sys.executable})")]
    checks.append(torch_check(torch.__version__))
    if not dist.is_available():
        checks.append(Check(FAIL, "distributed", "torch.distributed is not available in this build",
                            "torch was built without distributed support", "install an official torch build"))
    driver = _driver_version()
    cuda = torch.version.cuda
    if cuda is None and driver:
        checks.append(Check(WARN, "cuda runtime", "none: this torch is a CPU build, but an NVIDIA driver is installed",
                            "the CPU build of torch cannot use the GPUs: every run stays on the CPU",
                            f"install the CUDA build of torch {versions.DEFAULT_INSTALL} (README: GPU machines)"))
    elif cuda is None:
        checks.append(Check(PASS, "cuda runtime", "none: this torch is a CPU build"))
    elif not cuda_available:
        status = FAIL if on_cuda else WARN
        checks.append(Check(status, "cuda runtime", f"{cuda} (torch build), but CUDA is not usable",
                            cuda_warning or "no GPU visible, or the driver is missing or too old for this CUDA version",
                            "check nvidia-smi and CUDA_VISIBLE_DEVICES; install a driver that supports "
                            f"CUDA {cuda}"))
    else:
        checks.append(Check(PASS, "cuda runtime", f"{cuda} (torch build)"))
    cudnn = torch.backends.cudnn.version() if cuda is not None and torch.backends.cudnn.is_available() else None
    checks.append(Check(PASS, "cudnn", str(cudnn) if cudnn else "none" + (" (CPU build)" if cuda is None else "")))
    if cuda_available:
        try:
            nccl = ".".join(str(p) for p in torch.cuda.nccl.version()) if dist.is_nccl_available() else None
        except Exception as e:  # noqa: BLE001 - reported, not fatal here; the backend check decides
            nccl = f"unknown ({e})"
        checks.append(Check(PASS, "nccl", nccl or "not in this build"))
    else:
        checks.append(Check(PASS, "nccl", "not checked: needs CUDA"))
    checks.append(Check(PASS, "gpu driver", driver or "none found"))
    if dist.is_gloo_available():
        checks.append(Check(PASS, "gloo", "available"))
    else:
        checks.append(Check(FAIL if backend == "gloo" else WARN, "gloo", "not available in this torch build",
                            "torch was built without gloo: CPU runs cannot communicate",
                            "install an official torch build (they include gloo)"))
    return checks


def _cuda_state() -> tuple[bool, str, list[Gpu]]:
    """(CUDA usable, the warning torch gave if not, the visible GPUs)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        available = torch.cuda.is_available()
    message = " ".join(" ".join(str(w.message).split()) for w in caught)
    gpus = []
    if available:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            try:
                free = torch.cuda.mem_get_info(i)[0]
            except Exception:  # noqa: BLE001 - free memory is a nicety
                free = None
            gpus.append(Gpu(props.name, props.total_memory, free))
    return available, message, gpus


# ------------------------------------------------------------------------------------ the workers
def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _error_text(e: BaseException, limit: int = 600) -> str:
    text = " ".join("".join(traceback.format_exception_only(type(e), e)).split())
    return text if len(text) <= limit else text[:limit] + " ..."


def _worker(spec: dict[str, Any]) -> None:
    """One rank (started by the elastic agent): collective, bandwidth, GAN step; results to rank<r>.json.

    Every error is written to the rank's JSON (with a time, so the parent can tell the first failure
    from the ones it caused on other ranks) and raised again: the process exits non-zero, its
    connections close, and the agent stops the other workers at once instead of leaving them
    waiting in a collective.
    """
    rank = int(os.environ.get("RANK", "0"))
    out = Path(spec["out_dir"]) / f"rank{rank}.json"
    result: dict[str, Any] = {"rank": rank}

    def record(phase: str, data: dict) -> None:
        result[phase] = {**data, "time": time.time()}
        _write_json(out, result)

    from ganscale.launch import follow_launcher

    follow_launcher()
    record("started", {"ok": True})
    runtime = None
    try:
        import torch
        import torch.distributed as dist

        from ganscale import runtime as rt

        runtime = rt.start(spec["device"], spec["backend"], spec["timeout_s"])
        rt.calm_gloo_polling()  # as training does: the timings below are the ones a training run sees
        world, device = runtime.world, runtime.device
        record("group", {"ok": True, "world": world, "device": str(device)})

        phase = "collective"
        record(phase, {"running": True})
        index = torch.arange(PATTERN_ELEMENTS, device=device) % PATTERN_PERIOD + 1
        tensor = (index * (rank + 1)).float()
        dist.all_reduce(tensor)
        expected = (index * (world * (world + 1) // 2)).float()
        wrong = (tensor != expected).nonzero()
        mismatch = None
        if len(wrong):
            i = int(wrong[0])
            mismatch = (f"{len(wrong)} of {PATTERN_ELEMENTS} elements wrong on rank {rank}; first at {i}: "
                        f"got {float(tensor[i])}, expected {float(expected[i])}")
        any_wrong = torch.tensor([0.0 if mismatch is None else 1.0], device=device)
        dist.all_reduce(any_wrong, op=dist.ReduceOp.MAX)  # every rank agrees whether to go on
        record(phase, {"ok": mismatch is None, "error": mismatch, "elements": PATTERN_ELEMENTS,
                       "any_rank_wrong": bool(any_wrong.item())})

        phase = "bandwidth"
        record(phase, {"running": True})
        payload = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32, device=device)
        seconds = _all_reduce_seconds(payload, TIMED_ITERS)
        latency = _all_reduce_seconds(torch.zeros(LATENCY_BYTES // 4, dtype=torch.float32, device=device),
                                      LATENCY_ITERS)
        record(phase, {"ok": True, "seconds": seconds, "bytes": BANDWIDTH_BYTES, "world": world,
                       "latency_seconds": latency})

        phase = "gan"
        record(phase, {"running": True})
        if any_wrong.item():
            record(phase, {"ok": False, "skipped": "the all-reduce gave wrong results"})
        else:
            record(phase, _gan_step(spec, runtime))
        dist.barrier()  # no rank tears down its connections while a peer still uses them
        record("finished", {"ok": True})
    except BaseException as e:
        record(locals().get("phase", "group"), {"ok": False, "error": _error_text(e)})
        traceback.print_exc()  # into this worker's stderr.log, kept when a check fails
        raise
    runtime.close()


def _all_reduce_seconds(tensor, iters: int) -> float:
    """Collective: seconds per all-reduce of `tensor`, `iters` timed after WARMUP_ITERS; the slowest rank's time."""
    import torch
    import torch.distributed as dist

    sync = torch.cuda.synchronize if tensor.device.type == "cuda" else (lambda: None)
    for _ in range(WARMUP_ITERS):
        dist.all_reduce(tensor)
    sync()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(tensor)
    sync()
    elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    return float(elapsed.item()) / iters


def gan_overrides(spec: dict[str, Any], nproc: int) -> list[str]:
    """The tiny config of the GAN-step check (default recipe, width 8, 2 steps, 4 samples per rank)."""
    return ["train.steps=2", "model.g_width=8", "model.d_width=8", f"train.batch_size={4 * nproc}",
            "log.tensorboard=false", "log.sample_every=0", "log.samples=4", "log.every=1", "checkpoint.every=0",
            f"train.device={spec['device']}", f"parallel.backend={spec['backend']}",
            f"parallel.timeout_s={spec['timeout_s']}", f"fault.hang_timeout_s={spec['timeout_s']}"]


def _gan_step(spec: dict[str, Any], runtime) -> dict[str, Any]:
    import torch

    from ganscale import config, preflight
    from ganscale.checkpointer import check_replicas
    from ganscale.trainer import Trainer

    started = time.perf_counter()
    cfg = config.load(None, gan_overrides(spec, runtime.world))
    preflight.check(cfg, runtime.world, torch.cuda.is_available())
    trainer = Trainer(cfg, runtime, Path(spec["out_dir"]) / "run")
    summary = trainer.fit()
    check_replicas({"G": trainer.G.replicated(), "D": trainer.D.replicated(),
                    "G_ema": trainer.G.replicated(trainer.G_ema)})
    final = summary.get("final") or {}
    return {"ok": True, "steps": summary["steps"], "global_batch": summary["global_batch"],
            "micro_batch": summary["micro_batch"], "skipped_steps": summary["skipped_steps"],
            "loss_d": final.get("loss_d"), "loss_g": final.get("loss_g"), "seconds": time.perf_counter() - started}


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(line.strip() for line in text[-lines:])


def multiprocess_checks(nproc: int, on_cuda: bool, backend: str) -> list[Check]:
    """Checks 5 and 6: one launch of `nproc` workers through torch's elastic launcher."""
    import logging

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from ganscale.launch import local_agent

    device = "cuda" if on_cuda else "cpu"
    where = f"{_ranks(nproc)}, {backend} on {device}"
    with tempfile.TemporaryDirectory(prefix="ganscale-doctor-") as tmp:
        spec = {"out_dir": tmp, "device": device, "backend": backend, "timeout_s": TIMEOUT_S}
        logs = Path(tmp) / "logs"
        config = local_agent(nproc, logs_specs=DefaultLogsSpecs(log_dir=str(logs), redirects=Std.ALL))
        launch_error, exit_codes = None, {}
        quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.multiprocessing")]
        levels = [logger.level for logger in quiet]
        for logger in quiet:
            logger.setLevel(logging.CRITICAL)  # failures are reported below, with their cause
        try:
            elastic_launch(config, _worker)(spec)
        except ChildFailedError as e:
            exit_codes = {rank: (failure.exitcode, failure.timestamp) for rank, failure in e.failures.items()}
        except SignalException:
            raise
        except Exception as e:  # noqa: BLE001 - rendezvous or agent failure
            launch_error = _error_text(e)
        finally:
            for logger, level in zip(quiet, levels):
                logger.setLevel(level)
        results = {}
        for rank in range(nproc):
            path = Path(tmp) / f"rank{rank}.json"
            if path.exists():
                results[rank] = json.loads(path.read_text())
        stderr_tails = {int(p.parent.name): _tail(p) for p in logs.glob("*/attempt_*/*/stderr.log")}
        checks = _interpret(nproc, where, results, exit_codes, launch_error, stderr_tails)
        if any(c.status == FAIL for c in checks) and logs.is_dir():
            kept = tempfile.mkdtemp(prefix="ganscale-doctor-logs-")  # outlives the temporary directory
            shutil.copytree(logs, kept, dirs_exist_ok=True)
            for check in checks:
                if check.status == FAIL:
                    check.fix += f" (the workers' full output is under {kept})"
    return checks


_PHASE_NAMES = {"started": "process-group start", "group": "all_reduce", "collective": "all_reduce",
                "bandwidth": "bandwidth", "gan": "gan step", "finished": "shutdown"}


def _last_phase(result: dict) -> str:
    """The check a rank was in when it last reported."""
    return _PHASE_NAMES[max((v["time"], k) for k, v in result.items() if isinstance(v, dict) and "time" in v)[1]]


def _first_error(results: dict[int, dict], phases: tuple[str, ...], exit_codes: dict[int, tuple[int, float]],
                 stderr_tails: dict[int, str]) -> str:
    """The root cause: a rank that died on its own without reporting (a crash, kill -9, the hang
    watchdog; the others' errors follow from it), else the earliest error any rank recorded, else a
    rank the agent stopped."""
    errors = [(r[p]["time"], rank, p, r[p]["error"]) for rank, r in results.items() for p in phases
              if p in r and r[p].get("error")]
    silent = {rank: code for rank, code in exit_codes.items() if rank not in {e[1] for e in errors}}
    died = {rank: code for rank, code in silent.items() if code[0] != -signal.SIGTERM} or (silent if not errors else {})
    if died:
        rank, (code, _) = min(died.items(), key=lambda item: (item[1][0] < 0, item[1][1]))
        during = f" during the {_last_phase(results[rank])} check" if rank in results else " before it started"
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        tail = stderr_tails.get(rank, "")
        return f"rank {rank} {how}{during}" + (f": {tail}" if tail else "")
    if errors:
        _, rank, _, text = min(errors)
        others = sorted({e[1] for e in errors} - {rank})
        return f"rank {rank}: {text}" + (f" (then rank(s) {', '.join(map(str, others))} failed too)" if others else "")
    return "a worker stopped without reporting (see the workers' output)"


def _interpret(nproc: int, where: str, results: dict[int, dict], exit_codes: dict[int, tuple[int, float]],
               launch_error: str | None, stderr_tails: dict[int, str]) -> list[Check]:
    phases = ("group", "collective", "bandwidth", "gan")
    launch_fix = ("run `ganscale doctor --nproc 1`; check that the loopback interface (lo, 127.0.0.1) is up and "
                  "that GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME, if set, name a reachable interface")
    if launch_error:
        return [Check(FAIL, "all_reduce", f"{where}: the elastic launcher failed", launch_error, launch_fix),
                Check(SKIP, "bandwidth", "not measured", "the workers did not start", "fix the FAIL above"),
                Check(SKIP, "gan step", "not run", "the workers did not start", "fix the FAIL above")]
    cause = _first_error(results, phases, exit_codes, stderr_tails)
    rank0 = results.get(0, {})
    checks = []

    def done(phase: str) -> bool:
        return len(results) == nproc and all(r.get(phase, {}).get("ok") for r in results.values())

    if done("collective"):
        elements = rank0["collective"]["elements"]
        checks.append(Check(PASS, "all_reduce", f"{where}: exact result ({elements:,} elements, "
                                                f"sum of (i % {PATTERN_PERIOD} + 1) x (rank + 1))"))
    else:
        group_failed = not done("group")
        checks.append(Check(FAIL, "all_reduce", f"{where}: " + ("the process group did not start" if group_failed
                                                              else "wrong result or error"), cause,
                            launch_fix if group_failed else
                            "run with NCCL_DEBUG=INFO (NCCL) or TORCH_DISTRIBUTED_DEBUG=DETAIL and look at the first "
                            "error; try NCCL_P2P_DISABLE=1 to test a broken peer-to-peer path"))
    if done("bandwidth") and nproc == 1:
        checks.append(Check(PASS, "bandwidth",
                            "1 rank: an all_reduce moves no data; use --nproc 2 or more to measure it"))
    elif done("bandwidth"):
        b = rank0["bandwidth"]
        algbw = algorithm_bandwidth(b["bytes"], b["seconds"])
        busbw = bus_bandwidth(algbw, b["world"])
        latency = (f"; a {LATENCY_BYTES // 1024} KiB all_reduce takes {b['latency_seconds'] * 1e3:.2f} ms, which "
                   "DDP pays about once per network per step whatever the model's size"
                   if "latency_seconds" in b else "")
        checks.append(Check(PASS, "bandwidth", f"all_reduce {b['bytes'] // 2**20} MiB in {b['seconds'] * 1e3:.2f} ms: "
                                               f"algbw {algbw / 1e9:.2f} GB/s, busbw {busbw / 1e9:.2f} GB/s "
                                               f"({TIMED_ITERS} timed after {WARMUP_ITERS} warm-up, slowest rank)"
                                               + latency))
    elif checks[-1].status == FAIL:
        checks.append(Check(SKIP, "bandwidth", "not measured", "the all_reduce check failed", "fix the FAIL above"))
    else:
        checks.append(Check(FAIL, "bandwidth", f"{where}: the timed all_reduce failed", cause,
                            "run with NCCL_DEBUG=INFO (NCCL) and look at the first error"))
    if done("gan"):
        g = rank0["gan"]
        replicas = "G, D, G_ema bitwise identical on every rank" if nproc > 1 else "1 rank: no replicas to compare"
        checks.append(Check(PASS, "gan step", f"{g['steps']} steps of a width-8 DCGAN, "
                                              f"global batch {g['global_batch']} "
                                              f"({nproc} x {g['micro_batch']}), {g['seconds']:.1f} s; {replicas}"))
    elif any(r.get("gan", {}).get("skipped") for r in results.values()) or checks[-1].status in (FAIL, SKIP):
        checks.append(Check(SKIP, "gan step", "not run", "a collective check above failed", "fix the FAIL above"))
    else:
        checks.append(Check(FAIL, "gan step", f"{where}: training or the replica check failed", cause,
                            "the text above names the rank and the error; run `ganscale train --nproc N` with "
                            "--set train.steps=2 to see the full output"))
    if exit_codes and done("finished"):
        rank, (code, _) = min(exit_codes.items())
        checks.append(Check(WARN, "worker exit", f"every check finished, then rank {rank} exited with code {code}",
                            "a worker died while shutting down, after its work was done",
                            "nothing to do if it is rare; if it repeats, run the same `ganscale train --nproc N` "
                            "and watch the workers' exit"))
    return checks


# ------------------------------------------------------------------------------------ the command
def run(nproc: int | None = None, backend: str = "auto", device: str = "auto",
        echo: Callable[[str], None] = print) -> int:
    """Run every check, print one line per check; 0 when nothing FAILed or was SKIPped, else 1."""
    environ = dict(os.environ)  # before the launch below changes OMP_NUM_THREADS
    cuda_available, cuda_warning, gpus = _cuda_state() if device != "cpu" else (False, "", [])
    import torch
    import torch.distributed as dist

    on_cuda, chosen = resolve(device, backend, cuda_available)
    if nproc is None:
        nproc = len(gpus) if on_cuda and gpus else 2
    cores = usable_cores()
    checks: list[Check] = []

    def emit(new: list[Check]) -> None:
        for check in new:
            checks.append(check)
            for line in check.lines():
                echo(line)

    emit(version_checks(chosen, on_cuda, cuda_available, cuda_warning))
    emit(device_checks(nproc, device, on_cuda, cuda_available, torch.version.cuda, gpus, environ, cores, cuda_warning))
    emit(backend_checks(backend, chosen, on_cuda, dist.is_available() and dist.is_nccl_available(),
                        dist.is_available() and dist.is_gloo_available(), torch.version.cuda is not None))
    emit(environment_checks(environ, nproc, cores, chosen))
    emit(slurm_checks(environ))
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        reason = f"FAIL above: {', '.join(dict.fromkeys(failed))}"
        emit([Check(SKIP, "all_reduce", f"not run on {_ranks(nproc)}", reason, "fix the FAIL above"),
              Check(SKIP, "bandwidth", "not measured", reason, "fix the FAIL above"),
              Check(SKIP, "gan step", "not run", reason, "fix the FAIL above")])
    else:
        if "OMP_NUM_THREADS" not in os.environ:  # what `ganscale train --nproc` does (launch.launch_local)
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
        from torch.distributed.elastic.multiprocessing.api import SignalException

        try:
            emit(multiprocess_checks(nproc, on_cuda, chosen))
        except SignalException as e:  # Ctrl-C or SIGTERM: the agent stopped the workers
            echo(f"doctor: interrupted ({e.sigval.name}); the workers were stopped")
            return 1
    counts = {s: sum(c.status == s for c in checks) for s in (PASS, WARN, FAIL, SKIP)}
    ok = counts[FAIL] == 0 and counts[SKIP] == 0
    echo(f"doctor: {counts[PASS]} passed, {counts[WARN]} warning{'s' * (counts[WARN] != 1)}, {counts[FAIL]} failed, "
         f"{counts[SKIP]} skipped: "
         + ("OK" if ok else "NOT OK") + (" (WARN does not fail the doctor)" if ok and counts[WARN] else ""))
    return 0 if ok else 1
