"""Run a function on N real processes (gloo on CPU) and collect each rank's return value.

Each rank is a fresh process with one thread (so 1-rank references and N-rank runs do the same arithmetic),
MASTER_ADDR/PORT set as a launcher would. Ranks are forked from a server process that has imported torch and
ganscale's trainer once (multiprocessing's forkserver): a spawned rank spent ~3 s of CPU importing them, most of
a short test's time.
"""

from __future__ import annotations

import gc
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# What every rank imports. Importing them starts no thread in the server, so forking it is as safe as spawning.
mp.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "ganscale.trainer", "ganscale.runtime",
                           "ganscale.preflight", "dist_helpers"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, environ: dict, fn: Callable, args: tuple) -> None:
    os.environ.clear()  # the test's environment, not the server's (started by an earlier test)
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        # fn's DDP reducers, freed by a later collection (torch.save's imports), took the last reference to gloo's
        # group: ~ProcessGroupGloo joined a work thread that waited for the GIL the collector held (hung for good).
        gc.collect()
        gc.disable()
        dist.barrier()  # nobody tears down its connections while a peer still uses them
    finally:
        dist.destroy_process_group()
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    # Seen about once in 12 runs: after all work, teardown, and the result are done, the interpreter's
    # exit aborted in C++ ("terminate called without an active exception"). What is tested is saved
    # by now, so leave without the interpreter teardown rather than fail a finished test.
    os._exit(0)


def run_ranks(fn: Callable, world: int, *args: Any) -> list[Any]:
    """fn(rank, world, *args) on `world` processes; returns the list of results by rank."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(world, _free_port(), out_dir, dict(os.environ), fn, args), nprocs=world,
                           join=True, start_method="forkserver")
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def train_and_collect(rank: int, world: int, overrides: dict, run_dir: str, steps_hook: Callable | None = None,
                      resume: Path | None = None, recipe: str | None = None) -> dict:
    """Train a config (dict of dotted overrides on a recipe, default: the default one) and return the final
    weights."""
    from ganscale import config, preflight
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    cfg = config.load(recipe, [f"{k}={v}" for k, v in overrides.items()])
    preflight.check(cfg, world, False)
    trainer = Trainer(cfg, start("cpu"), Path(run_dir), resume)
    extra = steps_hook(trainer) if steps_hook else None
    summary = trainer.fit()
    # Full (unsharded) states, gathered on every rank whatever the strategy.
    return {"G": {k: v.clone() for k, v in trainer.G.model_state().items()},
            "D": {k: v.clone() for k, v in trainer.D.model_state().items()},
            "G_ema": {k: v.clone() for k, v in trainer.G.model_state(trainer.G_ema).items()},
            "summary": summary, "extra": extra() if callable(extra) else extra}


def resume_point(overrides: dict, run_dir: str, recipe: str | None = None) -> Path:
    """Collective: the checkpoint `--resume auto` continues `run_dir` from under `overrides` (on a recipe, default:
    the default one), decided on rank 0 and taken by every rank, as the CLI does (rundir.decide_run)."""
    from ganscale import config
    from ganscale.rundir import decide_run

    _, resume, held = decide_run(config.load(recipe, [f"{k}={v}" for k, v in overrides.items()]), run_dir, "auto")
    if held is not None:  # rank 0's hold on the run directory: the caller trains in it next
        held.release()
    return resume


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max |a - b| over all floating tensors, relative to the largest |a| of that tensor."""
    worst = 0.0
    assert a.keys() == b.keys()
    for key in a:
        if a[key].is_floating_point():
            scale = a[key].abs().max().clamp_min(1e-12)
            worst = max(worst, float((a[key] - b[key]).abs().max() / scale))
    return worst


