"""A real Slurm: jobs through sbatch/srun on the test cluster of tests/slurm_cluster.py."""

from __future__ import annotations

import subprocess
import time

import pytest

from slurm_cluster import slurm_cluster  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow


def _wait_job(env: dict, job: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["sacct", "-n", "-X", "-j", job, "-o", "State,ExitCode", "-P"], env=env,
                             capture_output=True, text=True).stdout.strip()
        queued = subprocess.run(["squeue", "-h", "-j", job], env=env, capture_output=True, text=True).stdout.strip()
        if not queued:
            return out
        time.sleep(1)
    pytest.fail(f"job {job} did not finish in {timeout_s} s")


def test_sbatch_srun_hostname(slurm_cluster, tmp_path):  # noqa: F811
    output = tmp_path / "hostname.out"
    submitted = subprocess.run(["sbatch", "--parsable", "-o", str(output), "--wrap", "srun hostname"],
                               env=slurm_cluster, capture_output=True, text=True, cwd=tmp_path)
    assert submitted.returncode == 0, submitted.stderr
    _wait_job(slurm_cluster, submitted.stdout.strip().split(";")[0])
    assert output.read_text().strip()
