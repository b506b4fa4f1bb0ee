"""Data sources, the world-size-independent batch stream and the sample pictures."""

from __future__ import annotations

import math
import time
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import Dataset, TensorDataset

from ganscale.config import ConfigError
from ganscale.data import ImageFolder
from ganscale.data.images import digits
from ganscale.data.mixtures import grid25, grid25_modes, ring8, ring8_modes
from ganscale.data.stream import GlobalBatches, Slicing, _RankSampler
from ganscale.observe.samples import image_grid, scatter

CPU = torch.device("cpu")
SIZE = 10


def index_dataset(n: int = SIZE) -> TensorDataset:
    """Sample i is the value i, so a batch shows which indices it holds."""
    return TensorDataset(torch.arange(n))


class IndexDataset(Dataset):
    """The same, but not a TensorDataset: goes through the DataLoader path of GlobalBatches."""

    def __init__(self, n: int = SIZE):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return (torch.tensor(i),)


def take(stream: GlobalBatches, n: int) -> list[list[torch.Tensor]]:
    """n global batches, each micro-batch's only field (these data sets hold one tensor per sample)."""
    return [[fields[0] for fields in next(stream)] for _ in range(n)]


def two_rank_streams(dataset: Dataset, seed: int, start: int = 0) -> list[GlobalBatches]:
    return [GlobalBatches(dataset, Slicing(rank, 2, 3, 2), seed, CPU, start=start) for rank in range(2)]


# --------------------------------------------------------------------------------------- slicing
def test_slicing_offsets_cover_the_global_batch_exactly_once():
    world, micro, accumulation = 3, 4, 2
    covered = []
    for rank in range(world):
        s = Slicing(rank, world, micro, accumulation)
        assert s.global_batch == world * micro * accumulation
        for m in range(accumulation):
            covered += list(range(s.offset(m), s.offset(m) + micro))
            taken = s.take(torch.arange(s.global_batch), m)
            assert taken.tolist() == list(range(s.offset(m), s.offset(m) + micro))
    assert sorted(covered) == list(range(world * micro * accumulation))


# ---------------------------------------------------------------------------------------- stream
@pytest.mark.parametrize("seed", [0, 3])
def test_every_rank_gets_equal_micro_batches_forever(seed):
    batches = 20  # 240 samples from a data set of 10: many epochs, none ends unevenly
    for stream in two_rank_streams(index_dataset(), seed):
        for item in take(stream, batches):
            assert len(item) == 2  # accumulation steps
            assert all(micro.shape == (3,) for micro in item)
        assert stream.position == batches


@pytest.mark.parametrize("seed", [0, 3])
def test_union_over_ranks_equals_one_rank_stream(seed):
    batches = 20
    ranks = [take(s, batches) for s in two_rank_streams(index_dataset(), seed)]
    single = take(GlobalBatches(index_dataset(), Slicing(0, 1, 12, 1), seed, CPU), batches)
    for i in range(batches):
        union = Counter(int(v) for rank in ranks for micro in rank[i] for v in micro)
        (one,) = single[i]
        assert len(one) == 12
        assert union == Counter(one.tolist()), f"global batch {i} differs"


def test_data_loader_path_gives_the_same_stream_as_in_memory_path():
    # a non-TensorDataset (e.g. ImageFolder) goes through a DataLoader with a batch sampler
    for rank in range(2):
        s = Slicing(rank, 2, 3, 2)
        fast = take(GlobalBatches(index_dataset(), s, 1, CPU), 7)
        loader = take(GlobalBatches(IndexDataset(), s, 1, CPU), 7)
        assert [[m.tolist() for m in b] for b in fast] == [[m.tolist() for m in b] for b in loader]



@pytest.mark.parametrize("workers", [0, 1])
def test_the_data_stream_leaves_the_global_rng_alone(workers):
    """A network's own randomness draws from the global stream (and `ganscale verify` watches it): the DataLoader
    seeds its workers from a generator of its own."""
    before = torch.get_rng_state()
    stream = GlobalBatches(IndexDataset(), Slicing(0, 1, 4, 1), 0, CPU, workers=workers)
    next(stream)
    stream.close()
    assert torch.equal(torch.get_rng_state(), before)

class StuckAfterOneBatch(IndexDataset):
    """A worker that hangs in its second batch (a stalled network file system, say)."""

    calls = 0  # per worker process

    def __getitem__(self, i: int):
        StuckAfterOneBatch.calls += 1
        if StuckAfterOneBatch.calls > 4:
            time.sleep(600)
        return (torch.tensor(i),)


