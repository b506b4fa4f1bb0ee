"""Class-conditional (BigGAN) and paired (pix2pix) training through the same loop: configs, data, and
the 1-process == N-process proof for each."""

from __future__ import annotations

import json

import pytest
import torch

from dist_helpers import (assert_same_functions, max_relative_difference, run_ranks, train_and_collect,
                          train_in_process)
from ganscale import config, preflight
from ganscale.config import ConfigError
from ganscale.data.synthetic import write_synthetic_facades
from ganscale.tasks import ClassConditional, Paired

QUIET = {"log.every": 1, "log.sample_every": 0, "checkpoint.every": 0, "log.tensorboard": "false",
         "train.ema_half_life_images": 50}
TINY_BIGGAN = {**QUIET, "model.kind": "biggan", "data.labels": "true", "model.z_dim": 8, "model.g_width": 4,
               "model.d_width": 4, "model.shared_dim": 8, "loss.kind": "hinge", "train.batch_size": 8,
               "train.steps": 3}


def tiny_pix2pix(path) -> dict:
    # 32x32 crops: a 5-level U-Net without dropout (64x64 crops add one dropout block).
    return {**QUIET, "model.kind": "pix2pix", "data.kind": "paired", "data.path": str(path), "data.channels": 3,
            "data.resolution": 32, "data.load_size": 36, "data.direction": "BtoA", "model.g_width": 4,
            "model.d_width": 4, "model.norm": "instance", "loss.l1_weight": 100, "train.batch_size": 4,
            "train.steps": 3, "optim.decay_start": 0.5}


def build(overrides: dict, world: int = 1) -> config.Config:
    cfg = config.load(None, [f"{k}={v}" for k, v in overrides.items()])
    preflight.check(cfg, world, False)
    return cfg


@pytest.fixture(scope="module")
def facades(tmp_path_factory):
    return write_synthetic_facades(tmp_path_factory.mktemp("facades") / "train", n=8, seed=0, size=(96, 48))


# ------------------------------------------------------------------------------------------ config
@pytest.mark.parametrize("overrides, key", [
    ({"model.kind": "biggan"}, "data.labels"),                               # a class-conditional G without labels
    ({"data.labels": "true"}, "data.labels"),                                # labels an unconditional G ignores
    ({"model.kind": "pix2pix"}, "model.kind"),                               # pix2pix on unpaired digits
    ({"loss.l1_weight": 100}, "loss.l1_weight"),                             # an L1 target that does not exist
    ({**TINY_BIGGAN, "loss.kind": "wgan-gp"}, "loss.kind"),                  # GP interpolates across conditions
    ({**TINY_BIGGAN, "model.n_classes": 7}, "model.n_classes")])             # digits have 10 classes
def test_model_data_and_loss_must_agree(overrides, key):
    with pytest.raises(ConfigError) as info:
        build(overrides)
    assert info.value.key == key and info.value.fix


@pytest.mark.parametrize("overrides, said", [
    ({"model.kind": "biggan"}, ["model.kind=biggan is class-conditional", "and data.labels=false",
                                "use data.labels=true", "or use an unconditional model.kind (dcgan, stylegan2)"]),
    ({**TINY_BIGGAN, "data.kind": "folder", "data.path": "."}, ["data.kind=folder has no class labels"]),
    ({"model.kind": "stylegan2", "model.conditional": "true", "data.resolution": 32},
     ["model.kind=stylegan2 with model.conditional=true is class-conditional", "or set model.conditional=false"]),
    ({"data.labels": "true"}, ["model.kind=dcgan takes no class labels",
                               "set data.labels=false, or use model.kind=biggan (or stylegan2 with"]),
    ({"model.kind": "stylegan2", "data.labels": "true", "data.resolution": 32},
     ["set data.labels=false, or set model.conditional=true"]),
], ids=["biggan-unlabelled", "biggan-on-folder", "conditional-stylegan2-unlabelled", "dcgan-labelled",
        "stylegan2-labelled"])
