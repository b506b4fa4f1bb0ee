"""`ganscale slurm`: a readable sbatch script in the run directory, submitted with `sbatch`.

The script follows torchtitan's and Accelerate's convention: one task per node, `srun` running torchrun with a
c10d rendezvous on the allocation's first node, the job id as rendezvous id. Before the time limit Slurm signals
the batch shell (USR1), which forwards SIGTERM to srun: torchrun's agents pass it to the workers, which finish
their step, write an agreed checkpoint and exit (fault.StopSignals); the job then requeues itself and resumes
from the same run directory (`--resume auto`). A SIGTERM (scancel, preemption) stops the job the same way, for good.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ganscale.config import Config, ConfigError, refuse_control_characters
from ganscale.fault import EXIT_PREEMPTED, stop_grace_s

# SLURM_TASKS_PER_NODE as Slurm writes it (env.c: "%u" or "%u(x%u)" per run of nodes alike, joined by commas).
TASKS_PER_NODE = re.compile(r"[0-9]+(?:\(x[0-9]+\))?(?:,[0-9]+(?:\(x[0-9]+\))?)*")
TIME = re.compile(r"^(?:(\d+)-)?(\d{1,2}):([0-5]\d):([0-5]\d)$")  # [D-]HH:MM:SS, one of sbatch's forms
SCRIPT = "job.sbatch"
# sbatch's lines where it never reached slurmctld (no slurm.conf or configless source, controller down, munge)...
UNREACHED = re.compile(r"configuration source|contact slurm controller|connect|timed out|Zero Bytes|munge|"
                       r"credential|authentication", re.IGNORECASE)
# ...and where slurmctld refused what the job asks (src/common/slurm_errno.c's texts).
OPTION_REFUSED = re.compile(r"partition|account|time limit|node|gres|gpu|cpu|qos|memory|association|"
                            r"task count|processor count", re.IGNORECASE)
SLURMCTLD_CHECK_S = 30  # slurmctld's time-limit check interval (PERIODIC_TIMEOUT): a signal may come this much early
MIN_TRAINING_S = 30  # start-up and at least one step before the earliest signal
# A job's rendezvous port (torchrun's) or MASTER_PORT (srun tasks) comes from its job id, so jobs sharing a node
# differ, and from its requeues, so a requeued run never joins a store its previous run still holds while it
# winds down (an agent that finds its port taken joins the store there as a client); below Linux's ephemeral
# range (32768 and up), where the kernel hands out client ports.
PORT_BASE, PORT_SPAN, PORT_REQUEUE_STEP = 10000, 20000, 7919
RDZV_PORT_LINE = (f"RDZV_PORT=$(({PORT_BASE} + (SLURM_JOB_ID + {PORT_REQUEUE_STEP} * ${{SLURM_RESTART_COUNT:-0}})"
                  f" % {PORT_SPAN}))")
# Slurm's default KillWait: a signal the scheduler delivers late still leaves the stop this long before SIGKILL.
SLURM_SLACK_S = 30


@dataclass(frozen=True)
class Layout:
    nodes: int
    gpus_per_node: int
    procs_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass(frozen=True)
class Job:
    """What the sbatch script asks of Slurm and runs."""
    layout: Layout
    name: str
    run_dir: Path
    train_args: list[str]  # after `ganscale train`: recipe or config file, --set values
    time: str | None
    partition: str | None
    account: str | None
    requeue: bool
    signal_lead_s: int
    cpus_per_node: int


def layout(nodes: int, gpus_per_node: int, procs_per_node: int | None) -> Layout:
    """The per-node layout; a CPU job (gloo) names its processes per node, a GPU job defaults to one per GPU."""
    if procs_per_node is None:
        if gpus_per_node == 0:
            raise ConfigError("--procs-per-node", "a CPU job (--gpus-per-node 0) has no GPU count to start one "
                              "process per", "pass --procs-per-node P (processes per node)")
        procs_per_node = gpus_per_node
    if gpus_per_node and procs_per_node != gpus_per_node:
        raise ConfigError("--procs-per-node", f"{procs_per_node} processes per node on {gpus_per_node} GPUs per node",
                          "start one process per GPU: leave --procs-per-node out, or make it equal --gpus-per-node")
    return Layout(nodes, gpus_per_node, procs_per_node)


def check_inputs(recipe: str | None, overrides: tuple[str, ...], time_limit: str | None, partition: str | None,
                 account: str | None, run_dir: str | None) -> None:
    """Every value the script will hold, as given, before anything reads it: no control characters (a newline in
    an #SBATCH line ends it, and the rest is a command the batch shell runs)."""
    values = [("RECIPE", recipe), *(("--set", override) for override in overrides), ("--time", time_limit),
              ("--partition", partition), ("--account", account), ("--run-dir", run_dir)]
    for option, value in values:
        refuse_control_characters(option, value)


def check_job(job: Job, python: str = sys.executable) -> None:
    """Every value the script holds, as written: with this machine's paths (the working directory a relative
    --run-dir or recipe file is resolved in, this Python), no control characters; and no backslash in an #SBATCH
    value, which sbatch reads as an escape even inside quotes and drops (a/b\\c is read a/bc)."""
    args = job.train_args
    train_values = [("--set" if i and args[i - 1] == "--set" else "RECIPE", arg)
                    for i, arg in enumerate(args) if arg != "--set"]
    sbatch_values = [("--run-dir", str(job.run_dir)), ("--partition", job.partition), ("--account", job.account),
                     ("name", job.name)]
    for option, value in [*sbatch_values, ("--time", job.time), *train_values, ("python", python)]:
        refuse_control_characters(option, value)
    for option, value in sbatch_values:
        if value and "\\" in value:
            raise ConfigError(option, f"'{value}' holds a backslash, which sbatch drops from #SBATCH lines",
                              f"pass {option} without a backslash")


def default_cpus_per_node(procs_per_node: int, cfg: Config) -> int:
    """A CPU for each process and for each of its data loader workers: the node's one task holds every process
    torchrun starts there, so Slurm's one CPU per task would bind them all (and their loaders) to one core (a
    Kubernetes pod, likewise, holds all of its node's processes)."""
    return procs_per_node * (1 + cfg.data.workers)


def check_cpus(procs_per_node: int, cpus_per_node: int) -> None:
    if cpus_per_node < procs_per_node:
        raise ConfigError("--cpus-per-node", f"{cpus_per_node} CPUs per node for {procs_per_node} processes "
                          "per node", f"ask for at least one per process: --cpus-per-node {procs_per_node} "
                          "or more")


def check_time(value: str | None) -> None:
    if value is not None and not TIME.fullmatch(value):  # fullmatch: `$` alone lets a trailing newline through
        raise ConfigError("--time", f"'{value}' is not a time limit Slurm reads here",
                          "write HH:MM:SS or D-HH:MM:SS, e.g. --time 04:00:00")


def seconds(time_limit: str) -> int:
    days, hours, minutes, secs = (int(part or 0) for part in TIME.match(time_limit).groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def check_signal_lead(time_limit: str | None, lead_s: int) -> None:
    """Refuse a lead that leaves no training before the signal: slurmctld checks limits every 30 s and sends the
    signal at the first check within lead + 30 s of the limit, so a job with less than that plus a start-up margin
    would be signalled as it starts, stop before its first step and requeue itself forever."""
    if time_limit is None:
        return
    earliest = seconds(time_limit) - lead_s - SLURMCTLD_CHECK_S
    if earliest < MIN_TRAINING_S:
        raise ConfigError("--signal-lead", f"{lead_s} s before a {time_limit} limit: Slurm may signal the job "
                          f"{max(earliest, 0)} s after it starts (it checks every {SLURMCTLD_CHECK_S} s), before it "
                          "trains, and every requeue would stop the same way",
                          f"ask for more --time (at least {lead_s + SLURMCTLD_CHECK_S + MIN_TRAINING_S} s) or a "
                          "shorter --signal-lead")


def default_signal_lead_s(cfg: Config) -> int:
    """Seconds before the time limit to signal: the longest a rank takes to stop (fault.stop_grace_s, which covers
    the measured checkpoint-on-signal time, benchmarks/results/stop-grace-*.md) plus Slurm's KillWait."""
    return math.ceil(stop_grace_s(cfg.fault.exit_timeout_s)) + SLURM_SLACK_S


def train_args(recipe: str | None, overrides: tuple[str, ...]) -> list[str]:
    """`ganscale train`'s arguments for the job: a config file by its absolute path (the job may start elsewhere)."""
    args = []
    if recipe is not None:
        args.append(str(Path(recipe).resolve()) if recipe.endswith((".yaml", ".yml")) else recipe)
    for override in overrides:
        args += ["--set", override]
    return args


def script(job: Job, python: str = sys.executable) -> str:
    """The sbatch script: readable and complete, so it can be edited and resubmitted by hand."""
    q = shlex.quote
    run_dir = q(str(job.run_dir))
    # --output/--error are Slurm filename patterns, where %j is the job id and %% a literal %: a % of the run
    # directory's own (lr5%u) would be replaced, and the job would fail with its log nowhere. Nothing else here
    # expands % (srun has no --output; torchrun's --log-dir and ganscale's --run-dir take the path as it is).
    log_pattern = str(job.run_dir).replace("%", "%%") + "/slurm"
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name={q(job.name)}",
             f"#SBATCH --nodes={job.layout.nodes}",
             "#SBATCH --ntasks-per-node=1  # one torchrun agent per node; it starts the node's processes",
             f"#SBATCH --cpus-per-task={job.cpus_per_node}  # the node's CPUs, for all its processes and loaders"]
    if job.layout.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.layout.gpus_per_node}")
    if job.time:
        lines.append(f"#SBATCH --time={job.time}")
    if job.partition:
        lines.append(f"#SBATCH --partition={q(job.partition)}")
    if job.account:
        lines.append(f"#SBATCH --account={q(job.account)}")
    lines += [f"#SBATCH --signal=B:USR1@{job.signal_lead_s}  # to this shell, before the time limit",
              "#SBATCH --requeue" if job.requeue else "#SBATCH --no-requeue",
              "#SBATCH --open-mode=append  # a requeued job adds to its logs",
              f"#SBATCH --output={q(log_pattern + '/%j.out')}",
              f"#SBATCH --error={q(log_pattern + '/%j.err')}",
              "",
              "set -u",
              f"RUN_DIR={run_dir}",
              f"REQUEUE={int(job.requeue)}",
              'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
              RDZV_PORT_LINE + "  # of this job and this run of it",
              'echo "ganscale: job $SLURM_JOB_ID, restart ${SLURM_RESTART_COUNT:-0}, rendezvous on $HEAD_NODE:$RDZV_PORT"',
              "",
              "# USR1 (before the time limit) or SIGTERM (scancel, preemption): SIGTERM to the job's steps (torchrun and",
              "# every worker, on every node); each worker finishes its step, writes an agreed checkpoint and exits. Not",
              "# `kill srun`: srun answers SIGTERM by killing its tasks at once, before any checkpoint.",
              "# Only USR1 requeues: a SIGTERM is scancel's or a preemption's (Slurm requeues those it means to).",
              'STOPPED=""',
              'stop() { STOPPED=$1; scancel --signal=TERM "$SLURM_JOB_ID"; }',
              "trap 'stop USR1' USR1",
              "trap 'stop TERM' TERM",
              "",
              "# Whether this run's workers stopped on request with a checkpoint: rank 0 writes summary.json with",
              "# stopped=preempted only after the stop's checkpoint.",
              "stopped_with_checkpoint() {",
              '    [ -f "$RUN_DIR/summary.json" ] && [ "$(stat -c %Y "$RUN_DIR/summary.json")" -ge "$STARTED" ] &&',
              '        grep -q \'"stopped": "preempted"\' "$RUN_DIR/summary.json"',
              "}",
              "",
              "STARTED=$(date +%s)",
              "# srun no longer takes --cpus-per-task from sbatch (Slurm 22.05): passed on, or the task gets one CPU.",
              "# ganscale.torchrun: torchrun, which ends a failure with one line and the failed workers' exit code.",
              'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" '
              f"{q(python)} -m ganscale.torchrun \\",
              '    --nnodes "$SLURM_NNODES" '
              f"--nproc-per-node {job.layout.procs_per_node} \\",
              f'    --rdzv-backend c10d --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \\',
              '    --log-dir "$RUN_DIR/slurm/logs/$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}" --tee 3 \\',
              "    -m ganscale train " + " ".join(q(a) for a in job.train_args) + ' --resume auto --run-dir "$RUN_DIR" &',
              "SRUN_PID=$!",
              'while wait "$SRUN_PID"; STATUS=$?; kill -0 "$SRUN_PID" 2>/dev/null; do :; done  # wait ends at a trap',
              "",
              'if [ -n "$STOPPED" ] && stopped_with_checkpoint; then',
              '    if [ "$STOPPED" = USR1 ] && [ "$REQUEUE" = 1 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
              f"    exit {EXIT_PREEMPTED}  # stopped on a signal, checkpoint written: resumes with --resume auto",
              "fi",
              'if [ -n "$STOPPED" ] && [ "$STATUS" != 0 ]; then',
              '    echo "ganscale: stopped on SIG$STOPPED, but the workers wrote no checkpoint of the stop'
              ' (exit $STATUS; their logs: $RUN_DIR/slurm/logs); not requeued" >&2',
              "fi",
              'exit "$STATUS"',
              ""]
    return "\n".join(lines)


