"""StyleGAN2's training phases (phases.py) and path length regularisation: the schedule, Adam's lazy correction,
the penalty and its gradient, 2 ranks == 1 process, exact resume with pl_mean, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from dist_helpers import assert_same_functions, record_steps, run_ranks, train_and_collect
from ganscale import checkpoint, config, objectives, phases, preflight, versions
from ganscale.config import ConfigError
from ganscale.models.stylegan2 import StyleGAN2Generator

RECIPE = "digits-stylegan2"
# A tiny StyleGAN2 with R1, path length regularisation, style mixing and noise inputs, in separate phases.
TINY = {"model.channel_base": 64, "model.channel_max": 8, "model.mapping_layers": 2, "model.mbstd_group": 2,
        "train.batch_size": 8, "loss.lazy_regularization": "separate", "loss.r1_gamma": 1.0, "loss.r1_interval": 2,
        "loss.pl_weight": 2.0, "loss.pl_interval": 2, "checkpoint.every": 0, "log.every": 1,
        "log.sample_every": 0, "log.tensorboard": "false"}

FOLDED = {"loss.lazy_regularization": "folded", "loss.pl_weight": 0}  # the default: R1 folded, no path length


def load(overrides: dict) -> config.Config:
    return config.load(RECIPE, [f"{k}={v}" for k, v in overrides.items()])


def names(schedule: list[phases.TrainingPhase]) -> list[str]:
    return [phase.name for phase in schedule]


def test_the_phase_schedule_is_a_function_of_the_step():
    separate = phases.iteration_phases(load({**TINY, "loss.r1_interval": 4, "loss.pl_interval": 2}).loss)
    assert names(phases.steps_at(separate, 0)) == ["D main", "D reg", "G main", "G reg"]
    assert names(phases.steps_at(separate, 1)) == ["D main", "G main"]
    assert names(phases.steps_at(separate, 2)) == ["D main", "G main", "G reg"]
    assert names(phases.steps_at(separate, 4)) == ["D main", "D reg", "G main", "G reg"]
    folded = phases.iteration_phases(load({**FOLDED, "loss.r1_interval": 4}).loss)  # R1 in D main's loss
    assert all(names(phases.steps_at(folded, step)) == ["D main", "G main"] for step in range(5))
    assert [phases.folded_due(folded, "r1", step) for step in range(5)] == [True, False, False, False, True]
    assert not any(phases.folded_due(separate, "r1", step) for step in range(5))


def _steps(trainer):
    recorded = record_steps(trainer)
    return lambda: {"steps": recorded(), "pl_mean": trainer.pl_mean}


def test_the_trainer_runs_the_scheduled_optimizer_steps(tmp_path):
    """Separate phases: D reg every 2 steps, G reg every 3, each an optimizer step of its own."""
    overrides = {**TINY, "train.steps": 4, "loss.pl_interval": 3}
    got = run_ranks(train_and_collect, 1, overrides, str(tmp_path / "run"), _steps, None, RECIPE)[0]["extra"]
    assert [s["net"] for s in got["steps"]] == ["D", "D", "G", "G", "D", "G", "D", "D", "G", "D", "G", "G"]
    assert got["pl_mean"] > 0
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = logged[-1]
    assert last["pl_mean"] == got["pl_mean"] and last["penalty_pl"] > 0 and last["penalty_r1"] > 0
    assert logged[0]["pl_mean"] < last["pl_mean"]  # moved by step 3's G reg


def test_lazy_regularisation_corrects_each_networks_adam(tmp_path):
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    cfg = load({**TINY, "loss.r1_interval": 16, "loss.pl_interval": 4, "optim.g.betas": "[0.5, 0.99]"})
    preflight.check(cfg, 1, False)
    runtime = start("cpu")
    try:
        trainer = Trainer(cfg, runtime, tmp_path / "run")
        d, g = trainer.opt_d.param_groups[0], trainer.opt_g.param_groups[0]
        assert d["initial_lr"] == pytest.approx(0.002 * 16 / 17) and g["initial_lr"] == pytest.approx(0.002 * 4 / 5)
        assert d["betas"] == pytest.approx((0.0, 0.99 ** (16 / 17)))
        assert g["betas"] == pytest.approx((0.5 ** 0.8, 0.99 ** 0.8))
        trainer.batches.close()
        folded = Trainer(load({**FOLDED, "checkpoint.every": 0}), runtime, tmp_path / "folded")  # no own phase
        assert folded.opt_d.param_groups[0]["initial_lr"] == 0.002
        assert folded.opt_d.param_groups[0]["betas"] == (0.0, 0.99)
        folded.batches.close()
    finally:
        runtime.close()


def test_the_path_length_penalty_is_non_zero_and_reaches_the_mapping_network():
    torch.manual_seed(0)
    G = StyleGAN2Generator(16, 16, 1, mapping_layers=2, channel_base=64, channel_max=8)
    z = torch.randn(4, 16)
    images, ws = G(z, return_ws=True)
    assert ws.shape == (4, G.num_ws, 16) and torch.equal(images, G(z))  # the public forward is unchanged
    noise = torch.randn_like(images) / 4
    lengths = objectives.path_lengths(images, ws, noise)
    penalty = objectives.path_length_penalty(lengths, 0.0)
    assert lengths.shape == (4,) and penalty > 0
    penalty.backward()
    mapping = torch.cat([p.grad.flatten() for p in G.mapping.parameters()])
    assert mapping.isfinite().all() and mapping.abs().max() > 0


def _assert_same_training(one: dict, two: list[dict], overrides: dict) -> None:
    steps = one["extra"]["steps"]
    assert [s["net"] for s in steps] == ["D", "D", "G", "G", "D", "G", "D", "D", "G", "G"]
    for rank in two:
        others = rank["extra"]["steps"]
        assert len(others) == len(steps)
        for first, other in zip(steps[:4], others[:4]):  # step 0's four optimizer steps: the gradients as well
            assert (first["grad"] - other["grad"]).abs().max() <= 1e-4 * first["grad"].abs().max(), first["net"]
        for step, other in zip(steps, others):
            assert abs(step["loss"] - other["loss"]) <= 1e-4 * abs(step["loss"]), step["net"]
        assert rank["extra"]["pl_mean"] == pytest.approx(one["extra"]["pl_mean"], rel=1e-5)
    assert one["extra"]["pl_mean"] > 0
    gen = torch.Generator().manual_seed(1)
    inputs = {"G": (torch.randn(8, 32, generator=gen),), "D": (torch.rand(8, 1, 16, 16, generator=gen) * 2 - 1,)}
    if overrides.get("model.conditional") == "true":
        classes = torch.arange(8) % 10
        inputs = {net: (*args, classes) for net, args in inputs.items()}
    assert_same_functions(overrides, one, two, inputs, RECIPE)


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch", [None, 2])
def test_two_ranks_equal_one_process_with_r1_and_path_length(tmp_path, micro_batch):
    """R1 and path length regularisation in their own phases (double backward through DDP-wrapped D and G), style
    mixing and noise inputs: 3 steps on 2 ranks compute what 1 process does, without accumulation, and with it,
    ADA and classes."""
    overrides = {**TINY, "train.steps": 3, "model.style_mixing": 0.5}
    if micro_batch:  # 1 process: 4 micro-batches of 2 (path length batch: 1 each); 2 ranks: 2 each
        overrides["train.micro_batch"] = micro_batch
        overrides.update({"augment.kind": "ada", "augment.p": 0.5})  # D reg augments its reals as D main does
        overrides.update({"model.conditional": "true", "data.labels": "true"})  # D reg judges reals with theirs
        if "grid-sample-double-backward" in versions.lacking(torch.__version__):  # torch 2.11: R1 refuses these
            overrides["augment.ada_ops"] = "[brightness,contrast,lumaflip,hue,saturation]"
    one = run_ranks(train_and_collect, 1, overrides, str(tmp_path / "one"), _steps, None, RECIPE)[0]
    two = run_ranks(train_and_collect, 2, overrides, str(tmp_path / "two"), _steps, None, RECIPE)
    _assert_same_training(one, two, overrides)


def test_a_resumed_run_continues_exactly_with_pl_mean(tmp_path):
    """4 steps straight == 2 steps, then a resume from that checkpoint for 2 more: pl_mean comes back with it."""
    overrides = {**TINY, "train.steps": 4, "checkpoint.every": 2}
    straight = run_ranks(train_and_collect, 1, overrides, str(tmp_path / "straight"), _steps, None, RECIPE)[0]
    saved = checkpoint.checkpoint_dir(tmp_path / "straight") / "step-00000002.pt"
    assert torch.load(saved, weights_only=True)["pl_mean"] > 0
    resumed = run_ranks(train_and_collect, 1, overrides, str(tmp_path / "resumed"), _steps, saved, RECIPE)[0]
    assert resumed["extra"]["pl_mean"] == straight["extra"]["pl_mean"]
    for net in ("G", "D", "G_ema"):
        for key, value in straight[net].items():
            assert torch.equal(value, resumed[net][key]), (net, key)


@pytest.mark.parametrize("args, key", [
    (["--set", "model.kind=dcgan", "--set", "data.resolution=16"], "loss.pl_weight"),  # no mapping network
    (["--nproc", "2", "--set", "parallel.generator=fsdp"], "parallel.generator"),       # no double backward
    (["--set", "loss.lazy_regularization=folded"], "loss.lazy_regularization"),
    (["--set", "loss.pl_batch_shrink=3"], "loss.pl_batch_shrink"),
])
def test_path_length_refusals_exit_2_naming_the_key(tmp_path, args, key):
    from ganscale.cli import main

    run_dir = tmp_path / "run"
    pl = ["--set", "loss.pl_weight=2", "--set", "loss.lazy_regularization=separate"]
    result = CliRunner().invoke(main, ["train", RECIPE, "--run-dir", str(run_dir), *pl, *args])
    assert result.exit_code == 2, result.output
    assert key in result.output and "Traceback" not in result.output
    assert not run_dir.exists()


def test_the_double_backward_rule_names_each_network():
    cfg = load({"loss.lazy_regularization": "separate", "loss.pl_weight": 2, "loss.r1_gamma": 0,
                "parallel.discriminator": "fsdp"})
    preflight.check(cfg, 2, False)  # D has no penalty: any strategy
    cfg = load({"loss.lazy_regularization": "separate", "loss.pl_weight": 2, "parallel.generator": "zero2"})
    with pytest.raises(ConfigError, match="path length") as refused:
        preflight.check(cfg, 2, False)
    assert refused.value.key == "parallel.generator"
