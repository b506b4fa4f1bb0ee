"""Derived seeds: the vectorised derivation is numpy's SeedSequence, number for number.

Every recorded run (quality tables, resumed runs, 1-vs-N equality) depends on the trainer's noise
stream; the block derivation must not change it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ganscale.seeds import StepSeeds, derive_seed, derive_seeds

# Integers of one, two and four entropy words, zero, and the largest one-word value.
SHAPES = [0, 1, 7, 2**20, 2**32 - 1, 2**32, 2**64 - 1, 2**100 + 12345]


def test_derive_seed_is_numpys_seed_sequence():
    parts = [3, 1234, 1]
    expected = np.random.SeedSequence(parts).generate_state(1, np.uint64)[0] >> 1
    assert derive_seed(*parts) == int(expected)
    assert 0 <= derive_seed(*parts) < 2**63


def test_block_derivation_equals_seed_sequence_for_every_element():
    rng = random.Random(0)
    for _ in range(150):  # 1 to 6 parts (below and beyond SeedSequence's 4-word pool), one of them an array
        parts = [rng.choice(SHAPES + [rng.randrange(2**32), rng.randrange(2**70)]) for _ in range(rng.randint(1, 6))]
        column = rng.randrange(len(parts))
        values = np.array([0, 2**32 - 1] + [rng.randrange(2**32) for _ in range(6)], dtype=np.uint64)
        got = derive_seeds(*parts[:column], values, *parts[column + 1:])
        for value, seed in zip(values, got):
            assert int(seed) == derive_seed(*parts[:column], int(value), *parts[column + 1:])
        assert int(derive_seeds(*parts)[0]) == derive_seed(*parts)  # no array: one seed


def test_block_derivation_refuses_array_values_beyond_one_word():
    with pytest.raises(ValueError, match="2\\*\\*32"):
        derive_seeds(0, np.array([2**32], dtype=np.uint64))
    with pytest.raises(ValueError, match="non-negative"):
        derive_seeds(-1, 5)


def test_step_seeds_match_derive_seed_across_blocks_phases_and_huge_steps():
    seeds = StepSeeds(42)
    block = StepSeeds.BLOCK
    steps = [0, 1, block - 1, block, 3 * block + 17, 2**32 - 3]  # the last: past one word per block, the fallback
    for step in steps:
        for tail in [(0,), (1,), (2**20,), (1, 2), (0, 1)]:
            assert seeds(step, *tail) == derive_seed(42, step, *tail)
    for step in range(5000, 5000 + 2 * block, 37):  # walking forward, as training does
        assert seeds(step, 1) == derive_seed(42, step, 1)


def test_trainer_latents_are_the_seed_sequence_stream(tmp_path):
    """The trainer's noise for (step, phase) is randn from a generator seeded with derive_seed(seed, step, phase):
    the stream every earlier run drew."""
    from ganscale import config
    from ganscale.runtime import start
    from ganscale.trainer import PHASE_D, PHASE_G, Trainer

    cfg = config.load(None, ["train.seed=5", "log.tensorboard=false", "train.batch_size=8"])
    runtime = start("cpu")
    try:
        trainer = Trainer(cfg, runtime, tmp_path)
        for step in (0, 3, 2047, 2048):
            for phase in (PHASE_G, PHASE_D):
                expected = torch.randn(8, cfg.model.z_dim, generator=torch.Generator().manual_seed(
                    derive_seed(5, step, phase)))
                assert torch.equal(trainer._global_latents(step, phase), expected)
    finally:
        runtime.close()


def test_rank_streams_take_a_derived_seed_near_2_to_the_63():
    """A resume under another world size reseeds from a derived seed (up to 2**64): no overflow, ranks differ."""
    from types import SimpleNamespace

    from ganscale.runtime import seed_rank_streams

    draws = []
    for rank in range(4):
        seed_rank_streams(2**64 - 7, SimpleNamespace(world=4, rank=rank))
        draws.append(torch.rand(2))
    assert all(not torch.equal(draws[0], other) for other in draws[1:])