def test_close_stops_the_loader_workers_even_when_the_iterator_is_held_and_a_worker_hangs():
    """The workers ignore SIGTERM, so one left alive keeps the interpreter's exit waiting forever: close() shuts
    them down itself (something else may hold the loader's iterator: with pinned memory on CUDA something did)
    and kills one that does not stop."""
    stream = GlobalBatches(StuckAfterOneBatch(), Slicing(0, 1, 4, 1), 0, CPU, workers=1)
    next(stream)
    held = stream._loader_batches  # noqa: F841 (what kept the iterator and its workers alive)
    workers = list(held._workers)
    stream.close()
    assert workers and not any(w.is_alive() for w in workers)


def test_each_epoch_is_a_permutation():
    sampler = _RankSampler(SIZE, Slicing(0, 1, 12, 1), seed=0, start=0)
    first_epoch = sampler.indices(0, 0)[:SIZE]
    assert sorted(first_epoch) == list(range(SIZE))
    # the next epochs too: positions [10, 20) and [20, 30) of the stream
    stream = sampler.indices(0, 0) + sampler.indices(1, 0) + sampler.indices(2, 0)
    for epoch in range(3):
        assert sorted(stream[epoch * SIZE:(epoch + 1) * SIZE]) == list(range(SIZE))
    # shuffled, and not the same order every epoch
    assert stream[:SIZE] != list(range(SIZE))
    assert stream[:SIZE] != stream[SIZE:2 * SIZE] or stream[SIZE:2 * SIZE] != stream[2 * SIZE:3 * SIZE]


def test_stream_depends_on_seed():
    a = [b[0].tolist() for b in take(GlobalBatches(index_dataset(), Slicing(0, 1, 12, 1), 0, CPU), 3)]
    b = [b[0].tolist() for b in take(GlobalBatches(index_dataset(), Slicing(0, 1, 12, 1), 1, CPU), 3)]
    assert a != b


def test_ranks_get_disjoint_positions_within_a_global_batch():
    # 2 ranks x 3 x 2 accumulation = 12 > 10 samples, so use a data set big enough for one epoch
    ds = index_dataset(48)
    streams = [GlobalBatches(ds, Slicing(rank, 2, 3, 2), 0, CPU) for rank in range(2)]
    for _ in range(4):
        values = [int(v) for s in streams for (micro,) in next(s) for v in micro]
        assert len(values) == len(set(values)) == 12


@pytest.mark.parametrize("start", [1, 5, 13])
def test_start_resumes_the_same_stream(start):
    for rank in range(2):
        s = Slicing(rank, 2, 3, 2)
        from_zero = GlobalBatches(index_dataset(), s, 2, CPU)
        take(from_zero, start)
        resumed = GlobalBatches(index_dataset(), s, 2, CPU, start=start)
        assert resumed.position == from_zero.position == start
        expected = [[m.tolist() for m in b] for b in take(from_zero, 6)]
        got = [[m.tolist() for m in b] for b in take(resumed, 6)]
        assert got == expected


# ---------------------------------------------------------------------------------- image folder
def write_images(root) -> None:
    (root / "sub").mkdir(parents=True)
    Image.new("RGB", (20, 12), (255, 255, 255)).save(root / "white.png")
    Image.new("L", (7, 15), 0).save(root / "black.png")
    gradient = np.tile(np.linspace(0, 255, 30, dtype=np.uint8), (30, 1))
    Image.fromarray(np.stack([gradient, gradient.T, 255 - gradient], -1)).save(root / "sub" / "gradient.png")
    Image.new("RGBA", (9, 9), (255, 0, 0, 128)).save(root / "sub" / "alpha.png")
    (root / "notes.txt").write_text("not an image")


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_image_folder_shapes_and_range(tmp_path, channels):
    write_images(tmp_path)
    ds = ImageFolder(tmp_path, resolution=8, channels=channels)
    assert len(ds) == 4  # recursive, non-images ignored
    names = [p.name for p in ds.files]
    assert "gradient.png" in names and "notes.txt" not in names
    for i in range(len(ds)):
        (x,) = ds[i]
        assert x.shape == (channels, 8, 8)
        assert x.dtype == torch.float32
        assert x.min() >= -1 and x.max() <= 1
    by_name = {p.name: ds[i][0] for i, p in enumerate(ds.files)}
    colour = 1 if channels <= 2 else 3  # grey or RGB, then alpha for 2 and 4 channels
    ones = torch.ones(colour, 8, 8)
    assert torch.allclose(by_name["white.png"][:colour], ones, atol=1e-3)
    assert torch.allclose(by_name["black.png"][:colour], -ones, atol=1e-3)
    assert by_name["gradient.png"][:colour].std() > 0.1  # content survives the resize
    if channels in (2, 4):
        assert torch.allclose(by_name["black.png"][colour:], torch.ones(1, 8, 8))  # opaque
        assert torch.allclose(by_name["alpha.png"][colour:], torch.full((1, 8, 8), 128 / 127.5 - 1), atol=1e-3)


