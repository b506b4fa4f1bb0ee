"""The fast path (parallel/speed.py, optim.fused): the same training, in another layout, kernel or graph."""

from __future__ import annotations

import os

import pytest
import torch

from dist_helpers import max_relative_difference, run_ranks, train_and_collect
from test_distributed import SMALL_DCGAN, SMALL_MLP

FAST = {"train.channels_last": "true", "optim.fused": "true"}
COMPILED = {**FAST, "train.compile": "default"}
GRAPHS = {**FAST, "train.compile": "reduce-overhead"}  # CUDA graphs on a GPU
# TF32 off in both legs: TF32 convolutions round to 10 bits by whichever algorithm cuDNN picks for a layout, and Adam's
# first steps move a weight by ~lr whatever its gradient's size, so eager and graphs would part by far more than 1e-3.
CUDA_FP32 = {"train.device": "cuda", "train.tf32": "false"}


def _trainer(overrides: dict, run_dir):
    """The trainer after training `overrides` in this process (CUDA-only tests)."""
    from ganscale import config
    from dist_helpers import train_in_process

    return train_in_process(config.load(None, [f"{k}={v}" for k, v in overrides.items()]), run_dir)


def _g_weights(trainer) -> dict:
    return {k: v.detach().cpu() for k, v in trainer.G.model_state().items()}


def _trained_g(overrides: dict, run_dir) -> dict:
    """G's weights after training `overrides` in this process."""
    return _g_weights(_trainer(overrides, run_dir))


def _graphed_g(overrides: dict, run_dir) -> dict:
    """`_trained_g` of a run compiled with CUDA graphs, which must have run as graphs: inductor falls back to
    plain kernels, silently, where a graph cannot be recorded (a mutated input, a CPU tensor, ...), and its
    graph trees where they stay in warm-up or re-record. The step before the last is profiled (which changes
    nothing trained): by then a step replays its graphs, and neither records one nor runs a compiled call
    outside one."""
    from torch._dynamo.utils import counters

    counters.clear()
    trainer = _trainer({**overrides, "log.profile_after": int(overrides["train.steps"]) - 2, "log.profile_steps": 1},
                       run_dir)
    assert counters["inductor"]["cudagraph_skips"] == 0, "inductor skipped CUDA graphs (TORCH_LOGS=perf_hints says why)"
    window = trainer.profiler.window
    assert window["CUDA graph replays"] > 0 and window["CUDA graphs recorded"] == 0, window
    assert window["calls outside CUDA graphs"] == 0, window
    return _g_weights(trainer)


def _trainer_layout(rank, world, overrides, run_dir):
    """Inspect a trainer without training: layouts of G's and D's weights and the optimizers' options."""
    from pathlib import Path

    from ganscale import config
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    cfg = config.load(None, [f"{k}={v}" for k, v in overrides.items()])
    trainer = Trainer(cfg, start("cpu"), Path(run_dir))
    convs = [p for net in (trainer.G.module, trainer.D.module, trainer.G_ema) for p in net.parameters() if p.dim() == 4]
    return {"convs": len(convs), "nhwc": sum(p.is_contiguous(memory_format=torch.channels_last) for p in convs),
            "fused": (trainer.opt_g.defaults["fused"], trainer.opt_d.defaults["fused"]),
            "compiled": trainer.G.forward is not trainer.G.net and trainer.D.forward is not trainer.D.net,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "fp32": (torch.backends.cudnn.conv.fp32_precision, torch.backends.cuda.matmul.fp32_precision)}


def test_fast_path_options_reach_the_networks_and_optimizers(tmp_path):
    plain = run_ranks(_trainer_layout, 1, SMALL_DCGAN, str(tmp_path / "plain"))[0]
    fast = run_ranks(_trainer_layout, 1, {**SMALL_DCGAN, **COMPILED}, str(tmp_path / "fast"))[0]
    assert plain["convs"] == fast["convs"] > 0
    assert plain["nhwc"] < plain["convs"] and fast["nhwc"] == fast["convs"]  # every 4-D weight in NHWC
    assert not any(plain["fused"]) and all(fast["fused"])
    assert not plain["compiled"] and fast["compiled"]


