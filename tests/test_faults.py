"""Named early stops: preemption by a signal and persistent non-finite values (gloo, 2 ranks, and the CLI)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dist_helpers import on_rank1_after_step, poison_d_loss_on_rank1, resume_point, run_ranks, train_and_collect
from test_cli import clean_env
from test_distributed import SMALL_DCGAN, SMALL_MLP

pytestmark = pytest.mark.slow


def _sigterm_rank1_at_step(step: int):
    def hook(trainer):
        original = trainer.generator_step

        def generator_step(current, *args):
            if trainer.runtime.rank == 1 and current == step:
                os.kill(os.getpid(), signal.SIGTERM)  # delivered to this rank only, mid-step
            return original(current, *args)
        trainer.generator_step = generator_step
    return hook


def _preempt_then_resume(rank, world, overrides, root):
    from ganscale.fault import Preempted

    root = Path(root)
    straight = train_and_collect(rank, world, overrides, str(root / "straight"))
    try:
        train_and_collect(rank, world, overrides, str(root / "preempted"), steps_hook=_sigterm_rank1_at_step(4))
        stopped = None
    except Preempted as e:
        stopped = str(e)
    latest = resume_point(overrides, str(root / "preempted"))
    resumed = train_and_collect(rank, world, overrides, str(root / "preempted"), resume=latest)
    return {"stopped": stopped, "latest": latest.name, "straight": straight, "resumed": resumed}


def test_sigterm_on_one_rank_checkpoints_every_rank_and_resume_matches(tmp_path):
    overrides = {**SMALL_MLP, "train.steps": 12, "checkpoint.every": 100}
    ranks = run_ranks(_preempt_then_resume, 2, overrides, str(tmp_path))
    for result in ranks:
        assert result["stopped"] is not None and "step 5" in result["stopped"]
        assert result["latest"] == "step-00000005.pt"  # the step in flight finished, then a checkpoint
        for net in ("G", "D", "G_ema"):
            for key, value in result["straight"][net].items():
                assert torch.equal(value, result["resumed"][net][key]), f"{net}.{key}"


def _non_finite_stop(rank, world, overrides, run_dir, steps_hook, resume=None) -> str | None:
    """The message of the NonFiniteTraining that stopped this rank, or None."""
    from ganscale.fault import NonFiniteTraining

    try:
        train_and_collect(rank, world, overrides, run_dir, steps_hook=steps_hook, resume=resume)
    except NonFiniteTraining as e:
        return str(e)
    return None


def _persistent_nan(rank, world, overrides, run_dir, resume=None):
    return _non_finite_stop(rank, world, overrides, run_dir, poison_d_loss_on_rank1(lambda step: step >= 3), resume)


def test_persistent_non_finite_stops_every_rank_and_keeps_last_good_checkpoint(tmp_path):
    overrides = {**SMALL_MLP, "train.steps": 20, "checkpoint.every": 2, "fault.max_consecutive_skips": 3}
    messages = run_ranks(_persistent_nan, 2, overrides, str(tmp_path))
    assert all(m is not None and "3 consecutive steps" in m for m in messages)
    assert all("the last good checkpoint, step-00000004.pt, is kept" in m for m in messages)
    # Steps 4, 5 and 6 were skipped; the run stops at 6 without writing a checkpoint there. The newest
    # checkpoint (step 4, taken inside the streak) holds only weights from good steps: skipped steps never update.
    from ganscale import checkpoint
    latest = checkpoint.latest(tmp_path)
    assert latest.name == "step-00000004.pt"
    state = checkpoint.load(latest)
    assert all(torch.isfinite(t).all() for net in ("G", "D", "G_ema") for t in state[net].values())
    assert json.loads((tmp_path / "summary.json").read_text())["stopped"] == "non-finite"
    # Resumed inside the streak (one skip before step 4), it stops where the uninterrupted run did: the
    # checkpoint carries the streak, not a fresh allowance of 3.
    messages = run_ranks(_persistent_nan, 2, overrides, str(tmp_path), latest)
    assert all(m is not None and "3 consecutive steps" in m for m in messages)
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6
    # With no checkpoint yet, the message does not promise one.
    messages = run_ranks(_persistent_nan, 2, {**overrides, "checkpoint.every": 0}, str(tmp_path / "none"))
    assert all("no checkpoint was written" in m and "kept" not in m for m in messages)


def _non_finite_buffer(rank, world, overrides, run_dir):
    """After step 3, rank 1's D holds a NaN in a spectral-norm vector."""
    def poison(trainer):
        trainer.D.module.net[0].parametrizations.weight[0]._u[0] = float("nan")
    return _non_finite_stop(rank, world, overrides, run_dir, on_rank1_after_step(3, poison))


def test_a_non_finite_buffer_stops_every_rank_before_it_is_saved(tmp_path):
    overrides = {**SMALL_DCGAN, "train.steps": 6, "checkpoint.every": 2, "model.d_spectral_norm": "true"}
    messages = run_ranks(_non_finite_buffer, 2, overrides, str(tmp_path))
    name = "D.net.0.parametrizations.weight.0._u at step 4 holds NaN or infinite values"
    assert messages[1].startswith(name), messages[1]
    assert messages[0].startswith(f"rank 1 could not keep G, D and G_ema finite: {name}"), messages[0]
    assert all("the last good checkpoint, step-00000002.pt, is kept" in m for m in messages)
    from ganscale import checkpoint
    assert checkpoint.latest(tmp_path).name == "step-00000002.pt"  # step 4's was not written


