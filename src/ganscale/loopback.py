"""The rendezvous of a single-machine launch (`train --nproc`, `doctor --nproc`): torch's c10d rendezvous,
with both TCP stores of its agent (the rendezvous store, and the store the workers find at MASTER_ADDR) listening
on 127.0.0.1 only. A TCPStore server listens on every interface, so any host could read and write its keys.

Registered with torch's rendezvous handler registry as RENDEZVOUS; multi-node runs use torchrun's own.
"""

from __future__ import annotations

import datetime
import inspect
import socket

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

ADDRESS = "127.0.0.1"
RENDEZVOUS = "ganscale-loopback"
STORE_READ_TIMEOUT_S = 60  # the c10d rendezvous store's default read timeout


def loopback_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """A TCPStore server on a free port of 127.0.0.1: it takes over a socket bound there (master_listen_fd)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((ADDRESS, 0))
    listener.listen(socket.SOMAXCONN)
    port = listener.getsockname()[1]
    return dist.TCPStore(ADDRESS, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=listener.detach())


def overridable() -> None:
    """The private method LoopbackRendezvousHandler overrides, as torch 2.11-2.14 define it: a torch that renamed
    it would silently skip the override and open the workers' store on every interface: refused (exit 2) instead."""
    method = getattr(DynamicRendezvousHandler, "_create_tcp_store_server", None)
    if method is None or list(inspect.signature(method).parameters) != ["self", "master_addr", "master_port"]:
        import torch

        from ganscale.config import ConfigError
        from ganscale.versions import describe_range

        raise ConfigError("--nproc", f"torch {torch.__version__}'s DynamicRendezvousHandler has no "
                          "_create_tcp_store_server(master_addr, master_port): its launch could not keep the "
                          "workers' store on 127.0.0.1", f"install {describe_range()}, or start the workers with "
                          "torchrun instead of --nproc")


class LoopbackRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous; the store it shares with its workers (MASTER_ADDR/PORT) is on the loopback."""

    def _create_tcp_store_server(self, master_addr, master_port) -> dist.TCPStore:
        return loopback_store()

    def get_backend(self) -> str:
        return RENDEZVOUS  # the registry checks that a handler is the backend it was asked for


def create_handler(params: RendezvousParameters) -> LoopbackRendezvousHandler:
    store = loopback_store(STORE_READ_TIMEOUT_S)
    return LoopbackRendezvousHandler.from_backend(params.run_id, store, C10dRendezvousBackend(store, params.run_id),
                                                  params.min_nodes, params.max_nodes, ADDRESS)


def register() -> None:
    """Make RENDEZVOUS known to torch's elastic launcher (again: a no-op)."""
    overridable()
    rendezvous_handler_registry.register(RENDEZVOUS, create_handler)
