"""Process group, device and seeds of one worker.

Under torchrun or `--nproc`, RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* come from the elastic launcher;
a plain `ganscale train` runs as a one-process group so the trainer has a single code path.
"""

from __future__ import annotations

import datetime
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from ganscale.config import ConfigError, ParallelConfig
from ganscale.fault import check_in


FLIGHT_RECORDER_ENTRIES = 2000
# How long a rank refused before it read its config waits for its peers at the check-in.
DEFAULT_TIMEOUT_S = ParallelConfig.model_fields["timeout_s"].default


@dataclass
class Runtime:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    owns_group: bool
    # The hook before init_process_group, which chains its own "[rankN]:" one: put back at close, or every
    # in-process run of the Python API added a prefix to the process's uncaught errors.
    excepthook: Callable | None = None
    # The global RNG states (torch's, CUDA's, numpy's, Python's) before training seeded them: put back at close,
    # or an in-process run of the Python API reseeded its caller's random numbers.
    rng_states: tuple | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
        if self.excepthook is not None:
            sys.excepthook = self.excepthook
        if self.rng_states is not None:
            torch_state, cuda_states, numpy_state, python_state = self.rng_states
            torch.set_rng_state(torch_state)
            if cuda_states is not None:
                torch.cuda.set_rng_state_all(cuda_states)
            np.random.set_state(numpy_state)
            random.setstate(python_state)
            self.rng_states = None