def script_env() -> dict:
    """clean_env() with this checkout's ganscale importable, for `python -c` scripts."""
    import ganscale

    src = str(Path(ganscale.__file__).resolve().parent.parent)
    return {**clean_env(), "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def start_training(command: list[str], run: Path, **popen) -> subprocess.Popen:
    """Start `command` (a `ganscale train` into `run`) in run's parent; return once it has logged a step."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, **popen}
    process = subprocess.Popen(command, cwd=run.parent, env=clean_env(), text=True, **popen)
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert time.time() < deadline and process.poll() is None, "training never started"
        time.sleep(0.2)
    return process


def test_sigterm_to_the_whole_process_group_with_data_workers_still_checkpoints(tmp_path):
    """A job scheduler signals every process of the job, DataLoader workers included: they leave the stop to the
    trainer (killed, they made its next batch raise before it could checkpoint, and the run was lost)."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "ganscale", "train", "--run-dir", str(run), "--set", "data.workers=2",
               "--set", "train.steps=100000", "--set", "checkpoint.every=0", "--set", "log.every=10",
               "--set", "log.sample_every=0", "--set", "log.tensorboard=false"]
    trainer = start_training(command, run, start_new_session=True)
    os.killpg(trainer.pid, signal.SIGTERM)  # the trainer and its two data workers
    _, stderr = trainer.communicate(timeout=90)
    assert trainer.returncode == 3 and "Traceback" not in stderr, stderr[-3000:]
    assert len(list((run / "checkpoints").glob("step-*.pt"))) == 1


def test_sigterm_to_the_launcher_whose_workers_write_no_checkpoint_is_not_exit_3(tmp_path):
    """Exit 3 promises a checkpoint to resume from; here the stop's checkpoint cannot be written (a file named
    checkpoints where its folder goes): the launcher exits with the workers' code, 7, and names them."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("")
    command = [sys.executable, "-m", "ganscale", "train", "ring8", "--nproc", "2", "--run-dir", str(run),
               "--set", "log.every=10", "--set", "checkpoint.every=0", "--set", "train.steps=100000",
               "--set", "log.tensorboard=false"]
    launcher = start_training(command, run)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=90)
    assert launcher.returncode == 7, stderr[-3000:]
    assert "SIGTERM received; worker ranks 0, 1 failed with exit code 7" in stderr, stderr[-3000:]
    assert "asked to checkpoint" not in stderr, stderr[-3000:]


SMALL_RING8 = ["--set", "model.g_width=32", "--set", "model.d_width=32", "--set", "log.tensorboard=false"]


@pytest.mark.parametrize("launch, ignored", [([], False), (["--nproc", "2"], False), ([], True),
                                             (["--nproc", "2"], True)],
                         ids=["one-process", "nproc-2", "one-process-under-nohup", "nproc-2-under-nohup"])
def test_a_closing_terminal_s_sighup_stops_with_a_checkpoint_unless_nohup_ignores_it(tmp_path, launch, ignored):
    """SIGHUP (the terminal closed: an ssh session lost, a window shut) killed the run with no checkpoint and left
    its run.lock; it now stops as SIGTERM does (exit 3, a checkpoint), on one process and through the launcher. A run
    started under nohup (SIGHUP ignored) trains on through it, its launcher's agent told not to handle SIGHUP."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "ganscale", "train", "ring8", *launch, "--run-dir", str(run), "--set",
               "train.steps=100000", "--set", "log.every=10", "--set", "checkpoint.every=100000", *SMALL_RING8]
    # Set either way: a suite itself run under nohup hands its SIGHUP-ignoring disposition to every child.
    hangup = signal.SIG_IGN if ignored else signal.SIG_DFL
    trainer = start_training(command, run, preexec_fn=lambda: signal.signal(signal.SIGHUP, hangup))
    trainer.send_signal(signal.SIGHUP)
    if ignored:
        time.sleep(3)
        assert trainer.poll() is None, trainer.communicate()[1][-3000:]
        trainer.send_signal(signal.SIGTERM)
    _, stderr = trainer.communicate(timeout=90)
    stopped_by = "SIGTERM" if ignored else "SIGHUP"
    assert trainer.returncode == 3 and "Traceback" not in stderr, stderr[-3000:]
    assert f"on request ({stopped_by}); checkpoint written" in stderr, stderr[-3000:]
    assert len(list((run / "checkpoints").glob("step-*.pt"))) == 1 and not (run / "run.lock").exists()