def rendezvous_port(job_id: int, requeues: int) -> int:
    """The rendezvous port of a job's run after `requeues` requeues (job.sbatch computes it in RDZV_PORT_LINE)."""
    return PORT_BASE + (job_id + PORT_REQUEUE_STEP * requeues) % PORT_SPAN


def requeue_count(environ=os.environ) -> int:
    """How many times Slurm requeued this job (SLURM_RESTART_COUNT; 0 outside Slurm). A malformed count is the
    ConfigError `ganscale train` refuses it with at its start."""
    from ganscale.launch import environment_integer  # here: launch imports torch, which submitting a job does not

    return environment_integer(environ, "SLURM_RESTART_COUNT", 0)


def start_line(resume_from: Path | None, environ=os.environ) -> str | None:
    """Rank 0's line at the start of a Slurm job; None outside one."""
    if "SLURM_JOB_ID" not in environ:
        return None
    resuming = f", resuming from {resume_from}" if resume_from else ""
    return f"ganscale: Slurm job {environ['SLURM_JOB_ID']}, requeued {requeue_count(environ)} times{resuming}"


def first_host(nodelist: str, name: str = "SLURM_NODELIST") -> str:
    """The first host of a Slurm node list ("node[03-05,9],gpu1" -> "node03"), as `scontrol show hostnames`; a
    ConfigError naming the variable `name` it was read from where it is none."""
    found = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if found is None:
        raise ConfigError(name, f"'{nodelist}' is not a node list", f"set {name} as Slurm writes it, e.g. "
                          "node[03-05],gpu1, or unset it (Slurm sets it in a job)")
    return found[1] + (re.split(r"[,-]", found[2])[0] if found[2] else "")