def test_cudnn_times_convolution_algorithms_and_uses_tf32_unless_told_not_to(tmp_path):
    """train.cudnn_benchmark (default true; torch's own default: false) and train.tf32 (default true: torch's TF32
    convolutions) reach the process's settings (each run is a new process)."""
    default = run_ranks(_trainer_layout, 1, SMALL_DCGAN, str(tmp_path / "default"))[0]
    told = run_ranks(_trainer_layout, 1, {**SMALL_DCGAN, "train.cudnn_benchmark": "false", "train.tf32": "false"},
                     str(tmp_path / "told"))[0]
    assert default["cudnn_benchmark"] and not told["cudnn_benchmark"]
    assert default["fp32"] == ("tf32", "none")  # torch's defaults: TF32 convolutions, matrix products as torch has them
    assert told["fp32"] == ("ieee", "ieee")


def test_channels_last_and_fused_adam_train_like_the_default(tmp_path):
    default = run_ranks(train_and_collect, 1, SMALL_DCGAN, str(tmp_path / "default"))[0]
    fast = run_ranks(train_and_collect, 1, {**SMALL_DCGAN, **FAST}, str(tmp_path / "fast"))[0]
    for net in ("G", "D", "G_ema"):
        assert max_relative_difference(default[net], fast[net]) <= 1e-4, net


def test_compiled_ddp_with_accumulation_equals_one_eager_process(tmp_path):
    """torch.compile over DDP: gradients still reduced in backward, no_sync still honoured per micro-step, and
    D's spectral norm still paused after the first micro-step (its parametrizations' mode is guarded on: the
    paused D is a graph of its own)."""
    plain = {**SMALL_DCGAN, "train.steps": 3, "model.g_batchnorm": "false",  # BatchNorm would see micro-batches
             "model.d_spectral_norm": "true"}
    accumulate = {**plain, "train.micro_batch": 4}  # 2 ranks x 2 micro-steps of 4 = one process's batch of 16
    eager = run_ranks(train_and_collect, 1, plain, str(tmp_path / "eager"))[0]
    ranks = run_ranks(train_and_collect, 2, {**accumulate, **COMPILED}, str(tmp_path / "compiled"))
    for rank in ranks:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(eager[net], rank[net]) <= 1e-4, net


def _with_dynamo_warnings(rank, world, overrides, run_dir):
    import logging

    said = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("torch._dynamo").addHandler(catch)
    return {**train_and_collect(rank, world, overrides, run_dir), "dynamo_warnings": said}


def test_compiled_ddp_reusing_d_steps_samples_equals_one_eager_process(tmp_path):
    """train.reuse_fake under torch.compile: G's compiled forward in D's step keeps its graph for G's step,
    whose backward reduces G's gradients; the frozen D's forward goes through the compiled network too. Dynamo's
    warning that DDP's profiler range is ignored (nothing to do about it) is not printed on each rank."""
    plain = {**SMALL_DCGAN, "train.steps": 3, "model.g_batchnorm": "false", "train.reuse_fake": "true"}
    eager = run_ranks(train_and_collect, 1, plain, str(tmp_path / "eager"))[0]
    ranks = run_ranks(_with_dynamo_warnings, 2, {**plain, **COMPILED}, str(tmp_path / "compiled"))
    for rank in ranks:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(eager[net], rank[net]) <= 1e-4, net
        assert not [said for said in rank["dynamo_warnings"] if "will be ignored" in said]


def _graph_calls_per_step(monkeypatch, cfg, run_dir, before=lambda: None) -> list[int]:
    """Calls of dynamo's graphs in each step of training `cfg` in this process (`before` run first), counted by a
    backend that runs dynamo's graph as it is (no inductor: fast on a CPU)."""
    from ganscale.trainer import Trainer
    from dist_helpers import train_in_process

    torch._dynamo.reset()  # no earlier test's graphs or skipped code
    at_step, graph_calls = [None], []
    compile_ = torch.compile

    def counted(model, mode):
        def backend(graph, example_inputs):
            def run(*args):
                graph_calls.append(at_step[0])
                return graph.forward(*args)
            return run
        return compile_(model, backend=backend)

    begin_step = Trainer._begin_step

    def noting_step(trainer, step, start_step):
        at_step[0] = step
        begin_step(trainer, step, start_step)

    monkeypatch.setattr(torch, "compile", counted)
    monkeypatch.setattr(Trainer, "_begin_step", noting_step)
    before()
    train_in_process(cfg, run_dir)
    return [graph_calls.count(step) for step in range(cfg.train.steps)]