@pytest.mark.parametrize("launch", [[], ["--nproc", "2"]], ids=["one-process", "nproc-2"])
def test_a_console_whose_reader_left_drops_its_output_and_training_goes_on(tmp_path, launch):
    """`ganscale train ... | head -2`: the first write after head left raised BrokenPipeError, and the run ended
    there (exit 1, nothing said; under --nproc a worker's traceback), without a checkpoint. Now its output is
    dropped, said once on stderr, and the run trains to its end."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "ganscale", "train", "ring8", *launch, "--run-dir", str(run), "--set",
               "train.steps=40", "--set", "log.every=1", *SMALL_RING8]
    with open(tmp_path / "stderr.txt", "w") as err:
        trainer = subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE, stderr=err,
                                   text=True)
        seen = [trainer.stdout.readline() for _ in range(2)]  # `| head -2`
        trainer.stdout.close()
        trainer.wait(timeout=120)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert all(seen) and trainer.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.count("ganscale: stdout has no reader any more (Broken pipe): its output is dropped from here; "
                        "training goes on") == 1, stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 40
    assert [p.name for p in (run / "checkpoints").glob("step-*.pt")] == ["step-00000040.pt"]


def test_sigterm_to_the_launcher_checkpoints_and_exits_3_then_resumes(tmp_path):
    run = tmp_path / "run"
    base = [sys.executable, "-m", "ganscale", "train", "ring8", "--nproc", "2", "--run-dir", str(run),
            "--set", "log.every=10", "--set", "checkpoint.every=100000", "--set", "model.g_width=32",
            "--set", "model.d_width=32", "--set", "log.tensorboard=false"]
    command = [*base, "--set", "train.steps=100000"]
    launcher = start_training(command, run)
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=90)
    assert launcher.returncode == 3, stderr[-3000:]
    # Both workers get the signal and stop alike: each line is said once, not once per rank.
    assert stderr.count("finishing this step") == 1 and stderr.count("stopped at step") == 1, stderr[-3000:]
    checkpoints = list((run / "checkpoints").glob("step-*.pt"))
    assert len(checkpoints) == 1
    stopped_at = int(checkpoints[0].stem.split("-")[1])
    resumed = subprocess.run([*base, "--resume", "auto", "--set", f"train.steps={stopped_at + 5}"],
                             cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == stopped_at + 5


@pytest.mark.parametrize("exit_timeout_s", [3.0, None], ids=["3s", "default"])
def test_a_rank_that_cannot_finish_its_step_after_sigterm_exits_within_exit_timeout(tmp_path, exit_timeout_s):
    """Rank 1 hangs at step 3 and rank 0 waits for it inside a collective (where Python signal handlers do
    not run); a SIGTERM then starts each rank's exit clock, and both write diagnostics and exit 5. With the
    default timeout too: before the launcher's grace (torch's agent SIGKILLs 30 s after passing SIGTERM on)."""
    from ganscale.config import FaultConfig
    from ganscale.fault import stop_grace_s

    run = tmp_path / "run"
    env = {**clean_env(), "GANSCALE_INJECT_FAULT": "sleep@1:3:300"}
    chosen = ["--set", f"fault.exit_timeout_s={exit_timeout_s}"] if exit_timeout_s else []
    exit_timeout_s = exit_timeout_s or FaultConfig().exit_timeout_s
    launcher = subprocess.Popen([sys.executable, "-m", "ganscale", "train", "--nproc", "2", "--run-dir", str(run),
                                 "--set", "train.steps=100000", "--set", "log.tensorboard=false", "--set", "log.every=1",
                                 "--set", "fault.hang_timeout_s=300", *chosen],
                                cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.time() < deadline and launcher.poll() is None, "training never reached step 3"
        time.sleep(0.2)
    time.sleep(1)  # both ranks are now stuck: rank 1 asleep, rank 0 in the step's collective
    asked = time.time()
    launcher.send_signal(signal.SIGTERM)
    _, stderr = launcher.communicate(timeout=90)
    elapsed = time.time() - asked
    assert launcher.returncode == 5, stderr[-3000:]
    assert f"asked to stop {exit_timeout_s:.0f} s ago (fault.exit_timeout_s)" in stderr
    assert elapsed < stop_grace_s(exit_timeout_s) + 10, f"took {elapsed:.0f} s after SIGTERM"  # + teardown
    for rank in (0, 1):
        assert "File" in (run / "diagnostics" / f"rank{rank}-stacks.txt").read_text()


def test_the_default_stop_grace_fits_the_grace_launchers_and_schedulers_give():
    """torchrun's agent (--shutdown-timeout), Slurm (KillWait) and Kubernetes (terminationGracePeriodSeconds) all
    SIGKILL 30 s after SIGTERM by default: a rank that cannot finish its step must have written its diagnostics
    and left before, with a margin for a loaded machine."""
    from ganscale.config import FaultConfig
    from ganscale.fault import stop_grace_s

    granted_s, margin_s = 30.0, 5.0
    assert stop_grace_s(FaultConfig().exit_timeout_s) <= granted_s - margin_s


def test_exception_on_one_rank_stops_all_fast_with_its_traceback(tmp_path):
    env = {**clean_env(), "GANSCALE_INJECT_FAULT": "raise@1:3"}
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "--nproc", "2", "--run-dir", str(tmp_path / "r"),
                             "--set", "train.steps=100000", "--set", "log.tensorboard=false"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.time() - started
    assert result.returncode == 1, result.stderr[-3000:]
    assert "InjectedFault: injected fault on rank 1 at step 3" in result.stderr
    assert "worker rank 1 failed" in result.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s to stop"


def test_a_malformed_injection_is_one_line_exit_2_before_anything_is_written(tmp_path):
    """It raised a traceback from the trainer, once per rank, after the run directory was made."""
    env = {**clean_env(), "GANSCALE_INJECT_FAULT": "raise@x:3"}
    for nproc in ([], ["--nproc", "2"]):
        result = subprocess.run([sys.executable, "-m", "ganscale", "train", "ring8", *nproc, "--run-dir",
                                 str(tmp_path / "r"), "--set", "train.steps=2"], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
        assert "'GANSCALE_INJECT_FAULT'" in result.stderr and "KIND@RANK:STEP[:SECONDS]" in result.stderr
        assert not (tmp_path / "r").exists()


def test_injection_spec_is_parsed_and_fires_only_where_asked():
    from ganscale.config import ConfigError
    from ganscale.fault import InjectedFault, injected_fault

    fire = injected_fault({"GANSCALE_INJECT_FAULT": "raise@1:3"})
    fire(3, 0)
    fire(2, 1)
    with pytest.raises(InjectedFault):
        fire(3, 1)
    injected_fault({})(3, 1)  # unset: never fires
    for malformed in ("explode@1:3", "raise@x:3", "raise@1", "sleep@1:3:soon", "raise@1:3:"):
        with pytest.raises(ConfigError, match="'GANSCALE_INJECT_FAULT'.*KIND@RANK:STEP"):
            injected_fault({"GANSCALE_INJECT_FAULT": malformed})
    import time as clock
    nap = injected_fault({"GANSCALE_INJECT_FAULT": "sleep@0:2:0.2"})
    started = clock.monotonic()
    nap(2, 0)
    assert clock.monotonic() - started >= 0.2


def test_a_slow_step_ends_early_on_a_stop_signal_and_only_then():
    import time as clock

    from ganscale.fault import injected_fault

    asked = clock.monotonic() + 0.3
    slow = injected_fault({"GANSCALE_INJECT_FAULT": "slow@0:2:60"}, stopping=lambda: clock.monotonic() > asked)
    slow(2, 0)  # would take 60 s without the stop
    assert asked <= clock.monotonic() < asked + 5
    started = clock.monotonic()
    injected_fault({"GANSCALE_INJECT_FAULT": "slow@0:2:0.3"})(2, 0)  # no stop: the whole time
    assert clock.monotonic() - started >= 0.3


def endless_ring8(run: Path) -> list[str]:
    """`ganscale train ring8 --nproc 2` into `run`, until stopped: no periodic checkpoint, a log every 10 steps."""
    return [sys.executable, "-m", "ganscale", "train", "ring8", "--nproc", "2", "--run-dir", str(run),
            "--set", "train.steps=100000", "--set", "checkpoint.every=100000", "--set", "log.every=10",
            "--set", "log.tensorboard=false", "--set", "log.sample_every=0"]


def worker_pids(launcher_pid: int) -> list[int]:
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children")
    return [int(pid) for pid in children.read_text().split()] if children.exists() else []


def test_kill_9_of_a_worker_with_max_restarts_resumes_and_finishes(tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "ganscale", "train", "ring8", "--nproc", "2", "--max-restarts", "1",
               "--run-dir", str(run), "--set", "train.steps=400", "--set", "checkpoint.every=50",
               "--set", "log.every=10", "--set", "model.g_width=32", "--set", "model.d_width=32",
               "--set", "log.tensorboard=false", "--set", "log.sample_every=0"]
    launcher = subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list((run / "checkpoints").glob("step-*.json")):
        assert time.time() < deadline and launcher.poll() is None, "no checkpoint appeared"
        time.sleep(0.1)
    workers = worker_pids(launcher.pid)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    killed_after = max(r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()))
    _, stderr = launcher.communicate(timeout=180)
    assert launcher.returncode == 0, stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["restarts"] == 1 and summary["steps"] == 400  # the elastic agent restarted the group once
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 400  # the redone steps replaced, not duplicated
    assert killed_after >= 50  # the kill came after the first checkpoint: at most one interval was redone
    # The killed worker is named, not the survivor the agent then stopped with SIGTERM (-15).
    assert re.search(r"worker rank \d failed with exit code -9 ", stderr), stderr[-3000:]


def test_the_root_cause_is_a_worker_s_own_failure_then_its_own_signal_then_a_peer_s_then_the_agent_s_sigterm():
    from ganscale.fault import EXIT_HANG, EXIT_PEER_FAILED
    from ganscale.launch import root_cause_order

    codes = [-signal.SIGTERM, EXIT_PEER_FAILED, -signal.SIGKILL, 1]
    assert sorted(codes, key=root_cause_order) == [1, -signal.SIGKILL, EXIT_PEER_FAILED, -signal.SIGTERM]
    # A survivor asked to stop inside a collective with the killed rank may time out there (seen in CI: the test
    # above then named rank 0's exit 5, not rank 1's -9)
    assert sorted([EXIT_HANG, -signal.SIGKILL], key=root_cause_order) == [-signal.SIGKILL, EXIT_HANG]
    assert root_cause_order(EXIT_HANG) < root_cause_order(-signal.SIGTERM)


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a worker whose launcher died is no child of ours)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_kill_9_of_the_launcher_makes_its_workers_checkpoint_and_exit(tmp_path):
    """Workers whose launcher is killed (kill -9: it cannot pass a signal on) agree to stop, checkpoint and exit,
    instead of training on, reparented to PID 1."""
    run = tmp_path / "run"
    command = endless_ring8(run)
    with open(tmp_path / "output.txt", "w") as output:  # read by no one: a full pipe would stall the workers
        launcher = start_training(command, run, stdout=output, stderr=subprocess.STDOUT)
    workers = worker_pids(launcher.pid)
    assert len(workers) == 2, workers
    launcher.kill()
    launcher.wait()
    try:
        deadline = time.time() + 60  # without a parent-death signal they train on for good
        while any(map(_running, workers)) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(map(_running, workers)), (tmp_path / "output.txt").read_text()[-3000:]
    finally:
        for pid in filter(_running, workers):
            os.kill(pid, signal.SIGKILL)
    output = (tmp_path / "output.txt").read_text()
    assert output.count("checkpoint written; continue with --resume auto") == 1, output[-3000:]  # by rank 0, once
    assert "sendBytes failed" not in output, output[-3000:]  # the watchdog's beat to the dead launcher's store
    assert output.count("SIGTERM received") == 1, output[-3000:]
    assert len(list((run / "checkpoints").glob("step-*.json"))) == 1  # the stop's checkpoint, complete


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_worker_whose_launcher_died_before_it_could_follow_it_stops_at_once():
    """The launcher may die before the worker asks for the parent-death signal: the worker then sees a parent
    other than the launcher it was given, and sends itself the stop request."""
    from ganscale.launch import LAUNCHER_ENV

    script = "from ganscale.launch import follow_launcher; follow_launcher(); import time; time.sleep(60)"
    launch = {LAUNCHER_ENV: "1:launch-a", "TORCHELASTIC_RUN_ID": "launch-a"}
    orphan = subprocess.run([sys.executable, "-c", script], env={**script_env(), **launch}, timeout=60)
    assert orphan.returncode == -signal.SIGTERM


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_worker_of_another_launch_ignores_a_launcher_it_inherited():
    """torchrun started from a process that once ran `--nproc` passes its launcher's variable on to workers of
    its own launch (another run id): they must not take torchrun's agent for a dead launcher and stop."""
    from ganscale.launch import LAUNCHER_ENV

    script = "from ganscale.launch import follow_launcher; follow_launcher(); print('trained on')"
    worker = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                            env={**script_env(), LAUNCHER_ENV: "1:launch-a", "TORCHELASTIC_RUN_ID": "launch-b"})
    assert worker.returncode == 0 and "trained on" in worker.stdout, worker.stderr