def test_class_labels_that_do_not_fit_a_shipped_model_name_its_own_switch(overrides, said):
    """One rule for every model: each message names the model as configured and how it takes labels or not."""
    with pytest.raises(ConfigError) as info:
        build(overrides)
    assert info.value.key == "data.labels" and all(part in str(info.value) for part in said), str(info.value)
    assert "model.task" not in str(info.value)  # a custom model's option


def test_a_pix2pix_given_labels_is_told_to_drop_them_only(facades):
    with pytest.raises(ConfigError) as info:
        build({**tiny_pix2pix(facades), "data.labels": "true"})
    assert info.value.key == "data.labels" and info.value.fix == "set data.labels=false"


def test_paired_load_size_below_crop_is_refused(facades):
    with pytest.raises(ConfigError) as info:
        build({**tiny_pix2pix(facades), "data.load_size": 30})
    assert info.value.key == "data.load_size"
    with pytest.raises(ConfigError) as info:
        build({**tiny_pix2pix(facades), "data.resolution": 16, "data.load_size": 18})
    assert info.value.key == "data.resolution"


# ------------------------------------------------------------------------------------------ tasks
def test_class_conditional_task_feeds_labels_to_both_networks():
    task = ClassConditional(10)
    labels = task.labels(6, torch.Generator().manual_seed(0))
    assert labels.dtype == torch.int64 and labels.min() >= 0 and labels.max() < 10
    real = (torch.zeros(6, 1, 8, 8), torch.arange(6))
    (both,) = task.critic_conditions(real, labels)
    assert both.tolist() == [*range(6), *labels.tolist()]  # D sees [real, fake] with their own classes
    (fake_only,) = task.critic_conditions(None, labels)
    assert torch.equal(fake_only, labels)


def test_paired_task_judges_input_and_output_together_and_adds_weighted_l1():
    source, target = torch.full((2, 3, 4, 4), -1.0), torch.full((2, 3, 4, 4), 0.5)
    task = Paired(l1_weight=100.0, preview_pairs=[])
    generated = torch.zeros(2, 3, 4, 4)
    view = task.critic_view((source, target), generated)
    assert view.shape == (2, 6, 4, 4) and torch.equal(view[:, :3], source) and torch.equal(view[:, 3:], generated)
    assert torch.equal(task.real_images((source, target)), target)
    assert float(task.reconstruction(generated, (source, target))) == pytest.approx(100 * 0.5)


