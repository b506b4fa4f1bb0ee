"""Sizes a machine cannot hold are refused before anything starts or is written (ganscale/memory.py).

The refused sizes are the issue's options at values no test machine holds (a hundred times its d_width and
batch_size): refused whatever the machine's memory, and never started.
"""

from __future__ import annotations

import pytest
import torch

from dist_helpers import run_ranks
from test_cli import explain, ganscale, ganscale_ranks

from ganscale import config, memory
from ganscale.models import build_networks

BEYOND_ANY_MACHINE = [("model.z_dim=100000000", "model.z_dim"), ("model.d_width=100000000", "model.d_width"),
                      ("train.batch_size=100000000", "train.batch_size"), ("log.samples=100000000", "log.samples")]


# Recipes written for a GPU, and the memory of the smallest GPU they are for (an 80 GB H100).
GPU_RECIPES = {"stylegan2-256": 79 * memory.GiB}


def refused_in_one_line(result, key: str) -> None:
    assert result.returncode == 2, explain(result)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"'{key}'" in lines[0] and "GiB" in lines[0], explain(result)
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("override, key", BEYOND_ANY_MACHINE)
def test_a_size_no_machine_holds_is_one_config_error_and_no_run_directory(tmp_path, override, key):
    result = ganscale("train", "--set", override, cwd=tmp_path)
    refused_in_one_line(result, key)
    assert list(tmp_path.iterdir()) == []  # no runs/, no config, no metrics


def test_the_nproc_parent_refuses_before_any_worker_starts(tmp_path):
    result = ganscale("train", "--set", "train.batch_size=100000000", "--nproc", "2", "--run-dir", "RUN", cwd=tmp_path)
    refused_in_one_line(result, "train.batch_size")
    assert "worker" not in result.stderr and list(tmp_path.iterdir()) == []


def test_torchrun_workers_refuse_together_before_deciding_the_run(tmp_path):
    results = ganscale_ranks([["--set", "model.z_dim=100000000", "--run-dir", "RUN"]] * 2, cwd=tmp_path)
    for result in results:
        refused_in_one_line(result, "model.z_dim")
    assert list(tmp_path.iterdir()) == []


