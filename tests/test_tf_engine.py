"""The tensorflow engine (ganscale.tf): MirroredStrategy over 2 logical CPU devices trains as 1 device, accumulation
and clipping keep the global batch's semantics, a resumed run is the uninterrupted one, and what it cannot do is
refused before anything starts.

The training tests need TensorFlow and skip without it, unless GANSCALE_REQUIRE_TENSORFLOW=1 (CI), where a missing
TensorFlow fails them. They run in this process: the CPU is split into 2 logical devices once, before TensorFlow's
runtime starts; a 1-replica strategy uses the first of them.

Criterion (as tests/test_distributed.py's): every step's losses and gradient norms within 1e-5, and what G_ema and D
compute on fixed inputs within 1e-4, each relative to the largest value compared.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ganscale import config as config_mod
from ganscale import rundir
from ganscale.cli import main
from ganscale.config import ConfigError

STEP_TOLERANCE = 1e-5    # losses and gradient norms of every step, relative
OUTPUT_TOLERANCE = 1e-4  # G_ema(z) and D(x) after the run, relative to the largest |value|
TINY_DCGAN = ["train.engine=tensorflow", "model.z_dim=8", "model.g_width=8", "model.d_width=8", "train.batch_size=16",
              "train.ema_half_life_images=50", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def tf():
    """TensorFlow with the CPU split into 2 logical devices; skips without it (fails under
    GANSCALE_REQUIRE_TENSORFLOW=1)."""
    try:
        import tensorflow
    except ImportError as e:
        if os.environ.get("GANSCALE_REQUIRE_TENSORFLOW") == "1":
            pytest.fail(f"GANSCALE_REQUIRE_TENSORFLOW=1 but TensorFlow does not import ({e})")
        pytest.skip(f"TensorFlow is not installed ({e}): pip install 'ganscale[tensorflow]'")
    from ganscale.tf import devices

    devices.strategy(2, "cpu")  # splits the CPU now, before any test runs an op
    return tensorflow


def _config(*overrides: str) -> config_mod.Config:
    return config_mod.load("digits", [*TINY_DCGAN, *overrides])


def _train(tf, replicas: int, steps: int, *overrides: str, run_dir: Path | None = None, resume: Path | None = None):
    """A Training on `replicas` logical CPUs after `steps` iterations, and each iteration's stats."""
    from ganscale.tf import devices
    from ganscale.tf.loop import Training

    training = Training(_config(*overrides), devices.strategy(replicas, "cpu"), run_dir or Path("unused"), resume)
    stats = []
    for _ in range(steps):
        training.iteration()
        stats.append(dict(training.stats))
    return training, stats


def _outputs(training) -> dict[str, np.ndarray]:
    """What G_ema and D compute on fixed inputs."""
    rng = np.random.default_rng(0)
    z = rng.standard_normal((32, training.cfg.model.z_dim)).astype(np.float32)
    x = rng.uniform(-1, 1, (32, 8, 8, 1)).astype(np.float32)
    return {"G_ema": training.G_ema(z, training=False).numpy(), "D": training.D(x, training=False).numpy()}


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-12))


def _differences(one, other) -> tuple[float, float]:
    """(worst relative difference of the steps' losses and norms, of the networks' outputs)."""
    (a, stats_a), (b, stats_b) = one, other
    steps = max(abs(x[k] - y[k]) / max(abs(x[k]), 1e-12) for x, y in zip(stats_a, stats_b) for k in x)
    outputs_a, outputs_b = _outputs(a), _outputs(b)
    return steps, max(_relative(outputs_a[k], outputs_b[k]) for k in outputs_a)


# ----------------------------------------------------------------------------------------------- (1) replicas
def test_two_replicas_with_sync_bn_train_as_one(tf):
    one, two = _train(tf, 1, 5), _train(tf, 2, 5, "parallel.sync_bn=true")
    steps, outputs = _differences(one, two)
    assert steps <= STEP_TOLERANCE and outputs <= OUTPUT_TOLERANCE, (steps, outputs)
    # Adam's moments too: its gradients are summed over the replicas once (Adam divides most of a scale error out of
    # the weights, not out of its moments)
    for name in ("opt_g", "opt_d"):
        moments = zip(getattr(one[0], name).variables, getattr(two[0], name).variables)
        assert max(_relative(a.numpy(), b.numpy()) for a, b in moments) <= OUTPUT_TOLERANCE, name


def test_tf32_is_on_unless_told_not_to(tf):
    """train.tf32 reaches TensorFlow (whose default is on, as torch's is for convolutions)."""
    _train(tf, 1, 0, "train.tf32=false")
    assert not tf.config.experimental.tensor_float_32_execution_enabled()
    _train(tf, 1, 0)
    assert tf.config.experimental.tensor_float_32_execution_enabled()