def test_image_folder_rgb_channel_order(tmp_path):
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "red.png")
    (x,) = ImageFolder(tmp_path, resolution=8, channels=3)[0]
    assert torch.allclose(x[0], torch.ones(8, 8)) and torch.allclose(x[1:], -torch.ones(2, 8, 8))


def test_image_folder_streams_through_global_batches(tmp_path):
    write_images(tmp_path)
    ds = ImageFolder(tmp_path, resolution=8, channels=3)
    stream = GlobalBatches(ds, Slicing(0, 2, 2, 1), 0, CPU)
    ((micro,),) = next(stream)
    assert micro.shape == (2, 3, 8, 8)


def test_empty_image_folder_is_a_config_error(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "readme.txt").write_text("no images here")
    with pytest.raises(ConfigError) as info:
        ImageFolder(tmp_path, resolution=8)
    assert info.value.key == "data.path"


def test_a_folder_named_like_an_image_is_searched_not_read(tmp_path):
    (tmp_path / "holiday.jpg").mkdir()  # was listed as an image: "[Errno 21] Is a directory" once training read it
    Image.new("RGB", (8, 8)).save(tmp_path / "holiday.jpg" / "beach.png")
    ds = ImageFolder(tmp_path, resolution=8)
    assert ds.files == [tmp_path / "holiday.jpg" / "beach.png"]
    assert ds[0][0].shape == (3, 8, 8)
    (tmp_path / "holiday.jpg" / "beach.png").unlink()
    with pytest.raises(ConfigError) as info:  # only folders: no images, refused before training
        ImageFolder(tmp_path, resolution=8)
    assert info.value.key == "data.path"


# ---------------------------------------------------------------------------------------- digits
def test_digits():
    ds = digits()
    assert len(ds) == 1797
    x = ds.tensors[0]
    assert x.shape == (1797, 1, 8, 8)
    assert x.min() == -1 and x.max() == 1
    assert ds[0][0].shape == (1, 8, 8)


def test_digits_resized_and_rgb():
    x = digits(16).tensors[0]
    assert x.shape == (1797, 1, 16, 16)
    assert x.min() >= -1 and x.max() <= 1
    rgb = digits(8, 3).tensors[0]
    assert rgb.shape == (1797, 3, 8, 8)
    assert torch.equal(rgb[:, 0], rgb[:, 2])


# -------------------------------------------------------------------------------------- mixtures
def test_ring8_modes_on_unit_circle_at_equal_angles():
    modes = ring8_modes().double()
    assert modes.shape == (8, 2)
    assert torch.allclose(modes.norm(dim=1), torch.ones(8, dtype=torch.float64), atol=1e-6)
    angles = torch.atan2(modes[:, 1], modes[:, 0]) % (2 * math.pi)
    expected = torch.arange(8, dtype=torch.float64) * 2 * math.pi / 8
    assert torch.allclose(angles, expected, atol=1e-6)
    distances = torch.cdist(modes, modes) + torch.eye(8, dtype=torch.float64) * 10
    assert distances.min() > 0.7  # 8 distinct modes (neighbours are 2 sin(pi/8) ~ 0.77 apart)


def test_grid25_modes():
    modes = grid25_modes()
    assert modes.shape == (25, 2)
    got = {tuple(p) for p in modes.tolist()}
    axis = [-4.0, -2.0, 0.0, 2.0, 4.0]
    assert got == {(a, b) for a in axis for b in axis}


@pytest.mark.parametrize("make, modes, std", [(ring8, ring8_modes, 0.01), (grid25, grid25_modes, 0.05)])
def test_mixture_samples_sit_near_their_modes(make, modes, std):
    x = make(2000, seed=0).tensors[0]
    assert x.shape == (2000, 2)
    distance, nearest = torch.cdist(x, modes()).min(dim=1)
    assert distance.max() < 5 * std
    assert set(nearest.tolist()) == set(range(len(modes())))  # every mode gets samples
    assert torch.equal(x, make(2000, seed=0).tensors[0])  # seeded
    assert not torch.equal(x, make(2000, seed=1).tensors[0])


# --------------------------------------------------------------------------------------- pictures
@pytest.mark.parametrize("channels", [1, 2, 3, 4])
def test_image_grid(channels):
    images = torch.ones(5, channels, 8, 8)
    images[1] = -1.0
    grid = image_grid(images)
    assert isinstance(grid, np.ndarray)
    assert grid.dtype == np.uint8
    assert grid.ndim == 3 and grid.shape[2] == 3
    assert grid.shape[0] >= 32 and grid.shape[1] >= 32  # cells upscaled to min_cell
    assert grid[0, 0].tolist() == [0, 0, 0]  # border
    # 4 white cells and 1 black one: white pixels are 4 cells' worth
    white = (grid == 255).all(-1).sum()
    assert white > 0 and white % 4 == 0
    cell_pixels = white // 4
    assert cell_pixels >= 32 * 32
    assert grid.max() == 255 and grid.min() == 0