def test_sample_refuses_more_samples_than_the_machine_holds_and_writes_nothing(tmp_path):
    trained = ganscale("train", "--set", "train.steps=2", "--set", "train.batch_size=6", "--set", "log.sample_every=0",
                       "--run-dir", "RUN", cwd=tmp_path)
    assert trained.returncode == 0, explain(trained)
    before = {p: p.read_bytes() for p in (tmp_path / "RUN").rglob("*") if p.is_file()}
    result = ganscale("sample", "RUN", "--n", "10000000000", "--out", "grid.png", cwd=tmp_path)
    refused_in_one_line(result, "--n")
    assert "--n " in result.stderr.split("Fix:")[1]  # how many would fit
    assert not (tmp_path / "grid.png").exists()
    assert {p: p.read_bytes() for p in (tmp_path / "RUN").rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("recipe", config.recipe_names())
@pytest.mark.parametrize("world", [1, 2])
def test_shipped_recipes_fit_this_machine(recipe, world):
    """Every model kind builds and runs on the meta device, and no shipped recipe is refused (a GPU recipe: on
    the GPU it is written for)."""
    cfg = config.load(recipe)
    if cfg.train.batch_size % world:
        pytest.skip(f"{recipe}'s batch does not split over {world} ranks (preflight.check refuses it)")
    estimate = memory.training_estimate(cfg, world, local_ranks=world)
    assert estimate.state > 0 and estimate.activations > 0
    room = GPU_RECIPES.get(recipe, memory.host_available() // world)
    memory.check_training(cfg, world, room, "available", local_ranks=world)


def test_the_estimate_counts_the_real_networks_parameters_gradients_adam_and_ema():
    cfg = config.load("digits", ["model.g_width=8", "model.d_width=8"])
    generator, discriminator = build_networks(cfg)  # real tensors, on the CPU

    def size(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    g, d = size(generator.parameters()), size(discriminator.parameters())
    g_buffers, d_buffers = size(generator.buffers()), size(discriminator.buffers())
    # G: itself, G_ema, a gradient and Adam's two moments per parameter; D: all but the EMA copy.
    expected = 2 * (g + g_buffers) + 3 * g + (d + d_buffers) + 3 * d
    assert memory.training_estimate(cfg, 1).state == expected
    sharded = config.load("digits", ["model.g_width=8", "model.d_width=8", "parallel.generator=fsdp",
                                     "parallel.discriminator=zero1"])
    assert memory.training_estimate(sharded, 4).state == (2 * (g + g_buffers) + 3 * g) // 4 + d + d_buffers + d + \
        2 * d // 4


def test_parameters_the_user_froze_get_no_gradient_or_adam_state_in_the_estimate(monkeypatch):
    """A network with a frozen part (a pretrained feature extractor in D, say): the optimizer and the gradients
    leave it out (Wrapped.trained_names), and so does the estimate; the weights themselves still count."""
    cfg = config.load("digits", ["model.g_width=8", "model.d_width=8"])
    whole = memory.training_estimate(cfg, 1).state
    built = memory.meta_networks

    def with_frozen_d(config_):
        generator, discriminator = built(config_)
        for p in discriminator.parameters():
            p.requires_grad_(False)
        return generator, discriminator

    monkeypatch.setattr(memory, "meta_networks", with_frozen_d)
    d = sum(p.numel() * p.element_size() for p in built(cfg)[1].parameters())
    assert memory.training_estimate(cfg, 1).state == whole - 3 * d  # D's gradient and Adam's two moments


def test_activations_grow_with_the_micro_batch_and_count_spectrally_normalised_layers():
    small = memory.training_estimate(config.load("digits", ["train.batch_size=64"]), 1)
    large = memory.training_estimate(config.load("digits", ["train.batch_size=128"]), 1)
    assert large.activations > 1.9 * small.activations and large.state == small.state
    accumulated = memory.training_estimate(config.load("digits", ["train.batch_size=128", "train.micro_batch=64"]), 1)
    assert accumulated.activations == small.activations
    spectral = memory.training_estimate(config.load("digits", ["model.d_spectral_norm=true"]), 1)
    assert spectral.activations >= small.activations  # a parametrized conv's output is counted too


def test_double_backward_phases_count_the_graph_they_keep(monkeypatch):
    """R1 (folded or its own phase) and path length regularisation differentiate twice: the first backward's
    graph is kept as well, and a StyleGAN2 at the size of a real run must not be estimated below its need."""
    plain = ["loss.r1_gamma=0", "loss.pl_weight=0", "train.batch_size=64", "log.samples=4"]

    def activations(*extra: str) -> int:
        return memory.training_estimate(config.load("digits-stylegan2", plain + list(extra)), 1).activations

    assert activations("loss.r1_gamma=1") > 1.2 * activations(), "R1's double backward through D"
    # Path length's double backward is through G: seen where D is too small to be the heavier step.
    real_networks = memory.meta_networks
    monkeypatch.setattr(memory, "meta_networks", lambda cfg: (real_networks(cfg)[0], torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(16 * 16, 1, device="meta"))))
    assert activations("loss.pl_weight=2", "loss.pl_batch_shrink=1") > 1.2 * activations()


def _refusal_of_each_rank(rank: int, world: int, run_dir: str) -> str | None:
    """run_worker with rank 1 seeing (almost) no memory: the refusal, or None if this rank trained."""
    from ganscale import launch

    if rank == 1:
        memory.available = lambda device, local_ranks: 1
    cfg = config.load("digits", ["train.steps=1", "train.batch_size=4", "log.sample_every=0"])
    try:
        launch.run_worker(cfg, run_dir, None)
    except config.ConfigError as e:
        return str(e)
    return None


def test_every_rank_refuses_together_when_one_rank_lacks_the_memory(tmp_path):
    refusals = run_ranks(_refusal_of_each_rank, 2, str(tmp_path / "RUN"))
    assert refusals[0] is not None and refusals[0] == refusals[1]
    assert refusals[0].startswith("config error at 'train.batch_size'")  # no size key above its default: the batch
    assert not (tmp_path / "RUN").exists()


def test_the_refusal_names_the_key_that_drives_the_size():
    def key_of(*overrides: str) -> str:
        with pytest.raises(config.ConfigError) as refused:
            memory.check_training(config.load("digits", list(overrides)), 1, 2**30, "available")
        return refused.value.key

    assert key_of("model.z_dim=100000000") == "model.z_dim"
    assert key_of("model.d_width=100000000") == "model.d_width"
    assert key_of("train.batch_size=100000000") == "train.batch_size"
    assert key_of("train.batch_size=100000000", "train.micro_batch=50000000") == "train.micro_batch"


def _held_after_one_step(rank: int, world: int, overrides: list[str], run_dir: str) -> int:
    """Bytes this rank holds after a step: G's and D's parameters, gradients and Adam state, and G_ema."""
    from ganscale.parallel import local
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    cfg = config.load("digits", overrides)
    trainer = Trainer(cfg, start("cpu"), run_dir)
    trainer.fit()
    ema = sum(local(p).numel() * p.element_size() for p in trainer.G_ema.parameters())
    return ema + sum(sum(held.values()) for held in trainer.memory[rank].values())


def test_the_estimated_state_is_what_the_ranks_hold_under_sharding(tmp_path):
    overrides = ["train.steps=1", "train.batch_size=4", "log.sample_every=0", "log.tensorboard=false",
                 "parallel.generator=fsdp", "parallel.discriminator=zero1"]
    held = run_ranks(_held_after_one_step, 2, overrides, str(tmp_path / "RUN"))
    estimated = memory.training_estimate(config.load("digits", overrides), 2, local_ranks=2).state
    # Adam's step counters and G's BatchNorm buffers (counted in the estimate, not in `held`) are under 1%.
    assert sum(held) == pytest.approx(2 * estimated, rel=0.01)


@pytest.mark.parametrize("shape, columns", [((10, 1, 8, 8), None), ((12, 3, 64, 64), 3)])
def test_the_grid_estimate_covers_the_picture_image_grid_makes(shape, columns):
    from ganscale.observe.samples import grid_bytes, image_grid

    picture = image_grid(torch.zeros(shape), cols=columns)
    assert picture.nbytes <= grid_bytes(torch.Size(shape), columns) <= 4 * picture.nbytes