def test_per_replica_batchnorm_trains_differently(tf, capsys):
    """With parallel.sync_bn=false each replica normalises its 8 samples, not the 16: the runs part (this test
    shows the equality above is not trivial), and the run says so."""
    steps, outputs = _differences(_train(tf, 1, 5), _train(tf, 2, 5, "parallel.sync_bn=false"))
    assert steps > 100 * STEP_TOLERANCE and outputs > 100 * OUTPUT_TOLERANCE, (steps, outputs)
    assert "Fix: --set parallel.sync_bn=true" in capsys.readouterr().err


def test_the_batchnorm_warning_is_the_torch_engines(tf, capsys):
    """A set train.micro_batch normalises the same samples on any number of replicas (sync_bn unset: off); the
    warning said it trained differently and that sync_bn=true mended it, which pools 2 x 4 samples instead."""
    _train(tf, 2, 0, "train.micro_batch=4")
    said = capsys.readouterr().err
    assert "parallel.sync_bn=true" not in said and "the weights train as on one process" in said, said
    _train(tf, 2, 0, "train.micro_batch=4", "parallel.sync_bn=true")
    assert "normalises 2 x 4 samples together" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- (2) workers
def test_two_worker_processes_train_as_one_replica_and_resume(tf, tmp_path):
    """`train --workers 2` (MultiWorkerMirroredStrategy, TensorFlow's collectives between 2 local processes),
    stopped at step 3 and resumed to 5 with --resume auto: every step's losses and norms (metrics.jsonl) and the
    networks of its last checkpoint are the 1-replica run's, within the criterion. The chief alone wrote the run
    directory: its files are exactly the torch engine's, and no other worker's checkpoint copy is left in it."""
    run = tmp_path / "run"
    settings = [*TINY_DCGAN, "parallel.sync_bn=true", "log.every=1", "checkpoint.keep=1", "log.sample_every=0",
                "parallel.tf_open_servers=true"]
    first = _cli("train", "digits", *_sets(*settings, "train.steps=3"), "--workers", "2", "--run-dir", str(run),
                 cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = _cli("train", "--resume", "auto", *_sets("train.steps=5"), "--workers", "2", "--run-dir", str(run),
                   cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.resumed-00000003.yaml", "config.yaml",
                                                     "metrics.jsonl", "samples", "summary.json"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000005.json", "step-00000005.tf"]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2

    reference, stats = _train(tf, 1, 5, "parallel.sync_bn=true")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    keys = ("loss_d", "loss_g", "grad_norm_d", "grad_norm_g")
    worst = max(abs(r[k] - s[k]) / max(abs(s[k]), 1e-12) for r, s in zip(records, stats) for k in keys)
    assert worst <= STEP_TOLERANCE, worst
    trained, _ = _train(tf, 1, 0, "parallel.sync_bn=true", resume=run / "checkpoints" / "step-00000005.tf")
    assert trained.step == 5
    ours, theirs = _outputs(reference), _outputs(trained)
    assert max(_relative(ours[k], theirs[k]) for k in ours) <= OUTPUT_TOLERANCE


def _sets(*settings: str) -> list[str]:
    return [argument for setting in settings for argument in ("--set", setting)]


def test_workers_refuse_nproc_the_torch_engine_and_open_servers_not_agreed_to(tmp_path):
    tensorflow = ["train", "digits", "--set", "train.engine=tensorflow", "--workers", "2"]
    for consent in ([], ["--set", "parallel.tf_open_servers=true"]):  # --nproc first: the consent's fix offers it
        both = CliRunner().invoke(main, [*tensorflow, *consent, "--nproc", "2", "--run-dir", str(tmp_path / "run")])
        assert both.exit_code == 2 and "config error at '--nproc'" in both.output, both.output
    unagreed = CliRunner().invoke(main, [*tensorflow, "--run-dir", str(tmp_path / "run")])
    assert unagreed.exit_code == 2 and "config error at 'parallel.tf_open_servers'" in unagreed.output
    assert "every interface" in unagreed.output and "--nproc" in unagreed.output, unagreed.output
    torch_engine = CliRunner().invoke(main, ["train", "digits", "--workers", "2", "--run-dir", str(tmp_path / "run")])
    assert torch_engine.exit_code == 2 and "config error at '--workers'" in torch_engine.output, torch_engine.output
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [None, 2])
def test_a_run_whose_lock_another_run_took_over_stops_and_writes_nothing_more(tf, tmp_path, workers):
    """As the torch engine's (test_runlock): once another run holds the run directory's lock, every worker stops in
    the step's agreement, before anything of the step is written: exit 9, one line. One process: found by the loop's
    look before a step that writes (the lock's thread is kept out). `--workers 2`: the launcher holds the lock and
    the chief watches it (nothing did: the run went on writing)."""
    from test_runlock import UNWATCHED, everything_but_the_lock, take_over_after_checkpoint

    from ganscale import fault, runlock

    python = [sys.executable, "-m", "ganscale"] if workers else [sys.executable, "-c", UNWATCHED]
    launched = ["--workers", str(workers), "--set", "parallel.tf_open_servers=true"] if workers else []
    settings = [*TINY_DCGAN, "train.steps=100000", "log.every=300", "checkpoint.every=300", "log.sample_every=0"]
    trains = subprocess.Popen([*python, "train", "digits", *_sets(*settings), *launched, "--run-dir", "R"],
                              cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, text=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    run = tmp_path / "R"
    theirs, written, err = take_over_after_checkpoint(trains, run, 300)
    assert trains.returncode == fault.EXIT_TAKEN_OVER == 9, err[-3000:]
    said = [line for line in err.splitlines() if "took over" in line]
    assert len(said) == 1 and re.fullmatch(
        rf"ganscale: another run took over the run directory R \(the lock R/{runlock.LOCK_NAME} is that run's now\): "
        r"this run stopped at step \d+ and wrote nothing more there, no checkpoint either", said[0]), err[-3000:]
    assert "Traceback" not in err and "no longer this run's" not in err, err[-3000:]
    assert everything_but_the_lock(run) == written and (run / runlock.LOCK_NAME).read_bytes() == theirs
    assert not (run / "summary.json").exists()


def test_a_hung_worker_is_named_with_diagnostics_and_every_worker_exits_5(tf, tmp_path):
    """As the torch engine's (test_faults): worker 1 sleeps at step 3 while worker 0 waits for it in TensorFlow's
    all-reduce, which has no deadline of its own (the run waited forever). Each worker's watchdog writes its stacks
    and marks after fault.hang_timeout_s, worker 0 names worker 1 and where it was last, and the run exits 5."""
    from ganscale.fault import EXIT_HANG, INJECT_ENV

    run = tmp_path / "run"
    settings = [*TINY_DCGAN, "train.steps=100000", "log.sample_every=0", "checkpoint.every=0",
                "parallel.tf_open_servers=true", "fault.hang_timeout_s=4"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", INJECT_ENV: "sleep@1:3:600"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "digits", *_sets(*settings), "--workers", "2",
                             "--run-dir", str(run)], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=400)
    elapsed = time.monotonic() - started
    assert result.returncode == EXIT_HANG == 5, result.stderr[-3000:]
    assert "hang detected on rank 0: no progress for 4 s" in result.stderr, result.stderr[-3000:]
    assert "rank(s) 1 did not arrive (rank 1 last at 'step 3: start')" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert elapsed < 300, f"took {elapsed:.0f} s"  # ~30 s here; the sleep (600 s) was not waited out
    for rank in (0, 1):
        assert "File" in (run / "diagnostics" / f"rank{rank}-stacks.txt").read_text()
        assert "step 3: start" in (run / "diagnostics" / f"rank{rank}-collectives.txt").read_text()
    assert "step 3: D step 1 of 1" in (run / "diagnostics" / "rank0-collectives.txt").read_text()


def test_a_step_that_does_not_end_after_sigterm_exits_within_exit_timeout(tf, tmp_path):
    """One process whose step 3 does not end (a hung read): SIGTERM starts its exit clock, and after
    fault.exit_timeout_s it writes its stacks and exits 5, where it waited for the step to end (or the SIGKILL)."""
    from ganscale.fault import EXIT_HANG, INJECT_ENV, stop_grace_s

    run = tmp_path / "run"
    settings = [*TINY_DCGAN, "train.steps=100000", "log.every=1", "log.sample_every=0", "checkpoint.every=0",
                "fault.exit_timeout_s=3"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", INJECT_ENV: "sleep@0:3:300"}
    training = subprocess.Popen([sys.executable, "-m", "ganscale", "train", "digits", *_sets(*settings),
                                 "--run-dir", str(run)], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
        assert time.monotonic() < deadline and training.poll() is None, "training never reached step 3"
        time.sleep(0.2)
    time.sleep(1)  # asleep in step 3
    asked = time.monotonic()
    training.send_signal(signal.SIGTERM)
    _, stderr = training.communicate(timeout=90)
    elapsed = time.monotonic() - asked
    assert training.returncode == EXIT_HANG, stderr[-3000:]
    assert "asked to stop 3 s ago (fault.exit_timeout_s)" in stderr, stderr[-3000:]
    assert elapsed < stop_grace_s(3.0) + 5, f"took {elapsed:.0f} s after SIGTERM"
    assert "File" in (run / "diagnostics" / "rank0-stacks.txt").read_text()


def test_image_metrics_during_training_are_the_offline_eval_s_and_two_workers_score_as_one(tf, tmp_path):
    """eval.every (refused on this engine before): FD-digits and the other image metrics of G_ema every 2 steps and
    at the last, in metrics.jsonl and summary.json; the last are what `ganscale eval` computes offline from the final
    checkpoint (G_ema converted to the torch DCGAN, the same noise), and 2 workers (each scoring its share, gathered
    in their gloo group) score as 1 process."""
    settings = [*TINY_DCGAN, "train.steps=4", "eval.every=2", "eval.samples=200", "log.every=2", "log.sample_every=0",
                "parallel.sync_bn=true"]
    one = _cli("train", "digits", *_sets(*settings), "--run-dir", "one", cwd=tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    two = _cli("train", "digits", *_sets(*settings, "parallel.tf_open_servers=true"), "--workers", "2",
               "--run-dir", "two", cwd=tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    scores = {}
    for run in ("one", "two"):
        records = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        scored = [r for r in records if "eval_fd_digits" in r]
        assert [r["step"] for r in scored] == [2, 4], records
        scores[run] = scored
        quality = json.loads((tmp_path / run / "summary.json").read_text())["quality"]
        assert quality["fd_digits"] == scored[-1]["eval_fd_digits"]
        assert {"kid_digits", "precision", "recall", "density", "coverage"} <= quality.keys()
    for ours, theirs in zip(scores["one"], scores["two"]):
        assert ours["eval_fd_digits"] == pytest.approx(theirs["eval_fd_digits"], rel=1e-3)
    offline = _cli("eval", "one", "--samples", "200", cwd=tmp_path)
    assert offline.returncode == 0, offline.stderr[-3000:]
    evaluated = json.loads((tmp_path / "one" / "eval.json").read_text())
    assert evaluated["step"] == 4
    for key in ("fd", "precision", "recall"):
        assert evaluated[key] == pytest.approx(scores["one"][-1][f"eval_{key}_digits" if key == "fd" else f"eval_{key}"],
                                               rel=1e-3, abs=1e-3), key


# ----------------------------------------------------------------------------------------------- (3) accumulation
def test_two_micro_steps_equal_one_step_of_the_double_batch(tf):
    """G without BatchNorm: a micro-step normalises its own micro-batch, so with BatchNorm they differ by design."""
    whole = _train(tf, 1, 3, "model.g_batchnorm=false")
    accumulated = _train(tf, 1, 3, "model.g_batchnorm=false", "train.micro_batch=8")
    assert accumulated[0].feed.accumulation == 2
    steps, outputs = _differences(whole, accumulated)
    assert steps <= STEP_TOLERANCE and outputs <= OUTPUT_TOLERANCE, (steps, outputs)


def test_clipping_uses_the_global_norm(tf, monkeypatch):
    """Clipped hard (every step's norm is far above train.grad_clip), 2 replicas train as 1. Each replica clipping
    its own share of the gradient by that share's norm scales the two shares differently: shown to part."""
    from ganscale.tf import step

    clip = ["train.grad_clip=0.005", "parallel.sync_bn=true"]
    one = _train(tf, 1, 3, *clip)
    assert all(min(s["grad_norm_d"], s["grad_norm_g"]) > 0.01 for s in one[1])  # clipped at every step, by half or more
    steps, outputs = _differences(one, _train(tf, 2, 3, *clip))
    assert steps <= STEP_TOLERANCE and outputs <= OUTPUT_TOLERANCE, (steps, outputs)

    def clipped_per_replica(self, loss, grads, scale=1.0):
        grads, _ = step.clip_by_global_norm([g / scale for g in grads], self.grad_clip)  # by this replica's own norm
        loss, *grads = tf.distribute.get_replica_context().all_reduce(step.SUM, [loss, *grads])
        return loss, tf.linalg.global_norm(grads), grads

    monkeypatch.setattr(step.Steps, "_reduced", clipped_per_replica)
    steps, outputs = _differences(one, _train(tf, 2, 3, *clip))
    assert outputs > 10 * OUTPUT_TOLERANCE, (steps, outputs)  # ~2e-3: Adam divides most of the scale out again


# ----------------------------------------------------------------------------------------------- bf16
def test_bf16_computes_in_bfloat16_and_trains_near_fp32(tf):
    """mixed_bfloat16: the convolutions compute in bf16 on fp32 weights, G's output and D's logits are fp32; 3 steps
    land near the fp32 run (within bf16's ~3 significant digits), not on it."""
    fp32, bf16 = _train(tf, 1, 3), _train(tf, 1, 3, "train.precision=bf16")
    network = bf16[0].G
    assert any(layer.compute_dtype == "bfloat16" for layer in network.layers[0].layers)
    assert all(v.dtype == "float32" for v in network.trainable_variables)
    assert network(np.zeros((2, 8), np.float32), training=False).dtype == tf.float32
    assert bf16[0].D(np.zeros((2, 8, 8, 1), np.float32), training=False).dtype == tf.float32
    steps, outputs = _differences(fp32, bf16)
    assert 1e-4 < outputs < 5e-2 and steps < 5e-2, (steps, outputs)


# ----------------------------------------------------------------------------------------------- non-finite
def test_a_non_finite_step_on_one_replica_is_skipped_by_every_replica(tf):
    """NaN reals in replica 1's half of step 1's batch: D's step is skipped on both replicas (weights and Adam's step
    count as before, still identical), G's step and the run go on."""
    training, _ = _train(tf, 2, 1, "parallel.sync_bn=true")
    feed = training.feed

    def poisoned(batch: int):
        reals = feed.samples[feed._order.index_tensor(batch, 0).numpy()].copy()
        reals[feed.micro:] = np.nan  # replica 1's slice only
        return feed.distribute(reals)

    feed.reals = poisoned
    d_before = [v.numpy() for v in training.D.trainable_variables]
    d_steps_before, g_steps_before = int(training.opt_d.iterations.numpy()), int(training.opt_g.iterations.numpy())
    training.iteration()
    assert training.skipped_steps == 1 and training.consecutive_skips == 1
    assert int(training.opt_d.iterations.numpy()) == d_steps_before and int(training.opt_g.iterations.numpy()) == g_steps_before + 1
    for variable, before in zip(training.D.trainable_variables, d_before):
        for replica in variable.value.values:
            np.testing.assert_array_equal(replica.numpy(), before)


def test_a_skipped_step_puts_back_gs_batchnorm_statistics(tf):
    """D's step with NaN reals moves G's BatchNorm statistics (its fakes are made in training mode) and is skipped:
    they are put back, on every replica; an applied D step leaves them moved (the test can fail)."""
    from ganscale.trainer import PHASE_D

    training, _ = _train(tf, 2, 1, "parallel.sync_bn=true")
    feed, buffers = training.feed, training.G.non_trainable_variables
    reals = feed.samples[feed._order.index_tensor(1, 0).numpy()]
    before = [v.numpy() for v in buffers]
    skipped = training.steps.discriminator(feed.distribute(np.full_like(reals, np.nan)), feed.latents(1, PHASE_D))
    assert not skipped.applied
    for variable, value in zip(buffers, before):
        for replica in variable.value.values:
            np.testing.assert_array_equal(replica.numpy(), value)
    assert training.steps.discriminator(feed.distribute(reals), feed.latents(1, PHASE_D)).applied
    assert any(not np.array_equal(v.numpy(), value) for v, value in zip(buffers, before))


# ----------------------------------------------------------------------------------------------- image files
def _write_images(root: Path, n: int, zipped: bool = False) -> Path:
    """n random 8x8 grey PNGs named as in a StyleGAN zip (00000/img00000000.png), in a folder or in a zip."""
    import io
    import zipfile

    from PIL import Image

    from ganscale.data.archive import member_name

    rng = np.random.default_rng(0)
    images = {member_name(i): Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L") for i in range(n)}
    if zipped:
        path = root / "images.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
            for name, image in images.items():
                png = io.BytesIO()
                image.save(png, "PNG")
                archive.writestr(name, png.getvalue())
        return path
    for name, image in images.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        image.save(root / name)
    return root


def test_an_image_folder_trains_on_two_replicas_as_one(tf, tmp_path):
    """data.kind=folder (the torch engine's ImageFolder, each replica's share of a global batch decoded when it is
    drawn): 2 replicas with sync_bn train as 1, within the criterion; 40 images and a batch of 16, so step 3 runs
    across an epoch's end."""
    from ganscale.tf import capabilities

    folder = ["data.kind=folder", f"data.path={_write_images(tmp_path, 40)}"]
    capabilities.check(_config(*folder))  # no longer refused
    one, two = _train(tf, 1, 3, *folder), _train(tf, 2, 3, *folder, "parallel.sync_bn=true")
    steps, outputs = _differences(one, two)
    assert steps <= STEP_TOLERANCE and outputs <= OUTPUT_TOLERANCE, (steps, outputs)

    # Each replica reads its own share of a global batch (a worker of several decodes only its replicas' images).
    feed, read = two[0].feed, []
    files = feed.samples
    feed.samples = type("Recorded", (), {"__getitem__": lambda _, share: read.append(share) or files[share]})()
    feed.reals(3)
    assert sorted(len(share) for share in read) == [8, 8]
    np.testing.assert_array_equal(np.sort(np.concatenate(read)), np.sort(feed._order.index_tensor(3, 0).numpy()))


def test_a_stylegan_zip_feeds_the_pixels_of_the_same_images_in_a_folder(tf, tmp_path):
    """data.kind=zip (ganscale.data.archive.ImageZip) and a folder of the same PNGs: the same global batches, in the
    torch engine's order and value range, so the same first steps."""
    from ganscale.data.folder import ImageFolder

    (tmp_path / "folder").mkdir()
    folder = ["data.kind=folder", f"data.path={_write_images(tmp_path / 'folder', 24)}"]
    zipped = ["data.kind=zip", f"data.path={_write_images(tmp_path, 24, zipped=True)}"]
    from_folder, from_zip = _train(tf, 1, 1, *folder), _train(tf, 1, 1, *zipped)
    indices = from_zip[0].feed._order.index_tensor(2, 0).numpy()
    batch = from_zip[0].feed.samples[indices]
    np.testing.assert_array_equal(batch, from_folder[0].feed.samples[indices])
    torch_engine = ImageFolder(tmp_path / "folder", 8, 1)
    np.testing.assert_array_equal(batch[3], torch_engine[int(indices[3])][0].numpy().transpose(1, 2, 0))
    assert from_zip[1] == from_folder[1]


# ----------------------------------------------------------------------------------------------- fp16
def test_fp16_scales_the_loss_skips_an_overflow_on_every_replica_and_resumes_its_scale(tf, tmp_path):
    """mixed_float16 on the CPU: fp16 compute, finite losses near the fp32 run's; a loss scale that overflows fp16
    makes both steps skip on both replicas and halves the scale (LossScaleOptimizer's dynamic scale); the scale and
    its growth count come back from the checkpoint."""
    fp16 = ["train.precision=fp16", "parallel.sync_bn=true"]
    training, stats = _train(tf, 2, 2, *fp16)
    assert any(layer.compute_dtype == "float16" for layer in training.G.layers[0].layers)
    assert all(np.isfinite(s[k]) for s in stats for k in s)
    steps, _ = _differences(_train(tf, 2, 2, "parallel.sync_bn=true"), (training, stats))
    assert steps < 5e-2, steps
    assert float(training.opt_d.dynamic_scale.numpy()) == 2.0**15 and int(training.opt_d.step_counter.numpy()) == 2

    d_before = [v.numpy() for v in training.D.trainable_variables]
    for optimizer in (training.opt_d, training.opt_g):
        optimizer.dynamic_scale.assign(2.0**100)  # scaled gradients beyond fp16's 65504
    training.iteration()
    assert training.skipped_steps == 2 and np.isfinite(training.stats["loss_d"])
    for optimizer in (training.opt_d, training.opt_g):
        assert [s.numpy() for s in optimizer.dynamic_scale.value.values] == [2.0**99] * 2
        assert int(optimizer.step_counter.numpy()) == 0 and int(optimizer.iterations.numpy()) == 2
    for variable, before in zip(training.D.trainable_variables, d_before):
        for replica in variable.value.values:
            np.testing.assert_array_equal(replica.numpy(), before)

    training.run_dir = tmp_path
    resumed, _ = _train(tf, 2, 0, *fp16, run_dir=tmp_path, resume=training.save())
    assert float(resumed.opt_g.dynamic_scale.numpy()) == 2.0**99 and int(resumed.opt_g.iterations.numpy()) == 2


def test_fp16_on_the_cpu_passes_preflight_on_this_engine_only(tf):
    from ganscale import preflight

    preflight.check(_config("train.precision=fp16"), 2, False)
    with pytest.raises(ConfigError, match="GradScaler needs a CUDA device"):
        preflight.check(config_mod.load("digits", ["train.precision=fp16"]), 2, False)


# ----------------------------------------------------------------------------------------------- (4) resume
def test_resumed_at_10_equals_uninterrupted_20(tf, tmp_path):
    """Stopped at step 10 (its checkpoint written, the training dropped) and resumed to 20: the same steps, and the
    same networks, as 20 steps in one go; G_ema, Adam's moments and the data and noise positions included."""
    uninterrupted = _train(tf, 2, 20, "parallel.sync_bn=true")
    first, first_stats = _train(tf, 2, 10, "parallel.sync_bn=true", run_dir=tmp_path)
    saved = first.save()
    assert saved.name == "step-00000010.tf" and (saved.parent / "step-00000010.json").is_file()
    resumed, resumed_stats = _train(tf, 2, 10, "parallel.sync_bn=true", run_dir=tmp_path, resume=saved)
    assert resumed.step == 20
    for a, b in zip(uninterrupted[1], first_stats + resumed_stats):
        assert a == b
    outputs_a, outputs_b = _outputs(uninterrupted[0]), _outputs(resumed)
    for key in outputs_a:
        np.testing.assert_array_equal(outputs_a[key], outputs_b[key])


# ----------------------------------------------------------------------------------------------- the CLI
def test_cli_trains_digits_on_two_replicas_and_resumes(tf, tmp_path):
    """`ganscale train digits --set train.engine=tensorflow --nproc 2`: the torch engine's run directory; then
    --resume auto trains on from its checkpoint."""
    run = tmp_path / "run"
    common = ["--set", "model.g_width=8", "--set", "model.d_width=8", "--set", "train.batch_size=16",
              "--set", "log.every=2", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=1",
              "--set", "log.sample_every=4", "--run-dir", str(run), "--nproc", "2"]
    first = _cli("train", "digits", "--set", "train.engine=tensorflow", "--set", "train.steps=4", *common, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert {p.name for p in run.iterdir()} >= {"config.yaml", "metrics.jsonl", "summary.json", "samples",
                                               "tensorboard", "checkpoints"}
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004.json", "step-00000004.tf"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4]
    assert {"loss_d", "loss_g", "grad_norm_d", "grad_norm_g", "skipped_steps", "img_per_s"} <= set(records[-1])
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert (run / "samples" / "step-00000004.png").is_file()

    resumed = _cli("train", "--resume", "auto", "--set", "train.steps=6", *common, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6]


def test_export_and_eval_read_a_tensorflow_run(tf, tmp_path):
    """`ganscale export` of a tensorflow run writes the torch engine's tensor names and layout: the torch DCGAN
    loaded from it draws what Keras' G_ema draws (BatchNorm's moving statistics included, 2 steps in); `ganscale
    eval` scores the run itself (FD-digits) from its checkpoint folder."""
    import torch
    from safetensors.torch import load_file

    from ganscale.evaluate import evaluate
    from ganscale.export import export_generator
    from ganscale.models import build_networks
    from ganscale.tf import loop

    training, _ = _train(tf, 1, 2, "train.steps=2", run_dir=tmp_path)
    loop._write_config(training)
    training.save()
    tensors = load_file(export_generator(tmp_path, tmp_path / "g.safetensors"))
    generator = build_networks(training.cfg)[0]
    assert set(tensors) == {f"{net}.{key}" for net in ("G", "G_ema") for key in generator.state_dict()}
    generator.load_state_dict({k.removeprefix("G_ema."): v for k, v in tensors.items() if k.startswith("G_ema.")})
    z = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
    with torch.no_grad():
        drawn = generator.eval()(torch.from_numpy(z)).numpy()
    assert _relative(training.G_ema(z, training=False).numpy().transpose(0, 3, 1, 2), drawn) <= OUTPUT_TOLERANCE

    result = evaluate(tmp_path, samples=64, features="digits")
    assert result["step"] == 2 and result["features"] == "digits" and np.isfinite(result["fd"]), result
    assert json.loads((tmp_path / "eval.json").read_text()) == result


def test_export_of_a_checkpoint_its_config_no_longer_describes_is_one_line(tf, tmp_path, monkeypatch):
    """A torch model with another layer count than the checkpoint's Keras generators (its config.yaml edited):
    `ganscale export` exits 2 with the checkpoint, the config and the fix in one line."""
    import torch

    from ganscale import models
    from ganscale.tf import loop

    training, _ = _train(tf, 1, 1, "train.steps=1", run_dir=tmp_path)
    loop._write_config(training)
    training.save()
    build_networks = models.build_networks

    def one_layer_more(cfg):
        G, *rest = build_networks(cfg)
        return (torch.nn.Sequential(G, torch.nn.Linear(2, 2)), *rest)

    monkeypatch.setattr(models, "build_networks", one_layer_more)
    result = CliRunner().invoke(main, ["export", str(tmp_path), "--out", str(tmp_path / "g.safetensors")])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert "step-00000001.tf" in line and "config.yaml" in line and "Fix:" in line and "Traceback" not in line, line
    assert not (tmp_path / "g.safetensors").exists()


def test_a_tensorflow_run_missing_its_config_is_one_line_saying_to_put_it_back(tf, tmp_path):
    """A tensorflow checkpoint holds no config: `sample` says the run's config.yaml is what to restore, not to use
    another checkpoint."""
    from ganscale.tf import loop

    training, _ = _train(tf, 1, 1, "train.steps=1", run_dir=tmp_path)
    training.save()  # no config.yaml written
    result = CliRunner().invoke(main, ["sample", str(tmp_path), "--out", str(tmp_path / "x.png")])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert f"Fix: put back {tmp_path / 'config.yaml'}, the config the run was trained with" in line, line
    assert not (tmp_path / "x.png").exists()


def test_a_tensorflow_run_whose_config_is_not_yaml_is_one_line_naming_it(tf, tmp_path):
    from ganscale.tf import loop

    training, _ = _train(tf, 1, 1, "train.steps=1", run_dir=tmp_path)
    loop._write_config(training)
    training.save()
    (tmp_path / "config.yaml").write_text("model: [unclosed\n")
    result = CliRunner().invoke(main, ["export", str(tmp_path), "--out", str(tmp_path / "g.safetensors")])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert f"config error at '{tmp_path / 'config.yaml'}': not valid YAML" in line, line
    assert not (tmp_path / "g.safetensors").exists()


def test_bench_throughput_measures_both_engines_in_one_invocation(tf, tmp_path):
    """`ganscale bench throughput --engine tensorflow`: each DCGAN row on torch, then on the tensorflow engine's
    step with the same model and batch; other models are refused (exit 2)."""
    out = tmp_path / "results"
    result = CliRunner().invoke(main, ["bench", "throughput", "--engine", "tensorflow", "--device", "cpu", "--batch",
                                       "4", "--resolution", "8", "--dcgan-width", "8", "--iters", "1", "--warmup", "1",
                                       "--out-dir", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(p.read_text()) for p in out.glob("bench-throughput-*.json")]
    rows = record["rows"]
    assert [(r["engine"], r["model"], r["batch"]) for r in rows] == [("torch", "dcgan", 4), ("tensorflow", "dcgan", 4)]
    assert rows[1]["img_per_s"] > 0 and rows[0]["params_G"] == rows[1]["params_G"]
    assert rows[0]["params_D"] == rows[1]["params_D"]  # the same model on both engines
    refused = CliRunner().invoke(main, ["bench", "throughput", "--engine", "tensorflow", "--model", "biggan",
                                        "--out-dir", str(out)])
    assert refused.exit_code == 2 and "--engine tensorflow" in refused.output, refused.output


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", "ganscale", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


# ----------------------------------------------------------------------------------------------- (6) refusals
REFUSED = [
    ("model.kind=stylegan2", "model.kind"),
    ("data.kind=paired", "data.kind"),
    ("data.workers=2", "data.workers"),
    ("data.labels=true", "data.labels"),
    ("parallel.generator=fsdp", "parallel.generator"),
    ("parallel.discriminator=zero2", "parallel.discriminator"),
    ("parallel.generator=pipeline", "parallel.generator"),
    ("loss.r1_gamma=1", "loss.r1_gamma"),
    ("loss.kind=wgan-gp", "loss.kind"),
    ("loss.gradient_penalty=true", "loss.gradient_penalty"),
    ("train.compile=default", "train.compile"),
    ("augment.kind=diffaugment", "augment.kind"),
    ("model.d_spectral_norm=true", "model.d_spectral_norm"),
    ("checkpoint.format=sharded", "checkpoint.format"),
    ("optim.fused=true", "optim.fused"),
    ("log.profile_steps=2", "log.profile_steps"),
    ("train.cudnn_benchmark=false", "train.cudnn_benchmark"),
]


@pytest.mark.parametrize("option,key", REFUSED, ids=[option for option, _ in REFUSED])
def test_refused_before_anything_starts(option, key, tmp_path):
    run = tmp_path / "run"
    result = CliRunner().invoke(main, ["train", "digits", "--set", "train.engine=tensorflow", "--set", option,
                                       "--run-dir", str(run)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"config error at '{key}'" in lines[0] and "Fix:" in lines[0], result.output
    assert "Traceback" not in result.output and not run.exists()


def test_max_restarts_is_refused(tmp_path):
    result = CliRunner().invoke(main, ["train", "digits", "--set", "train.engine=tensorflow", "--max-restarts", "1",
                                       "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "'--max-restarts'" in result.output, result.output


def test_missing_tensorflow_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "tensorflow", None)  # `import tensorflow` raises ImportError
    result = CliRunner().invoke(main, ["train", "digits", "--set", "train.engine=tensorflow",
                                       "--run-dir", str(tmp_path / "run")])
    assert result.exit_code == 2 and "TensorFlow is not installed" in result.output, result.output
    assert "ganscale[tensorflow]" in result.output and not (tmp_path / "run").exists()


def test_both_tensorflow_builds_installed_are_refused(monkeypatch):
    from ganscale.tf import capabilities

    monkeypatch.setattr(capabilities, "_installed", lambda name: True)
    with pytest.raises(ConfigError, match="both tensorflow and tensorflow-cpu are installed"):
        capabilities.require_tensorflow()


def test_a_checkpoint_of_the_other_engine_is_refused(tmp_path):
    torch_checkpoint = tmp_path / "checkpoints" / "step-00000010.pt"
    with pytest.raises(ConfigError, match="written by the torch engine") as refused:
        rundir._left_to_train(_config("train.steps=20"), torch_checkpoint)
    assert refused.value.key == "train.engine" and "--set train.engine=torch" in refused.value.fix
    with pytest.raises(ConfigError, match="written by the tensorflow engine"):
        rundir._left_to_train(config_mod.load("digits"), torch_checkpoint.with_suffix(".tf"))


def test_torch_readers_refuse_a_tensorflow_checkpoint_by_name(tmp_path):
    from ganscale import checkpoint

    folder = tmp_path / "checkpoints" / "step-00000010.tf"
    folder.mkdir(parents=True)
    with pytest.raises(ConfigError, match="a checkpoint of the tensorflow engine"):
        checkpoint.load(folder)


def test_the_cli_imports_neither_framework():
    """`ganscale --help`, slurm --dry-run and every refusal start without torch or TensorFlow (seconds each)."""
    code = "import sys, ganscale.cli; print(sorted({'torch', 'tensorflow', 'keras'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_the_torch_engines_tensorboard_log_does_not_import_tensorflow(tf, tmp_path):
    """With TensorFlow installed, TensorBoard would import it (seconds in every run's rank 0) to write event files
    its own writer writes as well: the run log's scalars are there, TensorFlow is not loaded."""
    code = ("import sys; from pathlib import Path; from ganscale.observe import RunLog\n"
            "log = RunLog(Path(sys.argv[1]), 2, 0, True, True); log.log(1, {'loss_d': 0.5}, 8); log.writer.close()\n"
            "print(sorted({'tensorflow', 'keras'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout + result.stderr
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [event.value for event in events.Scalars("loss_d")] == [0.5]


def test_tensorflow_s_start_up_lines_are_dropped_and_anything_else_it_says_is_kept(tf):
    """TensorFlow's C++ side wrote absl's and oneDNN's start-up lines (twice) to stderr at import, whatever
    TF_CPP_MIN_LOG_LEVEL said: in every run and every worker of the tensorflow engine."""
    script = ("import os\nfrom ganscale.tf import capabilities\n"
              "with capabilities._start_up_lines_dropped():\n"
              "    os.write(2, b'WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\\n')\n"
              "    os.write(2, b'an error of its own\\n')\n"
              "capabilities.require_tensorflow()\nprint('imported')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "imported\n", done.stderr
    assert done.stderr == "an error of its own\n"
