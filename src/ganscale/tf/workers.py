"""The tensorflow engine across processes: one MultiWorkerMirroredStrategy worker per launcher worker.

The workers are started as the torch engine's are (`train --workers N` through torch's elastic launcher on the
loopback, or torchrun / Slurm across nodes), and find each other the same way: a gloo process group on the
launcher's store, used only before training, to decide the run directory on rank 0 (`rundir.decide_run`) and to
gather every worker's TensorFlow server address. Rank r becomes TF_CONFIG's worker r (worker 0 is the chief); the
training's collectives are TensorFlow's own, between those servers.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import torch.distributed as dist

from ganscale import preflight, runlock
from ganscale import runtime as rt
from ganscale.config import Config, ConfigError
from ganscale.fault import every_rank_or_none
from ganscale.rundir import decide_run


def tf_config(addresses: list[str], rank: int) -> dict:
    """TF_CONFIG of worker `rank` in the cluster of `addresses` (host:port, in rank order)."""
    return {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}


def own_address() -> str:
    """host:port this worker's TensorFlow server listens on: the local address that reaches MASTER_ADDR (the
    loopback when the launcher's store is on it, else the interface towards the first node), and a port free
    there now. TensorFlow binds it itself a moment later and takes no open socket, so another program could take
    the port between the two: the run then fails to start, and starting it again picks another."""
    master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
        route.connect(master)  # no packet sent: the kernel only picks the interface
        host = route.getsockname()[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return f"{host}:{probe.getsockname()[1]}"


def check_workers(cfg: Config, nproc: int | None) -> None:
    """What worker processes need: no --nproc, and the user's consent to TensorFlow's open servers (asked second:
    its fix offers --nproc instead)."""
    if nproc:
        raise ConfigError("--nproc", "each tensorflow worker process trains on all its GPUs, or on its CPU as one "
                          "replica, so --nproc cannot also split it", "drop --nproc when starting workers")
    if not cfg.parallel.tf_open_servers:
        raise ConfigError("parallel.tf_open_servers", "TensorFlow's worker servers listen on every interface of "
                          "their host, without authentication (anyone who reaches the port can run code in a "
                          "worker)", "use --nproc N (replicas in one process, no server), or set "
                          "parallel.tf_open_servers=true on hosts whose firewall admits only the other workers")


def join(cfg: Config, run_dir: str | None, resume: str | None):
    """In a launcher worker: (strategy, run directory, resume point, rank 0's hold on the run directory or None,
    this worker's rank (0: the chief), the number of workers). Raises on every worker alike what rank 0 refused."""
    from ganscale.tf import devices

    control = rt.start("cpu", "gloo", cfg.parallel.timeout_s)
    rt.calm_gloo_polling()
    gpus = devices.worker_gpus(cfg.train.device)
    with every_rank_or_none("start"):  # a refusal on one node only (its data.path) ends every worker, named
        preflight.check(cfg, control.world * max(gpus, 1), gpus > 0)
    path, source, held = decide_run(cfg, run_dir, resume)
    if held is None and control.rank == 0:  # the `--workers` launcher holds it: the chief watches its hold
        held = runlock.watch_parent_hold(Path(path))
    addresses: list = [None] * control.world
    dist.all_gather_object(addresses, own_address())  # one collective: every worker's server, in rank order
    os.environ["TF_CONFIG"] = json.dumps(tf_config(addresses, control.rank))
    return devices.multi_worker(), Path(path), source, held, control.rank, control.world
