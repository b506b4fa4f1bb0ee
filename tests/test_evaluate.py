"""Sampling and scoring a finished run from its directory alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ganscale import config
from ganscale.config import ConfigError
from ganscale.evaluate import evaluate, load_generator, sample_picture
from ganscale.outputs import finite_json
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
    assert strict_json((run / "eval.json").read_text()) == finite_json(result)  # 4 steps: reverse KL may be inf
    assert evaluate(run) == result  # seeded: the same numbers again


def strict_json(text: str):
    """json.loads as JavaScript's JSON.parse reads: NaN and Infinity are no JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_score_is_null_in_eval_json(ring_run, monkeypatch):
    """A collapsed G's reverse KL is inf: eval.json held `Infinity`, which no strict JSON reader takes."""
    from click.testing import CliRunner

    from ganscale import evaluate as evaluating
    from ganscale.cli import main
    from ganscale.metrics.modes2d import MixtureScore

    run, _ = ring_run
    monkeypatch.setattr(evaluating, "score_named", lambda kind, samples: MixtureScore(0, 8, 0.0, float("inf"), 2500))
    result = CliRunner().invoke(main, ["eval", str(run)])
    assert result.exit_code == 0, result.output
    assert strict_json(result.output.strip().splitlines()[-1])["reverse_kl"] is None
    written = strict_json((run / "eval.json").read_text())
    assert written["reverse_kl"] is None and written["modes_captured"] == 0
    (run / "eval.json").unlink()  # the module's other tests score the real G again