def tasks_per_node(value: str) -> int:
    """The first node's count of SLURM_TASKS_PER_NODE, Slurm's compressed list ("4(x2),3"); a ConfigError naming
    the variable for anything else (empty included: no count stands in for it on a job of several nodes)."""
    if not TASKS_PER_NODE.fullmatch(value):
        raise ConfigError("SLURM_TASKS_PER_NODE", f"{value!r} is not Slurm's list of tasks per node",
                          "set SLURM_TASKS_PER_NODE as Slurm writes it, e.g. 2(x3),1 (3 nodes of 2 tasks, then "
                          "1 of 1), or unset it (Slurm sets it in a job)")
    return int(re.match(r"[0-9]+", value)[0])


def task_environment(environ, nproc: int | None) -> dict[str, str]:
    """torch.distributed's variables for a task `srun` started (Lightning's convention: one task per process);
    {} where another launcher set them or there is no Slurm job step. Refuses layouts that cannot work."""
    from ganscale.launch import environment_integer  # here: launch imports torch, which submitting a job does not

    if "SLURM_JOB_ID" not in environ or "TORCHELASTIC_RUN_ID" in environ or "RANK" in environ:
        return {}
    tasks = environment_integer(environ, "SLURM_NTASKS", 1)
    if tasks == 1:
        return {}
    if "SLURM_STEP_ID" not in environ:
        raise ConfigError("srun", f"this job has {tasks} tasks but ganscale runs in the batch script, outside srun",
                          "start it with `srun ganscale train ...`, or submit with `ganscale slurm`")
    if nproc:
        raise ConfigError("--nproc", f"each of the {tasks} srun tasks would start its own {nproc} workers",
                          "leave --nproc out under srun (one task per process), or run one task per node")
    for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODELIST"):
        if not environ.get(name):
            raise ConfigError(name, f"unset in a task of this {tasks}-task job step, so its rank or rendezvous "
                              "host is unknown", f"start ganscale with srun, which sets {name} in each task")
    rank, local_rank = (environment_integer(environ, name, 0) for name in ("SLURM_PROCID", "SLURM_LOCALID"))
    per_node = tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", str(tasks)))
    gpus = environment_integer(environ, "SLURM_GPUS_ON_NODE", 0)
    if gpus and per_node != gpus:
        raise ConfigError("srun", f"{per_node} tasks per node on {gpus} GPUs per node",
                          f"ask for one task per GPU: --ntasks-per-node={gpus}")
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(tasks),
            "LOCAL_WORLD_SIZE": str(per_node), "MASTER_ADDR": first_host(environ["SLURM_NODELIST"]),
            "MASTER_PORT": str(rendezvous_port(environment_integer(environ, "SLURM_JOB_ID", 0),
                                               requeue_count(environ)))}