def network_outputs(overrides: dict, states: dict, inputs: dict, recipe: str | None = None) -> dict[str, torch.Tensor]:
    """What G, G_ema (batch statistics) and D (eval) compute on fixed inputs, from collected states."""
    from ganscale import config
    from ganscale.models import build_networks

    generator, discriminator = build_networks(config.load(recipe, [f"{k}={v}" for k, v in overrides.items()]))
    out = {}
    with torch.no_grad():
        for net in ("G", "G_ema"):
            generator.load_state_dict(states[net])
            out[net] = generator.train()(*inputs["G"])
        discriminator.load_state_dict(states["D"])
        out["D"] = discriminator.eval()(*inputs["D"])
    return out


def assert_same_functions(overrides: dict, reference: dict, others: list[dict], inputs: dict,
                          recipe: str | None = None) -> None:
    """N ranks == 1 process, compared by what the networks compute: biases of convolutions that feed a
    normalisation get gradients that are zero up to rounding, which Adam scales up to lr-sized steps, so
    their values depend on the summation order while the functions do not."""
    expected = network_outputs(overrides, reference, inputs, recipe)
    for other in others:
        got = network_outputs(overrides, other, inputs, recipe)
        for net in expected:
            assert max_relative_difference({net: expected[net]}, {net: got[net]}) <= 1e-4, net


def poison_d_loss_on_rank1(bad_step: Callable[[int], bool]) -> Callable:
    """A steps_hook: on rank 1 only, D's loss becomes NaN at the steps where bad_step(step) is true."""
    def hook(trainer):
        from ganscale import trainer as trainer_module

        original = trainer_module.objectives.d_loss

        def poisoned(kind, real, fake):
            loss = original(kind, real, fake)
            return loss * float("nan") if trainer.runtime.rank == 1 and bad_step(trainer.step) else loss
        trainer_module.objectives.d_loss = poisoned
    return hook


def poison_g_forward_on_rank1(bad_step: int) -> Callable:
    """A steps_hook: on rank 1 only, G's first layer's output becomes NaN in G's step of step `bad_step` (an overflow
    inside G, before its first BatchNorm)."""
    def hook(trainer):
        def poisoned(module, args, output):
            in_g_step = trainer.D.frozen  # D is frozen in G's step only
            return output * float("nan") if trainer.runtime.rank == 1 and trainer.step == bad_step and in_g_step else output
        trainer.G.module.net[0].register_forward_hook(poisoned)
    return hook


def on_rank1_after_step(step: int, change: Callable) -> Callable:
    """A steps_hook: on rank 1 only, `change(trainer)` runs once step `step` is done (after its EMA update), where
    no loss or gradient sees it before the next step."""
    def hook(trainer):
        update_ema = trainer.update_ema

        def then_change(beta):
            update_ema(beta)
            if trainer.runtime.rank == 1 and trainer.step == step + 1:
                change(trainer)
        trainer.update_ema = then_change
    return hook


def train_in_process(cfg, run_dir):
    """Train `cfg` in this process as a one-rank group; returns the finished Trainer."""
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    runtime = start("cuda" if cfg.train.device == "cuda" else "cpu")  # "auto" stays on the CPU on a GPU machine
    try:
        trainer = Trainer(cfg, runtime, Path(run_dir))
        trainer.fit()
    finally:
        runtime.close()
    return trainer


def record_steps(trainer) -> Callable[[], list[dict]]:
    """A steps_hook: per optimizer step, in order, the network ('G' or 'D'), its gradients as the optimizer gets
    them (averaged over ranks, full tensors: DDP-style strategies only) and the step's losses as logged."""
    steps: list[dict] = []
    optimizers = {id(trainer.opt_g): "G", id(trainer.opt_d): "D"}
    step, finish = trainer.precision.step, trainer._finish_step

    def recording_step(optimizer):
        grads = [p.grad.detach().flatten().clone() for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        steps.append({"net": optimizers[id(optimizer)], "grad": torch.cat(grads)})
        step(optimizer)

    def recording_finish(net, optimizer, terms, moved):
        means = finish(net, optimizer, terms, moved)
        steps[-1]["loss"] = means[0]  # the adversarial (plus reconstruction) loss, global mean
        return means
    trainer.precision.step, trainer._finish_step = recording_step, recording_finish
    return lambda: steps
