"""A real one-node Slurm (munged, slurmctld, slurmd from Debian's slurm-wlm) for the test suite.

The session fixture `slurm_cluster` installs the packages when they are missing and the machine allows it
(root, apt-get), writes a munge key and a slurm.conf under a tmp folder, starts the daemons and waits until
`sinfo` shows the node idle; where any of that cannot work the tests skip with the reason.
One node, this machine's hostname, CPUs from nproc with oversubscription so two tasks fit on small machines.

`slurm_two_nodes` runs two nodes on this machine (root, iproute2, util-linux; skipped with the reason otherwise):
each node is a network namespace on a bridge in this one, and its slurmd runs with the node's own host name
(`unshare --uts`) and an /etc/hosts naming both nodes (`unshare --mount`, a bind mount), so job steps, srun and
torchrun on a node see what they would on a real one. slurmctld runs on the first node; munged runs here, its
socket a file that both namespaces reach. Where bridged traffic is filtered (br_netfilter with a dropping FORWARD
chain, as some Docker hosts have) the second node never registers and the fixture skips.
With GANSCALE_REQUIRE_SLURM=1 (CI sets it) a one-node cluster that cannot start, or Slurm that cannot be installed,
fails the tests instead of skipping them; the two nodes still skip where the machine cannot make their network
(namespaces, a bridge), which is the machine's limit, not Slurm's.
Installing the packages (apt-get update + install) took about 20 s on a 2-core Debian 12 machine (Slurm 22.05).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
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


def _require_packages() -> None:
    if any(_binary(name) is None for name in DAEMONS):
        reason = _install_packages()
        if reason:
            _cannot(reason)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _binary(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name,) if p.exists()), None)


def _slurm_conf(root: Path, host: str, cpus: int) -> str:
    # Ports of this cluster's own (the defaults, 6817 and 6818, would meet another test session's cluster).
    return f"""ClusterName=ganscale