def test_a_skipped_step_s_nan_loss_is_null_in_metrics_jsonl_and_summary_json(tmp_path):
    from ganscale.observe import RunLog

    log = RunLog(tmp_path, 2, 0, tensorboard=False, enabled=True)
    log.log(1, {"loss_d": float("nan"), "loss_g": float("inf"), "grad_norm_d": 1.5}, 8)
    log.log_extra(2, {"fd": float("-inf")})
    log.close({"final": {"loss_d": float("nan"), "loss_g": 0.5}})
    first, second = map(strict_json, (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first["loss_d"] is None and first["loss_g"] is None and first["grad_norm_d"] == 1.5
    assert second == {"step": 2, "fd": None}
    assert strict_json((tmp_path / "summary.json").read_text())["final"] == {"loss_d": None, "loss_g": 0.5}


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
    assert strict_json((run / "eval.json").read_text()) == finite_json(result)  # 4 steps: reverse KL may be inf
    assert evaluate(run, samples=200) == result  # seeded: the same numbers again
    assert evaluate(run, samples=200, seed=1)["fd"] != result["fd"]


def test_feature_options_are_checked(digits_run, ring_run):
    with pytest.raises(ConfigError, match="--inception-weights"):
        evaluate(digits_run[0], samples=200, features="inception")
    with pytest.raises(ConfigError, match="--features"):
        evaluate(ring_run[0], features="digits")


@pytest.mark.parametrize("run, said", [
    ("ring_run", "2000000000 samples need about"),
    ("digits_run", "scoring 2000000000 samples needs about")])
def test_eval_samples_beyond_the_machine_s_memory_are_refused_naming_how_many_fit(request, run, said):
    """--samples was a torch allocation traceback (the 2D mixtures draw every sample at once) or an out-of-memory
    kill, where sample --n is refused in one line."""
    folder = request.getfixturevalue(run)[0]
    scores = folder / "eval.json"
    before = scores.read_bytes() if scores.exists() else None  # another test's eval, kept
    with pytest.raises(ConfigError) as refused:
        evaluate(folder, samples=2_000_000_000)
    assert refused.value.key == "--samples" and said in refused.value.problem, refused.value
    fits = int(refused.value.fix.split("--samples ")[1].split(";")[0].rstrip(")"))
    assert 10_000 < fits < 2_000_000_000
    assert (scores.read_bytes() if scores.exists() else None) == before


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


def test_eval_of_an_image_run_whose_images_moved_says_how_to_point_at_them(tmp_path):
    """eval has no data.path option: "point data.path at a folder that holds them" could not be followed."""
    import shutil

    images = write_noise_pngs(tmp_path / "images", 8)
    run = tmp_path / "run"
    _train(run, None, ["data.kind=folder", f"data.path={images}", "data.resolution=16", "data.channels=3",
                       "train.batch_size=4", "model.g_width=8", "model.d_width=8"])
    shutil.move(images, tmp_path / "moved")
    with pytest.raises(ConfigError) as scored:
        evaluate(run, features="digits", samples=10)
    assert scored.value.key == "data.path" and "the run's training images" in scored.value.problem
    assert scored.value.fix == (f"put them back at {images}, or set data.path in the run's config.yaml to where they "
                                "are now") and not (run / "eval.json").exists()


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


@pytest.fixture(scope="module")
def pix2pix_run(tmp_path_factory):
    from ganscale.data.synthetic import write_synthetic_facades

    pairs = write_synthetic_facades(tmp_path_factory.mktemp("facades") / "pairs", 5, 0, (64, 32))
    run = tmp_path_factory.mktemp("pix2pix")
    _train(run, "pix2pix", [f"data.path={pairs}", "data.resolution=32", "data.load_size=32", "model.g_width=4",
                            "model.d_width=4", "train.batch_size=1", "data.workers=0", "checkpoint.every=4"])
    return run


def test_pix2pix_sample_draws_n_pairs_chosen_by_the_seed(pix2pix_run, tmp_path):
    """--n is the number of input | output | target rows, --seed chooses which of the data's pairs they show."""
    def rows(n, seed, name):
        picture = np.asarray(Image.open(sample_picture(pix2pix_run, n, tmp_path / name, seed)))
        return picture, (picture.shape[0] - 2) // 34  # 32 px cells, 2 px apart

    one, count = rows(1, 0, "one.png")
    assert count == 1
    everything, count = rows(None, 0, "all.png")
    assert count == 5  # the default: all pairs, as there are fewer than 64
    chosen, count = rows(3, 5, "seed5.png")
    assert count == 3 and np.array_equal(chosen, rows(3, 5, "again.png")[0])
    assert not np.array_equal(chosen, rows(3, 6, "seed6.png")[0])
    with pytest.raises(ConfigError, match="--n") as info:
        sample_picture(pix2pix_run, 6, tmp_path / "six.png")
    assert "holds 5" in info.value.problem and "--n 5" in info.value.fix and not (tmp_path / "six.png").exists()


@pytest.mark.parametrize("run, options, refused", [
    ("digits", {"inception_weights": "garbage.pth"}, "--inception-weights"),
    ("digits", {"inception_preprocess": "torch-fidelity"}, "--inception-preprocess"),
    ("digits", {"pairs": "."}, "--pairs"),
    ("ring", {"pairs": "."}, "--pairs"),
    ("ring", {"inception_weights": "garbage.pth"}, "--inception-weights"),
    ("pix2pix", {"features": "inception"}, "--features"),
    ("pix2pix", {"samples": 3}, "--samples"),
    ("pix2pix", {"seed": 1}, "--seed"),
    ("pix2pix", {"inception_weights": "fake.pth"}, "--inception-weights"),
])
def test_eval_options_the_run_is_not_scored_with_are_refused_naming_them(request, run, options, refused):
    run_dir = request.getfixturevalue(f"{run}_run")
    run_dir = run_dir if run == "pix2pix" else run_dir[0]
    (run_dir / "eval.json").unlink(missing_ok=True)
    with pytest.raises(ConfigError) as info:
        evaluate(run_dir, **{k: Path(v) if k in ("pairs", "inception_weights") else v for k, v in options.items()})
    assert info.value.key == refused and f"drop {refused}" in info.value.fix
    # Only the inception options are read once --features inception is given (--pairs was told so too).
    assert ("add --features inception" in info.value.fix) == (run == "digits" and refused.startswith("--inception"))
    assert not (run_dir / "eval.json").exists()


def test_pix2pix_eval_scores_every_pair(pix2pix_run):
    result = evaluate(pix2pix_run)
    assert result["pairs"] == 5 and result["l1"] > 0 and "seed" not in result


def test_pix2pix_sample_and_eval_of_a_run_whose_pairs_moved_say_how_to_point_at_them(pix2pix_run, tmp_path):
    """sample and eval have no data.path option: their fixes name what they do have (the run's config.yaml, --pairs)."""
    import shutil

    import yaml

    run = tmp_path / "run"
    shutil.copytree(pix2pix_run, run)
    (run / "eval.json").unlink(missing_ok=True)  # another test's
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["data"]["path"] = str(tmp_path / "moved")
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError) as drawn:
        sample_picture(run, 2, tmp_path / "x.png")
    assert drawn.value.key == "data.path" and "set data.path in the run's config.yaml" in drawn.value.fix
    with pytest.raises(ConfigError) as scored:
        evaluate(run)
    assert scored.value.key == "data.path" and "--pairs FOLDER" in scored.value.fix
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as empty:
        evaluate(run, pairs=tmp_path / "empty")
    assert empty.value.key == "--pairs" and empty.value.fix == "pass --pairs a folder of A|B pair images"
    assert not (tmp_path / "x.png").exists() and not (run / "eval.json").exists()
