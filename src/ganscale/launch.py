"""Starting workers: `--nproc N` through PyTorch's elastic launcher (the machinery behind torchrun),
or the current process when it already is a worker (plain run, or started by torchrun). The run directory
it trains in is decided before (rundir.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

import torch.distributed as dist

from ganscale import checkpoint, fault, runlock, versions
from ganscale.config import Config, ConfigError
from ganscale.fault import (EXIT_CONFIG, EXIT_FILE_REFUSED, EXIT_HANG, EXIT_NON_FINITE, EXIT_PEER_FAILED,
                           EXIT_PREEMPTED, EXIT_REPLICAS_DIFFER, EXIT_TAKEN_OVER, RESTARTS_ENV)
from ganscale.rundir import AlreadyTrained, decide_run, resume_after_restart


def adopt_slurm_task(nproc: int | None) -> None:
    """Under `srun ganscale train` (one Slurm task per process), the process group's variables from Slurm's."""
    from ganscale import slurm

    os.environ.update(slurm.task_environment(os.environ, nproc))


def under_launcher() -> bool:
    """True in a worker started by torchrun / the elastic launcher."""
    return fault.under_launcher()


def check_gpus(cfg: Config, nproc: int, visible: int) -> None:
    """`--nproc` ranks on this machine need as many GPUs when the run is on CUDA (refused before they start)."""
    on_cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and visible > 0)
    if on_cuda and nproc > visible:
        raise ConfigError("--nproc", f"{nproc} ranks on a machine that shows {visible} GPU(s): each rank needs its "
                          "own", f"pass --nproc {visible} or fewer, show more GPUs (CUDA_VISIBLE_DEVICES), or set "
                          "train.device=cpu")


def rank_from_environment() -> int:
    return int(os.environ.get("RANK", "0"))


MAX_RANKS = 2**31 - 1  # torch keeps ranks and group sizes in a C int
AGENT_GRACE_S = 30  # torch's agent's wait between passing a stop signal on and SIGKILL, by default
SET_BY_LAUNCHER = "a launcher sets it for each worker"
# The launcher's integer variables: (least, most, what a value must be, who sets it). torch reads each with int().
LAUNCHER_INTEGERS = {"RANK": (0, MAX_RANKS - 1, "a rank", SET_BY_LAUNCHER),
                     "LOCAL_RANK": (0, MAX_RANKS - 1, "a rank", SET_BY_LAUNCHER),
                     "WORLD_SIZE": (1, MAX_RANKS, "a process count", SET_BY_LAUNCHER),
                     "LOCAL_WORLD_SIZE": (1, MAX_RANKS, "a process count", SET_BY_LAUNCHER),
                     "MASTER_PORT": (1, 65535, "a port number", SET_BY_LAUNCHER),
                     "TORCHELASTIC_MAX_RESTARTS": (0, MAX_RANKS, "a restart count", SET_BY_LAUNCHER),
                     "TORCHELASTIC_RESTART_COUNT": (0, MAX_RANKS, "a restart count", SET_BY_LAUNCHER),
                     "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": (0, MAX_RANKS, "a number of seconds",
                                                        f"torch's agent then waits {AGENT_GRACE_S} s")}
# Slurm's integer variables that ganscale reads inside a job (`srun ganscale train`, doctor's Slurm section, the
# start line and summary's requeues). Slurm writes each as a plain integer (its "4(x2)" lists are other variables,
# e.g. SLURM_TASKS_PER_NODE), SLURM_RESTART_COUNT only in a batch job, and unsets SLURM_GPUS_ON_NODE where a step
# has no GPU; an empty count reads as unset, as ganscale always read it. SLURM_JOB_ID is the job's own id in an
# array or heterogeneous job too (their ids are other variables); Slurm writes it "%u" for the allocation but "%d"
# in each task's environment, so a federated job's id (cluster id in bits 26-31) can read negative there.
UINT32_MAX = 2**32 - 1
SLURM_INTEGERS = {"SLURM_JOB_ID": (-2**31, UINT32_MAX, "a job id", "Slurm sets it in a job"),
                  "SLURM_RESTART_COUNT": (0, UINT32_MAX, "a requeue count", "Slurm sets it in a batch job"),
                  "SLURM_NTASKS": (1, MAX_RANKS, "a task count", "Slurm sets it in a job"),
                  "SLURM_GPUS_ON_NODE": (0, MAX_RANKS, "a GPU count", "Slurm sets it in a job with GPUs"),
                  "SLURM_PROCID": (0, MAX_RANKS - 1, "a task rank", "srun sets it in each task"),
                  "SLURM_LOCALID": (0, MAX_RANKS - 1, "a task rank", "srun sets it in each task")}
# What a variable's fix asks for, where "an integer from <least>" would not do.
FIX_VALUES = {"MASTER_PORT": "the TCP port of rank 0's store, e.g. 29500",
              "SLURM_JOB_ID": "the job's id as Slurm writes it, e.g. 1234"}


def environment_errors(environ: Mapping[str, str]) -> dict[str, ConfigError]:
    """The launcher (and, inside a Slurm job, Slurm) variables set in `environ` that no process group can have
    (not an integer in range, a rank not below its group's size), each with its ConfigError; {} where all are
    fine or unset."""
    errors, values = {}, {}
    for name, (least, most, what, setter) in {**LAUNCHER_INTEGERS, **SLURM_INTEGERS}.items():
        text = _as_read(environ, name)
        if text is None:
            continue
        value = _integer(text)
        if value is not None and least <= value <= most:
            values[name] = value
        else:
            span = f"{least}-{most}" if least >= 0 else f"{least} to {most}"
            errors[name] = ConfigError(name, f"{text!r} is not {what} ({span})",
                                       f"set {name} to {FIX_VALUES.get(name, f'an integer from {least}')}, or "
                                       f"unset it ({setter})")
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if rank in values and size in values and values[rank] >= values[size]:
            errors[rank] = ConfigError(rank, f"{values[rank]} is not below {size}={values[size]} (ranks count "
                                       "from 0)", f"set {rank} below {values[size]}, or {size} to the number "
                                       "of processes")
    if "SLURM_JOB_ID" in environ and "SLURM_TASKS_PER_NODE" in environ:
        from ganscale.slurm import tasks_per_node

        try:
            tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
        except ConfigError as e:
            errors[e.key] = e
    return errors


def _as_read(environ: Mapping[str, str], name: str) -> str | None:
    """`name`'s value where ganscale reads it; None where unset, and for a Slurm count outside a job or empty."""
    # Not an empty SLURM_JOB_ID: its presence is what makes ganscale read Slurm's variables, and no id stands in.
    if name in SLURM_INTEGERS and ("SLURM_JOB_ID" not in environ
                                   or (not environ.get(name) and name != "SLURM_JOB_ID")):
        return None
    return environ.get(name)


def _integer(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def check_environment(environ: Mapping[str, str] = os.environ) -> None:
    """A ConfigError naming the first malformed launcher (or Slurm) variable, before anything reads it (int()
    raised)."""
    errors = environment_errors(environ)
    if errors:
        raise next(iter(errors.values()))


def environment_integer(environ: Mapping[str, str], name: str, default: int) -> int:
    """The value of `name` (LAUNCHER_INTEGERS, SLURM_INTEGERS), `default` where unset; where it is malformed, the
    ConfigError environment_errors (and doctor) give it."""
    error = environment_errors(environ).get(name)
    if error is not None:
        raise error
    text = _as_read(environ, name)
    return default if text is None else int(text)


# A worker's exit that a restart cannot mend: a config, data or checkpoint error (the same again), a stop
# request (the job is being ended), diverged training (the same again from the same checkpoint), a file
# operation the system refused (the same write fails again, after redoing up to a checkpoint interval), a run
# directory another run took over (it is that run's now).
NOT_RESTARTED = {EXIT_CONFIG: "a config, data or checkpoint error", EXIT_PREEMPTED: "a stop request",
                 EXIT_NON_FINITE: "non-finite training",
                 EXIT_FILE_REFUSED: "a file operation the system refused (permissions, a full disk)",
                 EXIT_TAKEN_OVER: "another run holding the run directory"}

# Set by launch_local for its workers: "PID:RUN_ID", the process they follow and the launch it made (a worker of
# another launch, e.g. torchrun started from a process that once launched, inherits a stale value and ignores it).
LAUNCHER_ENV = "GANSCALE_LAUNCHER"
PR_SET_PDEATHSIG = 1  # prctl(2): the signal the kernel sends this process when its parent thread exits


def follow_launcher() -> None:
    """In a worker of `launch_local`: the kernel sends it SIGTERM when the launcher dies, even by kill -9, so the
    ranks agree to stop, checkpoint and exit instead of training on unwatched. Linux only; elsewhere, and in a
    process the launcher did not start, a no-op."""
    launcher, _, run_id = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if not launcher or run_id != os.environ.get("TORCHELASTIC_RUN_ID") or not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None)
    # The agent's main thread starts the workers and lives as long as the launcher, so its exit is the launcher's.
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return
    if os.getppid() != int(launcher):  # it died before the prctl: no signal will come, so send it now
        os.kill(os.getpid(), signal.SIGTERM)


def local_agent(nproc: int, stop_grace_s: float = 0.0, **options):
    """torch's elastic launcher's settings for `nproc` workers on this machine (`train --nproc`, `doctor --nproc`):
    its stores and the workers' gloo listen on the loopback only (nothing from another host can connect), the
    workers stop when this process dies (`follow_launcher`), and after passing a stop signal on, the agent waits
    `stop_grace_s` (a worker's longest exit, `fault.stop_grace_s`) or its own grace, if longer, before SIGKILL."""
    from torch.distributed.launcher.api import LaunchConfig

    from ganscale import loopback

    loopback.register()
    run_id = str(uuid.uuid4())
    os.environ[LAUNCHER_ENV] = f"{os.getpid()}:{run_id}"
    if sys.platform.startswith("linux"):  # gloo listens on the address this host's name resolves to, else
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=run_id,
                        rdzv_backend=loopback.RENDEZVOUS, rdzv_endpoint=f"{loopback.ADDRESS}:0",
                        local_addr=loopback.ADDRESS, max_restarts=0, monitor_interval=0.5,
                        **agent_grace(stop_grace_s), **agent_signals(LaunchConfig), **options)


