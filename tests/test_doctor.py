"""`ganscale doctor`: the pure helpers, and the command end to end in a subprocess (CPU, gloo)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ganscale import doctor
from ganscale.cli import main
from ganscale.doctor import FAIL, PASS, SKIP, WARN, Check, Gpu
from test_cli import clean_env, explain

LINE = re.compile(r"^(PASS|WARN|FAIL|SKIP)  (\S.*?)\s{2,}(.*)$")


def run_doctor(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ganscale", "doctor", *args], cwd=cwd,
                          env={**clean_env(), **(env or {})}, capture_output=True, text=True, timeout=120)


def checks(stdout: str) -> dict[str, tuple[str, str]]:
    """name -> (status, detail) of every check line."""
    found = {}
    for line in stdout.splitlines():
        match = LINE.match(line)
        if match:
            found[match.group(2)] = (match.group(1), match.group(3))
    return found


def assert_well_formed(stdout: str) -> None:
    """Every line is a check, a cause/fix line under a non-PASS check, or the closing summary."""
    lines = stdout.splitlines()
    assert lines[-1].startswith("doctor: ")
    for i, line in enumerate(lines[:-1]):
        if line.startswith("      cause: "):
            assert lines[i - 1].split()[0] in (WARN, FAIL, SKIP)
            assert lines[i + 1].startswith("      fix:   ")
        elif not line.startswith("      fix:   "):
            assert LINE.match(line), line


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_healthy_cpu_machine_passes(tmp_path):
    result = run_doctor("--nproc", "2", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert_well_formed(result.stdout)
    found = checks(result.stdout)
    assert found["all_reduce"][0] == PASS and "exact" in found["all_reduce"][1]
    status, detail = found["bandwidth"]
    assert status == PASS
    algbw, busbw = (float(x) for x in re.search(r"algbw ([\d.]+) GB/s, busbw ([\d.]+) GB/s", detail).groups())
    assert algbw > 0 and busbw == pytest.approx(algbw, abs=0.011)  # 2 ranks: busbw = algbw x 2(2-1)/2
    assert float(re.search(r"a 4 KiB all_reduce takes ([\d.]+) ms", detail).group(1)) > 0
    assert found["gan step"][0] == PASS and "bitwise identical" in found["gan step"][1]
    assert found["backend"] == (PASS, "gloo on cpu (auto)")
    assert not [name for name, (s, _) in found.items() if s in (FAIL, SKIP)]
    assert list(tmp_path.iterdir()) == []  # the workers' files live in a temporary directory


def test_nccl_on_cpu_fails_names_the_fix_and_skips_the_launch(tmp_path):
    result = run_doctor("--nproc", "2", "--backend", "nccl", cwd=tmp_path)
    assert result.returncode == 1, explain(result)
    assert_well_formed(result.stdout)
    found = checks(result.stdout)
    status, detail = found["backend"]
    assert status == FAIL and "NCCL needs CUDA devices" in detail
    fix = result.stdout.split("FAIL  backend", 1)[1].split("      fix:   ", 1)[1].splitlines()[0]
    assert "--backend gloo" in fix and "--backend auto" in fix
    for name in ("all_reduce", "bandwidth", "gan step"):
        assert found[name][0] == SKIP
    assert "cause: FAIL above: backend" in result.stdout
    assert "NOT OK" in result.stdout.splitlines()[-1]



@pytest.mark.parametrize("variable, value", [("SLURM_NTASKS", "abc"), ("SLURM_GPUS_ON_NODE", "4(x2)"),
                                             ("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "abc")])
def test_a_malformed_count_train_refuses_fails_and_skips_the_launch(tmp_path, variable, value):
    job = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "1"} if variable.startswith("SLURM_") else {}
    result = run_doctor("--nproc", "1", cwd=tmp_path, env={**job, "OMP_NUM_THREADS": "1", variable: value})
    assert result.returncode == 1 and "Traceback" not in result.stderr, explain(result)  # was int()'s ValueError
    assert_well_formed(result.stdout)
    said = f"{value!r} is not"
    assert f"cause: {said}" in result.stdout and f"fix:   set {variable} to an integer" in result.stdout
    assert checks(result.stdout)["all_reduce"][0] == SKIP

@pytest.mark.slow
def test_p2p_disabled_is_a_warning_that_does_not_fail(tmp_path):
    result = run_doctor("--nproc", "1", cwd=tmp_path, env={"NCCL_P2P_DISABLE": "1", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, explain(result)  # WARN does not fail the doctor
    assert_well_formed(result.stdout)
    found = checks(result.stdout)
    assert found["env NCCL_P2P_DISABLE=1"][0] == WARN
    assert "P2P disabled: intra-node traffic goes through host memory" in result.stdout
    assert found["env OMP_NUM_THREADS=1"][0] == PASS
    assert "(WARN does not fail the doctor)" in result.stdout.splitlines()[-1]


@pytest.mark.slow
def test_an_exception_on_one_worker_fails_the_gan_step_naming_the_rank(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    result = run_doctor("--nproc", "2", cwd=tmp_path,
                        env={"GANSCALE_INJECT_FAULT": "raise@1:1", "OMP_NUM_THREADS": "1", "TMPDIR": str(temp)})
    assert result.returncode == 1, explain(result)
    assert_well_formed(result.stdout)
    found = checks(result.stdout)
    assert found["all_reduce"][0] == PASS and found["bandwidth"][0] == PASS
    assert found["gan step"][0] == FAIL
    assert "cause: rank 1: ganscale.fault.InjectedFault: injected fault on rank 1 at step 1" in result.stdout
    assert found["env GANSCALE_INJECT_FAULT=raise@1:1"][0] == WARN
    kept = list(temp.glob("ganscale-doctor-logs-*"))  # the workers' output outlives the run, and is named
    assert len(kept) == 1 and str(kept[0]) in result.stdout
    assert "InjectedFault" in "".join(p.read_text() for p in kept[0].glob("*/attempt_0/1/stderr.log"))


def test_help_explains_the_statuses():
    result = CliRunner().invoke(main, ["doctor", "--help"])
    assert result.exit_code == 0
    for word in ("--nproc", "--backend", "--device", "PASS", "WARN", "FAIL", "SKIP", "Exit code"):
        assert word in result.output


# ------------------------------------------------------------------------------------ helpers
def test_bus_bandwidth_is_nccl_tests_formula():
    assert doctor.algorithm_bandwidth(16 * 2**20, 0.01) == pytest.approx(16 * 2**20 / 0.01)
    assert doctor.bus_bandwidth(10.0, 1) == 0.0
    assert doctor.bus_bandwidth(10.0, 2) == pytest.approx(10.0)
    assert doctor.bus_bandwidth(10.0, 4) == pytest.approx(15.0)
    assert doctor.bus_bandwidth(10.0, 8) == pytest.approx(17.5)


@pytest.mark.parametrize("value, duplicates", [
    ("", []),
    ("0", []),
    ("0,1,2,3", []),
    ("0,0", ["0"]),
    ("0,1,2,1", ["1"]),
    (" 1, 01", ["01"]),            # CUDA reads indices like strtoul: 01 is 1
    ("1gpu,1", ["1"]),
    ("0,-1,0", []),                # a negative entry ends the list
    ("GPU-abc,GPU-def,GPU-abc", ["GPU-abc"]),
    ("MIG-x,MIG-x", ["MIG-x"]),
])
def test_visible_device_duplicates(value, duplicates):
    assert doctor.visible_device_duplicates(value) == duplicates


def test_driver_version_from_proc():
    assert doctor.parse_driver_version(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n"
        "GCC version:  gcc version 11.4.0") == "535.104.05"
    assert doctor.parse_driver_version(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15  Release Build") == "550.54.15"
    assert doctor.parse_driver_version("") is None


def test_resolve_follows_the_runtime():
    assert doctor.resolve("auto", "auto", cuda_available=False) == (False, "gloo")
    assert doctor.resolve("auto", "auto", cuda_available=True) == (True, "nccl")
    assert doctor.resolve("cpu", "auto", cuda_available=True) == (False, "gloo")
    assert doctor.resolve("cuda", "gloo", cuda_available=False) == (True, "gloo")


H100 = Gpu("NVIDIA H100 80GB HBM3", 80 * 2**30, 79 * 2**30)


def test_more_ranks_than_gpus_fails_with_the_fix():
    found = doctor.device_checks(4, "auto", True, True, "12.8", [H100, H100], {}, 16)
    assert [c.status for c in found] == [FAIL]
    assert "4 ranks but 2 GPU(s)" in found[0].detail
    assert "Duplicate GPU detected" in found[0].cause and "--nproc 2" in found[0].fix
    ok = doctor.device_checks(2, "auto", True, True, "12.8", [H100, H100], {}, 16)
    assert [c.status for c in ok] == [PASS] and "H100" in ok[0].detail and "80.0 GiB" in ok[0].detail


def test_duplicate_visible_devices_fail():
    found = doctor.device_checks(1, "auto", False, False, "12.8", [], {"CUDA_VISIBLE_DEVICES": "0,1,0"}, 2)
    assert found[0].status == FAIL and "0 twice" in found[0].detail and found[0].fix


def test_cuda_requested_without_cuda_names_the_reason():
    cpu_build = doctor.device_checks(1, "cuda", True, False, None, [], {}, 2)
    assert cpu_build[0].status == FAIL and "CPU build" in cpu_build[0].cause
    hidden = doctor.device_checks(1, "cuda", True, False, "12.8", [], {"CUDA_VISIBLE_DEVICES": ""}, 2)
    assert hidden[0].status == FAIL and "hides every GPU" in hidden[0].cause


def test_busy_gpu_and_oversubscribed_cpu_warn():
    busy = doctor.device_checks(1, "auto", True, True, "12.8", [Gpu("A100", 40 * 2**30, 2**20)], {}, 16)
    assert [c.status for c in busy] == [PASS, WARN]
    cpu = doctor.device_checks(4, "auto", False, False, None, [], {}, 2)
    assert cpu[0].status == WARN and "--nproc 2" in cpu[0].fix


def test_backend_for_the_hardware():
    nccl_cpu = doctor.backend_checks("nccl", "nccl", False, True, True)[0]
    assert nccl_cpu.status == FAIL and "NCCL needs CUDA devices; use gloo or --backend auto" in nccl_cpu.detail
    gloo_gpu = doctor.backend_checks("gloo", "gloo", True, True, True)[0]
    assert gloo_gpu.status == WARN and "slow" in gloo_gpu.detail and "nccl" in gloo_gpu.fix
    assert doctor.backend_checks("auto", "nccl", True, True, True)[0].status == PASS
    assert doctor.backend_checks("auto", "nccl", True, False, True)[0].status == FAIL  # build without NCCL


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs torch's CPU build")
def test_doctor_device_cuda_on_a_cpu_build_says_so(tmp_path):
    result = run_doctor("--device", "cuda", cwd=tmp_path)
    assert result.returncode == 1, explain(result)
    status, detail = checks(result.stdout)["backend"]
    assert status == FAIL and "this torch is a CPU build" in detail and "Windows" not in result.stdout


def test_nccl_on_a_cpu_build_of_torch_names_the_build_and_the_cuda_one():
    cpu_build = doctor.backend_checks("auto", "nccl", True, False, True, cuda_build=False)[0]
    assert cpu_build.status == FAIL and "CPU build" in cpu_build.detail
    assert "Windows" not in cpu_build.cause and "install the CUDA build of torch" in cpu_build.fix


def by_name(found: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in found}


def test_environment_variables_are_explained_when_set():
    env = {"NCCL_DEBUG": "INFO", "NCCL_P2P_DISABLE": "1", "NCCL_FOO": "x", "MASTER_PORT": "29500",
           "TORCH_DISTRIBUTED_DEBUG": "DETAIL", "OMP_NUM_THREADS": "1", "PATH": "/bin"}
    found = by_name(doctor.environment_checks(env, 2, 2, "nccl"))
    assert set(found) == {"env NCCL_DEBUG=INFO", "env NCCL_P2P_DISABLE=1", "env NCCL_FOO=x", "env MASTER_PORT=29500",
                          "env TORCH_DISTRIBUTED_DEBUG=DETAIL", "env OMP_NUM_THREADS=1"}
    assert found["env NCCL_DEBUG=INFO"].status == PASS
    assert found["env NCCL_DEBUG=INFO"].detail == doctor.ENV_EXPLANATIONS["NCCL_DEBUG"]
    p2p = found["env NCCL_P2P_DISABLE=1"]
    assert p2p.status == WARN and p2p.cause == "P2P disabled: intra-node traffic goes through host memory"
    assert found["env NCCL_FOO=x"].status == PASS and "NCCL setting" in found["env NCCL_FOO=x"].detail
    assert found["env TORCH_DISTRIBUTED_DEBUG=DETAIL"].status == WARN
    assert found["env OMP_NUM_THREADS=1"].status == PASS
    p2p_on = by_name(doctor.environment_checks({"NCCL_P2P_DISABLE": "0"}, 1, 2, "nccl"))
    assert p2p_on["env NCCL_P2P_DISABLE=0"].status == PASS


def test_omp_num_threads_against_the_cores():
    unset = by_name(doctor.environment_checks({}, 2, 8, "gloo"))["env OMP_NUM_THREADS"]
    assert unset.status == WARN and "OMP_NUM_THREADS=4" in unset.fix
    assert by_name(doctor.environment_checks({}, 1, 8, "gloo"))["env OMP_NUM_THREADS"].status == PASS
    over = by_name(doctor.environment_checks({"OMP_NUM_THREADS": "4"}, 4, 8, "gloo"))["env OMP_NUM_THREADS=4"]
    assert over.status == WARN and "16 threads on 8 cores" in over.detail and "OMP_NUM_THREADS=2" in over.fix
    ranks = by_name(doctor.environment_checks({"OMP_NUM_THREADS": "1"}, 3, 2, "gloo"))["env OMP_NUM_THREADS=1"]
    assert ranks.status == WARN and "run at most 2 ranks" in ranks.fix  # not the OMP_NUM_THREADS=1 it has
    bad = by_name(doctor.environment_checks({"OMP_NUM_THREADS": "many"}, 1, 8, "gloo"))["env OMP_NUM_THREADS=many"]
    assert bad.status == WARN


def test_stale_launcher_variables_warn():
    found = by_name(doctor.environment_checks({"RANK": "0", "MASTER_ADDR": "h", "OMP_NUM_THREADS": "1"}, 1, 2, "gloo"))
    assert found["env RANK=0"].status == WARN and "acts as one worker" in found["env RANK=0"].cause
    assert found["env MASTER_ADDR=h"].status == PASS


def test_a_launcher_variable_train_refuses_fails():
    env = {"MASTER_PORT": "abc", "RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "x",
           "OMP_NUM_THREADS": "1"}
    found = by_name(doctor.environment_checks(env, 1, 2, "gloo"))  # MASTER_PORT=abc was a PASS
    port = found["env MASTER_PORT=abc"]
    assert port.status == FAIL and "'abc' is not a port number (1-65535)" in port.cause and "MASTER_PORT" in port.fix
    assert found["env RANK=2"].status == FAIL and "not below WORLD_SIZE=2" in found["env RANK=2"].cause
    assert found["env LOCAL_WORLD_SIZE=x"].status == FAIL
    assert found["env WORLD_SIZE=2"].status == WARN and found["env LOCAL_RANK=0"].status == WARN  # well-formed
    fine = by_name(doctor.environment_checks({"MASTER_PORT": "29500"}, 1, 2, "gloo"))
    assert fine["env MASTER_PORT=29500"].status == PASS


@pytest.mark.parametrize("value, status", [("abc", FAIL), ("-1", FAIL), ("1.5", FAIL), ("0", PASS), ("120", PASS)])
def test_the_agent_grace_variable_is_explained_and_fails_where_train_refuses_it(value, status):
    found = by_name(doctor.environment_checks({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": value}, 1, 2, "gloo"))
    check = found[f"env TORCH_ELASTIC_SHUTDOWN_TIMEOUT={value}"]  # was unlisted, and read with int() by --nproc
    assert check.status == status and "SIGKILL" in check.detail
    if status == FAIL:
        assert f"{value!r} is not a number of seconds" in check.cause and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in check.fix


def test_every_warn_and_fail_prints_cause_and_fix():
    everything = {name: "1" for name in doctor.ENV_EXPLANATIONS}
    everything |= {"NCCL_ALGO": "Ring", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "CUDA_VISIBLE_DEVICES": "0,0"}
    produced = (doctor.environment_checks(everything, 8, 2, "nccl")
                + doctor.device_checks(8, "auto", True, True, "12.8", [H100], everything, 2)
                + doctor.backend_checks("nccl", "nccl", False, False, False)
                + doctor.backend_checks("gloo", "gloo", True, True, True))
    assert {c.status for c in produced} >= {PASS, WARN, FAIL}
    assert all(v.strip() for v in doctor.ENV_EXPLANATIONS.values())
    for check in produced:
        if check.status != PASS:
            assert check.cause and check.fix, check
            assert [line.split(":")[0].strip() for line in check.lines()[1:]] == ["cause", "fix"]
        else:
            assert len(check.lines()) == 1


# ------------------------------------------------------------------------------------ worker results
def finished_rank(rank: int, t: float = 1.0) -> dict:
    return {"rank": rank, "started": {"ok": True, "time": t}, "group": {"ok": True, "time": t},
            "collective": {"ok": True, "elements": 11, "time": t},
            "bandwidth": {"ok": True, "seconds": 0.01, "bytes": 16 * 2**20, "world": 2, "latency_seconds": 0.0012,
                          "time": t},
            "gan": {"ok": True, "steps": 2, "global_batch": 8, "micro_batch": 4, "skipped_steps": 0,
                    "seconds": 1.0, "time": t},
            "finished": {"ok": True, "time": t}}


def test_interpret_all_good():
    found = by_name(doctor._interpret(2, "2 ranks", {0: finished_rank(0), 1: finished_rank(1)}, {}, None, {}))
    assert [c.status for c in found.values()] == [PASS, PASS, PASS]
    assert "algbw 1.68 GB/s, busbw 1.68 GB/s" in found["bandwidth"].detail
    assert "a 4 KiB all_reduce takes 1.20 ms" in found["bandwidth"].detail


def test_interpret_names_the_rank_that_died_not_the_ones_it_broke():
    rank0 = finished_rank(0)
    rank0["gan"] = {"ok": False, "error": "RuntimeError: Connection closed by peer", "time": 5.0}
    del rank0["finished"]
    rank1 = finished_rank(1)
    rank1["gan"] = {"running": True, "time": 3.0}
    del rank1["finished"]
    found = by_name(doctor._interpret(2, "2 ranks", {0: rank0, 1: rank1}, {0: (-15, 6.0), 1: (-9, 4.0)}, None,
                                      {1: "Segmentation fault"}))
    assert [found[n].status for n in ("all_reduce", "bandwidth", "gan step")] == [PASS, PASS, FAIL]
    assert found["gan step"].cause == "rank 1 was killed by signal 9 during the gan step check: Segmentation fault"


def test_interpret_a_raising_rank_is_the_cause_not_the_rank_the_agent_stopped():
    rank0 = finished_rank(0)
    rank0["gan"] = {"ok": False, "error": "InjectedFault: injected fault on rank 0 at step 0", "time": 3.0}
    rank1 = finished_rank(1)
    rank1["gan"] = {"running": True, "time": 2.0}
    found = by_name(doctor._interpret(2, "2 ranks", {0: rank0, 1: rank1}, {0: (1, 3.5), 1: (-15, 4.0)}, None, {}))
    assert found["gan step"].status == FAIL
    assert found["gan step"].cause == "rank 0: InjectedFault: injected fault on rank 0 at step 0"


def test_interpret_earliest_error_is_the_cause_and_a_failed_group_skips_the_rest():
    rank0 = {"rank": 0, "started": {"ok": True, "time": 1.0}, "group": {"ok": False, "error": "late", "time": 9.0}}
    rank1 = {"rank": 1, "started": {"ok": True, "time": 1.0}, "group": {"ok": False, "error": "first", "time": 2.0}}
    found = by_name(doctor._interpret(2, "2 ranks", {0: rank0, 1: rank1}, {}, None, {}))
    assert [c.status for c in found.values()] == [FAIL, SKIP, SKIP]
    assert found["all_reduce"].cause == "rank 1: first (then rank(s) 0 failed too)"


def test_interpret_a_crash_after_every_check_finished_is_only_a_warning():
    found = doctor._interpret(2, "2 ranks", {0: finished_rank(0), 1: finished_rank(1)}, {1: (-6, 1.0)}, None, {})
    assert [c.status for c in found] == [PASS, PASS, PASS, WARN]


def test_slurm_section_reports_the_layout_and_names_the_classic_mistakes():
    from ganscale import doctor

    assert doctor.slurm_checks({}) == []
    job = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NNODES": "2",
           "SLURM_GPUS_ON_NODE": "4", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_ID": "0"}
    fine = doctor.slurm_checks(job)
    assert [c.status for c in fine] == ["PASS"]
    assert "2 node(s), 8 task(s) (4 per node), 4 GPU(s) per node, rendezvous on gpu07" in fine[0].detail
    batch_shell = {k: v for k, v in job.items() if k != "SLURM_STEP_ID"}
    assert "srun ganscale train" in doctor.slurm_checks(batch_shell)[1].fix
    wrong = doctor.slurm_checks({**job, "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS": "4"})
    assert wrong[1].status == "FAIL" and "--ntasks-per-node=4" in wrong[1].fix
    no_gpus = doctor.slurm_checks({k: v for k, v in job.items() if k != "SLURM_GPUS_ON_NODE"})
    assert "0 GPU(s) per node" in no_gpus[0].detail  # Slurm unsets it in a job without GPUs
    assert "0 GPU(s) per node" in doctor.slurm_checks({**job, "SLURM_GPUS_ON_NODE": ""})[0].detail


@pytest.mark.parametrize("variable, value, said", [
    ("SLURM_NTASKS", "abc", "'abc' is not a task count"), ("SLURM_NTASKS", "4(x2)", "'4(x2)' is not a task count"),
    ("SLURM_NTASKS", "0", "'0' is not a task count"), ("SLURM_GPUS_ON_NODE", "4(x2)", "'4(x2)' is not a GPU count"),
    ("SLURM_GPUS_ON_NODE", "gpu:4", "'gpu:4' is not a GPU count")])
def test_a_malformed_slurm_count_fails_the_slurm_section_where_it_raised(variable, value, said):
    job = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_ID": "0", variable: value}
    [check] = doctor.slurm_checks(job)  # was int()'s ValueError, ending the doctor in a traceback
    assert check.status == FAIL and f"{variable}={value!r}" in check.detail
    assert check.cause.startswith(said) and check.cause.endswith("`ganscale train` refuses it")
    assert check.fix.startswith(f"set {variable} to an integer from ")


@pytest.mark.parametrize("variable, value, said", [
    ("SLURM_TASKS_PER_NODE", "2(x", "'2(x' is not Slurm's list of tasks per node"),
    ("SLURM_TASKS_PER_NODE", "", "'' is not Slurm's list of tasks per node"),
    ("SLURM_RESTART_COUNT", "abc", "'abc' is not a requeue count"), ("SLURM_JOB_ID", "abc", "'abc' is not a job id"),
    ("SLURM_PROCID", "x", "'x' is not a task rank"), ("SLURM_PROCID", "8", "8 is not below SLURM_NTASKS=8"),
    ("SLURM_JOB_NODELIST", "[07-08]", "'[07-08]' is not a node list")])
def test_a_malformed_slurm_variable_train_refuses_fails_the_slurm_section(variable, value, said):
    job = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_GPUS_ON_NODE": "4",
           "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_ID": "0", variable: value}
    [check] = doctor.slurm_checks(job)  # SLURM_TASKS_PER_NODE was a TypeError's traceback; the others unchecked
    assert check.status == FAIL and f"{variable}={value!r}" in check.detail
    assert check.cause.startswith(said) and check.cause.endswith("`ganscale train` refuses it")
    assert check.fix.startswith(f"set {variable} ")


# ------------------------------------------------------------------------------------ torch range
def test_torch_inside_the_checked_range_passes():
    check = doctor.torch_check("2.14.1+cu130")
    assert check.status == PASS and "2.14.1" in check.detail and "2.11 through 2.15" in check.detail


def test_torch_inside_the_range_names_a_feature_it_lacks():
    check = doctor.torch_check("2.11.0+cu130")
    assert check.status == PASS and "2.11.0" in check.detail
    assert "lacks grid-sample-double-backward (R1" in check.detail and "; launcher-grace (train --nproc" in check.detail
    assert "all features" in doctor.torch_check("2.12.1").detail


def test_torch_older_than_the_range_fails_and_names_only_what_it_is_known_to_lack():
    check = doctor.torch_check("2.5.1")
    assert check.status == FAIL and "older than the supported range" in check.detail
    assert "fsdp (parallel strategies zero2, fsdp, hsdp" in check.cause and "pipeline" not in check.cause
    lacks, _, unchecked = check.cause.partition("; not checked whether it has: ")
    assert unchecked == "compile-callbacks, flight-recorder"  # read only from 2.11 on: not known to be missing
    assert "compile-callbacks" not in lacks and "flight-recorder" not in lacks
    assert "torch>=2.11" in check.fix
    cause = doctor.torch_check("2.10.0").cause
    assert cause.startswith("ganscale does not support it; it lacks: grid-sample-double-backward (R1")
    assert cause.endswith("; not checked whether it has: compile-callbacks, flight-recorder")


def test_torch_newer_than_the_checked_range_warns_to_run_the_tests_on_this_environment():
    check = doctor.torch_check("2.16.0")
    assert check.status == WARN and "newer than the checked range" in check.detail
    assert f"`GANSCALE_VENV={sys.prefix} scripts/test.sh`" in check.fix  # bootstrap's venv is this one, not .venv


def test_doctor_fails_on_a_running_torch_older_than_the_range(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.10.0")
    found = {c.name: c for c in doctor.version_checks("gloo", False, False, "")}
    assert found["torch"].status == FAIL and "2.10.0" in found["torch"].detail