def test_compiled_networks_run_their_graphs_in_every_step(tmp_path, monkeypatch, capsys):
    """torch.compile runs a compiled forward that it meets under a dispatch mode eagerly, and that forward's code
    eagerly for the rest of the process, without a word: the traffic meter's mode on the third step turned the
    fast path back to eager from there on. A compiled run does not measure its traffic, and says so."""
    from ganscale import config

    cfg = config.load(None, [f"{k}={v}" for k, v in {**SMALL_DCGAN, **COMPILED, "train.steps": 5}.items()])
    per_step = _graph_calls_per_step(monkeypatch, cfg, tmp_path)
    assert min(per_step) > 0 and len(set(per_step)) == 1, per_step  # G's and D's graphs, alike in every step
    assert "communicated per step  not measured (train.compile=default" in capsys.readouterr().out


def test_a_user_gan_the_preflight_ran_under_its_dispatch_mode_runs_its_graphs_in_every_step(tmp_path, monkeypatch):
    """The preflight runs the user's G and D forwards under a dispatch mode (randomness.process_draws), in the same
    process as the training (the API's, one rank): their code must not be left to run eagerly."""
    from ganscale import config, preflight
    from test_custom import write_user_gan

    recipe = write_user_gan(tmp_path / "code", "compiled_user_gan")
    cfg = config.load(str(recipe), [f"{k}={v}" for k, v in {**COMPILED, "train.steps": 4}.items()])
    per_step = _graph_calls_per_step(monkeypatch, cfg, tmp_path / "run", lambda: preflight.check(cfg, 1, False))
    assert min(per_step) > 0 and len(set(per_step)) == 1, per_step


@pytest.mark.parametrize("overrides, says", [
    ({"train.compile": "default", "loss.r1_gamma": 1}, "double backward"),
    ({"train.compile": "default", "loss.kind": "wgan-gp"}, "double backward"),
    ({"train.compile": "reduce-overhead", "parallel.generator": "fsdp"}, "fsdp"),
    ({"train.compile": "default", "parallel.generator": "pipeline", "parallel.discriminator": "pipeline"}, "pipeline")])
def test_compile_is_refused_where_it_cannot_compute_what_eager_does(overrides, says):
    from ganscale import config, preflight

    cfg = config.load(None, [f"{k}={v}" for k, v in overrides.items()])
    with pytest.raises(config.ConfigError) as refused:
        preflight.check(cfg, 2, False)
    assert refused.value.key == "train.compile" and says in str(refused.value)


@pytest.mark.parametrize("mode, marks", [("off", False), ("default", False), ("reduce-overhead", True),
                                         ("max-autotune", True)])
def test_every_compile_mode_that_records_cuda_graphs_marks_each_iteration(mode, marks):
    """max-autotune records CUDA graphs as reduce-overhead does; unmarked, a micro-step's forward would free the
    gradients of the one before."""
    from ganscale.parallel import Wrapped
    from ganscale.parallel.speed import compiled

    net = torch.nn.Linear(2, 2)
    wrapped = compiled(Wrapped(net, net), mode)  # torch.compile is lazy: nothing is compiled here
    assert (wrapped.begin_iteration == torch.compiler.cudagraph_mark_step_begin) is marks


