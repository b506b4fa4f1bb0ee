"""Single-process pieces of the engine: objectives, EMA, clipping, precision, cross-rank BN fallbacks."""

from __future__ import annotations

import math

import pytest
import torch

from dist_helpers import train_in_process
from ganscale import config, objectives
from ganscale.ema import EmaUpdate, ema_beta, make_ema, update_ema
from ganscale.parallel import Wrapped
from ganscale.precision import Precision


@pytest.mark.parametrize("kind", ["nonsaturating", "hinge", "wgan-gp", "lsgan"])
def test_losses_reward_d_for_separating_and_g_for_fooling(kind):
    confident_real, confident_fake = torch.full((8, 1), 3.0), torch.full((8, 1), -3.0)
    assert objectives.d_loss(kind, confident_real, confident_fake) < objectives.d_loss(kind, confident_fake, confident_real)
    assert objectives.g_loss(kind, confident_real) < objectives.g_loss(kind, confident_fake)


def test_nonsaturating_matches_bce_with_logits():
    real, fake = torch.randn(16, 1), torch.randn(16, 1)
    bce = torch.nn.functional.binary_cross_entropy_with_logits
    expected = bce(real, torch.ones_like(real)) + bce(fake, torch.zeros_like(fake))
    assert torch.allclose(objectives.d_loss("nonsaturating", real, fake), expected)


def test_r1_is_squared_input_gradient_and_unscales_fp16_factor():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.tensor([1.0, -2.0, 0.5])
    out = (x * w).sum(1) ** 2  # d/dx = 2 (x.w) w
    expected = ((2 * (x.detach() @ w)).unsqueeze(1) * w).square().sum(1).mean()
    assert torch.allclose(objectives.r1_penalty(out, x), expected)
    assert torch.allclose(objectives.r1_penalty(out, x, grad_scale=1024.0), expected)
    # differentiable: the penalty has a gradient w.r.t. the network's parameters (here x)
    assert objectives.r1_penalty(out, x).requires_grad


def test_ema_half_life_is_counted_in_images_not_steps():
    half_life = 10_000
    for batch in (32, 64, 256):
        steps = half_life // batch
        decay = ema_beta(batch, 10**9, half_life, rampup=0) ** steps
        assert math.isclose(decay, 0.5, rel_tol=0.05), batch


def test_ema_rampup_limits_half_life_early():
    assert ema_beta(64, 640, 10_000, rampup=0.05) < ema_beta(64, 640, 10_000, rampup=0)
    assert ema_beta(64, 0, 10_000, rampup=0.05) == 0.0  # first step: G_ema = G
    assert ema_beta(64, 10**9, 0, rampup=0) == 0.0


def test_update_ema_lerps_parameters_and_copies_buffers():
    g = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ema = make_ema(g)
    with torch.no_grad():
        for p in g.parameters():
            p.add_(1.0)
        g[1].running_mean.fill_(3.0)
    before = [p.clone() for p in ema.parameters()]
    update_ema(ema, g, beta=0.75)
    for old, new, live in zip(before, ema.parameters(), g.parameters()):
        assert torch.allclose(new, 0.75 * old + 0.25 * live)
    assert torch.equal(ema[1].running_mean, g[1].running_mean)
    assert not any(p.requires_grad for p in ema.parameters())


def test_ema_update_with_listed_tensors_matches_update_ema_and_follows_loaded_weights():
    torch.manual_seed(0)
    g = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))  # int64 num_batches_tracked too
    listed, walked = make_ema(g), make_ema(g)
    update = EmaUpdate(listed, g)
    assert update.fixed  # plain tensors: listed once
    for step in range(3):
        g(torch.randn(8, 2)).sum().backward()  # moves the BatchNorm statistics
        with torch.no_grad():
            for p in g.parameters():
                p.sub_(0.1 * p.grad)
        if step == 1:  # a checkpoint load copies into the same tensors: the lists follow it
            g.load_state_dict({k: v + 1 for k, v in g.state_dict().items()})
        update(0.5)
        update_ema(walked, g, 0.5)
    for a, b in zip(listed.state_dict().values(), walked.state_dict().values()):
        assert torch.equal(a, b)
    assert int(listed[1].num_batches_tracked) == int(g[1].num_batches_tracked) == 4


def test_grad_norm_returns_pre_clip_norm_and_clips():
    layer = torch.nn.Linear(4, 1)
    layer.weight.grad = torch.full_like(layer.weight, 3.0)
    layer.bias.grad = torch.full_like(layer.bias, 4.0)
    wrapped = Wrapped(layer, layer)
    expected = math.sqrt(4 * 9 + 16)
    assert math.isclose(float(wrapped.grad_norm(max_norm=0)), expected, rel_tol=1e-6)  # 0: no clipping
    assert math.isclose(float(wrapped.grad_norm(max_norm=1.0)), expected, rel_tol=1e-6)
    assert math.isclose(float(torch.nn.utils.get_total_norm([layer.weight.grad, layer.bias.grad])), 1.0, rel_tol=1e-4)


