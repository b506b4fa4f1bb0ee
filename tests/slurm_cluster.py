"""A real one-node Slurm (munged, slurmctld, slurmd from Debian's slurm-wlm) for the test suite.

The session fixture `slurm_cluster` installs the packages when they are missing and the machine allows it
(root, apt-get), writes a munge key and a slurm.conf under a tmp folder, starts the daemons and waits until
`sinfo` shows the node idle; where any of that cannot work the tests skip with the reason.
One node, this machine's hostname, CPUs from nproc with oversubscription so two tasks fit on small machines.
Two slurmd in network namespaces are not tried yet.
With GANSCALE_REQUIRE_SLURM=1 (CI sets it) a cluster that cannot start fails the tests instead of skipping them.
Installing the packages (apt-get update + install) took about 20 s on a 2-core Debian 12 machine (Slurm 22.05).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo")


def _install_packages() -> str | None:
    """Install slurm-wlm and munge quietly; returns why it could not, or None."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "Slurm is not installed and this is not a root Debian machine that could install it"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for step in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        try:
            result = subprocess.run(step, env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(step)}` took over 600 s"
        if result.returncode != 0:
            return f"`{' '.join(step)}` failed: {result.stderr.strip().splitlines()[-1:]}"
    return None


def _binary(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name,) if p.exists()), None)


def _slurm_conf(root: Path, host: str, cpus: int) -> str:
    return f"""ClusterName=ganscale
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Slurm's default: how long a stopping step may take after SIGTERM before SIGKILL
KillWait=30
ReturnToService=2
MpiDefault=none
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _wait_idle(env: dict, timeout_s: float = 60) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        if out.returncode == 0 and "idle" in out.stdout:
            return True
        time.sleep(1)
    return False


def _cannot(reason: str) -> None:
    """Skip with the reason, or fail where Slurm is required (CI: .ci/run sets GANSCALE_REQUIRE_SLURM=1)."""
    if os.environ.get("GANSCALE_REQUIRE_SLURM") == "1":
        pytest.fail(f"GANSCALE_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Yields the environment (SLURM_CONF set) under which sbatch/srun/sinfo reach the test cluster."""
    if any(_binary(name) is None for name in DAEMONS):
        reason = _install_packages()
        if reason:
            _cannot(reason)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir()
    host = socket.gethostname()
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, host, os.cpu_count() or 2))
    env = dict(os.environ, SLURM_CONF=str(conf))
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    munge = root / "munge"  # this cluster's own munged: its socket, pid, seed and log beside the key
    started = []
    try:
        started.append(subprocess.Popen([_binary("munged"), "-F", "--force", "-S", str(munge / "munge.socket"),
                                         "--key-file", str(key), "--pid-file", str(munge / "munged.pid"),
                                         "--seed-file", str(munge / "munged.seed"), "--log-file", str(munge / "munged.log")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([_binary(daemon), "-D", "-f", str(conf)] + (["-i"] if daemon == "slurmctld" else []),
                                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if not _wait_idle(env):
            _cannot(f"the Slurm node did not come up idle; see {root}/slurmctld.log and slurmd.log")
        yield env
    finally:
        for process in reversed(started):
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
