"""scripts/gpu-check.sh on a machine without a CUDA GPU: it runs to the end, every GPU item not run."""
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
CUDA_TEST = "cuda test test_cuda_graphs_batch_one_step_trains_like_eager"
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA GPU")


def gpu_check(out, *args, **env):
    return subprocess.run(["bash", str(SCRIPT), "--out", str(out), *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHON=sys.executable, **env))


def test_all_parts_without_a_gpu_list_every_item_as_not_run_and_the_machine(tmp_path):
    done = gpu_check(tmp_path, "--part", "all")
    assert done.returncode == 0, done.stderr
    record = json.loads((tmp_path / "results.json").read_text())
    # 5 CUDA tests, 3 tensorflow engine runs, 15 recipe runs, the pix2pix targets, 3 pix2pix profiles,
    # 2 throughput benches, 9 table rows
    assert len(record["items"]) == 38
    assert {row["status"] for row in record["items"].values()} == {"not run"}
    summary = (tmp_path / "summary.md").read_text()
    assert "## Machine" in summary and f"torch: {torch.__version__}" in summary
    for name in record["items"]:
        assert f"| {name} | not run | 0 | no CUDA GPU |" in summary


def test_parts_append_to_one_folder(tmp_path):
    assert gpu_check(tmp_path, "--part", "1").returncode == 0
    summary = (tmp_path / "summary.md").read_text()
    assert f"| {CUDA_TEST} | not run | 0 | no CUDA GPU |" in summary and "part 3 not run yet" in summary
    assert gpu_check(tmp_path, "--part", "3").returncode == 0
    record = json.loads((tmp_path / "results.json").read_text())
    assert CUDA_TEST in record["items"] and any(name.startswith("pix2pix targets") for name in record["items"])
    assert "part 2 not run yet" in (tmp_path / "summary.md").read_text()


def test_a_failing_item_is_recorded_as_fail_and_exits_non_zero(tmp_path):
    done = gpu_check(tmp_path, "--part", "1", GANSCALE_GPU_CHECK_FAIL=CUDA_TEST)
    assert done.returncode == 1
    assert f"| {CUDA_TEST} | fail | 0 | failed on purpose" in (tmp_path / "summary.md").read_text()


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
    assert (f"| {CUDA_TEST} | not run | 0 | dependencies missing: no_such_dependency; pass --wheels |"
            in (tmp_path / "summary.md").read_text())


def test_an_item_that_raises_is_a_fail_and_the_check_goes_on(tmp_path):
    gpu_check = import_gpu_check()

    def broken(out):
        raise RuntimeError("CUDA error: out of memory")

    row = gpu_check.run_item("broken", broken, tmp_path, blocker=None)
    assert row.pop("seconds") >= 0
    assert row == {"item": "broken", "status": "fail", "detail": "RuntimeError: CUDA error: out of memory"}


