"""scripts/gpu-check.sh on a machine without a CUDA GPU: it runs to the end, every GPU item not run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA GPU")


def gpu_check(out, *args, **env):
    return subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable, **env))


def test_all_parts_without_a_gpu_list_every_item_as_not_run_and_the_machine(tmp_path):
    done = gpu_check(tmp_path, "--part", "all")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "results.json").read_text())
    assert len(record["items"]) == 22  # cuda tests, 3 tensorflow engine runs, 15 recipe runs, 3 benches
    assert {row["status"] for row in record["items"].values()} == {"not run"}
    summary = (tmp_path / "summary.md").read_text()
    assert "## Machine" in summary and f"torch: {torch.__version__}" in summary
    for name in record["items"]:
        assert f"| {name} | not run | no CUDA GPU |" in summary


def test_parts_append_to_one_folder(tmp_path):
    assert gpu_check(tmp_path, "--part", "1").returncode == 0
    summary = (tmp_path / "summary.md").read_text()
    assert "| cuda-tests | not run | no CUDA GPU |" in summary and "part 3 not run yet" in summary
    assert gpu_check(tmp_path, "--part", "3").returncode == 0
    record = json.loads((tmp_path / "results.json").read_text())
    assert "cuda-tests" in record["items"] and any(name.startswith("bench pix2pix") for name in record["items"])
    assert "part 2 not run yet" in (tmp_path / "summary.md").read_text()


def test_a_failing_item_is_recorded_as_fail_and_exits_non_zero(tmp_path):
    done = gpu_check(tmp_path, "--part", "1", GANSCALE_GPU_CHECK_FAIL="cuda-tests")
    assert done.returncode == 1
    assert "| cuda-tests | fail | failed on purpose" in (tmp_path / "summary.md").read_text()


def import_gpu_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    return gpu_check


def test_a_missing_dependency_without_wheels_marks_the_items_not_run_and_names_it(tmp_path, monkeypatch):
    gpu_check = import_gpu_check()
    monkeypatch.setattr(gpu_check, "DEPENDENCIES", {**gpu_check.DEPENDENCIES, "no_such_dependency": "x"})
    assert gpu_check.main(["--part", "1", "--out", str(tmp_path)]) == 0
    assert ("| cuda-tests | not run | dependencies missing: no_such_dependency; pass --wheels |"
            in (tmp_path / "summary.md").read_text())


def test_an_item_that_raises_is_a_fail_and_the_check_goes_on(tmp_path):
    gpu_check = import_gpu_check()

    def broken(out):
        raise RuntimeError("CUDA error: out of memory")

    row = gpu_check.run_item("broken", broken, tmp_path, blocker=None)
    assert row == {"item": "broken", "status": "fail", "detail": "RuntimeError: CUDA error: out of memory"}


def test_a_missing_wheel_folder_is_one_line_and_exit_2(tmp_path):
    done = gpu_check(tmp_path / "out", "--wheels", str(tmp_path / "absent"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --wheels {tmp_path / 'absent'}: no such folder; build it with scripts/gpu-wheels.sh"]
    assert not (tmp_path / "out").exists()


def test_the_tensorflow_engine_item_runs_where_tensorflow_is_installed(tmp_path):
    """The item's own steps (train on the tensorflow engine, export, the checks), on the CPU here, so that it does
    not rot between GPU machines; without TensorFlow it is not run, saying why."""
    gpu_check = import_gpu_check()
    status, detail = gpu_check.tensorflow_run("fp32", tmp_path)
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        assert status == "not run" and "TensorFlow does not import" in detail
        return
    assert status == "pass", detail
    assert "loss_d" in detail and "1 replica(s)" in detail