def test_a_grid_of_fewer_images_than_its_columns_has_no_blank_cells():
    grid = image_grid(torch.ones(4, 1, 8, 8), cols=8)  # `sample --n 4` of a class-conditional G (8 classes a row)
    assert grid.shape[:2] == image_grid(torch.ones(4, 1, 8, 8), cols=4).shape[:2]
    assert (grid == 255).all(-1).sum() == 4 * 32 * 32


def test_image_grid_two_channels_shows_grey_not_alpha():
    images = torch.stack([-torch.ones(4, 4), torch.ones(4, 4)])[None]  # black, opaque
    grid = image_grid(images)
    assert grid.shape[2] == 3 and grid.max() == 0


def test_image_grid_mid_grey_maps_to_middle():
    grid = image_grid(torch.zeros(1, 1, 4, 4))
    assert set(np.unique(grid).tolist()) <= {0, 128}
    assert (grid == 128).any()


def test_scatter():
    points = ring8(500, seed=0).tensors[0]
    picture = scatter(points, ring8_modes(), size=128)
    assert isinstance(picture, np.ndarray)
    assert picture.shape == (128, 128, 3) and picture.dtype == np.uint8
    colours = {tuple(c) for c in picture.reshape(-1, 3).tolist()}
    assert (255, 255, 255) in colours  # background
    assert (30, 60, 160) in colours  # points
    assert (200, 30, 30) in colours  # mode markers
    Image.fromarray(picture)  # writable as a PNG
    lone = scatter(torch.zeros(1, 2), size=64)  # no reference, a single point at the origin
    assert lone.shape == (64, 64, 3)
    assert tuple(lone[32, 32]) == (30, 60, 160)


def test_an_undecodable_image_read_by_a_loader_worker_keeps_its_type_and_message(tmp_path):
    """Raised again in the main process, it is still UnreadableImage, and problem() is the worker's own message."""
    from torch.utils.data import DataLoader

    from ganscale.data.folder import UnreadableImage

    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "b.png").write_text("not an image")
    loader = DataLoader(ImageFolder(tmp_path, resolution=8), batch_size=2, num_workers=1)
    with pytest.raises(UnreadableImage) as raised:
        next(iter(loader))
    assert "Traceback" in str(raised.value)  # the worker's traceback is its text
    assert raised.value.problem().startswith(f"cannot read image {tmp_path / 'b.png'}: ")
    assert "\n" not in raised.value.problem()


# --- data.max_images: a fixed subset for small-data experiments ----------------------------------------------------

SUBSET_RUN = {"data.max_images": 50, "model.g_width": 8, "model.d_width": 8, "train.batch_size": 8, "train.steps": 2,
              "log.sample_every": 0, "log.tensorboard": "false", "checkpoint.every": 0}


def _subset_on_rank(rank: int, world: int, run_dir: str) -> torch.Tensor:
    from pathlib import Path

    from ganscale import config, preflight
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    cfg = config.load(None, [f"{k}={v}" for k, v in SUBSET_RUN.items()])
    preflight.check(cfg, world, False)
    trainer = Trainer(cfg, start("cpu"), Path(run_dir))
    trainer.fit()
    return trainer.dataset.tensors[0]


@pytest.mark.slow
def test_max_images_trains_every_rank_on_the_same_seeded_subset_and_eval_scores_against_all(tmp_path):
    from ganscale import config
    from ganscale.data import build_dataset
    from ganscale.evaluate import evaluate
    from dist_helpers import run_ranks

    chosen = run_ranks(_subset_on_rank, 2, str(tmp_path / "run"))
    assert chosen[0].shape == (50, 1, 8, 8) and torch.equal(chosen[0], chosen[1])
    other_seed = build_dataset(config.load(None, ["data.max_images=50", "train.seed=7"])).tensors[0]
    assert torch.equal(other_seed, chosen[0])  # not train.seed's: a resume or another seed trains on the same set
    everything = digits().tensors[0]
    rows = [int((everything == image).flatten(1).all(1).nonzero()[0]) for image in chosen[0]]
    assert rows == sorted(rows) and rows[-1] > 100  # items of the source, in order, drawn from all of it
    assert evaluate(tmp_path / "run", samples=20)["reference_samples"] == len(everything)  # ADA's protocol


def test_max_images_above_the_data_set_exits_2_before_anything_is_written(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from ganscale.cli import main

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["train", "--set", "data.max_images=1798", "--run-dir", "run"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
    assert "'data.max_images'" in lines[0] and "1798 is more than the 1797 items" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == []
