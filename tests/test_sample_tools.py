"""Sampling tools on trained runs: sample --truncation and --class, interpolate (GIF walks), style-mix (grids)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image, ImageSequence

from ganscale import checkpoint, config
from ganscale.cli import main
from ganscale.data.synthetic import write_synthetic_facades
from ganscale.evaluate import load_generator, sample_picture
from ganscale.observe.samples import image_grid
from ganscale.sampling import FRAME_MS, broadcast, grid_latents, interpolation, mixed_styles, slerp, style_mixing
from dist_helpers import train_in_process
from test_cli import explain, ganscale

QUIET = ["train.steps=4", "train.batch_size=8", "checkpoint.every=4", "log.sample_every=0", "log.tensorboard=false"]
CELL = 34  # a 16 px sample shown at 32 px, and the 2 px between cells


def _train(tmp_path_factory, name: str, recipe: str | None, overrides: list[str]) -> Path:
    run = tmp_path_factory.mktemp(name)
    train_in_process(config.load(recipe, [*QUIET, *overrides]), run)
    return run


@pytest.fixture(scope="module")
def sg2_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory, "sg2", "digits-stylegan2", [])


@pytest.fixture(scope="module")
def conditional_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory, "sg2-conditional", "digits-stylegan2", ["model.conditional=true",
                                                                              "data.labels=true"])


@pytest.fixture(scope="module")
def dcgan_run(tmp_path_factory) -> Path:
    return _train(tmp_path_factory, "dcgan", None, ["model.g_width=8", "model.d_width=8"])


@pytest.fixture(scope="module")
def pix2pix_run(tmp_path_factory) -> Path:
    pairs = write_synthetic_facades(tmp_path_factory.mktemp("facades") / "pairs", 2, 0, (64, 32))
    return _train(tmp_path_factory, "pix2pix", "pix2pix", [f"data.path={pairs}", "data.resolution=32",
                                                          "data.load_size=32", "model.g_width=4", "model.d_width=4",
                                                          "train.batch_size=1", "data.workers=0"])


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as picture:
        return np.asarray(picture.convert("RGB"))


def gif_frames(path: Path) -> list[np.ndarray]:
    with Image.open(path) as animation:
        return [np.asarray(frame.convert("RGB")) for frame in ImageSequence.Iterator(animation)]


def grid_of(images: torch.Tensor, cols: int | None = None) -> np.ndarray:
    return image_grid(images.float(), cols=cols)


def cli(*args: str):
    return CliRunner().invoke(main, list(map(str, args)))


def assert_refused(result, *named: str) -> None:
    """Exit 2 with one line naming `named`, no traceback."""
    output = result.output if hasattr(result, "output") else result.stderr
    code = result.exit_code if hasattr(result, "exit_code") else result.returncode
    assert code == 2, output
    assert len(output.strip().splitlines()) == 1, output
    assert all(name in output for name in named), output
    assert "Traceback" not in output


# ------------------------------------------------------------------------------------------------------ truncation
def without_noise(run: Path, into: Path) -> Path:
    """A copy of `run`'s newest checkpoint (into a new run directory) whose G_ema adds no per-pixel noise."""
    state = checkpoint.load(checkpoint.latest(run))
    for name, value in state["G_ema"].items():
        if name.endswith("noise_strength"):
            value.zero_()
    checkpoint.save(state, into, state["step"], keep=1)
    return into


def test_truncation_0_draws_the_w_avg_image_in_every_cell(sg2_run, tmp_path):
    run = without_noise(sg2_run, tmp_path / "noiseless")
    _, G, _ = load_generator(run)
    assert G.w_avg.abs().sum() > 0  # tracked by training
    with torch.no_grad():
        average = G.synthesize(broadcast(G, G.w_avg.expand(9, -1)), torch.zeros(9, dtype=torch.int64))
    out = sample_picture(run, 9, tmp_path / "psi0.png", psi=0.0)
    assert np.array_equal(pixels(out), grid_of(average))
    assert torch.allclose(average, average[:1].expand_as(average), atol=1e-5)  # one image, to rounding


def test_truncation_1_is_plain_sampling_and_others_pull_towards_w_avg(sg2_run, tmp_path):
    _, G, _ = load_generator(sg2_run)
    z = grid_latents(1, 16, G.z_dim, 5)[0]
    with torch.no_grad():
        plain, half = G(z), G(z, psi=0.5)
    assert np.array_equal(pixels(sample_picture(sg2_run, 16, tmp_path / "psi1.png", 5, psi=1.0)), grid_of(plain))
    assert np.array_equal(pixels(sample_picture(sg2_run, 16, tmp_path / "half.png", 5, psi=0.5)), grid_of(half))
    assert not np.array_equal(grid_of(plain), grid_of(half))


def test_truncation_outside_0_1_exits_2_through_the_cli_and_writes_nothing(sg2_run, tmp_path):
    result = ganscale("sample", str(sg2_run), "--out", "s.png", "--truncation", "1.5", cwd=tmp_path)
    assert_refused(result, "--truncation", "[0, 1]")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, out", [("sample", "s.png"), ("interpolate", "w.gif")])
def test_truncation_of_a_g_without_mapping_network_exits_2(dcgan_run, tmp_path, command, out):
    result = cli(command, dcgan_run, "--out", tmp_path / out, "--truncation", "0.7")
    assert_refused(result, "--truncation", "model.kind=dcgan", "no mapping network")
    assert not (tmp_path / out).exists()


# ------------------------------------------------------------------------------------------------------ --class
def test_class_picks_what_a_conditional_g_draws(conditional_run, tmp_path):
    _, G, _ = load_generator(conditional_run)
    z = grid_latents(1, 8, G.z_dim, 0)[0]
    drawn = {}
    for label in (3, 5):
        drawn[label] = pixels(cli_sample(conditional_run, tmp_path / f"c{label}.png", "--n", 8, "--class", label))
        with torch.no_grad():
            assert np.array_equal(drawn[label], grid_of(G(z, torch.full((8,), label)), cols=8))
    assert not np.array_equal(drawn[3], drawn[5])


def cli_sample(run: Path, out: Path, *args) -> Path:
    result = cli("sample", run, "--out", out, *args)
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("command, out", [("sample", "s.png"), ("interpolate", "w.gif"), ("style-mix", "m.png")])
def test_class_of_an_unconditional_g_exits_2(sg2_run, tmp_path, command, out):
    assert_refused(cli(command, sg2_run, "--out", tmp_path / out, "--class", 1), "--class", "not class-conditional")
    assert not (tmp_path / out).exists()


def test_a_class_outside_the_run_exits_2(conditional_run, tmp_path):
    assert_refused(cli("interpolate", conditional_run, "--out", tmp_path / "w.gif", "--class", 10), "--class",
                   "use 0 to 9")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------ interpolate
def test_interpolate_writes_the_frames_and_starts_at_sample(sg2_run, tmp_path):
    """Through the CLI: count x steps frames of the sample grid's size; the first is `sample` with the same
    --n, --seed and --truncation; the same file again for the same seed."""
    for name in ("w.gif", "again.gif"):
        result = ganscale("interpolate", str(sg2_run), "--out", name, "--n", "9", "--count", "3", "--steps", "4",
                          "--seed", "7", "--truncation", "0.8", cwd=tmp_path)
        assert result.returncode == 0, explain(result)
    result = ganscale("sample", str(sg2_run), "--out", "s.png", "--n", "9", "--seed", "7", "--truncation", "0.8",
                      cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    frames = gif_frames(tmp_path / "w.gif")
    assert len(frames) == 3 * 4
    assert np.array_equal(frames[0], pixels(tmp_path / "s.png"))
    assert frames[0].shape == (3 * CELL + 2, 3 * CELL + 2, 3)
    assert (tmp_path / "w.gif").read_bytes() == (tmp_path / "again.gif").read_bytes()
    with Image.open(tmp_path / "w.gif") as animation:
        assert animation.info["loop"] == 0 and animation.info["duration"] == FRAME_MS


def test_interpolate_walks_in_z_for_other_gs_and_fixes_the_class_per_cell(dcgan_run, conditional_run, tmp_path):
    for run, args in ((dcgan_run, ()), (conditional_run, ("--class", 4)), (conditional_run, ())):
        walk = interpolation(run, tmp_path / "w.gif", 16, 2, 3, 1, label=args[1] if args else None)
        frames = gif_frames(walk)
        assert len(frames) == 2 * 3
        assert np.array_equal(frames[0], pixels(cli_sample(run, tmp_path / "s.png", "--n", 16, "--seed", 1, *args)))
        walk.unlink()
        (tmp_path / "s.png").unlink()


def test_a_walk_visits_each_keyframe_and_returns_to_the_first(dcgan_run, tmp_path):
    """For a G walked in z: frame `steps` is the second keyframe's grid, and the walk ends one step before the
    first again (the GIF loops)."""
    from ganscale.sampling import walk
    from ganscale.tasks import build_task

    cfg, G, _ = load_generator(dcgan_run)
    task = build_task(cfg)
    keys = grid_latents(2, 4, cfg.model.z_dim, 0)
    frames = list(walk(G, task, keys, 3, 1.0, None))
    with torch.no_grad():
        assert torch.equal(frames[0], G(keys[0])) and torch.allclose(frames[3], G(keys[1]), atol=1e-5)
    assert len(frames) == 6 and not torch.allclose(frames[5], frames[0])


def test_slerp_ends_at_its_endpoints_and_keeps_the_norm_between_them():
    stream = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 32, generator=stream), torch.randn(3, 32, generator=stream)
    assert torch.equal(slerp(a, b, 0.0), a) and torch.allclose(slerp(a, b, 1.0), b, atol=1e-5)
    middle = slerp(a, a * 2, 0.5)  # parallel: linear
    assert torch.allclose(middle, a * 1.5)
    unit = torch.nn.functional.normalize
    assert torch.allclose(slerp(unit(a), unit(b), 0.3).norm(dim=1), torch.ones(3), atol=1e-5)


def test_interpolate_refuses_pix2pix_and_writes_nothing(pix2pix_run, tmp_path):
    result = ganscale("interpolate", str(pix2pix_run), "--out", "w.gif", cwd=tmp_path)
    assert_refused(result, "RUN_DIR", "image to image")
    assert list(tmp_path.iterdir()) == []


def test_interpolate_refuses_a_2d_run(tmp_path_factory, tmp_path):
    run = _train(tmp_path_factory, "ring", "ring8", ["model.g_width=8", "model.d_width=8", "data.size=64"])
    assert_refused(cli("interpolate", run, "--out", tmp_path / "w.gif"), "RUN_DIR", "2D points")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("out, named", [("w.png", ".gif"), ("old.gif", "already exists")])
def test_interpolate_checks_out_before_drawing(sg2_run, tmp_path, out, named):
    (tmp_path / "old.gif").write_bytes(b"kept")
    assert_refused(cli("interpolate", sg2_run, "--out", tmp_path / out), "--out", named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.gif"] and (tmp_path / "old.gif").read_bytes() == b"kept"
    assert cli("interpolate", sg2_run, "--out", tmp_path / "old.gif", "--steps", 1, "--force").exit_code == 0
    assert len(gif_frames(tmp_path / "old.gif")) == 4


def test_interpolate_never_writes_into_a_runs_checkpoints(sg2_run):
    out = sg2_run / "checkpoints" / "w.gif"
    assert_refused(cli("interpolate", sg2_run, "--out", out, "--force"), "--out", "checkpoints")
    assert not out.exists()


# ------------------------------------------------------------------------------------------------------ style-mix
def test_style_mix_grid_has_the_sources_on_its_edges(sg2_run, tmp_path):
    out = tmp_path / "mix.png"
    result = cli("style-mix", sg2_run, "--out", out, "--rows", 2, "--cols", 3, "--seed", 4)
    assert result.exit_code == 0, result.output
    grid = pixels(out)
    assert grid.shape == (3 * CELL + 2, 4 * CELL + 2, 3)
    _, G, _ = load_generator(sg2_run)
    z = grid_latents(1, 5, G.z_dim, 4)[0]
    with torch.no_grad():
        sources = G(z)
    cell = lambda row, col: grid[2 + row * CELL:row * CELL + CELL, 2 + col * CELL:col * CELL + CELL]  # noqa: E731
    expected = grid_of(sources, cols=1)
    source = lambda i: expected[2 + i * CELL:i * CELL + CELL, 2:CELL]  # noqa: E731
    assert not cell(0, 0).any()  # the blank corner
    for col in range(3):
        assert np.array_equal(cell(0, col + 1), source(2 + col))
    for row in range(2):
        assert np.array_equal(cell(row + 1, 0), source(row))
    style_mixing(sg2_run, tmp_path / "again.png", 2, 3, 4)
    assert out.read_bytes() == (tmp_path / "again.png").read_bytes()


def test_style_mixing_a_latent_with_itself_gives_that_latent(sg2_run):
    _, G, _ = load_generator(sg2_run)
    z = grid_latents(1, 3, G.z_dim, 0)[0]
    images = mixed_styles(G, z, z, 2, 1.0, (None, None)).view(4, 4, *G(z).shape[1:])  # (rows + 1) x (cols + 1)
    for row in range(3):
        assert torch.allclose(images[row + 1, row + 1], images[row + 1, 0], atol=1e-5)
        assert not torch.allclose(images[row + 1, 1 + (row + 1) % 3], images[row + 1, 0], atol=1e-3)


@pytest.mark.parametrize("args, named", [(("--crossover", 6), "use 1 to 5"), (("--crossover", 0), "use 1 to 5"),
                                         (("--truncation", -0.1), "[0, 1]")])
def test_style_mix_bad_options_exit_2(sg2_run, tmp_path, args, named):
    assert_refused(cli("style-mix", sg2_run, "--out", tmp_path / "m.png", *args), args[0], named)
    assert list(tmp_path.iterdir()) == []


def test_style_mix_refuses_other_models_through_the_cli(dcgan_run, tmp_path):
    result = ganscale("style-mix", str(dcgan_run), "--out", "m.png", cwd=tmp_path)
    assert_refused(result, "RUN_DIR", "model.kind=dcgan", "stylegan2")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("text, problem", [("model: [unclosed\n", "not valid YAML"),
                                           ("- a\n", "the top level is not a mapping"),
                                           ("", "the file holds no settings"),
                                           ("train: {steps: -3}\n", "train.steps: input should be greater than 0")])
def test_a_run_whose_config_file_is_broken_is_refused_by_name_by_every_command(dcgan_run, tmp_path, text, problem):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(dcgan_run, run)
    (run / "config.yaml").write_text(text)
    commands = [["sample", "--out", str(tmp_path / "s.png")], ["export", "--out", str(tmp_path / "g.safetensors")],
                ["interpolate", "--out", str(tmp_path / "i.gif")], ["eval", "--samples", "10"]]
    for command in commands:
        result = CliRunner().invoke(main, [command[0], str(run), *command[1:]])
        assert result.exit_code == 2, (command, result.output)
        assert result.output.strip().splitlines() == [result.output.strip()]  # one line, no traceback
        assert f"config error at '{run / 'config.yaml'}': {problem}" in result.output, result.output
    assert not any((tmp_path / name).exists() for name in ("s.png", "g.safetensors", "i.gif"))


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**64)])
def test_a_seed_outside_32_bits_is_refused_by_every_command_that_takes_one(dcgan_run, tmp_path, seed):
    """torch and numpy seed with 32 bits: 2**32 drew what 0 draws, 2**64 was a traceback."""
    commands = [["sample", str(dcgan_run), "--out", str(tmp_path / "s.png")],
                ["interpolate", str(dcgan_run), "--out", str(tmp_path / "i.gif")],
                ["eval", str(dcgan_run), "--samples", "10"], ["make-facades", str(tmp_path / "facades"), "--n", "1"],
                ["fit-digits-features", "--out", str(tmp_path / "f.safetensors"), "--epochs", "1"]]
    for command in commands:
        result = CliRunner().invoke(main, [*command, "--seed", seed])
        assert result.exit_code == 2, (command, result.output)
        assert f"Invalid value for '--seed': {seed} is not in the range 0<=x<=4294967295" in result.output
    assert list(tmp_path.iterdir()) == []