def test_a_missing_wheel_folder_is_one_line_and_exit_2(tmp_path):
    done = gpu_check(tmp_path / "out", "--wheels", str(tmp_path / "absent"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --wheels {tmp_path / 'absent'}: no such folder; build it with scripts/gpu-wheels.sh"]
    assert not (tmp_path / "out").exists()


def test_the_tensorflow_engine_item_runs_where_tensorflow_is_installed(tmp_path, monkeypatch):
    """The item's own steps (train on the tensorflow engine, export, the checks), on the CPU here, so that it does
    not rot between GPU machines; without TensorFlow it is not run, saying why."""
    gpu_check = import_gpu_check()
    monkeypatch.setattr(gpu_check, "SCRATCH", tmp_path / "scratch")
    status, detail = gpu_check.tensorflow_run("fp32", tmp_path)
    try:
        import tensorflow  # noqa: F401
    except ImportError:
        assert status == "not run" and "TensorFlow does not import" in detail
        return
    assert status == "pass", detail
    assert "loss_d" in detail and "1 replica(s)" in detail


@pytest.fixture
def check_on_a_gpu_machine(monkeypatch, tmp_path):
    """gpu_check as on a GPU machine with every dependency, its items replaced by the test's."""
    gpu_check = import_gpu_check()
    monkeypatch.setattr(gpu_check, "ensure_dependencies", lambda wheels: [])
    monkeypatch.setattr(gpu_check, "describe_machine", lambda: {
        "gpu": "Test GPU", "driver": "1", "torch": torch.__version__, "cuda": "12.8", "cuda_available": True,
        "python": "3", "cpus": 16})
    monkeypatch.setattr(gpu_check, "deadline", gpu_check.math.inf)
    monkeypatch.setattr(gpu_check, "SCRATCH", tmp_path / "scratch")
    return gpu_check


def test_correctness_items_run_side_by_side_and_the_benches_alone_after_them(tmp_path, monkeypatch,
                                                                             check_on_a_gpu_machine):
    gpu_check = check_on_a_gpu_machine
    side_by_side = threading.Barrier(2, timeout=30)  # breaks (a fail) unless both items wait at once
    running, seen_by_bench = [], []

    def correctness(out):
        running.append(1)
        side_by_side.wait()
        running.pop()
        return "pass", "ok"

    def bench(out):
        seen_by_bench.append(len(running))
        return "pass", "timed"

    monkeypatch.setattr(gpu_check, "items", lambda: [
        gpu_check.Item(1, "a", correctness), gpu_check.Item(3, "bench", bench, True),
        gpu_check.Item(2, "b", correctness)])
    assert gpu_check.main(["--out", str(tmp_path), "--jobs", "2"]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    assert [record["items"][name]["status"] for name in ("a", "b", "bench")] == ["pass"] * 3
    assert seen_by_bench == [0]


def test_the_budget_cuts_a_running_item_off_and_starts_no_other(tmp_path, monkeypatch, check_on_a_gpu_machine):
    gpu_check = check_on_a_gpu_machine

    def hangs(out):
        rc = gpu_check.run_logged([sys.executable, "-c", "import time; time.sleep(60)"], out / "hangs.log", 300)
        return ("pass", "") if rc == 0 else ("fail", f"exit {rc}")

    monkeypatch.setattr(gpu_check, "items", lambda: [
        gpu_check.Item(3, "hangs", hangs, True), gpu_check.Item(3, "after", lambda out: ("pass", ""), True)])
    assert gpu_check.main(["--out", str(tmp_path), "--budget", "2"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["items"]
    assert rows["hangs"]["status"] == "not run" and rows["hangs"]["detail"] == "cut off by --budget (exit 124)"
    assert rows["hangs"]["seconds"] < 60 and re.search(r"timed out after \d s", (tmp_path / "hangs.log").read_text())
    assert rows["after"] == {"item": "after", "status": "not run", "seconds": 0, "call": 0,
                             "detail": "the --budget was spent before it started"}
    assert "| 3 | after | not run | 0 | the --budget was spent before it started |" in (
        tmp_path / "summary.md").read_text()


def test_pending_runs_only_the_items_without_a_pass_or_fail(tmp_path, monkeypatch, check_on_a_gpu_machine):
    gpu_check = check_on_a_gpu_machine
    ran = []
    monkeypatch.setattr(gpu_check, "items", lambda: [
        gpu_check.Item(1, name, lambda out, n=name: ran.append(n) or ("pass", ""))
        for name in ("passed", "failed", "cut off", "new")])
    (tmp_path / "results.json").write_text(json.dumps({"items": {
        "passed": {"status": "pass", "detail": ""}, "failed": {"status": "fail", "detail": ""},
        "cut off": {"status": "not run", "detail": "cut off by --budget"}}}))
    assert gpu_check.main(["--out", str(tmp_path), "--pending", "--jobs", "1"]) == 1  # the recorded fail stays
    assert ran == ["cut off", "new"]
    rows = json.loads((tmp_path / "results.json").read_text())["items"]
    statuses = [rows[name]["status"] for name in ("passed", "failed", "cut off", "new")]
    assert statuses == ["pass", "fail", "pass", "pass"]


@pytest.mark.parametrize("fast, wait, status", [(3.5, 1.0, "pass"), (4.5, 1.0, "fail"), (3.5, 6.0, "fail")])
def test_the_pix2pix_targets_are_read_from_the_bench_s_record(tmp_path, monkeypatch, fast, wait, status):
    gpu_check = import_gpu_check()
    record = {"rows": [{"row": "baseline", "epoch median s": 12.0, "data wait %": 0.5, "status": "ok"},
                       {"row": "fast", "epoch median s": fast, "data wait %": wait, "status": "ok"}]}
    monkeypatch.setattr(gpu_check, "pix2pix_rows", lambda rows, out: ("pass", "", record))
    got, detail = gpu_check.pix2pix_targets(tmp_path)
    assert got == status and detail.endswith(": missed") == (status == "fail")
    assert f"fast path {fast:.2f} s/epoch" in detail and f"{12 / fast:.2f}x" in detail


@pytest.mark.parametrize("option", ["--budget", "--jobs"])
def test_a_budget_or_jobs_not_above_zero_is_one_line_and_exit_2(tmp_path, option):
    done = gpu_check(tmp_path / "out", option, "0")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {option} 0: give a number above 0"]
    assert not (tmp_path / "out").exists()


def test_the_profile_item_runs_the_table_s_fast_row_and_keeps_the_profile(tmp_path, monkeypatch):
    """Exercised on the CPU with tiny networks: the profile of steps 31-50 lands in the result folder; the run
    goes on past the window (its last step, with the final checkpoint, is not a steady step)."""
    from ganscale.bench.pix2pix import rows

    gpu_check = import_gpu_check()
    fast = next(row for row in rows(on_cuda=True) if row.name == "fast")
    assert gpu_check.FAST_PATH == list(fast.overrides)
    for name, value in {"DEVICE": "cpu", "FACADES_IMAGES": 4, "SCRATCH": tmp_path / "scratch"}.items():
        monkeypatch.setattr(gpu_check, name, value)
    tiny = ["model.g_width=2", "model.d_width=2", "data.resolution=32", "data.load_size=36", "data.workers=0"]
    status, detail = gpu_check.pix2pix_profile("tiny", tiny, tmp_path)
    assert status == "pass", detail
    assert detail.startswith("steps 31-50 as logged (20),")
    assert (tmp_path / "profile-pix2pix-tiny.txt").read_text().startswith("steps 31-50")
    logged = (tmp_path / "profile-pix2pix-tiny.log").read_text()
    assert "done: 60 steps" in logged
    # torch.compile's reasons for skipped CUDA graphs and recompiles, and the CUDA-graph trees' doings, go to the log
    assert logged.startswith("$ TORCH_LOGS=perf_hints,recompiles,cudagraphs ")


def test_only_runs_the_items_whose_name_holds_a_given_word(tmp_path):
    done = gpu_check(tmp_path, "--only", "pix2pix profile, fp16")
    assert done.returncode == 0, done.stderr
    names = set(json.loads((tmp_path / "results.json").read_text())["items"])
    assert names and all("pix2pix profile" in name or "fp16" in name for name in names)
    assert "recipe pix2pix fp16" in names and "pix2pix profile: eager fp32" in names


def test_only_with_no_matching_item_is_refused_before_anything_is_written(tmp_path):
    done = gpu_check(tmp_path / "out", "--only", "no such item")
    assert done.returncode == 2 and "--only 'no such item'" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("below", ["", "sub"])
def test_an_out_that_is_or_lies_below_a_file_is_one_line_and_exit_2(tmp_path, below):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    out = afile / below if below else afile
    done = gpu_check(out)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: --out {out}: {afile} is a file, not a folder; give a new folder or an earlier check's"]
    assert done.stdout == "" and afile.read_text() == "mine\n"  # refused before the dependency step


@pytest.mark.parametrize("damaged", ['{"items": {"a": {"status": "pass", "det', "{}", '{"items": []}',
                                     '{"items": {"a": {"status": 1, "detail": ""}}}', "[]"])
def test_a_damaged_record_is_one_line_exit_2_and_left_as_it_is(tmp_path, damaged):
    (tmp_path / "results.json").write_text(damaged)
    done = gpu_check(tmp_path, "--part", "1")
    assert done.returncode == 2 and done.stdout == ""
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"error: {tmp_path / 'results.json'} is damaged (")
    assert line.endswith("); give a new --out, or move that file aside to start the folder's record afresh")
    assert (tmp_path / "results.json").read_text() == damaged and not (tmp_path / "summary.md").exists()


def test_a_call_killed_while_writing_its_record_leaves_the_earlier_record_whole(tmp_path, monkeypatch,
                                                                                check_on_a_gpu_machine):
    gpu_check = check_on_a_gpu_machine
    monkeypatch.setattr(gpu_check, "items", lambda: [gpu_check.Item(1, "a", lambda out: ("pass", ""))])
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    earlier = (tmp_path / "results.json").read_text()
    write_text = Path.write_text

    def killed_halfway(path, text, *args, **kwargs):
        write_text(path, text[:len(text) // 2], *args, **kwargs)
        raise KeyboardInterrupt  # as the device's time limit ends the call

    monkeypatch.setattr(Path, "write_text", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--out", str(tmp_path)])
    assert (tmp_path / "results.json").read_text() == earlier


CPU_MACHINE = {"gpu": None, "driver": None, "torch": torch.__version__, "cuda": None, "cuda_available": False,
               "python": "3", "cpus": 2}


def test_a_not_run_never_replaces_an_earlier_pass_or_fail_and_each_result_keeps_its_machine(
        tmp_path, monkeypatch, check_on_a_gpu_machine):
    gpu_check = check_on_a_gpu_machine
    monkeypatch.setattr(gpu_check, "items", lambda: [
        gpu_check.Item(1, "passes", lambda out: ("pass", "ok")), gpu_check.Item(1, "fails", lambda out: ("fail", "x")),
        gpu_check.Item(2, "later", lambda out: ("pass", "ok"))])
    assert gpu_check.main(["--out", str(tmp_path), "--part", "1"]) == 1
    monkeypatch.setattr(gpu_check, "describe_machine", lambda: CPU_MACHINE)
    # the earlier fail still stands, so the folder still fails
    assert gpu_check.main(["--out", str(tmp_path), "--only", "passes,fails"]) == 1
    record = json.loads((tmp_path / "results.json").read_text())
    assert [(row["status"], row["call"]) for row in record["items"].values()] == [("pass", 0), ("fail", 0)]
    assert [call["machine"]["gpu"] for call in record["calls"]] == ["Test GPU", None]
    summary = (tmp_path / "summary.md").read_text()
    assert "## Machine\n\n- GPU: Test GPU\n" in summary and "no CUDA GPU" not in summary
    assert "Last call: `scripts/gpu-check.sh --out" in summary

    assert gpu_check.main(["--out", str(tmp_path)]) == 1  # a CPU's "not run" of "later" stands beside them
    summary = (tmp_path / "summary.md").read_text()
    assert "## Machines" in summary and "### Machine 1\n\n- GPU: Test GPU\n" in summary
    assert "### Machine 2\n\n- GPU: none (no CUDA GPU)\n" in summary
    assert "| 1 | passes | pass | 0.0 | ok | 1 |" in summary
    assert "| 2 | later | not run | 0 | no CUDA GPU | 2 |" in summary


def test_a_spent_budget_keeps_the_earlier_results_and_their_exit_status(tmp_path, monkeypatch,
                                                                        check_on_a_gpu_machine):
    gpu_check = check_on_a_gpu_machine
    monkeypatch.setattr(gpu_check, "items", lambda: [
        gpu_check.Item(3, "passes", lambda out: ("pass", "ok"), True),
        gpu_check.Item(3, "fails", lambda out: ("fail", "x"), True)])
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    monkeypatch.setattr(gpu_check, "describe_machine", lambda: time.sleep(0.05) or {  # the budget runs out here
        "gpu": "Test GPU", "driver": "1", "torch": torch.__version__, "cuda": "12.8", "cuda_available": True,
        "python": "3", "cpus": 16})
    done = gpu_check.main(["--out", str(tmp_path), "--budget", "0.01"])
    assert done == 1
    rows = json.loads((tmp_path / "results.json").read_text())["items"]
    assert [rows[name]["status"] for name in ("passes", "fails")] == ["pass", "fail"]


def test_a_cpu_call_into_the_h200_results_keeps_every_recorded_pass_and_its_machine(tmp_path):
    out = tmp_path / "h200"
    shutil.copytree(ROOT / "benchmarks" / "results" / "gpu-check-20261127-h200", out)
    before = json.loads((out / "results.json").read_text())["items"]
    done = gpu_check(out, "--only", "pix2pix row")
    assert done.returncode == 1, done.stderr  # the targets' fail recorded on the H200 stands
    after = json.loads((out / "results.json").read_text())["items"]
    assert {name: row["status"] for name, row in after.items() if row["status"] != "not run"} == {
        name: row["status"] for name, row in before.items() if row["status"] != "not run"}
    summary = (out / "summary.md").read_text()
    assert "### Machine 1\n\n- GPU: NVIDIA H200\n- driver: 580.159.04\n" in summary
    assert "| 3 | pix2pix row amp-bf16 | pass |" in summary and summary.count("no CUDA GPU | 2 |") == 4


def test_a_torch_that_fails_to_import_is_named_in_the_summary_not_taken_for_no_gpu(tmp_path):
    broken = tmp_path / "broken" / "torch"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    done = gpu_check(tmp_path / "out", "--part", "1",
                     PYTHONPATH=os.pathsep.join([str(broken.parent), os.environ.get("PYTHONPATH", "")]))
    assert done.returncode == 0, done.stderr
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "- torch: could not be imported (ImportError: broken on purpose)\n" in summary
    assert "no CUDA GPU" not in summary and "torch: None" not in summary
    assert f"| {CUDA_TEST} | not run | 0 | torch does not import: ImportError: broken on purpose |" in summary


def test_a_wheel_folder_without_the_missing_dependency_says_so(tmp_path, monkeypatch):
    gpu_check = import_gpu_check()
    monkeypatch.setattr(gpu_check, "DEPENDENCIES", {**gpu_check.DEPENDENCIES, "no_such_dependency": "no-such>=1"})
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    assert gpu_check.main(["--part", "1", "--out", str(tmp_path / "out"), "--wheels", str(wheels)]) == 0
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert (f"| {CUDA_TEST} | not run | 0 | dependencies missing: no_such_dependency; --wheels {wheels} has no "
            f"wheel for them: scripts/gpu-wheels.sh {wheels} {python} 'no-such>=1' |"
            in (tmp_path / "out" / "summary.md").read_text())


def test_the_last_call_is_quoted_to_be_pasted_back(tmp_path, monkeypatch, check_on_a_gpu_machine):
    gpu_check = check_on_a_gpu_machine
    monkeypatch.setattr(gpu_check, "items", lambda: [gpu_check.Item(2, "recipe ring8 fp32", lambda out: ("pass", ""))])
    assert gpu_check.main(["--out", str(tmp_path), "--only", "ring8 fp32"]) == 0
    assert f"Last call: `scripts/gpu-check.sh --out {tmp_path} --only 'ring8 fp32'`" in (
        tmp_path / "summary.md").read_text()