def test_bf16_autocast_on_cpu_and_no_scaler():
    precision = Precision("bf16", torch.device("cpu"))
    with precision.autocast():
        y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16
    assert precision.loss_scale == 1.0 and not precision.scaler.is_enabled()


def _fp16_step(precision: Precision, gradient: float) -> torch.optim.Optimizer:
    """One scaled backward whose parameter gets `gradient` (unscaled), then the scaler's unscale_."""
    weight = torch.nn.Parameter(torch.zeros(()))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    precision.scale(weight * gradient).backward()
    precision.unscale_(optimizer)
    return optimizer


def test_fp16_scale_follows_the_agreed_skips_not_each_rank_s_own_inf_check():
    """Two ranks whose shards differ (only one holds the overflowing gradient), both told the agreed skip: both back
    off alike. GradScaler's own update would halve the first rank's scale only."""
    overflowing, finite = Precision("fp16", torch.device("cpu")), Precision("fp16", torch.device("cpu"))
    _fp16_step(overflowing, float("inf"))
    _fp16_step(finite, 1.0)
    for precision in (overflowing, finite):
        precision.skipped()  # the trainer's agreed decision, the same on every rank
        precision.update()
    assert overflowing.loss_scale == finite.loss_scale == 2.0**15
    assert overflowing.scaler.get_scale() == finite.scaler.get_scale() == 2.0**15  # what the next scale() uses


def test_fp16_scale_grows_after_an_interval_without_skips_and_resumes_where_it_was():
    from ganscale.precision import GROWTH_INTERVAL

    precision = Precision("fp16", torch.device("cpu"))
    for update in range(GROWTH_INTERVAL - 1):
        _fp16_step(precision, 1.0).step()
        precision.update()
    assert precision.loss_scale == 2.0**16
    saved = precision.state_dict()
    resumed = Precision("fp16", torch.device("cpu"))
    resumed.load_state_dict(saved)
    for precision_ in (precision, resumed):
        _fp16_step(precision_, 1.0)
        precision_.update()
        assert precision_.loss_scale == precision_.scaler.get_scale() == 2.0**17


def test_cross_rank_batchnorm_is_plain_batchnorm_in_one_process():
    from ganscale.parallel.syncbn import CrossRankBatchNorm, convert_batchnorm

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3))
    reference = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.BatchNorm2d(3))
    reference.load_state_dict(net.state_dict())
    converted = convert_batchnorm(net, use_cuda=False)
    assert isinstance(converted[1], CrossRankBatchNorm)
    x = torch.randn(4, 1, 6, 6)
    assert torch.allclose(converted(x), reference(x))
    assert converted.state_dict().keys() == reference.state_dict().keys()


PIPELINE = ["parallel.generator=pipeline", "parallel.discriminator=pipeline"]
PIX2PIX_R1 = ["train.batch_size=4", "loss.r1_gamma=1"]  # BatchNorm in G and D (model.norm=batch)


@pytest.mark.parametrize("recipe, overrides, world, says", [
    ("digits", ["parallel.sync_bn=false"], 2,
     ["BatchNorm statistics in G are per rank (each rank normalises its own 32 samples; "
      "parallel.sync_bn is off), so this 2-rank run trains differently from one process. "
      "Fix: --set parallel.sync_bn=true"]),
    ("digits", [], 2, None),                         # unset: cross-rank, as one process normalises
    ("digits-biggan", ["parallel.sync_bn=false"], 4, ["in G are per rank", "own 16 samples", "4-rank run"]),
    ("digits-biggan", [], 4, None),                  # conditional BatchNorm, cross-rank by default
    ("pix2pix", PIX2PIX_R1, 2, ["in G and D are per rank", "with loss.r1_gamma=0"]),  # sync_bn alone is refused
    # A set micro-batch is normalised as on one process; only the running statistics (G_ema's) differ, and
    # cross-rank statistics would normalise 2 x 8 samples together: no sync_bn to offer.
    ("digits", ["train.micro_batch=8"], 2, ["running statistics in G", "G_ema's samples and scores differ"]),
    ("digits", [], 1, None),
    ("digits", ["parallel.sync_bn=true"], 2, None),
    # Cross-rank statistics over 2 x 8 samples, where one process normalises 8.
    ("digits", ["parallel.sync_bn=true", "train.micro_batch=8"], 2,
     ["BatchNorm in G normalises 2 x 8 samples together across ranks (parallel.sync_bn), where one process with "
      "this config normalises 8: this run trains differently from one process. Fix: set train.micro_batch=4"]),
    ("digits", ["parallel.sync_bn=true", "train.micro_batch=8", "model.g_batchnorm=false"], 2, None),
    ("digits", ["model.g_batchnorm=false"], 2, None),                       # DCGAN's D has no BatchNorm
    ("pix2pix", [*PIX2PIX_R1, "model.norm=instance"], 2, None),
    ("digits", ["train.micro_batch=8", "model.g_batchnorm=false"], 2, None),
    ("digits", PIPELINE, 2, None)])                  # normalises each pipeline micro-batch by design; refuses sync_bn
