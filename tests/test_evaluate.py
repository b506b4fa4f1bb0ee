"""Sampling and scoring a finished run from its directory alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from ganscale import config
from ganscale.config import ConfigError
from ganscale.evaluate import evaluate, load_generator, sample_picture
from dist_helpers import train_in_process
from image_helpers import write_noise_pngs


def _train(run_dir, source, overrides):
    return train_in_process(config.load(source, ["train.steps=4", "log.tensorboard=false", "log.sample_every=0",
                                                 *overrides]), run_dir)


@pytest.fixture(scope="module")
def ring_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("ring")
    return run, _train(run, "ring8", ["model.g_width=16", "model.d_width=16", "data.size=200"])


def test_load_generator_rebuilds_g_ema_from_the_checkpoint(ring_run):
    run, trainer = ring_run
    cfg, generator, step = load_generator(run)
    assert step == 4 and cfg.data.kind == "ring8"
    for key, value in trainer.G_ema.state_dict().items():
        assert np.array_equal(value.numpy(), generator.state_dict()[key].numpy()), key


def test_evaluate_scores_2500_samples_and_writes_eval_json(ring_run):
    run, _ = ring_run
    result = evaluate(run)
    assert result["samples"] == 2500 and 0 <= result["modes_captured"] <= 8
    assert json.loads((run / "eval.json").read_text()) == result
    assert evaluate(run) == result  # seeded: the same numbers again


def test_sample_writes_a_picture(ring_run, tmp_path):
    run, _ = ring_run
    out = sample_picture(run, 300, tmp_path / "s.png")
    assert Image.open(out).size[0] > 100


def test_sample_of_a_checkpoint_holding_nan_exits_4_and_draws_nothing(ring_run, tmp_path):
    from click.testing import CliRunner

    from ganscale import checkpoint
    from ganscale.cli import main

    run, _ = ring_run
    state = checkpoint.load(checkpoint.latest(run))
    name = next(iter(state["G_ema"]))
    state["G_ema"][name].view(-1)[0] = float("inf")
    poisoned = checkpoint.save(state, tmp_path / "run", state["step"], keep=3)
    result = CliRunner().invoke(main, ["sample", str(tmp_path / "run"), "--out", str(tmp_path / "s.png")])
    assert result.exit_code == 4, result.output
    assert f"ganscale: G_ema.{name} in checkpoint {poisoned} holds NaN or infinite values" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "s.png").exists()


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("digits")
    return run, _train(run, None, ["model.g_width=8", "model.d_width=8", "train.batch_size=8"])


def test_image_runs_sample_a_grid(digits_run, tmp_path):
    run, _ = digits_run
    out = sample_picture(run, 16, tmp_path / "grid.png")
    assert np.asarray(Image.open(out)).ndim == 3


def test_digits_runs_are_scored_by_fd_digits_against_the_training_digits(digits_run):
    run, _ = digits_run
    result = evaluate(run, samples=200)
    assert result["features"] == "digits" and result["samples"] == 200 and result["reference_samples"] == 1797
    assert result["fd"] > 0 and {"kid", "kid_std", "precision", "recall", "density", "coverage"} <= result.keys()
    assert json.loads((run / "eval.json").read_text()) == result
    assert evaluate(run, samples=200) == result  # seeded: the same numbers again
    assert evaluate(run, samples=200, seed=1)["fd"] != result["fd"]


def test_feature_options_are_checked(digits_run, ring_run):
    with pytest.raises(ConfigError, match="--inception-weights"):
        evaluate(digits_run[0], samples=200, features="inception")
    with pytest.raises(ConfigError, match="--features"):
        evaluate(ring_run[0], features="digits")


def test_eval_of_a_run_on_fewer_images_than_density_coverage_need_is_one_line_and_exit_2(tmp_path):
    """k = 5 nearest neighbours need 6 real images: refused before scoring, not a traceback from the distances."""
    from click.testing import CliRunner

    from ganscale.cli import main

    five = write_noise_pngs(tmp_path / "five", 5)
    run = tmp_path / "run"
    _train(run, None, ["data.kind=folder", f"data.path={five}", "data.resolution=16", "data.channels=3",
                       "train.batch_size=4", "model.g_width=8", "model.d_width=8"])
    result = CliRunner().invoke(main, ["eval", str(run), "--features", "digits", "--samples", "10"])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "Traceback" not in result.output
    assert f"'data.path': data.path={five} holds 5 images" in result.output and "at least 6" in result.output
    assert not (run / "eval.json").exists()


def test_an_unreadable_inception_file_is_refused_by_eval_in_one_line(digits_run, tmp_path):
    from click.testing import CliRunner

    from ganscale.cli import main

    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(torch.randint(256, (5000,), generator=torch.Generator().manual_seed(0),
                                      dtype=torch.uint8).numpy().tobytes())
    result = CliRunner().invoke(main, ["eval", str(digits_run[0]), "--samples", "10", "--features", "inception",
                                       "--inception-weights", str(garbage)])
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "'--inception-weights'" in result.output and str(garbage) in result.output
    assert "weights_only" not in result.output and "Traceback" not in result.output


def test_sample_and_eval_commands(ring_run, digits_run, tmp_path):
    import subprocess
    import sys

    from test_cli import clean_env

    run, _ = ring_run
    out = tmp_path / "grid.png"
    result = subprocess.run([sys.executable, "-m", "ganscale", "sample", str(run), "--n", "200", "--out", str(out)],
                            env=clean_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and out.exists(), result.stderr
    result = subprocess.run([sys.executable, "-m", "ganscale", "eval", str(run)], env=clean_env(), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["samples"] == 2500
    missing = subprocess.run([sys.executable, "-m", "ganscale", "eval", str(digits_run[0]), "--features", "inception",
                              "--inception-weights", str(tmp_path / "none.pth")], env=clean_env(), capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "--inception-weights" in missing.stderr and "never downloads" in missing.stderr
    refused = subprocess.run([sys.executable, "-m", "ganscale", "sample", str(run), "--out", str(tmp_path / "3.png"),
                              "--class", "3"], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--class" in refused.stderr
    not_png = subprocess.run([sys.executable, "-m", "ganscale", "sample", str(run), "--out", str(tmp_path / "grid.txt")],
                             env=clean_env(), capture_output=True, text=True, timeout=120)
    assert not_png.returncode == 2 and "--out" in not_png.stderr and "Traceback" not in not_png.stderr
