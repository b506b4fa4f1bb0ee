"""`ganscale slurm`: the sbatch script it writes and submits, its refusals, and the script's stop on a signal (run
with stand-ins for srun and scontrol, no Slurm needed)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_cli import clean_env, explain

CPU_JOB = ["digits", "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2"]


def slurm(*args: str, cwd: Path, path_dirs: tuple[Path, ...] = (), system_path: bool = True) -> subprocess.CompletedProcess:
    env = clean_env()
    system = ["/usr/bin", "/bin"] if system_path else []  # without: no real sbatch, where Slurm is installed
    env["PATH"] = os.pathsep.join([*map(str, path_dirs), os.path.dirname(sys.executable), *system])
    return subprocess.run([sys.executable, "-m", "ganscale", "slurm", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def tool(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/bash\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def fake_sbatch(folder: Path, job_id: str = "4242") -> Path:
    """sbatch that records the script it was given and answers as `sbatch --parsable` does."""
    return tool(folder, "sbatch", f'echo "$@" >> {folder}/sbatch.calls\necho "{job_id};cluster"').parent


def test_dry_run_prints_the_script_and_writes_nothing(tmp_path):
    result = slurm(*CPU_JOB, "--set", "train.steps=4", "--time", "01:00:00", "--partition", "debug",
                   "--run-dir", "run", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    text = result.stdout
    for line in ["#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --cpus-per-task=2",
                 "#SBATCH --time=01:00:00",
                 "#SBATCH --partition=debug", "#SBATCH --signal=B:USR1@55", "#SBATCH --requeue",
                 f"#SBATCH --output={tmp_path}/run/slurm/%j.out",
                 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1',
                 "RDZV_PORT=$((10000 + (SLURM_JOB_ID + 7919 * ${SLURM_RESTART_COUNT:-0}) % 20000))",
                 '--rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID"',
                 '--nnodes "$SLURM_NNODES" --nproc-per-node 2',
                 f'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" {sys.executable} -m '
                 "ganscale.torchrun",
                 '-m ganscale train digits --set train.steps=4 --resume auto --run-dir "$RUN_DIR" &',
                 'scontrol requeue "$SLURM_JOB_ID"', "trap 'stop USR1' USR1", "trap 'stop TERM' TERM",
                 'scancel --signal=TERM "$SLURM_JOB_ID"']:
        assert line in text, line
    assert "--gpus-per-node" not in text
    assert not (tmp_path / "run").exists()


def test_gpu_job_asks_for_gpus_and_one_process_each(tmp_path):
    result = slurm("digits", "--nodes", "2", "--gpus-per-node", "4", "--no-requeue", "--signal-lead", "120",
                   "--set", "train.device=auto", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert "#SBATCH --gpus-per-node=4" in result.stdout and "--nproc-per-node 4" in result.stdout
    assert "#SBATCH --no-requeue" in result.stdout and "#SBATCH --signal=B:USR1@120" in result.stdout
    assert "#SBATCH --nodes=2" in result.stdout


def test_the_job_asks_for_cpus_for_every_process_and_loader_of_a_node(tmp_path):
    """--ntasks-per-node=1 without --cpus-per-task was one CPU per node: under task/affinity or cgroups torchrun,
    every worker and its loaders shared one core. Default: processes per node x (1 + data.workers)."""
    cases = [([*CPU_JOB, "--set", "data.workers=3"], 8), ([*CPU_JOB, "--cpus-per-node", "5"], 5),
             (["digits", "--nodes", "2", "--gpus-per-node", "4", "--set", "train.device=auto"], 4)]
    for args, cpus in cases:
        result = slurm(*args, "--dry-run", cwd=tmp_path)
        assert result.returncode == 0, explain(result)
        assert f"#SBATCH --cpus-per-task={cpus}  #" in result.stdout, result.stdout
        assert 'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" ' in result.stdout


def test_submits_with_sbatch_and_keeps_an_earlier_script(tmp_path):
    bin_dir = fake_sbatch(tmp_path / "bin")
    first = slurm(*CPU_JOB, "--set", "train.steps=4", "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,))
    assert first.returncode == 0, explain(first)
    script = tmp_path / "run" / "slurm" / "job.sbatch"
    assert "job 4242" in first.stdout and str(script) in first.stdout
    assert (bin_dir / "sbatch.calls").read_text().split() == ["--parsable", str(script)]
    before = script.read_text()
    second = slurm(*CPU_JOB, "--set", "train.steps=8", "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,))
    assert second.returncode == 0, explain(second)
    assert (tmp_path / "run" / "slurm" / "job.1.sbatch").read_text() == before
    assert "train.steps=8" in script.read_text()


def test_a_config_file_is_named_by_its_absolute_path(tmp_path):
    (tmp_path / "my.yaml").write_text("train: {steps: 4}\n")
    result = slurm("my.yaml", "--nodes", "1", "--gpus-per-node", "0", "--procs-per-node", "2", "--dry-run",
                   cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert f"-m ganscale train {tmp_path}/my.yaml --resume auto" in result.stdout


def _refused(result: subprocess.CompletedProcess, option: str) -> None:
    assert result.returncode == 2, explain(result)
    assert option in result.stderr and len(result.stderr.strip().splitlines()) == 1, explain(result)
    assert "Traceback" not in result.stderr


def test_bad_input_exits_2_submits_and_writes_nothing(tmp_path):
    bin_dir = fake_sbatch(tmp_path / "bin")
    cases = [
        (["digits", "--nodes", "1", "--gpus-per-node", "0"], "--procs-per-node"),
        ([*CPU_JOB, "--time", "90 minutes"], "--time"),
        ([*CPU_JOB, "--time", "00:01:00"], "--signal-lead"),  # the default 55 s lead: signalled as it starts
        ([*CPU_JOB, "--time", "00:02:00", "--signal-lead", "90"], "--signal-lead"),
        ([*CPU_JOB, "--set", "train.batch_size=63"], "train.batch_size"),
        (["digits", "--nodes", "1", "--gpus-per-node", "2", "--procs-per-node", "3"], "--procs-per-node"),
        ([*CPU_JOB, "--cpus-per-node", "1"], "--cpus-per-node 2"),  # fewer CPUs than processes
    ]
    for args, option in cases:
        _refused(slurm(*args, "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,)), option)
    _refused(slurm(*CPU_JOB, "--run-dir", "run", cwd=tmp_path, system_path=False), "sbatch")  # not on PATH
    assert not (tmp_path / "run").exists() and not (bin_dir / "sbatch.calls").exists()


def test_a_percent_in_the_run_directory_stays_a_percent_in_the_log_paths(tmp_path):
    """#SBATCH --output/--error are Slurm filename patterns (%j: the job id, %%: a %): a run directory's own %
    (lr5%u) was read as %u, the user name, and the job failed with its log nowhere while ganscale said submitted.
    (tests/test_slurm_real.py runs a job in such a folder.)"""
    result = slurm(*CPU_JOB, "--run-dir", "lr5%u it's", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    run = f"{tmp_path}/lr5%u it's"
    pattern = run.replace("%", "%%") + "/slurm/%j"
    expected = [f"#SBATCH --output={shlex.quote(pattern + '.out')}",
                f"#SBATCH --error={shlex.quote(pattern + '.err')}", f"RUN_DIR={shlex.quote(run)}"]  # bash: % as it is
    for line in expected:
        assert line in result.stdout.splitlines(), line


def test_a_value_that_would_break_a_line_of_the_script_is_refused_before_anything_is_written(tmp_path):
    """A newline in a value ended its #SBATCH line, and the rest was a command the batch shell ran (and sbatch read
    no #SBATCH line after it); a backslash in an #SBATCH value is dropped by sbatch. Refused with one line naming the
    option: nothing written, nothing submitted."""
    bin_dir = fake_sbatch(tmp_path / "bin")
    cases = [
        ([*CPU_JOB, "--partition", "gpu\necho a command"], "--partition"),
        ([*CPU_JOB, "--account", "lab\rx"], "--account"),
        ([*CPU_JOB, "--time", "01:00:00\n"], "--time"),
        ([*CPU_JOB, "--set", "train.steps=4\n"], "--set"),
        (["digits\n", *CPU_JOB[1:]], "RECIPE"),
        ([*CPU_JOB, "--partition", "gpu\\x"], "--partition"),
    ]
    for args, option in cases:
        _refused(slurm(*args, "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,)), f"'{option}'")
    for run_dir in ["run\nx", "back\\slash"]:
        _refused(slurm(*CPU_JOB, "--run-dir", run_dir, cwd=tmp_path, path_dirs=(bin_dir,)), "'--run-dir'")
    # The working directory is part of a relative run directory's path, which the script holds.
    odd = tmp_path / "a\nb"
    odd.mkdir()
    _refused(slurm(*CPU_JOB, "--run-dir", "run", cwd=odd, path_dirs=(bin_dir,)), "'--run-dir'")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a\nb", "bin"] and not list(odd.iterdir())
    assert not (bin_dir / "sbatch.calls").exists()


def test_sbatch_refusal_is_one_line_and_leaves_the_run_directory_as_it_was(tmp_path):
    """The refused job's script stayed in the run directory (made for it), or replaced an earlier script."""
    bin_dir = tool(tmp_path / "bin", "sbatch", 'echo "sbatch: error: invalid partition specified: gpu" >&2; exit 1').parent
    _refused(slurm(*CPU_JOB, "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,)), "invalid partition")
    assert not (tmp_path / "run").exists()
    _refused(slurm(*CPU_JOB, "--run-dir", "new/runs/run", cwd=tmp_path, path_dirs=(bin_dir,)), "invalid partition")
    assert not (tmp_path / "new").exists()  # nor the folders above the run directory it made
    scripts = tmp_path / "kept" / "slurm"
    scripts.mkdir(parents=True)
    (scripts / "job.sbatch").write_text("#!/bin/bash\n# submitted before\n")
    (scripts / "job.1.sbatch").write_text("#!/bin/bash\n# kept before\n")
    before = {p.name: p.read_text() for p in scripts.iterdir()}
    _refused(slurm(*CPU_JOB, "--run-dir", "kept", cwd=tmp_path, path_dirs=(bin_dir,)), "invalid partition")
    assert {p.name: p.read_text() for p in scripts.iterdir()} == before


def test_an_sbatch_that_cannot_reach_slurm_is_told_to_run_where_it_can(tmp_path):
    """sbatch without a configuration source was told to fix --partition, --account, --time or --nodes."""
    from ganscale.slurm import sbatch_fix

    for said in ["sbatch: fatal: Could not establish a configuration source",
                 "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"]:
        assert "login node whose sbatch reaches the controller (check `sinfo`" in sbatch_fix(said), said
    for said in ["sbatch: error: Batch job submission failed: Invalid account or account/partition combination "
                 "specified", "sbatch: error: Batch job submission failed: Requested node configuration is not "
                 "available", "sbatch: error: invalid partition specified: gpu"]:
        assert sbatch_fix(said).startswith("fix the option it names (--partition"), said
    bin_dir = tool(tmp_path / "bin", "sbatch",
                   'echo "sbatch: fatal: Could not establish a configuration source" >&2; exit 1').parent
    refused = slurm(*CPU_JOB, "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,))
    _refused(refused, "configuration source")
    assert "check `sinfo`" in refused.stderr and "--partition" not in refused.stderr


def _script_env(bin_dir: Path) -> dict:
    env = clean_env()
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", SLURM_JOB_ID="77", SLURM_JOB_NODELIST="localhost",
               SLURM_NNODES="1", SLURM_CPUS_PER_TASK="2", GLOO_SOCKET_IFNAME="lo")
    return env


@pytest.mark.parametrize("signum, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_the_script_stops_on_a_signal_checkpoints_and_requeues_only_on_usr1(tmp_path, signum, requeued):
    """The batch shell, given Slurm's signal, stops torchrun's workers: they checkpoint, the job exits with the
    preempted code (3); only USR1 (the time limit's) asks scontrol to requeue it: a SIGTERM (plain scancel) was
    requeued too, so the job never ended."""
    bin_dir = tmp_path / "bin"
    tool(bin_dir, "srun", 'while [[ $1 == --* ]]; do shift; done; exec "$@"')  # srun's options: one task, here
    tool(bin_dir, "scontrol", f'if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> {bin_dir}/scontrol.calls; fi')
    # scancel --signal=TERM JOB: SIGTERM to the job step's processes (here: this job's torchrun and its workers)
    tool(bin_dir, "scancel", f'echo "$@" >> {bin_dir}/scancel.calls; pkill -TERM -f "run-dir {tmp_path}/run"')
    written = slurm(*CPU_JOB, "--set", "train.steps=100000", "--set", "log.every=1", "--set", "checkpoint.every=100000",
                    "--run-dir", "run", "--dry-run", cwd=tmp_path)
    assert written.returncode == 0, explain(written)
    script = tmp_path / "job.sbatch"
    script.write_text(written.stdout)
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=_script_env(bin_dir), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 150
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3) and job.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    job.send_signal(signum)
    out, _ = job.communicate(timeout=120)
    assert job.returncode == 3 and "Traceback" not in out, out  # torchrun's SignalException was one
    assert list((tmp_path / "run" / "checkpoints").glob("step-*")), out
    assert (bin_dir / "scontrol.calls").exists() == requeued, out
    if requeued:
        assert (bin_dir / "scontrol.calls").read_text().split() == ["requeue", "77"]
    assert (bin_dir / "scancel.calls").read_text().split() == ["--signal=TERM", "77"]


def test_the_job_s_torchrun_ends_a_worker_failure_with_one_line_and_the_worker_s_exit_code(tmp_path):
    """torch.distributed.run printed its ChildFailedError traceback after the worker's line, and exited 1 for any
    failure; ganscale.torchrun is the same agent, ended as `ganscale train --nproc` ends."""
    result = subprocess.run([sys.executable, "-m", "ganscale.torchrun", "--standalone", "--nproc-per-node", "2",
                             "-m", "ganscale", "train", "ring8", "--set", "train.steps=2", "--set", "data.kind=folder",
                             "--set", "data.path=missing", "--run-dir", "run"], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, explain(result)
    assert "config error at 'data.path'" in result.stderr, explain(result)
    assert result.stderr.splitlines()[-1].startswith("ganscale: worker rank"), explain(result)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM])
def test_a_stop_that_wrote_no_checkpoint_exits_with_the_failure_and_is_not_requeued(tmp_path, signum):
    """A stop whose checkpoint failed (exit 7; torchrun exits 1 for it) exited 3 and was requeued. Now only a run
    whose summary.json, written after this start, says stopped=preempted counts as stopped with a checkpoint; an
    earlier run's summary saying so does not."""
    bin_dir = tmp_path / "bin"
    # torchrun's workers, stopping: they fail to write the stop's checkpoint, so no summary; torchrun exits 1
    tool(bin_dir, "srun", "trap 'exit 1' TERM; while :; do sleep 0.1; done")
    tool(bin_dir, "scontrol", f'if [ "$1" = show ]; then echo 127.0.0.1; else echo "$@" >> {bin_dir}/scontrol.calls; fi')
    tool(bin_dir, "scancel", f'echo "$@" >> {bin_dir}/scancel.calls; pkill -TERM -f "^/bin/bash {bin_dir}/srun"')
    written = slurm(*CPU_JOB, "--run-dir", "run", "--dry-run", cwd=tmp_path)
    assert written.returncode == 0, explain(written)
    script = tmp_path / "job.sbatch"
    script.write_text(written.stdout)
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"stopped": "preempted"}, indent=2))  # an earlier job's
    os.utime(run / "summary.json", (time.time() - 60, time.time() - 60))
    job = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=_script_env(bin_dir), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    time.sleep(1)
    job.send_signal(signum)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 1, out + err
    assert "wrote no checkpoint of the stop (exit 1" in err and "not requeued" in err, err
    assert not (bin_dir / "scontrol.calls").exists()


def test_a_requeued_job_says_so_and_records_it_in_the_summary(tmp_path):
    env = clean_env()
    env.update(SLURM_JOB_ID="77", SLURM_RESTART_COUNT="2")
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "ring8", "--set", "train.steps=2",
                             "--run-dir", "run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, explain(result)
    assert "Slurm job 77, requeued 2 times" in result.stdout
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["requeues"] == 2


def test_a_requeued_job_s_run_rendezvouses_on_a_port_of_its_own():
    """A requeued job keeps its id: its next run's port differs from its last (whose store may still be winding
    down on a busy node), for the torchrun agents (job.sbatch's RDZV_PORT) and srun tasks (MASTER_PORT) alike."""
    from ganscale.slurm import RDZV_PORT_LINE, rendezvous_port, task_environment

    for job_id, requeues in [(2, 0), (2, 1), (2, 2), (19999, 3), (123456, 0)]:
        env = {**os.environ, "SLURM_JOB_ID": str(job_id), "SLURM_RESTART_COUNT": str(requeues)}
        port = subprocess.run(["bash", "-c", f'{RDZV_PORT_LINE}\necho "$RDZV_PORT"'], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()
        assert int(port) == rendezvous_port(job_id, requeues)
        tasks = {"SLURM_JOB_ID": str(job_id), "SLURM_RESTART_COUNT": str(requeues), "SLURM_NTASKS": "2",
                 "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODELIST": "n1",
                 "SLURM_TASKS_PER_NODE": "2"}
        assert task_environment(tasks, None)["MASTER_PORT"] == port
    runs = [rendezvous_port(2, requeues) for requeues in range(4)]
    assert len(set(runs)) == 4 and all(10000 <= port < 30000 for port in runs)
    assert rendezvous_port(2, 0) == 10002  # a job never requeued: the port of its id, as before


def srun_task(proc_id: int, tasks: int, job_id: int, **extra: str) -> dict[str, str]:
    """The environment srun gives one task of a one-node job step."""
    env = clean_env()
    env.update(SLURM_JOB_ID=str(job_id), SLURM_STEP_ID="0", SLURM_PROCID=str(proc_id), SLURM_LOCALID=str(proc_id),
               SLURM_NTASKS=str(tasks), SLURM_TASKS_PER_NODE=str(tasks), SLURM_NODELIST="localhost",
               GLOO_SOCKET_IFNAME="lo", **extra)
    return env


def test_srun_tasks_train_as_one_world(tmp_path):
    import socket

    from ganscale.slurm import PORT_BASE

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ganscale", "train", "ring8", "--set", "train.steps=2", "--run-dir", "run"]
    tasks = [subprocess.Popen(command, cwd=tmp_path, env=srun_task(rank, 2, port - PORT_BASE), text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    outputs = [task.communicate(timeout=240)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 2


def test_srun_layouts_that_cannot_work_are_refused(tmp_path):
    from ganscale.config import ConfigError
    from ganscale.slurm import first_host, task_environment

    assert first_host("node[03-05,9],gpu1") == "node03" and first_host("localhost") == "localhost"
    batch_shell = {k: v for k, v in srun_task(0, 2, 5).items() if k != "SLURM_STEP_ID"}
    wrong_gpus = srun_task(0, 2, 5, SLURM_GPUS_ON_NODE="4")
    for environ, nproc, option in [(batch_shell, None, "srun"), (srun_task(0, 2, 5), 2, "--nproc"),
                                   (wrong_gpus, None, "--ntasks-per-node=4")]:
        try:
            task_environment(environ, nproc)
        except ConfigError as e:
            assert option in str(e)
        else:
            raise AssertionError(f"not refused: {option}")
    refused = subprocess.run([sys.executable, "-m", "ganscale", "train", "ring8", "--run-dir", "run"], cwd=tmp_path,
                             env=batch_shell, capture_output=True, text=True, timeout=120)
    _refused(refused, "srun")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("variable, value, said", [
    ("SLURM_NTASKS", "abc", "'abc' is not a task count"), ("SLURM_NTASKS", "2(x1)", "'2(x1)' is not a task count"),
    ("SLURM_GPUS_ON_NODE", "4(x2)", "'4(x2)' is not a GPU count"),
    ("SLURM_GPUS_ON_NODE", "gpu:2", "'gpu:2' is not a GPU count")])
def test_srun_tasks_refuse_a_malformed_slurm_count_by_name(variable, value, said):
    """Slurm writes SLURM_NTASKS and SLURM_GPUS_ON_NODE as plain counts (the "2(x3)" lists are other variables):
    anything else was int()'s ValueError and a traceback."""
    from ganscale.config import ConfigError
    from ganscale.slurm import task_environment

    with pytest.raises(ConfigError) as refused:
        task_environment({**srun_task(0, 2, 5), variable: value}, None)
    assert refused.value.key == variable and refused.value.problem.startswith(said)
    assert refused.value.fix.startswith(f"set {variable} to an integer from ")


@pytest.mark.parametrize("variable, value, said", [
    ("SLURM_PROCID", None, "unset in a task of this 2-task job step"), ("SLURM_LOCALID", "", "unset in a task"),
    ("SLURM_NODELIST", None, "unset in a task"), ("SLURM_PROCID", "one", "'one' is not a task rank"),
    ("SLURM_PROCID", "2", "2 is not below SLURM_NTASKS=2"), ("SLURM_NODELIST", ",node1", "',node1' is not a node list")])
def test_srun_tasks_refuse_a_missing_or_malformed_rank_or_node_list_by_name(variable, value, said):
    """A task environment without SLURM_PROCID, SLURM_LOCALID or SLURM_NODELIST was a KeyError's traceback, and a
    malformed rank was refused as RANK's, a variable the user never set."""
    from ganscale.config import ConfigError
    from ganscale.slurm import task_environment

    environ = {k: v for k, v in srun_task(0, 2, 5).items() if k != variable}
    with pytest.raises(ConfigError) as refused:
        task_environment(environ if value is None else {**environ, variable: value}, None)
    assert refused.value.key == variable and refused.value.problem.startswith(said)


def test_srun_tasks_read_slurm_s_own_counts():
    from ganscale.slurm import task_environment

    for gpus in ("2", "", None):  # Slurm's count, and none (Slurm unsets it without GPUs; empty reads as unset)
        extra = {} if gpus is None else {"SLURM_GPUS_ON_NODE": gpus}
        environment = task_environment({**srun_task(1, 2, 5), "SLURM_TASKS_PER_NODE": "2(x1)", **extra}, None)
        assert environment["WORLD_SIZE"] == "2" and environment["LOCAL_WORLD_SIZE"] == "2"
    assert task_environment(srun_task(0, 1, 5, SLURM_GPUS_ON_NODE="1"), None) == {}


def test_a_malformed_slurm_count_is_one_line_and_exit_2_before_anything_is_written(tmp_path):
    refused = subprocess.run([sys.executable, "-m", "ganscale", "train", "ring8", "--run-dir", "run"], cwd=tmp_path,
                             env={**srun_task(0, 2, 5), "SLURM_NTASKS": "abc"}, capture_output=True, text=True,
                             timeout=120)
    _refused(refused, "'SLURM_NTASKS': 'abc' is not a task count")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("variable, value, said", [
    ("SLURM_JOB_ID", "abc", "'abc' is not a job id"), ("SLURM_JOB_ID", "", "'' is not a job id"),
    ("SLURM_JOB_ID", "12.5", "'12.5' is not a job id"),
    ("SLURM_RESTART_COUNT", "abc", "'abc' is not a requeue count"),
    ("SLURM_RESTART_COUNT", "-1", "'-1' is not a requeue count"),
    ("SLURM_TASKS_PER_NODE", "abc", "'abc' is not Slurm's list of tasks per node"),
    ("SLURM_TASKS_PER_NODE", "2(x", "'2(x' is not Slurm's list of tasks per node"),
    ("SLURM_TASKS_PER_NODE", "", "'' is not Slurm's list of tasks per node"),
    ("SLURM_TASKS_PER_NODE", "2(x1),", "'2(x1),' is not Slurm's list of tasks per node")])
def test_srun_tasks_refuse_a_malformed_job_id_requeue_count_or_tasks_list_by_name(variable, value, said):
    """int() of SLURM_JOB_ID and SLURM_RESTART_COUNT, and tasks_per_node's match, were a ValueError or TypeError
    and a traceback."""
    from ganscale.config import ConfigError
    from ganscale.slurm import task_environment

    with pytest.raises(ConfigError) as refused:
        task_environment({**srun_task(0, 2, 5), variable: value}, None)
    assert refused.value.key == variable and refused.value.problem.startswith(said)
    assert refused.value.fix.startswith(f"set {variable} ") and "unset it (Slurm sets it in " in refused.value.fix


def test_srun_tasks_read_every_value_slurm_writes():
    """Slurm's compressed tasks-per-node lists; a job id as written in a task ("%d": a federated job's, cluster id
    in bits 26-31, can be negative) or for the allocation ("%u"), an array's or heterogeneous job's alike; no
    requeue count outside a batch job, and an empty one, read as 0."""
    from ganscale.slurm import PORT_BASE, PORT_SPAN, requeue_count, task_environment, tasks_per_node

    for value, first in [("2", 2), ("2(x3)", 2), ("2(x3),1", 2), ("1,2,1(x3),3,2", 1), ("0,2(x2)", 0)]:
        assert tasks_per_node(value) == first
    for job_id in ("1234", "-2080374783", "4227858433"):
        for restarts in ({}, {"SLURM_RESTART_COUNT": ""}, {"SLURM_RESTART_COUNT": "3"}):
            environ = {**srun_task(1, 2, 5), "SLURM_JOB_ID": job_id, **restarts}
            port = int(task_environment(environ, None)["MASTER_PORT"])
            assert PORT_BASE <= port < PORT_BASE + PORT_SPAN
            assert requeue_count(environ) == int(restarts.get("SLURM_RESTART_COUNT") or 0)


def test_the_requeue_count_is_read_only_in_a_job_and_refused_there_when_malformed():
    """It was int()'s ValueError wherever it was read: rank 0's start line and summary.json's requeues."""
    from ganscale.config import ConfigError
    from ganscale.slurm import requeue_count, start_line

    assert requeue_count({"SLURM_RESTART_COUNT": "abc"}) == 0 and start_line(None, {"SLURM_RESTART_COUNT": "x"}) is None
    said = start_line(None, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2"})
    assert said == "ganscale: Slurm job 77, requeued 2 times"
    with pytest.raises(ConfigError) as refused:
        start_line(None, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "2x"})
    assert refused.value.key == "SLURM_RESTART_COUNT"


def test_a_malformed_requeue_count_is_one_line_and_exit_2_before_anything_is_written(tmp_path):
    env = {**clean_env(), "SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "two"}  # a batch job's one process
    refused = subprocess.run([sys.executable, "-m", "ganscale", "train", "ring8", "--run-dir", "run"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=120)
    _refused(refused, "'SLURM_RESTART_COUNT': 'two' is not a requeue count")
    assert not (tmp_path / "run").exists()


def test_a_run_directory_a_live_run_of_this_host_holds_is_refused_at_submission(tmp_path, monkeypatch):
    """The job would be refused as it starts (its run.lock is held), after waiting in the queue: refused now, one
    line naming the holder, nothing written or submitted. Not for --dry-run (the script is submitted later, by
    hand), nor where the holder is a Slurm job's (this run's previous job, which may end or requeue first) or on
    another host (a lease says nothing of the time to come): the job's start judges those, as before."""
    from ganscale import runlock

    bin_dir = fake_sbatch(tmp_path / "bin")
    run = tmp_path / "run"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    held = runlock.hold(run)  # this process: `ganscale train --run-dir run` on the login node
    try:
        _refused(slurm(*CPU_JOB, "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,)), "is in use by the run")
        assert [p.name for p in run.iterdir()] == [runlock.LOCK_NAME] and not (bin_dir / "sbatch.calls").exists()
        printed = slurm(*CPU_JOB, "--run-dir", "run", "--dry-run", cwd=tmp_path)
        assert printed.returncode == 0 and "#SBATCH" in printed.stdout, explain(printed)
    finally:
        held.release()
    monkeypatch.setenv("SLURM_JOB_ID", "4100")
    held = runlock.hold(run)  # this run's previous job, still running here
    try:
        assert json.loads((run / runlock.LOCK_NAME).read_text())["slurm_job"] == "4100"
        submitted = slurm(*CPU_JOB, "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,))
        assert submitted.returncode == 0 and "submitted job 4242" in submitted.stdout, explain(submitted)
    finally:
        held.release()
    (run / runlock.LOCK_NAME).write_text(json.dumps({"host": "node07", "pid": 1, "pid_start": 1, "token": "theirs",
                                                     "started": "2026-11-24 20:31:05"}))  # a fresh lease elsewhere
    submitted = slurm(*CPU_JOB, "--run-dir", "run", cwd=tmp_path, path_dirs=(bin_dir,))
    assert submitted.returncode == 0 and "submitted job 4242" in submitted.stdout, explain(submitted)