def test_per_rank_batchnorm_is_named_with_its_fix_where_it_applies(recipe, overrides, world, says):
    """Found in the built networks (any model kind); the trainer prints it on rank 0 (test_cli)."""
    from ganscale.models import build_networks
    from ganscale.trainer import per_rank_batchnorm

    cfg = config.load(recipe, overrides)
    with torch.device("meta"):
        generator, discriminator = build_networks(cfg)
    warning = per_rank_batchnorm(cfg, world, generator, discriminator)
    if says is None:
        assert warning is None
    else:
        assert all(part in warning for part in says), warning
        assert ("--set parallel.sync_bn=true" in warning) == ("train.micro_batch=8" not in overrides)


def test_fp16_scaler_path_backs_off_and_keeps_training(tmp_path):
    """The fp16 path (GradScaler, scaled R1, one update per iteration) on CPU autocast.

    Users are refused fp16 on a CPU by the config check; the code path is the same as on CUDA.
    """
    from ganscale import config
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    cfg = config.load(None, ["train.precision=fp16", "train.steps=12", "log.every=4", "log.tensorboard=false",
                             "model.g_width=16", "model.d_width=16", "train.batch_size=16",
                             "loss.r1_gamma=1", "loss.r1_interval=2", "loss.n_critic=2"])
    runtime = start("cpu")
    try:
        trainer = Trainer(cfg, runtime, tmp_path)
        initial_scale = trainer.precision.loss_scale  # read before training, so not train_in_process
        reads, get_scale = [], trainer.precision.scaler.get_scale  # on CUDA each read waits for the GPU
        trainer.precision.scaler.get_scale = lambda: reads.append(trainer.step) or get_scale()
        summary = trainer.fit()
    finally:
        runtime.close()
    # R1 (scaled by the loss scale) and the final checkpoint (which saves it) read the host's copy of the scale
    assert reads == []
    assert trainer.precision.scaler.is_enabled()
    assert trainer.precision.loss_scale == get_scale()
    assert trainer.precision.loss_scale < initial_scale  # overflowed at first, backed off
    assert summary["skipped_steps"] < 12
    assert all(math.isfinite(summary["final"][k]) for k in ("loss_d", "loss_g", "grad_norm_d", "grad_norm_g"))


def test_lr_factor_is_constant_then_linear_decay():
    from ganscale.trainer import lr_factor

    assert [lr_factor(s, 10, 1.0) for s in range(10)] == [1.0] * 10
    decayed = [lr_factor(s, 10, 0.5) for s in range(10)]
    assert decayed[:4] == [1.0] * 4
    assert all(a > b for a, b in zip(decayed[4:], decayed[5:])) and 0 < decayed[-1] < 0.2


def test_learning_rates_follow_the_schedule_during_training(tmp_path):
    from dist_helpers import train_in_process
    from ganscale import config
    from ganscale.trainer import lr_factor

    # A lazy R1 (every 16 steps) rides in the ordinary D step: no extra optimizer step, so unlike StyleGAN2's
    # separate one, nothing to correct in D's lr or betas.
    cfg = config.load("ring8", ["train.steps=6", "optim.decay_start=0.5", "log.tensorboard=false", "loss.r1_interval=16",
                                "model.g_width=8", "model.d_width=8", "data.size=100", "log.sample_every=0"])
    trainer = train_in_process(cfg, tmp_path)
    base_g, base_d = trainer.opt_g.param_groups[0]["initial_lr"], trainer.opt_d.param_groups[0]["initial_lr"]
    assert (base_g, base_d) == (cfg.optim.g.lr, cfg.optim.d.lr)
    assert trainer.opt_d.param_groups[0]["betas"] == tuple(cfg.optim.d.betas)
    assert math.isclose(trainer.opt_g.param_groups[0]["lr"], base_g * lr_factor(5, 6, 0.5))
    assert math.isclose(trainer.opt_d.param_groups[0]["lr"], base_d * lr_factor(5, 6, 0.5))