def agent_signals(launch_config: type) -> dict[str, str]:
    """LaunchConfig's keyword for the signals torch's agent stops its workers on: its own but SIGHUP where this
    process ignores SIGHUP (started under nohup: the run is to outlive the terminal); {} otherwise, and where a
    torch has no such keyword (its agent then stops the workers on SIGHUP, with their checkpoint)."""
    keyword = inspect.signature(launch_config).parameters.get("signals_to_handle")
    if keyword is None or not isinstance(keyword.default, str) or signal.getsignal(signal.SIGHUP) != signal.SIG_IGN:
        return {}
    handled = [name for name in keyword.default.split(",") if name.strip() != "SIGHUP"]
    return {"signals_to_handle": ",".join(handled)}


def agent_grace(stop_grace_s: float) -> dict[str, int]:
    """LaunchConfig's keyword for the agent's grace: `stop_grace_s` + 1 s, or torch's own if longer. A torch
    without the keyword (versions' launcher-grace) waits its fixed AGENT_GRACE_S (check_stop_grace)."""
    if "launcher-grace" in versions.lacking(versions.running()):
        return {}
    granted = environment_integer(os.environ, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", AGENT_GRACE_S)  # as torch reads it
    return {"shutdown_timeout": max(granted, _grace_needed(stop_grace_s))}


def _grace_needed(stop_grace_s: float) -> int:
    return math.ceil(stop_grace_s) + 1  # a second of margin over the workers' longest exit


def check_stop_grace(cfg: Config) -> None:
    """`--nproc` workers that may take longer to exit after a stop signal than a torch's fixed agent grace
    allows (it would SIGKILL them before their checkpoint or diagnostics): refused before they start."""
    exit_timeout_s = cfg.fault.exit_timeout_s
    needed = _grace_needed(fault.stop_grace_s(exit_timeout_s))
    if needed <= AGENT_GRACE_S or "launcher-grace" not in versions.lacking(versions.running()):
        return
    feature = versions.FEATURES["launcher-grace"]
    first = ".".join(map(str, feature.first))
    most = exit_timeout_s - (fault.stop_grace_s(exit_timeout_s) + 1 - AGENT_GRACE_S)  # grace needed == granted
    raise ConfigError("fault.exit_timeout_s", f"{exit_timeout_s:g} s: --nproc workers may then take {needed} s to "
                      f"exit after a stop signal, and torch {versions.running()}'s agent kills them after "
                      f"{AGENT_GRACE_S} s (a longer grace needs torch >= {first}, {feature.api})",
                      f"set fault.exit_timeout_s to at most {most:g}, or install torch>={first}")


def root_cause_order(exit_code: int) -> int:
    """How likely a worker's exit code is the failure's root cause, most likely first: a worker that failed on its
    own; one killed by a signal of its own (SIGKILL by the OOM killer or a user, a crash); one whose collective broke
    because a peer had died (EXIT_PEER_FAILED) or stalled past its stop's timeout waiting for it (EXIT_HANG: a rank
    asked to stop in a collective with a killed peer, whose socket had not yet closed); last, SIGTERM, which the
    agent sends every worker still running. Ranks that all hang share EXIT_HANG, which is then named."""
    if exit_code == -signal.SIGTERM:
        return 3
    if exit_code in (EXIT_PEER_FAILED, EXIT_HANG):
        return 2
    return 1 if exit_code < 0 else 0


def launch_local(nproc: int, worker_args: list[str], run_dir: Path, max_restarts: int = 0,
                 resume: str | None = None, held: runlock.RunLock | None = None, stop_grace_s: float = 0.0) -> int:
    """Start `nproc` workers running `python -m ganscale <worker_args> --run-dir RUN_DIR [--resume ...]` via torch's
    elastic agent; after a worker dies, start the group again (up to `max_restarts` times) from the newest intact
    checkpoint, unless the failure is one a restart repeats (NOT_RESTARTED). The restarts are ours, not the
    agent's: the agent restarts on any exit code, a config error included. `held`: this process's hold on the run
    directory, which the workers then run under. `stop_grace_s`: see `local_agent`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    if "OMP_NUM_THREADS" not in os.environ:  # share the cores instead of oversubscribing them
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    if held is not None:
        os.environ[runlock.TOKEN_ENV] = held.token
        held.stops_run = True  # its workers' rank 0 watches it too, stops them and says so
    restart = 0
    try:
        while True:  # each pass ends in a return, or in a restart
            os.environ[RESTARTS_ENV] = str(restart)
            where = ["--run-dir", str(run_dir), *(["--resume", resume] if resume else [])]
            code, failed = _launch_once(nproc, [*worker_args, *where], run_dir, stop_grace_s)
            if not failed or restart == max_restarts:
                return code
            if code in NOT_RESTARTED:
                print(f"ganscale: not restarting the workers: {NOT_RESTARTED[code]} would stop them again",
                      file=sys.stderr)
                return code
            resume = resume_after_restart(run_dir, resume)
            if resume != "auto":  # it died writing its first checkpoint: start over that write
                checkpoint.remove_unfinished(run_dir)
            restart += 1
            print(f"ganscale: restarting the workers ({restart} of --max-restarts {max_restarts}), resuming "
                  f"from {'the newest intact checkpoint' if resume == 'auto' else resume or 'the start'}",
                  file=sys.stderr)
    except SignalException as e:  # between two starts (the agent's handlers stay installed): no workers to ask
        print(f"ganscale: {e.sigval.name} received between restarts; continue with --resume auto", file=sys.stderr)
        return EXIT_PREEMPTED


def _launch_once(nproc: int, worker_args: list[str], run_dir: Path, stop_grace_s: float) -> tuple[int, bool]:
    """One start of the worker group: (exit code, whether a worker failed). The code is the root cause's where
    a worker failed; a signal to this process (the job is being stopped) is not a worker's failure."""
    from torch.distributed.launcher.api import elastic_launch

    _quiet_agent_logs()
    return agent_outcome(lambda: elastic_launch(local_agent(nproc, stop_grace_s), sys.executable)(
        "-m", "ganscale", *worker_args), run_dir)


def agent_outcome(run_agent: Callable[[], object], run_dir: Path) -> tuple[int, bool]:
    """Run torch's elastic agent (`run_agent`) to its end: (exit code, whether a worker failed), the failure or
    the stop said in one line, not the agent's traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    started = time.time()
    try:
        with _worker_exit_codes() as codes:
            run_agent()
    except SignalException as e:
        # The agent forwarded the signal; workers finish their step and checkpoint before exiting (exit 3), unless
        # a rank could not within fault.exit_timeout_s: it then wrote diagnostics. Their exit codes say the rest.
        stalled = [p.name.split("-")[0] for p in sorted(Path(run_dir).glob("diagnostics/rank*-stacks.txt"))
                   if p.stat().st_mtime >= started]
        if stalled:
            print(f"ganscale: {e.sigval.name} received, but {', '.join(stalled)} did not finish the step within "
                  f"fault.exit_timeout_s; stacks and collectives are in {run_dir}/diagnostics/; the previous "
                  "checkpoint is kept", file=sys.stderr)
            return EXIT_HANG, False
        failed = {rank: code for rank, code in codes.items() if code not in (0, EXIT_PREEMPTED)}
        if failed and not all(-code in fault.StopSignals.SIGNALS for code in failed.values()):
            return _name_root_cause({rank: (code, 0.0) for rank, code in failed.items()},
                                    f"{e.sigval.name} received; "), False
        if failed or not codes:
            # Exit 3 promises a checkpoint: workers that died of the signal, or before training, wrote none.
            print(f"ganscale: {e.sigval.name} received, and the workers stopped without writing a checkpoint (their "
                  "output is above); the previous checkpoint, if any, is kept", file=sys.stderr)
            return 1, False
        if EXIT_PREEMPTED not in codes.values():
            print(f"ganscale: {e.sigval.name} received as the workers finished training; nothing to continue",
                  file=sys.stderr)
            return 0, False
        print(f"ganscale: {e.sigval.name} received; workers were asked to checkpoint. Continue with --resume auto",
              file=sys.stderr)
        return EXIT_PREEMPTED, False
    except ChildFailedError as e:
        return _name_root_cause({rank: (failure.exitcode, failure.timestamp)
                                 for rank, failure in e.failures.items()}), True
    return 0, False


def _name_root_cause(failures: dict[int, tuple[int, float]], prefix: str = "") -> int:
    """Print which workers failed ({rank: (exit code, when)}), naming the root cause's code; return the launcher's
    exit code for it: the worker's where README names it, else 1."""
    first_rank, (first, _) = min(failures.items(), key=lambda item: (root_cause_order(item[1][0]), item[1][1],
                                                                     item[0]))
    # Ranks that stopped together at one error share its code; one of them printed it (told_by).
    alike = [str(rank) for rank, (code, _) in sorted(failures.items()) if code == first]
    who = f"worker rank {first_rank}" if len(alike) == 1 else f"worker ranks {', '.join(alike)}"
    print(f"ganscale: {prefix}{who} failed with exit code {first} (see {'their' if alike[1:] else 'its'} output "
          "above)", file=sys.stderr)
    # Replicas that differ are restarted: the last checkpoint, checked when written, makes them one again.
    named = first in NOT_RESTARTED or first in (EXIT_HANG, EXIT_REPLICAS_DIFFER)
    return first if named else 1


@contextlib.contextmanager
def _worker_exit_codes():
    """Yields {local rank: exit code}, filled when torch's elastic agent stops the workers: on a signal to this
    process its SignalException carries no exit codes, so they are read from the agent's workers as it closes
    them. Empty where no worker was started (or one could not be reaped)."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    codes: dict[int, int] = {}
    shutdown = LocalElasticAgent._shutdown

    def recording(agent, *args, **kwargs):
        shutdown(agent, *args, **kwargs)
        # torch's internals: where another version has none of them, no codes are known (the launcher exits 1)
        handlers = getattr(getattr(agent, "_pcontext", None), "subprocess_handlers", None) or {}
        exits = {rank: getattr(getattr(handler, "proc", None), "poll", lambda: None)()
                 for rank, handler in handlers.items()}
        if None not in exits.values():
            codes.update(exits)

    LocalElasticAgent._shutdown = recording
    try:
        yield codes
    finally:
        LocalElasticAgent._shutdown = shutdown


def _quiet_agent_logs() -> None:
    """Silence the elastic agent's own lines (a worker that failed, the SIGTERMs it sends the others): they repeat
    what the workers and `_launch_once` say once. LOGLEVEL (torch's setting for them) shows them again."""
    if "LOGLEVEL" in os.environ:
        return
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def run_worker(cfg: Config, run_dir: str | None, resume: str | None, note: str | None = None
               ) -> tuple[Path, dict]:
    """Train in this process as one rank of the group described by the environment; (run directory, summary).
    Raises AlreadyTrained on every rank when rank 0 finds the run finished. `note`: said by rank 0 once the
    checkpoint it resumes from has loaded, before training starts."""
    import torch

    from ganscale import memory, slurm
    from ganscale import runtime as rt
    from ganscale.trainer import Trainer

    from ganscale.fault import NonFiniteTraining, Preempted, ReplicaDivergence, RunDirectoryTakenOver

    follow_launcher()
    runtime = rt.start(cfg.train.device, cfg.parallel.backend, cfg.parallel.timeout_s, cfg.parallel.cpu_offload)
    held, trained = None, False
    try:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        room = torch.tensor([memory.available(runtime.device, local_ranks)], device=runtime.device)
        dist.all_reduce(room, op=dist.ReduceOp.MIN)  # one verdict: every rank judges by the tightest rank's memory
        needed = memory.check_training(cfg, runtime.world, int(room), memory.where(runtime.device.type, local_ranks),
                                       local_ranks, runtime.device.type == "cuda")
        if needed.note and runtime.is_main:
            print(f"ganscale: warning: {needed.note}", file=sys.stderr, flush=True)
        run_path, resume_from, held = decide_run(cfg, run_dir, resume)
        if runtime.is_main and (said := slurm.start_line(resume_from)):
            print(said, flush=True)
        if held is None and runtime.is_main:  # an `--nproc` worker: the launcher holds it, rank 0 watches it
            held = runlock.watch_parent_hold(run_path)
        trainer = Trainer(cfg, runtime, run_path, resume_from, run_lock=held)  # refuses a checkpoint that misfits
        if runtime.is_main and note:
            print(note, flush=True)
        summary = trainer.fit()
        trained = True
        dist.barrier()  # no rank tears down its connections while a peer still uses them
    except (ConfigError, AlreadyTrained, Preempted, NonFiniteTraining, ReplicaDivergence, RunDirectoryTakenOver):
        runtime.close()  # decisions every rank reached together: leave together
        raise
    except BaseException:
        if runtime.world == 1:  # no peer to tell: an in-process caller (ganscale.train) gets its process back clean
            runtime.close()
        raise
    finally:
        if held is not None:  # rank 0's hold on the run directory (or watch): free once this run has left it
            held.release(abandon=not trained)  # refused before writing anything: no empty folder left behind
    # Any other error is this rank's own: the group stays open until the process exits, so the peers'
    # collectives break only then and the launcher sees this rank fail first.
    runtime.close()
    return run_path, summary