def test_make_facades_names_its_folder_argument_when_refusing_it(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("kept")
    result = CliRunner().invoke(main, ["make-facades", str(tmp_path / "taken"), "--n", "1"])
    assert result.exit_code == 2 and result.output.startswith("ganscale: config error at 'FOLDER': "), result.output
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]


def test_a_checkpoint_s_completion_marker_given_as_the_checkpoint_is_named_as_such(dcgan_run, tmp_path):
    marker = sorted((dcgan_run / "checkpoints").glob("*.json"))[-1]
    result = CliRunner().invoke(main, ["export", str(dcgan_run), "--out", str(tmp_path / "g.safetensors"),
                                       "--checkpoint", str(marker)])
    assert result.exit_code == 2 and "a completion marker, not a checkpoint: pass the checkpoint beside it" in (
        result.output), result.output


@pytest.mark.parametrize("command,out", [("sample", "s.png"), ("interpolate", "w.gif")])
def test_a_grid_pillow_would_refuse_to_open_is_refused_naming_the_n_that_fits(dcgan_run, tmp_path, monkeypatch,
                                                                              command, out):
    """Past Image.MAX_IMAGE_PIXELS Pillow warns on opening the picture, past twice that it refuses it."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100_000)  # a 10 x 10 grid of 34 px cells is 116,964 pixels
    refused = CliRunner().invoke(main, [command, str(dcgan_run), "--out", str(tmp_path / out), "--n", "100"])
    assert refused.exit_code == 2 and len(refused.output.strip().splitlines()) == 1, refused.output
    assert "config error at '--n'" in refused.output and "116,964 pixels" in refused.output
    most = int(refused.output.split("(--n ")[1].split(")")[0])
    assert not (tmp_path / out).exists()
    drawn = CliRunner().invoke(main, [command, str(dcgan_run), "--out", str(tmp_path / out), "--n", str(most)])
    assert drawn.exit_code == 0, drawn.output
    grown = CliRunner().invoke(main, [command, str(dcgan_run), "--out", str(tmp_path / f"more-{out}"),
                                      "--n", str(most + 1)])
    assert grown.exit_code == 2 and "config error at '--n'" in grown.output


@pytest.mark.parametrize("error", [MemoryError(), ValueError("")])
def test_a_writer_error_without_a_message_is_named_by_its_type(tmp_path, error):
    """str(MemoryError()) is empty: taking its first line was an IndexError and a traceback."""
    from ganscale.outputs import write_output

    def fail(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise error

    with pytest.raises(config.ConfigError, match=f"could not write .*: {type(error).__name__}"):
        write_output(tmp_path / "s.png", fail)
    assert list(tmp_path.iterdir()) == []


def test_a_write_removes_what_a_killed_write_of_the_same_file_left_on_this_host(tmp_path):
    """SIGKILL runs no cleanup: its temporary file stayed beside the output for good. A write now removes those of
    processes that are gone; a live writer's, another host's and other files are kept."""
    import socket
    import subprocess
    import sys

    from ganscale.outputs import write_output

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    abandoned = [f".s.tmp-{host}-{gone.stdout.strip()}.png"]
    kept = [f".s.tmp-{host}-{os.getppid()}.png", f".s.tmp-elsewhere-{gone.stdout.strip()}.png",
            f".s.tmp-{host}-{gone.stdout.strip()}.jpg", f".t.tmp-{host}-{gone.stdout.strip()}.png", "notes.txt"]
    for name in abandoned + kept:
        (tmp_path / name).write_bytes(b"half")
    write_output(tmp_path / "s.png", lambda tmp: tmp.write_bytes(b"picture"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*kept, "s.png"])


def test_interpolate_refuses_more_frames_than_memory_holds_naming_count_and_steps(dcgan_run, tmp_path, monkeypatch):
    """Pillow keeps every GIF frame until the end: --count 200 --steps 50 at --n 64 was OOM-killed."""
    from ganscale import memory

    frame = (2 * CELL + 2) ** 2  # --n 4: a 2 x 2 grid, a byte a pixel
    monkeypatch.setattr(memory, "host_available", lambda: 30 * frame)
    out = tmp_path / "w.gif"
    refused = cli("interpolate", dcgan_run, "--out", out, "--n", "4", "--count", "4", "--steps", "8")
    assert_refused(refused, "'--count/--steps'", "4 x 8 = 32 frames", "at most 30")
    assert not out.exists()
    assert cli("interpolate", dcgan_run, "--out", out, "--n", "4", "--count", "3", "--steps", "10").exit_code == 0
    assert len(gif_frames(out)) <= 30


@pytest.mark.parametrize("command,under", [("sample", "y.png"), ("sample", "deeper/y.png"),
                                           ("export", "g.safetensors")])
def test_an_out_under_a_file_is_refused_saying_that_it_is_a_file(dcgan_run, tmp_path, command, under):
    """mkdir under a file failed as 'File exists' (exit 7, with a fix about permissions and free space)."""
    (tmp_path / "a.png").write_bytes(b"mine")
    refused = cli(command, dcgan_run, "--out", tmp_path / "a.png" / under)
    assert_refused(refused, "'--out'", f"'{tmp_path / 'a.png'}'", "is a file, not a folder")
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"] and (tmp_path / "a.png").read_bytes() == b"mine"


@pytest.mark.parametrize("command", [["fit-features", "--dataset", "digits"], ["fit-digits-features"]])
def test_fit_features_refuses_an_out_that_is_not_a_safetensors_file(tmp_path, command):
    """It wrote safetensors under feat.png, where sample and export check their --out's suffix."""
    refused = cli(*command, "--out", tmp_path / "feat.png", "--epochs", "1")
    assert_refused(refused, "'--out'", "is not a .safetensors file")
    assert list(tmp_path.iterdir()) == []