def check_sbatch() -> str:
    found = shutil.which("sbatch")
    if found is None:
        raise ConfigError("sbatch", "no sbatch on PATH, so the job cannot be submitted",
                          "run this on a Slurm login node (or load its module), or pass --dry-run to print the script")
    return found


def write_script(run_dir: Path, text: str) -> tuple[Path, Path | None]:
    """(script path, where an earlier, different script was kept). Atomic; an earlier script is never lost."""
    folder = run_dir / "slurm"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / SCRIPT
    kept = None
    if target.exists() and target.read_text() != text:
        n = 1
        while (folder / f"job.{n}.sbatch").exists():
            n += 1
        kept = folder / f"job.{n}.sbatch"
        os.replace(target, kept)
    partial = folder / f".{SCRIPT}.{os.getpid()}.tmp"
    partial.write_text(text)
    partial.chmod(0o755)
    os.replace(partial, target)
    return target, kept


def sbatch_fix(said: str) -> str:
    """The fix for sbatch's last line: an option where the controller refused the job's request, reaching the
    controller where sbatch never got to ask, what it says otherwise."""
    if UNREACHED.search(said):
        return ("run this on a Slurm login node whose sbatch reaches the controller (check `sinfo`; SLURM_CONF, "
                "munge), then submit again (--dry-run prints the script)")
    if OPTION_REFUSED.search(said):
        return ("fix the option it names (--partition, --account, --time, --nodes, --gpus-per-node, --cpus-per-node) "
                "and submit again (--dry-run prints the script)")
    return "fix what sbatch names and submit again (--dry-run prints the script)"