def test_step_time_breakdown_is_logged_and_adds_up(tmp_path):
    """Every part of the step is reported per logged step, and together they are at most the wall time."""
    import json

    from dist_helpers import train_in_process
    from ganscale import config
    from ganscale.observe.timing import PARTS

    cfg = config.load(None, ["train.steps=4", "log.every=2", "train.batch_size=16", "log.sample_every=0",
                             "checkpoint.every=0", "log.tensorboard=false"])
    train_in_process(cfg, tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    for record in records:
        parts = [record[f"time_{part}_ms"] for part in PARTS]
        assert all(t >= 0 for t in parts)
        assert record["time_d_forward_backward_ms"] > 0 and record["time_g_forward_backward_ms"] > 0
        assert sum(parts) / 1000 <= 16 / record["img_per_s"] * 1.05  # within the step's wall time
    quiet = config.load(None, ["train.steps=2", "log.every=1", "log.step_times=false", "log.sample_every=0",
                               "checkpoint.every=0", "log.tensorboard=false"])
    train_in_process(quiet, tmp_path / "quiet")
    assert not any(k.startswith("time_") for k in json.loads((tmp_path / "quiet" / "metrics.jsonl").read_text().splitlines()[0]))


def test_on_cuda_one_step_in_eight_is_synchronised_for_the_breakdown(monkeypatch):
    """Timing synchronises the device at each part's edges, which stalls its queue: on CUDA only the first step
    of each logging interval and every 8th after it are timed; outputs (rare steps) whenever they run."""
    import torch

    from ganscale.observe.timing import CUDA_SAMPLE_EVERY, PARTS, StepTimes

    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *device: synchronised.append(1))
    times = StepTimes(torch.device("cuda"))
    timed = []
    for step in range(20):
        before = len(synchronised)
        times.begin_step()
        with times.part("data"):
            pass
        with times.part("optimizer"):
            pass
        timed.append(len(synchronised) > before)
        if step == 9:  # a log step: the next interval starts timed
            assert set(times.take(10)) == {f"time_{part}_ms" for part in PARTS}
    assert CUDA_SAMPLE_EVERY == 8
    assert [i for i, t in enumerate(timed) if t] == [0, 8, 10, 18]
    before = len(synchronised)
    with times.part("outputs"):  # not a timed step, still timed
        pass
    assert len(synchronised) == before + 2
    cpu = StepTimes(torch.device("cpu"))
    assert cpu.sample_every == 1


def test_a_cuda_step_that_is_not_timed_and_writes_nothing_is_never_synchronised(tmp_path, monkeypatch):
    """The trainer with a CUDA-kind StepTimes (torch.cuda.synchronize counted): only timed steps and steps with
    outputs synchronise; the others leave the GPU's queue running."""
    from ganscale.observe.timing import StepTimes
    from ganscale.runtime import start
    from ganscale.trainer import Trainer
    from test_distributed import SMALL_DCGAN

    syncs: list[int] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *device: syncs.append(1))
    cfg = config.load(None, [f"{k}={v}" for k, v in {**SMALL_DCGAN, "train.steps": 12, "log.every": 12,
                                                      "log.sample_every": 6, "checkpoint.every": 0}.items()])
    runtime = start("cpu")
    try:
        trainer = Trainer(cfg, runtime, tmp_path)
        trainer.times = StepTimes(torch.device("cuda"))
        at_start = []
        original = trainer.times.begin_step
        trainer.times.begin_step = lambda: (at_start.append(len(syncs)), original())
        trainer.fit()
    finally:
        runtime.close()
    per_step = [after - before for before, after in zip(at_start, [*at_start[1:], len(syncs)])]
    assert [i for i, n in enumerate(per_step) if n] == [0, 5, 8, 11]  # timed: 0, 8; samples after 6 and 12


def test_one_process_skips_a_step_with_a_non_finite_loss_and_keeps_finite_weights(tmp_path, monkeypatch):
    """The one-rank path takes the skip decision without a collective: a NaN D loss at one step skips it."""
    calls = []
    original = objectives.d_loss

    def nan_at_third_call(kind, real, fake):
        calls.append(1)
        loss = original(kind, real, fake)
        return loss * float("nan") if len(calls) == 3 else loss

    monkeypatch.setattr(objectives, "d_loss", nan_at_third_call)
    cfg = config.load(None, ["train.steps=5", "log.every=1", "log.tensorboard=false", "log.sample_every=0",
                             "checkpoint.every=0", "model.g_width=8", "model.d_width=8", "train.batch_size=8"])
    trainer = train_in_process(cfg, tmp_path)
    assert trainer.skipped_steps == 1
    assert all(torch.isfinite(p).all() for net in (trainer.G.module, trainer.D.module) for p in net.parameters())