def global_rng_states(use_cuda: bool) -> tuple:
    """(torch's, every CUDA device's or None, numpy's, Python's) global RNG state."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state_all() if use_cuda else None, np.random.get_state(),
            random.getstate())


def environment_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def gpu_of(local_rank: int, visible: int, narrowed: bool = False) -> int:
    """This rank's GPU: its LOCAL_RANK among the GPUs the node shows; the only one when the launcher shows each
    task just its own (`narrowed`: Slurm's --gpus-per-task=1; torchrun never does). More local ranks than GPUs
    is a ConfigError (it was CUDA's 'invalid device ordinal', or NCCL's 'Duplicate GPU detected')."""
    if visible == 1 and narrowed:
        return 0
    if local_rank >= visible:
        raise ConfigError("LOCAL_RANK", f"local rank {local_rank}, but this node shows {visible} GPU(s): each rank "
                          "needs its own", f"start at most {visible} ranks per node, or show more GPUs "
                          "(CUDA_VISIBLE_DEVICES)")
    return local_rank


def backend_for(backend: str, use_cuda: bool, cpu_collectives: bool = False) -> str:
    """The process group's backend: NCCL on GPUs, gloo on CPUs ('auto'). `cpu_collectives` (FSDP2's CPU offload,
    whose gradients live in host memory: their norm and fp16's inf check are all-reduced there) adds gloo for
    CPU tensors beside NCCL, which has no CPU backend."""
    chosen = backend if backend != "auto" else ("nccl" if use_cuda else "gloo")
    return "cpu:gloo,cuda:nccl" if chosen == "nccl" and cpu_collectives else chosen


def uses_cuda(device: str) -> bool:
    """Whether `train.device` puts this run on a GPU."""
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def in_launched_group() -> bool:
    """Whether the environment names a group to join (torchrun's, srun's adopted, `--nproc`'s variables)."""
    return "RANK" in os.environ and "MASTER_ADDR" in os.environ


def launcher_store(timeout_s: float) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) of the group the environment names, found as init_process_group finds it: the
    store of torchrun's agent, or one that rank 0 serves."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
    store.set_timeout(timeout)
    return store, rank, world


def start(device: str = "auto", backend: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S,
          cpu_collectives: bool = False) -> Runtime:
    use_cuda = uses_cuda(device)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        narrowed = "TORCHELASTIC_RUN_ID" not in os.environ  # another launcher may show each task its own GPU
        dev = torch.device("cuda", gpu_of(local_rank, torch.cuda.device_count(), narrowed))
        torch.cuda.set_device(dev)  # one GPU per rank; without it every rank lands on GPU 0
    else:
        dev = torch.device("cpu")
    owns = not dist.is_initialized()
    excepthook = sys.excepthook if owns else None
    # PyTorch's flight recorder keeps each process group's last collectives (NCCL's and gloo's); the hang
    # watchdog writes it to RUN_DIR/diagnostics/. It must be sized before the group is made.
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    if owns:
        chosen = backend_for(backend, use_cuda, cpu_collectives)
        timeout = datetime.timedelta(seconds=timeout_s)
        if in_launched_group():
            store, rank, world = launcher_store(timeout_s)
            if (refused := check_in(store, rank, world)) is not None:
                raise refused  # another rank could not start: every rank leaves now, named
            dist.init_process_group(chosen, store=store, rank=rank, world_size=world, timeout=timeout,
                                    device_id=dev if use_cuda else None)
        else:
            dist.init_process_group(chosen, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Runtime(dist.get_rank(), dist.get_world_size(), local_rank, dev, owns, excepthook,
                   global_rng_states(use_cuda) if owns else None)


GLOO_POLLING_THREAD = "gloo_tcp_loop"
_EPOLL_WAITS = ("do_epoll_wait", "ep_poll")  # the kernel's wait channel of a thread blocked in epoll_wait


def gloo_polling_threads(looks: int = 5) -> list[int]:
    """Thread ids of gloo's TCP event-loop threads in this process (Linux; elsewhere none).

    torch 2.13 names them `gloo_tcp_loop`. torch 2.11 leaves them unnamed, so each carries the name of the thread
    that made the process group (the main thread's, or a gloo worker's): there they are the threads of such a name
    seen waiting in epoll, which gloo's workers (a futex) and the main thread never do. A loop is busy at times,
    so it is looked for `looks` times, 1 ms apart.
    """
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return []
    found: set[int] = set()
    for look in range(looks):
        if look:
            time.sleep(0.001)
        threads = {}
        for task in tasks.iterdir():
            try:
                threads[int(task.name)] = ((task / "comm").read_text().strip(), (task / "wchan").read_text().strip())
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
        named = [tid for tid, (name, _) in threads.items() if name == GLOO_POLLING_THREAD]
        if named:
            return named
        inherited = {threads.get(os.getpid(), ("", ""))[0], "pt_gloo_runloop"}
        found |= {tid for tid, (name, wait) in threads.items()
                  if tid != os.getpid() and name in inherited and wait in _EPOLL_WAITS}
    return sorted(found)


def calm_gloo_polling() -> int:
    """Lower the scheduling priority (nice 19) of gloo's TCP event-loop threads in this process; returns how
    many it lowered.

    Each gloo process group runs one such thread, which spins on epoll (pytorch/gloo#246) and took ~20% of a
    core per rank here; with as many ranks as cores it takes those cycles from the ranks' compute: a 2-process
    DDP step on 2 cores cost 1.99x a 1-process step before, 1.31x after (`ganscale bench scaling`,
    benchmarks/results/bench-scaling-20261122-133838 and -134228).
    At nice 19 it still runs whenever a core is free, which is when ranks wait in a collective. Call it after
    the process groups exist (a new group brings a new thread). Linux only; elsewhere, and without gloo, a no-op.
    """
    lowered = 0
    for tid in gloo_polling_threads():
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < 19:
                os.setpriority(os.PRIO_PROCESS, tid, 19)  # per thread on Linux: a TID is a PRIO_PROCESS id
                lowered += 1
        except OSError:  # the thread ended meanwhile, or the system refuses: leave it
            continue
    return lowered


def seed_rank_streams(seed: int, runtime: Runtime) -> None:
    """Per-rank RNG (dropout, augmentation): seed * world + rank, so ranks differ and runs repeat."""
    stream = seed * runtime.world + runtime.rank  # a derived seed (a resume under another world size) is ~2**63
    torch.manual_seed(stream % 2**64)
    np.random.seed(stream % 2**32)