def test_hang_on_one_rank_is_named_with_diagnostics_and_exits_fast(tmp_path):
    run = tmp_path / "run"
    env = {**clean_env(), "GANSCALE_INJECT_FAULT": "sleep@1:3:120"}
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "--nproc", "2", "--run-dir", str(run),
                             "--set", "train.steps=100000", "--set", "log.tensorboard=false",
                             "--set", "fault.hang_timeout_s=4"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    elapsed = time.time() - started
    assert result.returncode == 5, result.stderr[-3000:]
    assert "hang detected on rank 0" in result.stderr
    assert "rank(s) 1 did not arrive (rank 1 last at 'step 3: start')" in result.stderr
    assert elapsed < 4 + 30 + 15, f"took {elapsed:.0f} s"  # timeout + 30 s, plus start-up
    for rank in (0, 1):
        assert "File" in (run / "diagnostics" / f"rank{rank}-stacks.txt").read_text()
        assert "step 3" in (run / "diagnostics" / f"rank{rank}-collectives.txt").read_text()
        # PyTorch's own flight recorder: the collectives issued, with their sizes and states.
        recorded = json.loads((run / "diagnostics" / f"rank{rank}-flight-recorder.json").read_text())
        assert any("all_reduce" in entry["profiling_name"] for entry in recorded["entries"])