def test_channels_last_with_fsdp2_networks_is_refused():
    """FSDP2 shards only contiguous parameters: it raised NotImplementedError at start-up."""
    from ganscale import config, preflight

    cfg = config.load(None, ["train.channels_last=true", "parallel.generator=zero2"])
    with pytest.raises(config.ConfigError) as refused:
        preflight.check(cfg, 2, False)
    assert refused.value.key == "train.channels_last" and "zero2" in str(refused.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_batch_one_step_trains_like_eager(tmp_path):
    """reduce-overhead (CUDA graphs) at batch 1 on a small pix2pix-like conv GAN: same training as eager."""
    base = {**SMALL_DCGAN, **CUDA_FP32, "train.batch_size": 1, "model.g_batchnorm": "false", "train.steps": 4}
    eager, graphs = _trained_g(base, tmp_path / "eager"), _graphed_g({**base, **GRAPHS}, tmp_path / "graphs")
    assert max_relative_difference(eager, graphs) <= 1e-3


def test_fused_adam_under_sharded_optimizers_equals_one_process(tmp_path):
    """Fused Adam on ZeRO-1's shard of the parameters (G) and on FSDP2's DTensor shards (D)."""
    mlp = {**SMALL_MLP, "train.steps": 4, "loss.r1_gamma": 0}  # R1 is refused on an FSDP2 D
    one = run_ranks(train_and_collect, 1, mlp, str(tmp_path / "one"))[0]
    sharded = {**mlp, "optim.fused": "true", "parallel.generator": "zero1", "parallel.discriminator": "fsdp"}
    for rank in run_ranks(train_and_collect, 2, sharded, str(tmp_path / "sharded")):
        for net in ("G", "D"):
            assert max_relative_difference(one[net], rank[net]) <= 1e-5, net


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_pix2pix_fast_path_on_cuda_trains_like_eager(tmp_path):
    """The pix2pix-table's fast row at a tiny size: NHWC, fused Adam, compiled with CUDA graphs, G's output
    kept from D's step to G's (no new-iteration mark in between)."""
    from ganscale.data.synthetic import write_synthetic_facades
    from test_tasks import tiny_pix2pix  # 32 px: no dropout, so eager and graphs draw nothing random

    facades = write_synthetic_facades(tmp_path / "facades", n=4, seed=0, size=(96, 48))
    base = {**tiny_pix2pix(facades), **CUDA_FP32, "train.batch_size": 1, "model.norm": "batch", "train.steps": 4,
            "log.every": 1}
    eager, fast = _trained_g(base, tmp_path / "eager"), _graphed_g({**base, **GRAPHS}, tmp_path / "fast")
    assert max_relative_difference(eager, fast) <= 1e-3


def _polling_thread_priorities(rank, world, overrides, run_dir, unnamed):
    """gloo's TCP event-loop threads of this rank (thread ids, found by their name) and their nice values after
    the Trainer is built. `unnamed`: the threads first renamed as torch 2.11 leaves them (the main thread's name)."""
    import os
    from pathlib import Path

    from ganscale import config
    from ganscale.runtime import GLOO_POLLING_THREAD, start
    from ganscale.trainer import Trainer

    tasks = Path("/proc/self/task")
    loops = [int(t.name) for t in tasks.iterdir() if (t / "comm").read_text().strip() == GLOO_POLLING_THREAD]
    if not loops:
        return None  # this torch leaves the loop unnamed (2.11): nothing here to find it by but the code under test
    if unnamed:
        for tid in loops:
            (tasks / str(tid) / "comm").write_text((tasks / str(os.getpid()) / "comm").read_text().strip())
    Trainer(config.load(None, [f"{k}={v}" for k, v in overrides.items()]), start("cpu"), Path(run_dir))
    niced = sorted(int(t.name) for t in tasks.iterdir() if os.getpriority(os.PRIO_PROCESS, int(t.name)) == 19)
    return sorted(loops), niced


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread priorities are read from Linux /proc")
@pytest.mark.parametrize("unnamed", [False, True], ids=["named", "unnamed-as-on-torch-2.11"])
def test_gloo_polling_threads_run_at_the_lowest_priority(tmp_path, unnamed):
    """gloo's TCP loop spins on epoll (pytorch/gloo#246); at normal priority it takes cycles from the ranks'
    compute when there are as many ranks as cores. The trainer lowers it, and only it, to nice 19 on every rank,
    also where torch leaves the thread unnamed."""
    if os.getpriority(os.PRIO_PROCESS, 0) == 19:
        pytest.skip("the test runs at nice 19 already: every thread would pass")
    ranks = run_ranks(_polling_thread_priorities, 2, SMALL_DCGAN, str(tmp_path / "run"), unnamed)
    if None in ranks:
        pytest.skip(f"torch {torch.__version__} leaves gloo's loop thread unnamed; the test renames it on a torch "
                    "that names it")
    for loops, niced in ranks:
        assert loops and niced == loops


def test_gradient_norm_of_a_network_without_gradients_is_zero():
    """The one-kernel gradient norm keeps get_total_norm's answer when nothing has a gradient yet."""
    from ganscale.parallel import Wrapped

    net = torch.nn.Linear(3, 2)
    assert float(Wrapped(net, net).grad_norm(max_norm=1.0)) == 0.0
    net(torch.ones(4, 3)).sum().backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in net.parameters()])
    assert torch.allclose(Wrapped(net, net).grad_norm(max_norm=0.0), expected)
