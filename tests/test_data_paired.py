"""Synthetic facades on disk and the paired (A|B) data set: layout, determinism, shared crop/flip, errors."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import random
import shutil
import signal
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from ganscale.config import ConfigError
from ganscale.data import synthetic
from ganscale.data.paired import PairedImages
from ganscale.data.stream import Slicing, _RankSampler
from ganscale.data.synthetic import LABEL_COLOURS, MARKER, write_synthetic_facades

SMALL = (128, 64)  # A|B files of 64x64 halves keep the tests fast


def jpgs(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.jpg"))


def write_pair_png(path: Path, a: np.ndarray, b: np.ndarray) -> None:
    Image.fromarray(np.concatenate([a, b], axis=1)).save(path)


@pytest.fixture(scope="module")
def facades(tmp_path_factory) -> Path:
    return write_synthetic_facades(tmp_path_factory.mktemp("synthetic") / "facades", n=6, seed=0)


# ------------------------------------------------------------------------------- synthetic set
def test_synthetic_count_size_and_marker(facades):
    files = jpgs(facades)
    assert [f.name for f in files] == [f"{i:04d}.jpg" for i in range(6)]
    assert (facades / MARKER).is_file()
    for f in files:
        with Image.open(f) as image:
            assert image.format == "JPEG" and image.mode == "RGB" and image.size == (512, 256)


def test_synthetic_labels_are_flat_colours(facades):
    """B (right half) is a label map: nearly every pixel is one of the label colours (JPEG adds a little noise)."""
    labels = np.asarray(Image.open(jpgs(facades)[0]), dtype=np.float32)[:, 256:]
    distances = np.linalg.norm(labels[:, :, None, :] - LABEL_COLOURS[None, None].astype(np.float32), axis=-1)
    assert (distances.min(-1) < 20).mean() > 0.97
    assert len(np.unique(distances.argmin(-1))) >= 4  # wall, windows, door, cornice at least


def test_synthetic_is_deterministic_per_seed_and_per_image(tmp_path):
    first = write_synthetic_facades(tmp_path / "a", n=3, seed=7, size=SMALL)
    again = write_synthetic_facades(tmp_path / "b", n=5, seed=7, size=SMALL)
    other = write_synthetic_facades(tmp_path / "c", n=3, seed=8, size=SMALL)
    assert [f.read_bytes() for f in jpgs(first)] == [f.read_bytes() for f in jpgs(again)[:3]]  # image i ignores n
    assert all(f.read_bytes() != g.read_bytes() for f, g in zip(jpgs(first), jpgs(other)))


def test_synthetic_refuses_a_foreign_non_empty_folder(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        write_synthetic_facades(folder, n=2, seed=0, size=SMALL)
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging folder left behind


def test_synthetic_reuses_or_replaces_a_previous_set(tmp_path):
    folder = write_synthetic_facades(tmp_path / "set", n=3, seed=0, size=SMALL)
    stamps = [f.stat().st_mtime_ns for f in jpgs(folder)]
    write_synthetic_facades(folder, n=3, seed=0, size=SMALL)  # same arguments: kept as it is
    assert [f.stat().st_mtime_ns for f in jpgs(folder)] == stamps
    write_synthetic_facades(folder, n=2, seed=1, size=SMALL)  # other arguments: replaced
    assert len(jpgs(folder)) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(jpgs(write_synthetic_facades(empty, n=2, seed=0, size=SMALL))) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "set"]


def _write_small_set(folder: str) -> None:
    write_synthetic_facades(folder, n=8, seed=0, size=SMALL)


def test_synthetic_concurrent_writers_agree(tmp_path):
    """Every rank may call it at once: all return, one complete set remains, no staging folders."""
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=_write_small_set, args=(str(tmp_path / "set"),)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert [w.exitcode for w in workers] == [0, 0, 0]
    assert len(jpgs(tmp_path / "set")) == 8 and sorted(p.name for p in tmp_path.iterdir()) == ["set"]


def test_synthetic_failure_leaves_nothing(tmp_path, monkeypatch):
    real_write = synthetic._write_pair

    def failing(path, seed, index, size):
        if index == 2:
            raise OSError("disk full")
        real_write(path, seed, index, size)

    monkeypatch.setattr(synthetic, "_write_pair", failing)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic_facades(tmp_path / "set", n=4, seed=0, size=SMALL)
    assert list(tmp_path.iterdir()) == []


def test_synthetic_bad_arguments(tmp_path):
    with pytest.raises(ConfigError, match="size"):
        write_synthetic_facades(tmp_path / "x", n=2, seed=0, size=(101, 50))
    with pytest.raises(ConfigError, match="at least one"):
        write_synthetic_facades(tmp_path / "x", n=0, seed=0)


def test_synthetic_never_deletes_files_it_did_not_write(tmp_path):
    """Rerunning on an earlier set that someone added files to refuses (naming them) instead of replacing it."""
    folder = write_synthetic_facades(tmp_path / "set", n=3, seed=0, size=SMALL)
    (folder / "NOTES.txt").write_text("keep me")
    (folder / "mine.png").write_bytes(b"mine")
    (folder / "extra").mkdir()
    before = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    with pytest.raises(ConfigError, match=r"set holds an earlier synthetic set .*\(NOTES.txt, extra, mine.png\)"):
        write_synthetic_facades(folder, n=4, seed=0, size=SMALL)
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before and (folder / "extra").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["set"]  # no staging folder left behind
    write_synthetic_facades(folder, n=3, seed=0, size=SMALL)  # the same set: kept, and nothing is touched
    assert {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()} == before
    for name in ("NOTES.txt", "mine.png", "extra"):  # with only its own files left, it is replaced as before
        (folder / name).rmdir() if name == "extra" else (folder / name).unlink()
    write_synthetic_facades(folder, n=4, seed=0, size=SMALL)
    assert len(jpgs(folder)) == 4


def test_make_facades_keeps_the_user_s_files_and_exits_2(tmp_path):
    from click.testing import CliRunner

    from ganscale.cli import main

    folder = tmp_path / "set"
    assert CliRunner().invoke(main, ["make-facades", str(folder), "--n", "2", "--size", "128x64"]).exit_code == 0
    (folder / "NOTES.txt").write_text("keep me")
    result = CliRunner().invoke(main, ["make-facades", str(folder), "--n", "3", "--size", "128x64"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert "NOTES.txt" in result.output and str(folder) in result.output
    assert (folder / "NOTES.txt").read_text() == "keep me" and len(jpgs(folder)) == 2


def test_make_facades_gives_its_folder_the_umask_s_permissions(tmp_path):
    """The staging folder came from mkdtemp: the set was left 0700 whatever the umask."""
    from click.testing import CliRunner

    from ganscale.cli import main

    old = os.umask(0o022)
    try:
        result = CliRunner().invoke(main, ["make-facades", str(tmp_path / "set"), "--n", "1", "--size", "64x32"])
    finally:
        os.umask(old)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE((tmp_path / "set").stat().st_mode) == 0o755


def test_make_facades_refuses_more_pairs_than_the_disk_holds_naming_n(tmp_path, monkeypatch):
    """--n 100000000 wrote until the disk was full: now the first pair's size x n is checked against free space."""
    from click.testing import CliRunner

    from ganscale.cli import main

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=10_000))
    result = CliRunner().invoke(main, ["make-facades", str(tmp_path / "set"), "--n", "1000", "--size", "64x32"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "config error at '--n'" in result.output and "1,000 pairs" in result.output, result.output
    assert list(tmp_path.iterdir()) == []  # the staging folder removed


def test_a_sigterm_while_make_facades_writes_removes_its_staging_folder(tmp_path, monkeypatch, default_sigterm):
    from click.testing import CliRunner

    from ganscale.cli import main

    real_pair = synthetic._write_pair

    def pair_then_sigterm(path, seed, index, size):
        real_pair(path, seed, index, size)
        if index == 1:
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:  # uninstalled, the signal would end pytest
                pytest.fail("SIGTERM is not handled while make-facades writes")
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(synthetic, "_write_pair", pair_then_sigterm)
    result = CliRunner().invoke(main, ["make-facades", str(tmp_path / "set"), "--n", "5", "--size", "64x32"])
    assert result.exit_code == 128 + signal.SIGTERM, result.output
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


@pytest.mark.parametrize("size, why", [("64x64", "twice as wide as high"), ("99999x99999", "width 99999 is odd"),
                                       ("99998x49999", "too large"), ("16x8", "too small"), ("128x", "WIDTHxHEIGHT")])
def test_make_facades_refuses_a_size_the_trainer_would_not_take(tmp_path, size, why):
    from click.testing import CliRunner

    from ganscale.cli import main

    result = CliRunner().invoke(main, ["make-facades", str(tmp_path / "set"), "--n", "1", "--size", size])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and "'--size'" in result.output and why in result.output
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


@pytest.mark.parametrize("size", [(32, 16), (34, 16), (128, 64), (140, 64)])
def test_every_size_synthetic_accepts_is_a_set_the_paired_loader_reads(tmp_path, size):
    folder = write_synthetic_facades(tmp_path / "set", n=1, seed=0, size=size)
    a, b = PairedImages(folder, load_size=32, crop_size=32)[0]
    assert a.shape == b.shape == (3, 32, 32)


# ------------------------------------------------------------------------------- paired data set
def test_paired_reads_synthetic_in_both_directions(facades):
    a_to_b = PairedImages(facades, direction="AtoB", seed=3)
    b_to_a = PairedImages(facades, direction="BtoA", seed=3)
    assert len(a_to_b) == 6
    source, target = a_to_b[(4, 123)]
    assert source.shape == target.shape == (3, 256, 256) and source.dtype == torch.float32
    assert source.min() >= -1 and source.max() <= 1 and source.std() > 0.1
    flipped_source, flipped_target = b_to_a[(4, 123)]
    assert torch.equal(flipped_source, target) and torch.equal(flipped_target, source)
    grey = PairedImages(facades, load_size=72, crop_size=64, channels=1)[0]
    assert grey[0].shape == grey[1].shape == (1, 64, 64)


def test_same_crop_and_flip_for_both_halves(tmp_path):
    rng = np.random.default_rng(0)
    picture = rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)
    write_pair_png(tmp_path / "same.png", picture, picture)
    data = PairedImages(tmp_path, load_size=56, crop_size=40)
    outputs = [data[(0, position)] for position in range(24)]
    assert all(torch.equal(source, target) for source, target in outputs)
    assert len({s.numpy().tobytes() for s, _ in outputs}) > 12  # crops and flips vary with the position


def test_flip_mirrors_and_crop_window(tmp_path):
    """A horizontal ramp: flipped draws run right to left; unflipped ones keep the order."""
    ramp = np.broadcast_to(np.linspace(0, 255, 40).astype(np.uint8)[None, :, None], (40, 40, 3)).copy()
    write_pair_png(tmp_path / "ramp.png", ramp, ramp)
    data = PairedImages(tmp_path, load_size=40, crop_size=32)
    directions = [np.sign((s[0, :, -1] - s[0, :, 0]).mean().item()) for s, _ in (data[(0, p)] for p in range(40))]
    assert 10 < directions.count(-1.0) < 30 and directions.count(-1.0) + directions.count(1.0) == 40


def test_augmentation_comes_from_the_key_not_global_rng(facades):
    first = PairedImages(facades, seed=5)
    expected = [first[(i, 1000 + i)] for i in range(3)]
    torch.manual_seed(123)
    np.random.seed(123)
    random.seed(123)
    second = PairedImages(facades, seed=5)
    for i, (s, t) in enumerate(expected):
        again = second[(i, 1000 + i)]
        assert torch.equal(again[0], s) and torch.equal(again[1], t)
    assert torch.equal(first[2][0], first[(2, 0)][0])  # a plain index is position 0
    assert not torch.equal(PairedImages(facades, seed=6)[(0, 1000)][0], expected[0][0])


def test_no_augmentation_resizes_to_crop_size(facades):
    data = PairedImages(facades, crop_size=128, augment=False)
    source, target = data[(1, 5)]
    assert source.shape == (3, 128, 128)
    assert torch.equal(source, data[(1, 99)][0])
    with Image.open(jpgs(facades)[1]) as image:
        left = image.convert("RGB").crop((0, 0, 256, 256)).resize((128, 128), Image.Resampling.BICUBIC)
    assert torch.equal(source, torch.from_numpy(np.asarray(left, np.float32)).permute(2, 0, 1) / 127.5 - 1)


def test_samples_do_not_depend_on_world_size(facades):
    """Keys (index, stream position) computed as the module docstring says: 1 x 4 and 2 x 2 see the same samples."""
    data = PairedImages(facades, load_size=72, crop_size=64)

    def global_batch(world: int, batch: int) -> list[torch.Tensor]:
        samples = []
        for rank in range(world):
            slicing = Slicing(rank, world, 4 // world, 1)
            sampler = _RankSampler(len(data), slicing, seed=0, start=0)
            first = batch * slicing.global_batch + slicing.offset(0)
            keys = zip(sampler.indices(batch, 0), range(first, first + slicing.micro_batch))
            samples += [data[key][0] for key in keys]
        return samples

    for batch in range(3):  # crosses an epoch boundary (6 samples, 4 per batch)
        assert all(torch.equal(a, b) for a, b in zip(global_batch(1, batch), global_batch(2, batch)))


def test_dataloader_workers_and_pin_memory(facades):
    data = PairedImages(facades, load_size=72, crop_size=64, direction="BtoA")
    batches = [[(0, 10), (3, 11)], [(5, 12), (0, 13)]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pin_memory without an accelerator only warns
        loader = DataLoader(data, batch_sampler=batches, num_workers=2, pin_memory=True)
        loaded = list(loader)
    for keys, (sources, targets) in zip(batches, loaded):
        assert sources.shape == targets.shape == (2, 3, 64, 64)
        for row, key in enumerate(keys):
            source, target = data[key]
            assert torch.equal(sources[row], source) and torch.equal(targets[row], target)
    copy = pickle.loads(pickle.dumps(data))  # what spawn-started workers receive
    assert torch.equal(copy[(5, 12)][0], data[(5, 12)][0])


# ------------------------------------------------------------------------------- errors
def test_missing_and_empty_folders_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        PairedImages(tmp_path / "absent")
    with pytest.raises(ConfigError, match="no images"):
        PairedImages(tmp_path)
    (tmp_path / "train").mkdir()
    with pytest.raises(ConfigError, match="sub-folders train"):
        PairedImages(tmp_path)


def test_a_single_image_is_named(tmp_path):
    pixels = np.zeros((32, 32, 3), np.uint8)
    write_pair_png(tmp_path / "good.png", pixels, pixels)
    Image.fromarray(pixels).save(tmp_path / "square.png")
    with pytest.raises(ConfigError, match=r"square\.png is 32x32"):
        PairedImages(tmp_path)


def test_unreadable_image_is_named(tmp_path):
    (tmp_path / "broken.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ConfigError, match=r"broken\.jpg"):
        PairedImages(tmp_path)


def test_a_decompression_bomb_is_named(tmp_path):
    from image_helpers import write_decompression_bomb_png

    write_decompression_bomb_png(tmp_path / "bomb.png")
    with pytest.raises(ConfigError, match=r"bomb\.png.*exceeds limit"):
        PairedImages(tmp_path)


def test_bad_options_are_config_errors(facades):
    with pytest.raises(ConfigError, match="data.crop_size"):
        PairedImages(facades, load_size=256, crop_size=286)
    with pytest.raises(ConfigError, match="data.direction"):
        PairedImages(facades, direction="AB")


@pytest.mark.parametrize("seed", range(6))
def test_synthetic_smallest_size_paints_every_pair(tmp_path, seed):
    """Balcony rails near the edge of a narrow canvas are clipped to it, not dropped or crashed on."""
    folder = write_synthetic_facades(tmp_path / "small", n=4, seed=seed, size=(32, 16))
    assert len(list(folder.glob("*.jpg"))) == 4