def test_a_hang_is_still_caught_and_exits_5_when_its_diagnostics_cannot_be_written(tmp_path):
    """A full disk, or a file where diagnostics/ should be: the watchdog says so in one line and still exits 5,
    instead of dying and leaving the ranks to the collective's own (much longer) timeout."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "diagnostics").write_text("x")
    env = {**clean_env(), "GANSCALE_INJECT_FAULT": "sleep@1:3:120"}
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "--nproc", "2", "--run-dir", str(run),
                             "--set", "train.steps=100000", "--set", "log.tensorboard=false",
                             "--set", "fault.hang_timeout_s=4", "--set", "parallel.timeout_s=100"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 5, result.stderr[-3000:]
    assert time.time() - started < 4 + 30 + 15
    assert "hang detected on rank 0" in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
    for rank in (0, 1):
        assert f"ganscale: rank {rank} could not write its hang diagnostics to {run / 'diagnostics'}: " in result.stderr
    assert (run / "diagnostics").read_text() == "x"


def test_a_rank_that_never_comes_to_start_up_is_one_line_and_exit_5_not_a_traceback(tmp_path):
    """Outside the steps the hang watchdog watches (here the rendezvous: rank 1 starts after parallel.timeout_s),
    the rank left waiting says in one line that another rank is stuck or gone, and exits 5."""
    from test_cli import ganscale_ranks

    args = ["ring8", "--run-dir", "run", "--set", "train.steps=2", "--set", "parallel.timeout_s=3"]
    late = {1: lambda: time.sleep(10)}  # before rank 1 is even exec'd
    waited = ganscale_ranks([args, args], cwd=tmp_path, timeout=60, setup=late)[0]
    assert waited.returncode == 5 and "Traceback" not in waited.stderr, waited.stderr[-3000:]
    said = [line for line in waited.stderr.splitlines() if line.startswith("ganscale:")]
    assert len(said) == 1 and "rank 0 waited parallel.timeout_s for another rank, which is stuck or gone" in said[0]


def test_a_data_set_that_does_not_divide_by_ranks_times_batch_does_not_hang(tmp_path):
    # 101 points, global batch 64 on 2 ranks: every rank still gets exactly one micro-batch per step.
    started = time.time()
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "ring8", "--nproc", "2",
                             "--run-dir", str(tmp_path / "run"), "--set", "data.size=101", "--set", "train.batch_size=64",
                             "--set", "train.steps=12", "--set", "log.every=4", "--set", "log.tensorboard=false",
                             "--set", "fault.hang_timeout_s=20"],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 12
    assert time.time() - started < 60


def test_peer_failures_are_told_apart_from_a_rank_s_own_error():
    from ganscale.fault import is_peer_failure

    assert is_peer_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"))
    assert not is_peer_failure(RuntimeError("CUDA out of memory"))



def test_a_peer_failure_is_summed_up_to_its_sign_whole():
    """Backend errors add sentences after the sign; a cut at a fixed width ended mid-sentence ("This is )")."""
    from ganscale.fault import peer_failure_summary

    error = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting " + "x" * 120
                         + " for recv operation to complete: Connection reset by peer. This is likely due to a rank "
                         "exiting early; see the other ranks' logs for the root cause.")
    summary = peer_failure_summary(error)
    assert summary.endswith("Connection reset by peer") and summary.startswith("...") and len(summary) == 200
    assert peer_failure_summary(RuntimeError("Connection closed by peer [127.0.0.1]:1")) == "Connection closed by peer"


@pytest.mark.parametrize("said, cause", [
    ("Got the following error when running the callback: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/"
     "transport/tcp/pair.cc:537] Read error [127.0.0.1]:26536: Connection reset by peer",
     "its connection to the others closed"),
    ("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1",
     "its connection to the others closed"),
    ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or there "
     "was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error",
     "its connection to the others closed"),
    ("NCCL communicator was aborted on rank 1.", "NCCL communicator was aborted on rank 1."),  # another cause: as said
])
def test_a_rank_stopped_by_another_s_failure_says_a_closed_connection_in_words(monkeypatch, capsys, said, cause):
    """Rank 1 of a run whose rank 0 failed on a data set item quoted gloo's source path and socket ("[/__w/pytorch/
    .../pair.cc:537] Read error [127.0.0.1]:26536: Connection reset by peer"): its line says what happened instead."""
    import torch.distributed as dist

    from ganscale.cli import leave
    from ganscale.fault import EXIT_PEER_FAILED

    for name in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR"):  # not a worker: the line, then the exit code
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as left:
        leave((dist.DistBackendError if said.startswith("NCCL") else RuntimeError)(said))  # as gloo and NCCL raise them
    assert left.value.code == EXIT_PEER_FAILED
    assert capsys.readouterr().err == f"ganscale: rank 1 stopped because another rank failed first ({cause})\n"