SlurmctldHost={host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
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


def _wait_idle(env: dict, timeout_s: float = 60, nodes: int = 1) -> bool:
    """Whether all `nodes` nodes came up idle in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=env, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split() == ["idle"] * nodes:
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
    _require_packages()
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, socket.gethostname(), os.cpu_count() or 2))
    env = dict(os.environ, SLURM_CONF=str(conf))
    started = []
    try:
        started.append(_start_munged(root / "munge"))
        for daemon in ("slurmctld", "slurmd"):
            started.append(subprocess.Popen([_binary(daemon), "-D", "-f", str(conf)] + (["-i"] if daemon == "slurmctld" else []),
                                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        if not _wait_idle(env):
            _cannot(f"the Slurm node did not come up idle; see {root}/slurmctld.log and slurmd.log")
        yield env
    finally:
        _cancel_jobs(env)
        _stop(started)


TWO_NODES = ("gsnode1", "gsnode2")
NODE_TOOLS = ("ip", "nsenter", "unshare", "mount", "hostname")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@contextmanager
def _bridged_namespaces(count: int):
    """`count` network namespaces, each joined by a veth pair to a bridge in this one: node i at SUBNET.i, this
    namespace (where the tests call sbatch and squeue) at SUBNET.254. Yields [(namespace, address)]; skips where
    a step fails (not root, no bridge support). The subnet and names come from the pid, so concurrent suites differ."""
    tag, pid = f"gt{os.getpid() % 100000}", os.getpid()
    subnet, bridge = f"10.213.{pid % 250 + 1}", f"{tag}br"
    nodes = [(f"{tag}n{i}", f"{subnet}.{i}") for i in range(1, count + 1)]
    made_bridge, made = False, []
    try:
        _ip_or_skip("link", "add", bridge, "type", "bridge")
        made_bridge = True
        _ip_or_skip("addr", "add", f"{subnet}.254/24", "dev", bridge)
        _ip_or_skip("link", "set", bridge, "up")
        for i, (namespace, address) in enumerate(nodes, 1):
            _ip_or_skip("netns", "add", namespace)
            made.append(namespace)
            inside, outside = f"{tag}v{i}", f"{tag}h{i}"
            for step in [("link", "add", inside, "type", "veth", "peer", "name", outside),
                         ("link", "set", inside, "netns", namespace), ("link", "set", outside, "master", bridge),
                         ("link", "set", outside, "up"),
                         ("-n", namespace, "addr", "add", f"{address}/24", "dev", inside),
                         ("-n", namespace, "link", "set", inside, "up"), ("-n", namespace, "link", "set", "lo", "up")]:
                _ip_or_skip(*step)
        yield nodes
    finally:
        for namespace in made:  # its veth goes with it, and the peer on the bridge with that
            _ip("netns", "del", namespace)
        if made_bridge:
            _ip("link", "del", bridge)


def _ip_or_skip(*step: str) -> None:
    result = _ip(*step)
    if result.returncode != 0:
        pytest.skip(f"cannot build the two nodes' network here (`ip {' '.join(step)}`): {result.stderr.strip()}")


def _as_node(namespace: str, name: str, hosts: Path, argv: list[str]) -> list[str]:
    """argv run as node `name`: in its network namespace, with its own host name (UTS namespace) and /etc/hosts
    (mount namespace); whatever it starts (job steps, srun, torchrun) inherits all three. nsenter, not `ip netns exec`,
    which remounts /sys without the cgroup file system that slurmd needs."""
    return ["nsenter", f"--net=/run/netns/{namespace}", "unshare", "--uts", "--mount", "sh", "-c",
            'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"', "node", name, str(hosts), *argv]


def _two_node_conf(root: Path, cpus: int, nodes: list[tuple[str, str]]) -> str:
    """The one-node cluster's settings, with slurmctld on the first node, one NodeName line per node (NodeAddr: its
    namespace's address) and slurmd's files per node (%n: the node's name)."""
    head, names = nodes[0][0], ",".join(name for name, _ in nodes)
    per_node = {"SlurmctldHost": f"{head}({nodes[0][1]})", "SlurmdSpoolDir": f"{root}/spool/%n",
                "SlurmdPidFile": f"{root}/slurmd.%n.pid", "SlurmdLogFile": f"{root}/slurmd.%n.log"}
    lines = []
    for line in _slurm_conf(root, head, cpus).splitlines():
        key = line.split("=", 1)[0]
        if key == "NodeName":
            lines += [line.replace(f"NodeName={head}", f"NodeName={name} NodeAddr={address}")
                      for name, address in nodes]
        elif key == "PartitionName":
            lines.append(line.replace(f"Nodes={head}", f"Nodes={names}"))
        else:
            lines.append(f"{key}={per_node[key]}" if key in per_node else line)
    return "\n".join(lines) + "\n"


def _start_munged(munge: Path) -> subprocess.Popen:
    """A munged of this cluster's own: a new key, its socket, pid, seed and log beside it."""
    key = munge / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    return subprocess.Popen([_binary("munged"), "-F", "--force", "-S", str(munge / "munge.socket"),
                             "--key-file", str(key), "--pid-file", str(munge / "munged.pid"),
                             "--seed-file", str(munge / "munged.seed"), "--log-file", str(munge / "munged.log")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _cancel_jobs(env: dict, timeout_s: float = 30) -> None:
    """Cancels what is still queued or running (a failed test's job), so that no job step outlives its slurmd."""
    jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
    if not jobs:
        return
    subprocess.run(["scancel", *jobs], env=env, capture_output=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and subprocess.run(["squeue", "-h"], env=env, capture_output=True,
                                                         text=True).stdout.strip():
        time.sleep(1)


def _stop(processes: list[subprocess.Popen]) -> None:
    for process in reversed(processes):
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def slurm_two_nodes(tmp_path_factory):
    """Two Slurm nodes, TWO_NODES, on this machine; yields the environment (SLURM_CONF set) under which sbatch, squeue
    and scontrol reach them from this namespace. slurmctld runs on the first node, munged here (its socket is a file,
    so every namespace reaches it); each node resolves both names through its own /etc/hosts."""
    _require_packages()
    missing = [tool for tool in NODE_TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"two nodes need iproute2 and util-linux; missing: {', '.join(missing)}")
    root = tmp_path_factory.mktemp("slurm2")
    for sub in ("state", "munge", *(f"spool/{name}" for name in TWO_NODES)):
        (root / sub).mkdir(parents=True)
    with _bridged_namespaces(len(TWO_NODES)) as namespaces:
        nodes = [(name, address) for name, (_, address) in zip(TWO_NODES, namespaces)]
        hosts = root / "hosts"
        hosts.write_text("127.0.0.1 localhost\n::1 localhost\n" + "".join(f"{a} {n}\n" for n, a in nodes))
        conf = root / "slurm.conf"
        conf.write_text(_two_node_conf(root, os.cpu_count() or 2, nodes))
        env = dict(os.environ, SLURM_CONF=str(conf))
        started = []
        try:
            started.append(_start_munged(root / "munge"))
            daemons = [(0, [_binary("slurmctld"), "-D", "-i", "-f", str(conf)])]  # the controller on the first node
            daemons += [(i, [_binary("slurmd"), "-D", "-f", str(conf), "-N", name]) for i, name in enumerate(TWO_NODES)]
            for i, argv in daemons:
                started.append(subprocess.Popen(_as_node(namespaces[i][0], TWO_NODES[i], hosts, argv), env=env,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            if not _wait_idle(env, nodes=len(TWO_NODES)):
                pytest.skip(f"the two Slurm nodes did not come up idle; see {root}/slurmctld.log and slurmd.*.log")
            yield env
        finally:
            _cancel_jobs(env)
            _stop(started)
