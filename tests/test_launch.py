"""The single-machine launcher (`train --nproc`, `doctor --nproc`) lets nobody in: what it and its workers
listen on, read from the kernel's socket tables."""

from __future__ import annotations

import ipaddress
import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from ganscale import versions
from ganscale.config import ConfigError
from test_faults import endless_ring8, start_training, worker_pids

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/net tables")]


def listening_addresses(pid: int) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The local addresses of the TCP sockets (IPv4 and IPv6) that process `pid` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            _, local, _, state, *_, inode = line.split()[:10]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                found.append(_address(local.split(":")[0]))
    return found


def _address(hexadecimal: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp* print it: each 32-bit word in this machine's byte order."""
    raw = bytes.fromhex(hexadecimal)
    if sys.byteorder == "little":
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(raw)
    return getattr(address, "ipv4_mapped", None) or address


def _listening_in_worker() -> dict[str, list[str]]:
    """Run in a worker of `local_agent`, after its process group exists: what it and its launcher listen on."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()  # every rank's gloo connections exist
    found = {"launcher": [str(a) for a in listening_addresses(os.getppid())],
             "worker": [str(a) for a in listening_addresses(os.getpid())]}
    dist.barrier()  # no rank closes its sockets while a peer still reads the tables
    dist.destroy_process_group()
    return found


def test_the_local_launchers_stores_and_its_workers_gloo_listen_on_the_loopback_only():
    """The agent's two TCP stores (rendezvous, and the workers' MASTER_ADDR) and each worker's gloo sockets
    (`doctor --nproc` launches with the same settings as `train --nproc`)."""
    from torch.distributed.launcher.api import elastic_launch

    from ganscale.launch import local_agent

    found = elastic_launch(local_agent(2), _listening_in_worker)()
    assert len(found[0]["launcher"]) >= 2, found  # the rendezvous store and the one the workers share
    assert all(found[rank]["worker"] for rank in (0, 1)), found  # gloo listens for its peers
    everything = [ipaddress.ip_address(a) for listing in found.values() for addresses in listing.values()
                  for a in addresses]
    assert all(address.is_loopback for address in everything), found


def test_train_nproc_listens_on_the_loopback_only(tmp_path):
    run = tmp_path / "run"
    command = endless_ring8(run)
    launcher = start_training(command, run)
    try:
        workers = worker_pids(launcher.pid)
        launcher_listens = listening_addresses(launcher.pid)
        listens = {pid: listening_addresses(pid) for pid in workers}
    finally:
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=90)
    assert len(workers) == 2 and len(launcher_listens) >= 2, (workers, launcher_listens)
    assert all(address.is_loopback for address in launcher_listens), launcher_listens
    assert all(address.is_loopback for addresses in listens.values() for address in addresses), listens
    assert launcher.returncode == 3, stderr[-3000:]


def test_bench_scaling_s_ranks_and_their_store_listen_on_the_loopback_only():
    """`ganscale bench scaling` spawns its ranks itself: their store is the bench's, on 127.0.0.1, and gloo's
    sockets are on the loopback too (rank 0 would otherwise open the store on every interface)."""
    import threading

    from ganscale.bench import scaling

    seen: dict[int, set] = {}
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            for pid in [os.getpid(), *worker_pids(os.getpid())]:
                try:
                    seen.setdefault(pid, set()).update(listening_addresses(pid))
                except OSError:  # ended meanwhile
                    pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        times = scaling.step_times("ring8", ["model.g_width=16", "model.d_width=16", "train.batch_size=16",
                                             "train.steps=60", "log.every=1000", "log.sample_every=0",
                                             "checkpoint.every=0", "log.tensorboard=false"], 2, 1)
    finally:
        done.set()
        watcher.join()
    assert len(times) == 2 and all(times), times
    ranks = [pid for pid in seen if pid != os.getpid() and seen[pid]]
    assert seen[os.getpid()] and ranks, seen  # the bench's store, and the ranks' gloo sockets
    assert all(address.is_loopback for addresses in seen.values() for address in addresses), seen


@pytest.mark.skipif("launcher-grace" in versions.lacking(torch.__version__),
                    reason="this torch's agent has a fixed grace (test_a_torch_with_a_fixed_agent_grace_...)")
def test_the_local_launcher_waits_for_its_workers_longest_exit_before_sigkill(monkeypatch):
    """torch's agent SIGKILLs the workers its grace after passing a stop on: a longer fault.exit_timeout_s
    lengthens it, so a rank still finishing its step or writing its diagnostics is not killed meanwhile."""
    from ganscale.fault import stop_grace_s
    from ganscale.launch import local_agent

    monkeypatch.setattr(os, "environ", {**os.environ})  # local_agent sets the workers' variables here
    monkeypatch.delitem(os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    slow = stop_grace_s(60)
    assert local_agent(2, slow).shutdown_timeout > slow
    assert local_agent(2, stop_grace_s(20)).shutdown_timeout >= 30  # torch's own grace is never shortened


@pytest.mark.skipif("launcher-grace" in versions.lacking(torch.__version__),
                    reason="this torch's agent has a fixed grace: TORCH_ELASTIC_SHUTDOWN_TIMEOUT is not read")
@pytest.mark.parametrize("value, granted", [("abc", None), ("-1", None), ("30s", None), ("0", 0), ("600", 600)])
def test_the_local_launcher_reads_torch_s_grace_variable_or_refuses_it_by_name(monkeypatch, value, granted):
    """TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which `train --nproc` and `doctor` read for the agent's grace: a longer one is
    kept, a malformed one refused as the other launcher variables are (it was int()'s ValueError, a traceback)."""
    from ganscale.fault import stop_grace_s
    from ganscale.launch import local_agent

    monkeypatch.setattr(os, "environ", {**os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": value})
    if granted is None:
        with pytest.raises(ConfigError) as refused:
            local_agent(2, stop_grace_s(20))
        assert refused.value.key == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
        assert refused.value.problem.startswith(f"{value!r} is not a number of seconds")
    else:
        assert local_agent(2, stop_grace_s(20)).shutdown_timeout == max(granted, math.ceil(stop_grace_s(20)) + 1)

def test_a_torch_with_a_fixed_agent_grace_gets_no_grace_keyword(monkeypatch):
    """torch 2.11's LaunchConfig has no `shutdown_timeout` (its agent always waits 30 s): the launcher's settings
    leave the keyword out there instead of failing every `train --nproc` and `doctor`."""
    from torch.distributed.launcher import api

    from ganscale.fault import stop_grace_s
    from ganscale.launch import local_agent

    taken = {}

    def launch_config_2_11(**settings):  # torch 2.11's LaunchConfig: the same settings, less shutdown_timeout
        if "shutdown_timeout" in settings:
            raise TypeError("LaunchConfig.__init__() got an unexpected keyword argument 'shutdown_timeout'")
        taken.update(settings)
    monkeypatch.setattr(os, "environ", {**os.environ})  # local_agent sets the workers' variables here
    monkeypatch.setattr(api, "LaunchConfig", launch_config_2_11)
    monkeypatch.setattr(versions, "running", lambda: "2.11.0+cu130")
    local_agent(2, stop_grace_s(20))
    assert taken["nproc_per_node"] == 2 and "shutdown_timeout" not in taken


@pytest.mark.parametrize("exit_timeout_s, torch_version, refused", [
    (24.0, "2.11.0", False), (24.5, "2.11.0", True), (60.0, "2.11.0", True), (60.0, "2.12.1", False)])
def test_an_exit_timeout_longer_than_a_fixed_agent_grace_is_refused_by_name(monkeypatch, exit_timeout_s,
                                                                          torch_version, refused):
    """Where the agent cannot wait longer than 30 s (torch 2.11), workers that may need longer to stop would be
    SIGKILLed before their checkpoint or diagnostics: refused before they start, naming the largest value."""
    from ganscale import config, launch

    monkeypatch.setattr(versions, "running", lambda: torch_version)
    cfg = config.load(None, [f"fault.exit_timeout_s={exit_timeout_s}"])
    if not refused:
        launch.check_stop_grace(cfg)
        return
    with pytest.raises(ConfigError) as info:
        launch.check_stop_grace(cfg)
    assert info.value.key == "fault.exit_timeout_s" and "2.11.0" in info.value.problem
    assert "at most 24," in info.value.fix and "torch>=2.12" in info.value.fix


def test_train_nproc_refuses_the_longer_exit_timeout_before_claiming_the_run_directory(monkeypatch, tmp_path):
    from ganscale import api

    monkeypatch.setattr(versions, "running", lambda: "2.11.0")
    with pytest.raises(ConfigError) as info:
        api.run(None, ["fault.exit_timeout_s=40"], 2, str(tmp_path / "run"), None, 0, print)
    assert info.value.key == "fault.exit_timeout_s"
    assert not (tmp_path / "run").exists()


def _signal_during_launch(monkeypatch, tmp_path, exit_codes):
    """`_launch_once` where SIGTERM reaches the launcher after a periodic checkpoint of this start, and torch's
    agent then stops workers that exit with `exit_codes` (their ranks in order)."""
    from types import SimpleNamespace

    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ganscale import launch

    def elastic_launch(config, entrypoint):
        def run(*args):
            (tmp_path / "checkpoints").mkdir()
            (tmp_path / "checkpoints" / "step-00000005.pt").write_bytes(b"")  # a periodic one, of this start
            handlers = {rank: SimpleNamespace(proc=SimpleNamespace(poll=lambda code=code: code))
                        for rank, code in enumerate(exit_codes)}
            agent = SimpleNamespace(_pcontext=SimpleNamespace(subprocess_handlers=handlers))
            LocalElasticAgent._shutdown(agent, signal.SIGTERM)
            raise SignalException("Process got signal: 15", signal.SIGTERM)
        return run

    monkeypatch.setattr(launcher_api, "elastic_launch", elastic_launch)
    monkeypatch.setattr(LocalElasticAgent, "_shutdown", lambda agent, *args, **kwargs: None)
    monkeypatch.setattr(launch, "local_agent", lambda *args, **kwargs: None)
    return launch._launch_once(len(exit_codes), [], tmp_path, 0.0)


@pytest.mark.parametrize(("codes", "expected", "said"), [
    ((7, 7), 7, "SIGTERM received; worker ranks 0, 1 failed with exit code 7"),  # the stop's checkpoint failed
    ((0, 0), 0, "SIGTERM received as the workers finished training"),  # it came during the last step
    ((3, 3), 3, "workers were asked to checkpoint. Continue with --resume auto"),
], ids=["checkpoint-failed", "finished", "checkpointed"])
def test_a_launcher_stopped_by_a_signal_exits_as_its_workers_did(monkeypatch, tmp_path, capsys, codes, expected,
                                                                 said):
    """Exit 3 only where the workers checkpointed and stopped on the signal: a checkpoint written earlier in the
    same start is no sign of one (a failed stop checkpoint exited 3, and so did a run that finished)."""
    assert _signal_during_launch(monkeypatch, tmp_path, codes) == (expected, False)
    assert said in capsys.readouterr().err
