"""A real two-node Slurm (tests/slurm_cluster.py's `slurm_two_nodes`: two slurmd, each in its own network namespace
with its own host name): `ganscale slurm --nodes 2` trains one 2-rank world across both nodes, bit for bit as
`ganscale train --nproc 2` does."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import TWO_NODES, slurm_two_nodes  # noqa: F401  (the fixture)
from test_cli import clean_env, explain
from test_slurm_real import TINY, _assert_same_final_checkpoint, _job_log, _train, _wait_job

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # scripts/test.sh runs them after the others, one at a time


def test_each_node_answers_with_its_own_name_and_resolves_the_other(slurm_two_nodes, tmp_path):  # noqa: F811
    output = tmp_path / "names.out"
    each_node = f"srun sh -c 'echo $(hostname) $(getent hosts {' '.join(TWO_NODES)} | wc -l)'"
    submitted = subprocess.run(["sbatch", "--parsable", "--nodes", "2", "--ntasks-per-node", "1", "-o", str(output),
                                "--wrap", each_node],
                               env=slurm_two_nodes, capture_output=True, text=True, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    _wait_job(slurm_two_nodes, submitted.stdout.strip().split(";")[0])
    assert sorted(output.read_text().split("\n")[:-1]) == [f"{name} 2" for name in TWO_NODES], output.read_text()


def _submit_two_nodes(cluster: dict, cwd: Path, run: Path, settings: list[str]) -> str:
    """`ganscale slurm` of a job of one process on each of two nodes; the job id it printed."""
    env = clean_env()
    env["SLURM_CONF"] = cluster["SLURM_CONF"]
    env.pop("GLOO_SOCKET_IFNAME", None)  # each node finds its address from its host name, as on a real cluster
    # Each process as many threads as `ganscale train --nproc 2` gives it here (torchrun leaves a node's only process
    # all the cores): CPU kernels sum in an order that depends on the thread count.
    env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // 2))
    done = subprocess.run([sys.executable, "-m", "ganscale", "slurm", "ring8", "--nodes", "2", "--gpus-per-node", "0",
                           "--procs-per-node", "1", "--run-dir", str(run), *settings], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, explain(done)
    return re.search(r"job (\d+)", done.stdout)[1]


def test_ganscale_slurm_on_two_nodes_trains_as_ganscale_train_does(slurm_two_nodes, tmp_path):  # noqa: F811
    settings = [*TINY, "--set", "train.steps=3"]
    run = tmp_path / "slurm-run"
    job = _submit_two_nodes(slurm_two_nodes, tmp_path, run, settings)
    state = _wait_job(slurm_two_nodes, job, timeout_s=300)
    assert "JobState=COMPLETED" in state and " NumNodes=2 " in state, f"{state}\n{_job_log(run)}"
    agents = list((run / "slurm" / "logs" / f"{job}-0").iterdir())  # torchrun's log folder: one per agent
    assert len(agents) == 2, f"{agents}\n{_job_log(run)}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3 and summary["requeues"] == 0, summary
    _train(tmp_path, tmp_path / "local-run", settings)
    _assert_same_final_checkpoint(run, tmp_path / "local-run", 3)
