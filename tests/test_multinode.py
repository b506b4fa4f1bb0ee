"""Two nodes on one machine: two network namespaces joined by a veth pair, torchrun's c10d rendezvous.

Needs root and iproute2 (`ip netns`); skipped with the reason when the machine does not allow it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from test_cli import clean_env
from test_custom import write_user_gan
from test_tf_engine import STEP_TOLERANCE, TINY_DCGAN, _sets, _train, tf  # noqa: F401 (tf: a fixture)

pytestmark = pytest.mark.slow


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_nodes():
    if shutil.which("ip") is None:
        pytest.skip("iproute2 (`ip`) is not installed")
    tag = f"gs{os.getpid() % 100000}"
    nodes = [(f"{tag}a", f"{tag}v0", "10.77.0.1"), (f"{tag}b", f"{tag}v1", "10.77.0.2")]
    created = []
    try:
        for ns, _, _ in nodes:
            result = _ip("netns", "add", ns)
            if result.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {result.stderr.strip()}")
            created.append(ns)
        steps = [("link", "add", nodes[0][1], "type", "veth", "peer", "name", nodes[1][1])]
        for ns, veth, address in nodes:
            steps += [("link", "set", veth, "netns", ns),
                      ("netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", veth),
                      ("netns", "exec", ns, "ip", "link", "set", veth, "up"),
                      ("netns", "exec", ns, "ip", "link", "set", "lo", "up")]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot set up the veth pair here ({' '.join(step)}): {result.stderr.strip()}")
        yield nodes
    finally:
        for ns in created:
            _ip("netns", "del", ns)


def _train_on_two_nodes(nodes, train_args: list[str], cwds: list, tag: str, exit_code: int = 0) -> list[str]:
    """`ganscale train TRAIN_ARGS` under torchrun on both nodes (one process each), node i started in cwds[i];
    fails the test unless both exit with `exit_code`. Returns each node's stderr."""
    endpoint = f"{nodes[0][2]}:29555"
    processes = []
    for node_rank, (ns, veth, address) in enumerate(nodes):
        command = ["ip", "netns", "exec", ns, "env", f"GLOO_SOCKET_IFNAME={veth}",
                   sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                   "--node-rank", str(node_rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", f"{tag}-{os.getpid()}",
                   # In a namespace the endpoint is not the hostname's address: say which node hosts it.
                   "--rdzv-conf", f"is_host={int(node_rank == 0)}", "--local-addr", address,
                   "-m", "ganscale", "train", *train_args]
        processes.append(subprocess.Popen(command, cwd=cwds[node_rank], env=clean_env(), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    outputs = [p.communicate(timeout=240) for p in processes]
    for p, (_, err) in zip(processes, outputs):
        assert p.returncode == exit_code, err[-3000:]
    return [err for _, err in outputs]


def test_two_nodes_over_c10d_rendezvous_train_as_one_world(tmp_path, two_nodes):
    run = tmp_path / "run"
    _train_on_two_nodes(two_nodes, ["--set", "train.steps=10", "--set", "log.every=5", "--set", "log.tensorboard=false",
                                    "--run-dir", str(run)], [tmp_path, tmp_path], "test")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 10


def test_two_nodes_import_the_user_s_gan_from_an_absolute_code_path(tmp_path, two_nodes):
    """The user's package lies only under code_path: not on PYTHONPATH, beside the YAML or in either node's
    working directory (each node starts in its own)."""
    code, configs, run = tmp_path / "code", tmp_path / "configs", tmp_path / "run"
    recipe = write_user_gan(code, "multinode_user_gan")
    configs.mkdir()
    moved = configs / "config.yaml"
    moved.write_text(recipe.read_text() + f"code_path: [{code}]\n")
    recipe.unlink()
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    _train_on_two_nodes(two_nodes, [str(moved), "--run-dir", str(run)], cwds, "user")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3


def test_a_run_directory_the_nodes_do_not_share_is_refused_on_every_node(tmp_path, two_nodes):
    """`--run-dir run` from two working directories: each node's `run` is its own folder, as on storage that is
    not shared. Every rank exits 2, rank 0 names --run-dir, and nothing stays behind."""
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    errors = _train_on_two_nodes(two_nodes, ["--set", "train.steps=3", "--run-dir", "run"], cwds, "unshared",
                                 exit_code=1)  # torchrun's own code when a worker failed
    said = [line for line in errors[0].splitlines() if "not on storage every node shares" in line]
    assert len(said) == 1 and "'--run-dir'" in said[0] and "rank(s) 1 do not see" in said[0], errors[0][-3000:]
    for err in errors:  # torchrun's report of its worker on each node: a config error
        assert "exitcode  : 2" in err, err[-3000:]
    assert not (cwds[0] / "run").exists() and not (cwds[1] / "run").exists()


def test_tensorflow_workers_on_two_nodes_train_as_one_replica(tf, tmp_path, two_nodes):
    """The tensorflow engine across nodes: one MultiWorkerMirroredStrategy worker per node under torchrun, each
    finding the other's TensorFlow server through the launcher's store (ganscale.tf.workers). Every step's losses
    and gradient norms are the 1-replica run's, within the tensorflow engine's criterion."""
    run = tmp_path / "run"
    settings = [*TINY_DCGAN, "parallel.sync_bn=true", "log.every=1", "log.sample_every=0", "train.steps=3",
                "parallel.tf_open_servers=true"]
    _train_on_two_nodes(two_nodes, ["digits", *_sets(*settings), "--run-dir", str(run)], [tmp_path, tmp_path], "tf")
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    _, stats = _train(tf, 1, 3, "parallel.sync_bn=true")
    keys = ("loss_d", "loss_g", "grad_norm_d", "grad_norm_g")
    assert [r["step"] for r in records] == [1, 2, 3]
    worst = max(abs(r[k] - s[k]) / max(abs(s[k]), 1e-12) for r, s in zip(records, stats) for k in keys)
    assert worst <= STEP_TOLERANCE, worst


@pytest.mark.parametrize("engine", ["torch", "tensorflow"])
def test_data_missing_on_one_node_ends_both_nodes_at_once_naming_that_rank(tmp_path, two_nodes, engine):
    """data.path is node 0's folder of images, absent on node 1 (node-local data, copied to one node only). Node 1
    refused it before joining the group, and node 0's rank waited parallel.timeout_s in init_process_group for it,
    then exited 5 ("stuck or gone"). Now every rank hears the refusal at the start's check-in: exit 2 on both nodes,
    node 0 naming rank 1 and its folder. The tensorflow engine's workers check their config once their gloo group
    exists: node 0 said only "stopped because another rank failed first" (exit 6)."""
    from image_helpers import write_noise_pngs

    if engine == "tensorflow":
        pytest.importorskip("tensorflow")
    engine_sets = _sets(*TINY_DCGAN, "parallel.tf_open_servers=true") if engine == "tensorflow" else []

    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    write_noise_pngs(cwds[0] / "images", 8, 8)
    errors = _train_on_two_nodes(two_nodes, [*engine_sets, "--set", "train.steps=3", "--set", "data.kind=folder", "--set",
                                             "data.path=images", "--set", "parallel.timeout_s=120",
                                             "--run-dir", str(tmp_path / "run")], cwds, f"nodata-{engine}",
                                 exit_code=1)  # torchrun's own code when a worker failed
    missing = f"'{cwds[1] / 'images'}' is not a directory"
    assert f"config error at 'data.path': rank 1 could not start: {missing}" in errors[0], errors[0][-3000:]
    assert f"config error at 'data.path': {missing}" in errors[1], errors[1][-3000:]
    for err in errors:
        assert "exitcode  : 2" in err, err[-3000:]