# ------------------------------------------------------------------------------------------ training
def test_conditional_digits_train_and_draw_one_class_per_grid_row(tmp_path):
    cfg = build({**TINY_BIGGAN, "log.sample_every": 3, "log.samples": 16})
    trainer = train_in_process(cfg, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(torch.isfinite(torch.tensor(r["loss_d"])) for r in records)
    assert (tmp_path / "samples" / "step-00000003.png").exists()
    # The projection D really uses the label: the same images judged under other classes score differently.
    x = torch.zeros(4, 1, 8, 8)
    with torch.no_grad():
        assert not torch.allclose(trainer.D.module(x, torch.zeros(4, dtype=torch.long)),
                                  trainer.D.module(x, torch.full((4,), 7, dtype=torch.long)))


def test_pix2pix_trains_on_synthetic_pairs_and_logs_l1(tmp_path, facades):
    cfg = build({**tiny_pix2pix(facades), "train.steps": 4, "log.sample_every": 4, "log.samples": 6})
    train_in_process(cfg, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["l1_g"] < 100 * 2 for r in records)  # L1 of [-1, 1] images, weighted by 100
    assert all(r["loss_g"] > r["l1_g"] for r in records)   # G's loss = adversarial + L1
    assert (tmp_path / "samples" / "step-00000004.png").exists()


def biggan_inputs() -> dict:
    """Fixed latents, classes and images on which TINY_BIGGAN networks are compared."""
    gen = torch.Generator().manual_seed(1)
    classes = torch.arange(32) % 10
    return {"G": (torch.randn(32, 8, generator=gen), classes),
            "D": (torch.rand(32, 1, 8, 8, generator=gen) * 2 - 1, classes)}


@pytest.fixture(scope="module")
def biggan_one_process(tmp_path_factory):
    """TINY_BIGGAN trained on one process: the reference of every N-rank BigGAN run here."""
    return run_ranks(train_and_collect, 1, TINY_BIGGAN, str(tmp_path_factory.mktemp("biggan-one")))[0]


@pytest.mark.slow
def test_conditional_biggan_on_two_ranks_equals_one_process(tmp_path, biggan_one_process):
    """G has (conditional) BatchNorm: with cross-rank statistics (parallel.sync_bn unset: the default), 2 x 4 ==
    1 x 8, labels included."""
    one, inputs = biggan_one_process, biggan_inputs()
    two = run_ranks(train_and_collect, 2, TINY_BIGGAN, str(tmp_path / "two"))
    assert_same_functions(TINY_BIGGAN, one, two, inputs)
    # Sensitivity: without cross-rank statistics the two trainings are measurably different.
    local = run_ranks(train_and_collect, 2, {**TINY_BIGGAN, "parallel.sync_bn": "false"}, str(tmp_path / "local"))[0]
    with pytest.raises(AssertionError):
        assert_same_functions(TINY_BIGGAN, one, [local], inputs)


SHARDED_BIGGAN = {**TINY_BIGGAN, "parallel.sync_bn": "true", "parallel.generator": "fsdp",
                  "parallel.discriminator": "zero2"}


@pytest.mark.slow
def test_sharded_biggan_on_two_ranks_equals_one_process(tmp_path, biggan_one_process):
    """FSDP2 refuses 0-d parameters: self-attention's gamma is (1,), so BigGAN shards like any network."""
    one = biggan_one_process
    two = run_ranks(train_and_collect, 2, SHARDED_BIGGAN, str(tmp_path / "two"))
    assert_same_functions(TINY_BIGGAN, one, two, biggan_inputs())
    for net in ("G", "D"):  # the attention's weight itself trained as on one process
        assert one[net]["attention.gamma"].abs().item() > 0
        torch.testing.assert_close(two[0][net]["attention.gamma"], one[net]["attention.gamma"], rtol=1e-4, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint_format", ["full", "sharded"])
def test_biggan_checkpoint_with_the_old_0d_gamma_resumes_sharded(tmp_path, monkeypatch, biggan_one_process,
                                                                   checkpoint_format):
    """Checkpoints written while gamma was 0-d hold it, and Adam's moments of it, 0-d: a resume reads them as
    (1,), into FSDP2 shards (G) and replicas (D) alike, and goes on as the uninterrupted run."""
    from torch import nn

    from ganscale import checkpoint
    from ganscale.models.layers import SelfAttention

    made = SelfAttention.__init__

    def as_before(self, *args, **kwargs):
        made(self, *args, **kwargs)
        self.gamma = nn.Parameter(torch.zeros(()))
    monkeypatch.setattr(SelfAttention, "__init__", as_before)
    train_in_process(build({**TINY_BIGGAN, "train.steps": 2, "checkpoint.every": 2,
                            "checkpoint.format": checkpoint_format}), tmp_path / "old")
    monkeypatch.undo()
    written = checkpoint.latest(tmp_path / "old")
    assert checkpoint.load(written)["G"]["attention.gamma"].shape == (1,)  # as export and sample read it
    resumed = {**SHARDED_BIGGAN, "parallel.discriminator": "ddp"}
    two = run_ranks(train_and_collect, 2, resumed, str(tmp_path / "resumed"), None, written)
    assert_same_functions(TINY_BIGGAN, biggan_one_process, two, biggan_inputs())


@pytest.mark.slow
@pytest.mark.parametrize("generator, discriminator, size", [("ddp", "ddp", 32), ("fsdp", "zero2", 32), ("ddp", "ddp", 64)],
                         ids=["ddp", "fsdp-zero2", "ddp-with-dropout"])
def test_pix2pix_on_two_ranks_equals_one_process(tmp_path, facades, generator, discriminator, size):
    """Crops and flips are functions of the stream position, so the ranks' union is one process's batch; so are
    the dropout masks (64 px). G's output is kept with its graph from D's step to G's (a sharded G re-gathers
    for that backward)."""
    overrides = {**tiny_pix2pix(facades), "data.resolution": size, "data.load_size": size + size // 8}
    one = run_ranks(train_and_collect, 1, overrides, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, {**overrides, "parallel.generator": generator,
                                           "parallel.discriminator": discriminator}, str(tmp_path / "two"))
    gen = torch.Generator().manual_seed(1)
    seeds = torch.tensor([7, 11])  # G in train mode: its dropout masks from given seeds
    inputs = {"G": (torch.rand(2, 3, size, size, generator=gen) * 2 - 1, seeds),
              "D": (torch.rand(2, 6, size, size, generator=gen) * 2 - 1,)}
    assert_same_functions(overrides, one, two, inputs)


def test_a_sample_s_dropout_mask_depends_on_its_seed_alone():
    """pix2pix's dropout: the same mask for a sample alone or in any batch (on any rank, in any micro-step);
    half the units dropped, the kept ones scaled by 2; another layer (salt) or seed, another mask."""
    from ganscale.randomness import SampleDropout, sample_seeds

    seeds = sample_seeds(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
    x = torch.ones(6, 64, 8, 8)
    dropout = SampleDropout(0.5, salt=1).train()
    out = dropout(x, seeds)
    assert set(out.unique().tolist()) == {0.0, 2.0}
    assert abs((out == 0).float().mean().item() - 0.5) < 0.02
    for i in range(6):
        assert torch.equal(dropout(x[i:i + 1], seeds[i:i + 1]), out[i:i + 1])
    assert torch.equal(dropout(x[[3, 1]], seeds[[3, 1]]), out[[3, 1]])
    assert not torch.equal(SampleDropout(0.5, salt=2).train()(x, seeds), out)
    assert not torch.equal(out[0], out[1])
    assert torch.equal(dropout.eval()(x, seeds), x)


# ------------------------------------------------------------------------------------------ commands
def test_make_facades_writes_a_set_the_pix2pix_recipe_trains_on(tmp_path):
    from click.testing import CliRunner

    from ganscale.cli import main

    folder = tmp_path / "facades"
    result = CliRunner().invoke(main, ["make-facades", str(folder), "--n", "3", "--size", "96x48"])
    assert result.exit_code == 0, result.output
    assert len(list(folder.glob("*.jpg"))) == 3 and "data.path=" in result.output
    cfg = config.load("pix2pix", [f"data.path={folder}"])
    preflight.check(cfg, 1, False)
    assert (cfg.model.kind, cfg.data.direction, cfg.loss.l1_weight, cfg.train.batch_size) == ("pix2pix", "BtoA", 100, 1)
    bad = CliRunner().invoke(main, ["make-facades", str(tmp_path / "x"), "--size", "wide"])
    assert bad.exit_code == 2 and "--size" in bad.output


def _count_power_iterations(trainer):
    """Counts, per spectral-norm parametrization of G and D, the power-method calls (one per training-mode forward
    in torch, unless the trainer pauses it)."""
    counts = {}
    for net, wrapped in (("G", trainer.G), ("D", trainer.D)):
        for index, norm in enumerate(wrapped.spectral_norms):
            key = f"{net}.{index}"
            counts[key] = 0

            def counting(*args, key=key, original=norm._power_method):
                counts[key] += 1
                return original(*args)
            norm._power_method = counting
    return lambda: dict(counts)


def _train_counting_power_iterations(rank, world, overrides, run_dir):
    return train_and_collect(rank, world, overrides, run_dir, steps_hook=_count_power_iterations)


def test_spectral_norm_in_g_and_d_refines_once_per_network_step_whatever_the_accumulation(tmp_path):
    """BigGAN normalises G's and D's weights: each D step refines both networks' estimates once (G's forward makes
    its samples), the G step once (the frozen D's forward too), in one micro-step or in four."""
    steps, critics = 2, 2
    overrides = {**TINY_BIGGAN, "train.steps": steps, "loss.n_critic": critics}
    whole = run_ranks(_train_counting_power_iterations, 1, overrides, str(tmp_path / "whole"))[0]
    accumulated = run_ranks(_train_counting_power_iterations, 1, {**overrides, "train.micro_batch": 2},
                            str(tmp_path / "accumulated"))[0]
    assert accumulated["summary"]["accumulation_steps"] == 4
    counts = whole["extra"]
    assert {key[0] for key in counts} == {"G", "D"} and set(counts.values()) == {steps * (critics + 1)}
    assert accumulated["extra"] == counts


def test_sample_draws_one_class_on_request_and_refuses_unknown_classes(tmp_path):
    from click.testing import CliRunner

    from ganscale.cli import main

    train_in_process(build({**TINY_BIGGAN, "train.steps": 1, "checkpoint.every": 1}), tmp_path / "run")
    runner = CliRunner()
    ok = runner.invoke(main, ["sample", str(tmp_path / "run"), "--n", "16", "--class", "3", "--out", str(tmp_path / "3.png")])
    assert ok.exit_code == 0, ok.output
    assert (tmp_path / "3.png").stat().st_size > 0
    refused = runner.invoke(main, ["sample", str(tmp_path / "run"), "--class", "10", "--out", str(tmp_path / "x.png")])
    assert refused.exit_code == 2 and "--class" in refused.output and not (tmp_path / "x.png").exists()


def test_the_conditional_digits_recipe_is_valid():
    cfg = config.load("digits-biggan")
    preflight.check(cfg, 2, False)
    assert cfg.model.kind == "biggan" and cfg.data.labels and cfg.loss.kind == "hinge"


def test_pair_scoring_measures_l1_to_the_target(facades):
    """An identity G scores exactly the identity baseline; a perfect G would score 0."""
    from ganscale.evaluate import score_pairs

    cfg = build(tiny_pix2pix(facades))
    scores = score_pairs(cfg, torch.nn.Identity())
    assert scores["pairs"] == 8 and scores["l1"] == pytest.approx(scores["l1_identity"]) and scores["l1"] > 0.1
    with pytest.raises(config.ConfigError) as refused:  # held-out pairs that are not a paired set: eval's option
        score_pairs(cfg, torch.nn.Identity(), facades.parent / "no-such-folder")
    assert refused.value.key == "--pairs"


def test_class_conditional_samples_from_noise_are_deterministic_and_cover_the_classes():
    task = ClassConditional(10)
    seen = []
    z = torch.randn(4000, 8, generator=torch.Generator().manual_seed(0))
    task.from_noise(lambda noise, classes: seen.append(classes) or noise, z)
    task.from_noise(lambda noise, classes: seen.append(classes) or noise, z[:100])
    counts = torch.bincount(seen[0], minlength=10)
    assert torch.equal(seen[0][:100], seen[1])              # a function of each sample's own noise
    assert counts.min() > 300 and counts.max() < 500          # about uniform (400 each)


# ------------------------------------------------------------------------------------------ eval.every
EVAL_DIGITS = {**QUIET, "model.z_dim": 16, "model.g_width": 16, "model.d_width": 16, "model.g_batchnorm": "false",
               "train.batch_size": 16, "train.steps": 4, "eval.every": 2, "eval.samples": 64}


def test_image_metrics_during_training_go_to_metrics_and_summary(tmp_path):
    trainer = train_in_process(build(EVAL_DIGITS), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if "eval_fd_digits" in r]
    assert [r["step"] for r in scored] == [2, 4]
    assert all(r["eval_fd_digits"] > 0 and 0 <= r["eval_coverage"] <= 1 for r in scored)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["quality"]["fd_digits"] == pytest.approx(scored[-1]["eval_fd_digits"])
    assert trainer.reporter.image_scorer.reference.shape[0] == 1797  # every training digit


@pytest.mark.parametrize("overrides, key", [
    ({"eval.every": 10, "model.kind": "mlp", "data.kind": "ring8"}, "eval.every"),        # scored at sample grids
    ({"eval.every": 10, "eval.features": "inception"}, "eval.inception_weights")])         # no local weights file
def test_eval_settings_that_cannot_work_are_refused(overrides, key):
    with pytest.raises(ConfigError) as info:
        build(overrides)
    assert info.value.key == key


def test_eval_every_on_fewer_images_than_density_coverage_need_is_refused_before_anything_is_written(tmp_path):
    """k = 5 nearest neighbours need 6 real images: refused at the start, not a traceback at the first eval step
    with no checkpoint written; the corrected command then trains and scores in the same run directory."""
    import subprocess
    import sys

    from image_helpers import write_noise_pngs
    from test_cli import clean_env

    images, run = write_noise_pngs(tmp_path / "images", 5), tmp_path / "run"
    command = [sys.executable, "-m", "ganscale", "train", "--run-dir", str(run)] + [
        arg for key, value in {**QUIET, "data.kind": "folder", "data.path": images, "data.resolution": 16,
                               "data.channels": 3, "model.g_width": 8, "model.d_width": 8, "train.steps": 2,
                               "train.batch_size": 4, "eval.every": 2, "eval.features": "digits",
                               "eval.samples": 10}.items() for arg in ("--set", f"{key}={value}")]
    refused = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert f"'data.path': data.path={images} holds 5 images" in refused.stderr
    assert "at least 6" in refused.stderr and "eval.every=0" in refused.stderr
    assert not run.exists()
    write_noise_pngs(images, 6)
    trained = subprocess.run(command, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert trained.returncode == 0, trained.stderr
    assert "eval_coverage" in (run / "metrics.jsonl").read_text() and list((run / "checkpoints").iterdir())


def test_inception_preprocessing_choice_reaches_the_extractor_from_config_and_from_eval_flag(tmp_path, monkeypatch):
    """eval.inception_preprocess (training's scorer, and `ganscale eval`'s default) and --inception-preprocess
    (which wins) reach the feature extractor. A stand-in records the choice: a real Inception file is ~100 MB."""
    from click.testing import CliRunner

    import ganscale.evaluate
    import ganscale.metrics.features
    from ganscale.cli import main
    from ganscale.metrics.features import DigitsFeatures

    asked = []

    def recording(name, device="cpu", inception_weights=None, digits_weights=None, inception_preprocess="pytorch-fid"):
        asked.append((name, inception_preprocess))
        return DigitsFeatures(None, device)

    monkeypatch.setattr(ganscale.metrics.features, "build_extractor", recording)  # the scorer imports it late
    monkeypatch.setattr(ganscale.evaluate, "build_extractor", recording)
    run, weights = tmp_path / "run", tmp_path / "pt_inception.pth"
    weights.write_bytes(b"never read")
    train_in_process(build({**EVAL_DIGITS, "eval.features": "inception", "eval.inception_weights": str(weights),
                            "eval.inception_preprocess": "torch-fidelity", "train.steps": 2}), run)
    assert asked == [("inception", "torch-fidelity")]
    runner = CliRunner()
    common = ["eval", str(run), "--samples", "8", "--features", "inception", "--inception-weights", str(weights)]
    assert runner.invoke(main, common).exit_code == 0 and asked[-1] == ("inception", "torch-fidelity")  # the run's
    flagged = runner.invoke(main, [*common, "--inception-preprocess", "pytorch-fid"])
    assert flagged.exit_code == 0, flagged.output
    assert asked[-1] == ("inception", "pytorch-fid")


@pytest.mark.slow
def test_image_metrics_during_training_on_two_sharded_ranks_equal_one_process(tmp_path):
    """Each rank generates its share through an FSDP-sharded G_ema (every rank the same number of forwards)."""
    one = run_ranks(train_and_collect, 1, EVAL_DIGITS, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, {**EVAL_DIGITS, "parallel.generator": "fsdp"}, str(tmp_path / "two"))
    for rank in two:
        assert rank["summary"]["quality"]["fd_digits"] == pytest.approx(one["summary"]["quality"]["fd_digits"], rel=1e-3)


def _forwards(cfg: config.Config, run_dir) -> tuple[int, list[list[torch.Tensor]], bool]:
    """Train `cfg` in this process; G's forward count and every D call's arguments (images, classes), in order."""
    from ganscale.randomness import SampleDropout
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    runtime = start("cpu")
    try:
        trainer = Trainer(cfg, runtime, run_dir)
        g_calls, d_inputs = [], []
        trainer.G.module.register_forward_hook(lambda module, args, out: g_calls.append(1))
        trainer.D.module.register_forward_hook(lambda module, args, out: d_inputs.append([a.detach().clone() for a in args]))
        dropout = any(isinstance(m, SampleDropout) for m in trainer.G.module.modules())
        trainer.fit()
    finally:
        runtime.close()
    return len(g_calls), d_inputs, dropout


def test_pix2pix_runs_g_once_per_iteration_and_its_step_judges_what_d_judged(tmp_path, facades):
    """As the reference trains: G's output is computed once; D's step judges it detached, G's step the very
    same tensor (one dropout mask, one BatchNorm update), so G runs once per iteration instead of twice."""
    steps, batch = 3, 4
    cfg = build({**tiny_pix2pix(facades), "data.resolution": 64, "data.load_size": 72, "train.steps": steps})
    g_calls, d_inputs, dropout = _forwards(cfg, tmp_path / "pix2pix")
    assert dropout  # a 64 px U-Net has a dropout block: two G forwards would give two different outputs
    assert g_calls == steps
    for step in range(steps):
        (d_step,), (g_step,) = d_inputs[2 * step], d_inputs[2 * step + 1]  # [real, fake] pairs, then [fake] pairs
        assert d_step.shape[0] == 2 * batch and torch.equal(d_step[batch:], g_step)
    # Unconditional GANs draw fresh latents for G's step by default: G runs twice per iteration there.
    unconditional = build({**QUIET, "model.z_dim": 8, "model.g_width": 8, "model.d_width": 8, "train.batch_size": 8,
                           "train.steps": steps})
    assert _forwards(unconditional, tmp_path / "dcgan")[0] == 2 * steps
    # And pix2pix can be asked to translate twice.
    twice = build({**tiny_pix2pix(facades), "train.steps": steps, "train.reuse_fake": "false"})
    assert _forwards(twice, tmp_path / "twice")[0] == 2 * steps


TINY_DCGAN = {**QUIET, "model.z_dim": 8, "model.g_width": 8, "model.d_width": 8, "train.batch_size": 8}


@pytest.mark.parametrize("overrides", [TINY_DCGAN, TINY_BIGGAN], ids=["unconditional", "class-conditional"])
def test_reuse_fake_runs_g_once_and_its_step_judges_what_d_judged_with_the_same_classes(tmp_path, overrides):
    """train.reuse_fake: G's step judges D's step's samples (and, class-conditional, their classes)."""
    steps, batch = 3, 8
    g_calls, d_inputs, _ = _forwards(build({**overrides, "train.steps": steps, "train.reuse_fake": "true"}), tmp_path)
    assert g_calls == steps
    for step in range(steps):
        d_step, g_step = d_inputs[2 * step], d_inputs[2 * step + 1]
        assert len(d_step) == len(g_step)  # images, and classes for the conditional D
        for d_arg, g_arg in zip(d_step, g_step):  # the fake half of D's [real, fake] is exactly G's input
            assert d_arg.shape[0] == 2 * batch and torch.equal(d_arg[batch:], g_arg)


@pytest.mark.parametrize("overrides", [
    {"loss.n_critic": 2},                                                  # D's steps judge two batches, G's one
    {"train.micro_batch": 16}])                                            # 4 micro-steps' graphs kept alive
def test_reuse_fake_where_d_and_g_batches_differ_is_refused(overrides):
    with pytest.raises(ConfigError) as info:
        build({"train.reuse_fake": "true", **overrides})
    assert info.value.key == "train.reuse_fake" and info.value.fix



@pytest.mark.slow
def test_reuse_fake_conditional_on_two_ranks_equals_one_process(tmp_path):
    """The kept samples carry their classes and G's DDP reduces in G's step's backward, as without reuse."""
    overrides = {**TINY_BIGGAN, "train.reuse_fake": "true", "parallel.sync_bn": "true"}
    one = run_ranks(train_and_collect, 1, overrides, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, overrides, str(tmp_path / "two"))
    assert_same_functions(overrides, one, two, biggan_inputs())


def _g_batchnorm_statistics(trainer) -> list[torch.Tensor]:
    return [b.clone() for name, b in trainer.G.module.named_buffers() if "running" in name]


def test_a_skipped_d_step_leaves_the_reused_g_forward_s_statistics_to_g_s_step(tmp_path, monkeypatch, facades):
    """pix2pix with BatchNorm: D's step 2 has a NaN loss and is skipped. Its G forward is G's step's (reused):
    putting G's statistics back under that graph broke its backward ('modified by an inplace operation', seen
    with fp16 on CUDA). G's statistics end as in a run where nothing was skipped."""
    from ganscale import objectives

    overrides = {**tiny_pix2pix(facades), "model.norm": "batch", "train.steps": 2, "train.reuse_fake": "true"}
    clean = _g_batchnorm_statistics(train_in_process(build(overrides), tmp_path / "clean"))
    calls, d_loss = [], objectives.d_loss
    monkeypatch.setattr(objectives, "d_loss", lambda *args: d_loss(*args) * (
        float("nan") if len(calls.append(1) or calls) == 2 else 1.0))
    trainer = train_in_process(build(overrides), tmp_path / "skipped")
    assert trainer.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(_g_batchnorm_statistics(trainer), clean))


def test_a_skipped_g_step_puts_back_what_its_reused_forward_moved(tmp_path, monkeypatch, facades):
    """With the reused output, G's forward ran in D's step: a skipped G step puts G's statistics back to before it."""
    from ganscale import objectives

    overrides = {**tiny_pix2pix(facades), "model.norm": "batch", "train.reuse_fake": "true"}
    one_step = _g_batchnorm_statistics(train_in_process(build({**overrides, "train.steps": 1}), tmp_path / "one"))
    calls, g_loss = [], objectives.g_loss
    monkeypatch.setattr(objectives, "g_loss", lambda *args: g_loss(*args) * (
        float("nan") if len(calls.append(1) or calls) == 2 else 1.0))
    trainer = train_in_process(build({**overrides, "train.steps": 2}), tmp_path / "skipped")
    assert trainer.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(_g_batchnorm_statistics(trainer), one_step))


@pytest.mark.parametrize("l1_weight,stops", [(1e6, False), (1e9, True)])
def test_fp16_backing_off_from_its_initial_scale_is_not_a_non_finite_streak(tmp_path, facades, l1_weight, stops):
    """fp16 (CPU autocast; users are refused it there, the path is CUDA's): an L1 weight of 1e6 overflows the
    scaled gradients until the scale has halved ~20 times from 2**16, every step with finite losses. Those skips
    are the scaler's doing and do not end the run after fault.max_consecutive_skips (10), as they did. At 1e9 the
    gradients overflow even unscaled: the streak counts once the scale is below 1, and the run stops, saying so."""
    from ganscale.fault import NonFiniteTraining

    overrides = {**tiny_pix2pix(facades), "train.precision": "fp16", "loss.l1_weight": l1_weight,
                 "train.steps": 30, "log.every": 30}
    cfg = config.load(None, [f"{k}={v}" for k, v in overrides.items()])
    if stops:
        with pytest.raises(NonFiniteTraining, match=r"10 consecutive steps .* at fp16 loss scale 0\.000"):
            train_in_process(cfg, tmp_path)
        return
    trainer = train_in_process(cfg, tmp_path)
    assert trainer.skipped_steps > cfg.fault.max_consecutive_skips and trainer.step == 30
    assert trainer.precision.loss_scale < 2.0**16