def test_the_watchdog_works_when_its_descriptors_are_numbered_above_1024(tmp_path):
    """Many open files (data.workers=500) give the watchdog's sockets numbers select() cannot watch; it must still
    notice a stop signal and enforce fault.exit_timeout_s (with select() its thread died at once, silently)."""
    import resource
    import socket
    import threading

    from ganscale.watchdog import Watchdog

    wanted = 1100 + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {wanted}: cannot open enough files")
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    filler: list[int] = []
    try:
        filler.append(os.open(tmp_path / "filler", os.O_WRONLY | os.O_CREAT))
        while len(filler) < 1100:
            filler.append(os.dup(filler[0]))  # the lowest free numbers: everything below ~1100 is taken
        signals, sender = socket.socketpair()
        watchdog = Watchdog(0, 1, timeout_s=1000, diagnostics_dir=tmp_path / "diagnostics", exit_timeout_s=0.4)
        assert min(signals.fileno(), watchdog._wake.fileno()) > 1024
        fired = threading.Event()
        reasons: list[str] = []

        def diagnose_and_exit(why: str) -> None:  # the real one writes diagnostics and calls os._exit
            reasons.append(why)
            fired.set()
            watchdog._stop.set()
        watchdog._diagnose_and_exit = diagnose_and_exit
        with watchdog.watching(signals):
            time.sleep(0.3)
            assert watchdog._thread.is_alive(), "the watchdog thread died"
            sender.send(bytes([int(signal.SIGTERM)]))
            assert fired.wait(10), "the exit timeout never fired after a stop signal"
        assert watchdog.stop_requested_at is not None
        assert "asked to stop 0 s ago (fault.exit_timeout_s)" in reasons[0]
        signals.close()
        sender.close()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # this process's limit as it was
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_hang_names_where_the_main_thread_is_not_only_its_last_mark(tmp_path):
    """Slow local work after a mark (an optimizer step after "DDP all-reduce in backward") must not be reported
    as a hang in the marked collective alone: the verdict also says where the main thread actually is."""
    # Mark once from the main thread, then spin past the timeout in a uniquely named function.
    script = (
        "import time\n"
        "from ganscale.watchdog import Watchdog\n"
        "def spin_in_slow_local_work_q7z():\n"
        "    until = time.monotonic() + 30\n"
        "    while time.monotonic() < until:\n"
        "        pass\n"
        f"with Watchdog(0, 1, timeout_s=1, diagnostics_dir={str(tmp_path / 'diagnostics')!r}) as watchdog:\n"
        "    watchdog.mark('step 1: DDP all-reduce in backward')\n"
        "    spin_in_slow_local_work_q7z()\n"
    )
    env = script_env()
    started = time.time()
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    from ganscale.fault import EXIT_HANG

    assert result.returncode == EXIT_HANG, result.stderr[-3000:]
    assert time.time() - started < 20
    assert "hang detected on rank 0: no progress for 1 s" in result.stderr
    assert "('step 1: DDP all-reduce in backward')" in result.stderr  # the last mark, as before
    assert "main thread in <string>:" in result.stderr and " spin_in_slow_local_work_q7z" in result.stderr
    stacks = (tmp_path / "diagnostics" / "rank0-stacks.txt").read_text()
    assert stacks.startswith("# main thread in <string>:") and "spin_in_slow_local_work_q7z" in stacks.splitlines()[0]
    assert "File" in stacks


