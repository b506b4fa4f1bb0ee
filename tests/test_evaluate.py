"""Sampling and scoring a finished run from its directory alone."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from ganscale import config
from ganscale.config import ConfigError
from ganscale.evaluate import evaluate, load_generator, sample_picture
from dist_helpers import train_in_process


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


def test_image_runs_sample_a_grid_and_have_no_metric_yet(tmp_path):
    _train(tmp_path, None, ["model.g_width=8", "model.d_width=8", "train.batch_size=8"])
    out = sample_picture(tmp_path, 16, tmp_path / "grid.png")
    assert np.asarray(Image.open(out)).ndim == 3
    with pytest.raises(ConfigError, match="data.kind"):
        evaluate(tmp_path)


def test_sample_and_eval_commands(ring_run, tmp_path):
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
    refused = subprocess.run([sys.executable, "-m", "ganscale", "sample", str(run), "--out", str(out), "--class", "3"],
                             env=clean_env(), capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--class" in refused.stderr
