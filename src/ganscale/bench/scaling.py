"""`ganscale bench scaling`: an N-process DDP step against a 1-process step of the same per-rank batch.

Each rank is a spawned process (gloo, `--threads` threads) running ganscale's Trainer on the given recipe,
exactly as `ganscale train --nproc N` would after start-up; a hook on the trainer's per-step progress
call records, per step, the wall time and the process's CPU time (all its threads: gloo's and the
autograd engine's included). Wall time is the target; CPU time tells the work DDP adds (hooks, bucket
copies, the all-reduce itself) apart from the time a rank waits in a collective for a peer, which on
a machine shared with other jobs grows with the time the peer waits for a core.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from ganscale.bench.report import median, quantile
from ganscale.loopback import ADDRESS, loopback_store

SETUP_STEPS = 3  # one-time work, the memory report after step 1, step 3's traffic measurement


def _rank(rank: int, world: int, port: int, out_dir: str, recipe: str, overrides: list[str], threads: int,
          independent: bool = False) -> None:
    if not independent:  # independent: every process trains alone (a group of one), at the same time as the others
        # Every rank a client of the parent's store on the loopback (rank 0 would open one on every interface).
        os.environ.update(MASTER_ADDR=ADDRESS, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
        if sys.platform.startswith("linux"):  # gloo listens on the address this host's name resolves to, else
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    from ganscale import config, preflight
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    cfg = config.load(recipe, overrides)
    preflight.check(cfg, 1 if independent else world, False)
    runtime = start("cpu")
    steps: list[tuple[float, float]] = []
    try:
        trainer = Trainer(cfg, runtime, Path(out_dir) / "run")
        advance, last = trainer.reporter.log.advance, [time.perf_counter(), time.process_time()]

        def timed_advance(n: int = 1) -> None:
            advance(n)
            now = [time.perf_counter(), time.process_time()]
            steps.append((now[0] - last[0], now[1] - last[1]))
            last[:] = now

        trainer.reporter.log.advance = timed_advance
        trainer.fit()
    finally:
        runtime.close()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(steps[SETUP_STEPS:]))
    # About once in 70 spawns a rank that had finished, torn down its group and written its times hung in
    # the interpreter's exit (main thread in a futex wait, gloo's threads alive), and the bench with it.
    # Everything measured is on disk by now: leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def step_times(recipe: str, overrides: list[str], world: int, threads: int,
               independent: bool = False) -> list[list[tuple[float, float]]]:
    """Per rank (or per independent process), per step (after setup): (wall seconds, CPU seconds)."""
    store = loopback_store()  # kept until the ranks are done
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank, args=(world, store.port, out_dir, recipe, overrides, threads, independent),
                           nprocs=world, join=True, start_method="spawn")
        return [json.loads((Path(out_dir) / f"rank{r}.json").read_text()) for r in range(world)]


def _summary(runs: list[list[list[tuple[float, float]]]]) -> dict:
    """Medians over every step of every rank of every run (ranks meet in collectives: a step lasts as long on each)."""
    walls = [w for run in runs for rank in run for w, _ in rank]
    cpus = [c for run in runs for rank in run for _, c in rank]
    return {"wall_median_s": median(walls), "wall_p10_s": quantile(walls, 0.1), "cpu_median_s": median(cpus),
            "steps_measured": len(walls)}


def ddp_scaling(recipe: str, base: list[str], nproc: int, per_rank_batch: int, steps: int, repeats: int,
                threads: int) -> dict:
    """1 process x per-rank batch against nproc processes x the same per-rank batch (DDP), alternating runs."""
    quiet = ["log.sample_every=0", "log.tensorboard=false", "checkpoint.every=0", "train.device=cpu",
             "parallel.generator=ddp", "parallel.discriminator=ddp", f"train.steps={steps}"]
    one, many, apart = [], [], []
    alone = [*base, *quiet, f"train.batch_size={per_rank_batch}"]
    for _ in range(repeats):
        one.append(step_times(recipe, alone, 1, threads))
        many.append(step_times(recipe, [*base, *quiet, f"train.batch_size={per_rank_batch * nproc}"], nproc, threads))
        # The machine's own ceiling: the same 1-process training N times at once, nothing shared but the cores,
        # caches and memory. DDP cannot beat this; the gap between it and DDP is what DDP itself costs.
        apart.append(step_times(recipe, alone, nproc, threads, independent=True))
    single, multi, independent = _summary(one), _summary(many), _summary(apart)
    # Each N-process run over the 1-process run just before it: the machine's speed drifts over minutes (other
    # jobs, boost clocks), and a pair's two runs see the same drift where the medians over all runs mix it in.
    pair_ratios = [_summary([n])["wall_median_s"] / _summary([o])["wall_median_s"] for o, n in zip(one, many)]
    return {"one_process": single, "n_process": multi, "independent": independent,
            "pair_wall_ratios": pair_ratios, "pair_wall_ratio_median": median(pair_ratios),
            "wall_ratio": multi["wall_median_s"] / single["wall_median_s"],
            "wall_p10_ratio": multi["wall_p10_s"] / single["wall_p10_s"],
            "cpu_ratio": multi["cpu_median_s"] / single["cpu_median_s"],
            "independent_wall_ratio": independent["wall_median_s"] / single["wall_median_s"],
            "independent_cpu_ratio": independent["cpu_median_s"] / single["cpu_median_s"]}