def test_a_slow_compile_is_not_a_hang_but_as_long_a_sleep_is(tmp_path):
    """torch.compile can take minutes between two marks (compiling, tuning, recording CUDA graphs), in the first
    steps or at any recompile: torch's compile callbacks tell the watchdog, which allows that time."""
    from ganscale.fault import EXIT_HANG

    def watched(work: str) -> str:  # a backend slower than the watchdog's timeout, and `work` between two marks
        return (
            "import time\n"
            "import torch\n"
            "from ganscale.watchdog import Watchdog\n"
            "def slow_backend(gm, example_inputs):\n"
            "    time.sleep(3)\n"
            "    return gm.forward\n"
            "torch.compile(lambda x: x - 1, backend='eager')(torch.ones(2))  # dynamo's imports: not under the clock\n"
            f"with Watchdog(0, 1, timeout_s=1.5, diagnostics_dir={str(tmp_path / 'diagnostics')!r}) as watchdog:\n"
            "    watchdog.mark('step 0: G forward')\n"
            f"    {work}\n"
            "    watchdog.mark('step 1: start')\n"
            "print([where for _, _, where in watchdog.history])\n"
        )
    env = script_env()
    compiling, sleeping = (subprocess.Popen([sys.executable, "-c", watched(work)], cwd=tmp_path, env=env, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                           for work in ("torch.compile(lambda x: x * 2, backend=slow_backend)(torch.ones(2))",
                                        "time.sleep(3)"))
    out, err = compiling.communicate(timeout=60)
    assert compiling.returncode == 0 and "hang detected" not in err, err[-3000:]
    assert out.strip() == str(["step 0: G forward", "torch.compile: compiling (dynamo)",
                               "torch.compile: compiled (dynamo)", "step 1: start"])
    _, err = sleeping.communicate(timeout=60)
    assert sleeping.returncode == EXIT_HANG and "hang detected on rank 0: no progress for 2 s" in err, err[-3000:]


def _compile_slowly_on_rank0_before_an_all_reduce(rank, world, diagnostics_dir):
    import torch.distributed as dist

    from ganscale.watchdog import Watchdog

    def slow_backend(gm, example_inputs):
        time.sleep(3)
        return gm.forward

    torch.compile(lambda x: x - 1, backend="eager")(torch.ones(2))  # dynamo's imports: not under the clock
    with Watchdog(rank, world, timeout_s=1.5, diagnostics_dir=diagnostics_dir) as watchdog:
        watchdog.mark("step 0: all-reduce")
        if rank == 0:
            torch.compile(lambda x: x * 2, backend=slow_backend)(torch.ones(2))
        started = time.monotonic()
        dist.all_reduce(torch.ones(1))
        waited = time.monotonic() - started
        watchdog.mark("step 1: start")
    return {"waited": waited, "saw_a_compile": watchdog.compile_seen_at > started,
            "history": [where for _, _, where in watchdog.history]}


def test_a_rank_waiting_in_a_collective_for_a_compiling_peer_is_not_hung(tmp_path):
    """Ranks compile at different speeds: rank 1 waits in the all-reduce 3 s (its timeout is 1.5 s) while rank 0
    compiles; rank 1 reads that from rank 0's published progress. A watchdog that fired would exit the rank (5)."""
    compiler, waiter = run_ranks(_compile_slowly_on_rank0_before_an_all_reduce, 2, str(tmp_path / "diagnostics"))
    assert "torch.compile: compiling (dynamo)" in compiler["history"]
    assert waiter["waited"] > 2.5 and waiter["saw_a_compile"]
    assert waiter["history"] == ["step 0: all-reduce", "step 1: start"]  # it did not compile itself
    assert not (tmp_path / "diagnostics").exists()


def test_the_watchdog_hears_of_compiles_only_while_it_is_active(tmp_path):
    from torch._dynamo.callback import callback_handler

    from ganscale.watchdog import Watchdog

    registered = (list(callback_handler.start_callbacks), list(callback_handler.end_callbacks))
    watchdog = Watchdog(0, 1, timeout_s=1000, diagnostics_dir=tmp_path / "diagnostics")
    with watchdog:
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))
    torch.compile(lambda x: x + 2, backend="eager")(torch.ones(2))  # after the run: not heard
    assert (list(callback_handler.start_callbacks), list(callback_handler.end_callbacks)) == registered
    assert [where for _, _, where in watchdog.history] == ["torch.compile: compiling (dynamo)",
                                                          "torch.compile: compiled (dynamo)"]
    assert watchdog.count == 0 and watchdog.compiling == ""  # compiles are progress, not marks ranks compare


def test_main_thread_location_names_the_innermost_frame_and_ganscale_s_caller(tmp_path):
    import threading

    from ganscale.watchdog import Watchdog, main_thread_location

    watchdog = Watchdog(0, 1, timeout_s=1000, diagnostics_dir=tmp_path / "diagnostics")
    seen: list[str] = []

    def look_while_main_waits_in_exit() -> None:  # stands in for the watchdog loop
        watchdog._stop.wait(10)
        time.sleep(0.3)  # the main thread is now in Watchdog.__exit__, joining this thread
        seen.append(main_thread_location())
    watchdog._thread = threading.Thread(target=look_while_main_waits_in_exit, daemon=True)
    with watchdog:
        pass
    assert seen and seen[0].startswith("main thread in "), seen
    assert ", called from ganscale/watchdog.py:" in seen[0] and seen[0].endswith(" __exit__"), seen