def submit(sbatch: str, path: Path) -> str:
    """The job id sbatch gives; sbatch's own refusal (a partition or account it rejects) is bad input."""
    done = subprocess.run([sbatch, "--parsable", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        last = said[-1] if said else f"exit {done.returncode}"
        raise ConfigError("sbatch", f"refused the job: {last}", sbatch_fix(last))
    return done.stdout.strip().split(";")[0]


def write_and_submit(sbatch: str, run_dir: Path, text: str) -> tuple[str, Path, Path | None]:
    """(job id, script path, where an earlier, different script was kept): the script written and submitted.
    A job sbatch refuses leaves the run directory as it was: the script is taken back, an earlier one put back in
    its place, and the folders this made removed."""
    scripts = run_dir / "slurm"
    made = [folder for folder in (scripts, *scripts.parents) if not folder.exists()]  # deepest first
    path = run_dir / "slurm" / SCRIPT
    existed = path.exists()
    path, kept = write_script(run_dir, text)
    try:
        return submit(sbatch, path), path, kept
    except ConfigError:
        if kept is not None:
            os.replace(kept, path)
        elif not existed:
            path.unlink()
        for folder in made:
            with contextlib.suppress(OSError):  # left where something else wrote into it meanwhile
                folder.rmdir()
        raise