@pytest.mark.parametrize("backend, written", [("nccl", b"nccl trace"), ("gloo", b"generic trace")])
def test_the_flight_recorder_dumped_is_the_backend_s_own(tmp_path, monkeypatch, backend, written):
    """Under NCCL the NCCL recorder (CUDA builds only: faked here); the generic one holds gloo's collectives."""
    from torch._C import _distributed_c10d as c10d

    from ganscale import watchdog

    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda *flags: b"nccl trace", raising=False)
    monkeypatch.setattr(c10d, "_dump_fr_trace_json", lambda *flags: b"generic trace")
    monkeypatch.setattr(watchdog.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(watchdog.dist, "get_backend", lambda *group: backend)
    watchdog._write_flight_recorder(tmp_path / "fr.json")
    assert (tmp_path / "fr.json").read_bytes() == written


def test_an_interrupted_training_process_is_stopped_as_a_scheduler_stops_it():
    """A benchmark's or verify's training, timed out or interrupted: SIGTERM first (it checkpoints and leaves), its
    output kept on the exception; subprocess.run sent SIGKILL on a timeout, and nothing at all on a SIGTERM."""
    import subprocess
    import sys

    from ganscale.fault import run_training_process

    training = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *_: (print('stopping', flush=True), sys.exit(3)))\n"
                "print('training', flush=True)\ntime.sleep(60)")
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        run_training_process([sys.executable, "-c", training], 1.0, 5.0, stdout=subprocess.PIPE, text=True)
    assert stopped.value.stdout == "training\nstopping\n"
    done = run_training_process([sys.executable, "-c", "print('done')"], 1.0, stdout=subprocess.PIPE, text=True)
    assert done.returncode == 0 and done.stdout == "done\n"


PAUSING_DATA = '''
import os, pathlib, time
import torch


def make(run_dir):
    """8x8 images; first waits, once the run holds its directory (run.lock), until the test writes `go` beside it."""
    run = pathlib.Path(run_dir)
    if (run / "run.lock").exists():  # the run's start-up, after its lock was taken: a worker, or the trainer
        (run.parent / f"paused-{os.environ.get('RANK', '0')}").touch()
        while not (run.parent / "go").exists():
            time.sleep(0.05)
    return torch.utils.data.TensorDataset(torch.rand(64, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1)
'''


def paused_start(tmp_path: Path, *options: str) -> tuple[Path, list[str]]:
    """(run directory, a `ganscale train` into it whose start-up waits, after taking run.lock, until tmp_path/go is
    written: `paused-RANK` beside the run directory says it waits there, before training began)."""
    (tmp_path / "pausing_data.py").write_text(PAUSING_DATA)
    run = tmp_path / "run"
    return run, [sys.executable, "-m", "ganscale", "train", *options, "--run-dir", str(run),
                 "--set", "data.kind=custom", "--set", "data.dataset=pausing_data:make",
                 "--set", f"data.dataset_args={{run_dir: '{run}'}}", "--set", f"code_path=['{tmp_path}']",
                 "--set", "train.steps=2", "--set", "log.every=1", "--set", "log.sample_every=0",
                 "--set", "checkpoint.every=0", "--set", "log.tensorboard=false"]


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.time() + timeout_s
    while not path.exists():
        assert time.time() < deadline and process.poll() is None, f"never came to {path.name}"
        time.sleep(0.05)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"])
def test_a_stop_signal_before_training_began_is_one_line_exit_3_and_frees_the_run_directory(tmp_path, sig):
    """Stopped while it starts (here: building its data set, after taking run.lock), a one-process run leaves at
    once with one line and exit 3, its lock released; it was killed silently (exit 143, or a KeyboardInterrupt
    traceback) and left run.lock behind. The same command then trains in that directory."""
    run, command = paused_start(tmp_path)
    trainer = subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True,  # SIGHUP handled even in a suite run under nohup
                               preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    wait_for(tmp_path / "paused-0", trainer)
    trainer.send_signal(sig)
    _, stderr = trainer.communicate(timeout=60)
    assert trainer.returncode == 3, stderr[-3000:]
    assert stderr.strip() == (f"ganscale: stopped by {sig.name} before training began: nothing was trained, no "
                              "checkpoint written; continue with --resume auto (or start it again)"), stderr[-3000:]
    assert not (run / "run.lock").exists() and not (run / "checkpoints").exists()
    (tmp_path / "go").touch()
    again = subprocess.run(command, cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]


def test_a_stop_signal_to_the_launcher_while_its_workers_start_checkpoints_after_one_step(tmp_path):
    """`--nproc 2` whose workers are starting (building their data set) when the launcher is stopped: the workers
    keep the signal and stop after their first step, agreed, with a checkpoint (exit 3); they died of it (exit 1)."""
    run, command = paused_start(tmp_path, "--nproc", "2")
    with open(tmp_path / "stderr.txt", "w") as err:
        launcher = subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=subprocess.DEVNULL, stderr=err)
        for rank in (0, 1):
            wait_for(tmp_path / f"paused-{rank}", launcher)
        launcher.send_signal(signal.SIGTERM)
        deadline = time.time() + 30  # the workers have the signal (said once) before they go on
        while "received while the run starts" not in (tmp_path / "stderr.txt").read_text():
            assert time.time() < deadline and launcher.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            time.sleep(0.05)
        (tmp_path / "go").touch()
        launcher.wait(timeout=90)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert launcher.returncode == 3 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.count("received while the run starts") == 1, stderr[-3000:]
    assert "stopped at step 1 on request (SIGTERM); checkpoint written" in stderr, stderr[-3000:]
    assert [p.name for p in (run / "checkpoints").glob("step-*.pt")] == ["step-00000001.pt"]
    assert not (run / "run.lock").exists()
