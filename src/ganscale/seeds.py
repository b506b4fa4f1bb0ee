"""Seeds derived from integers (seed, step, phase, ...): the same on every rank and every machine.

`derive_seed` hashes its parts with numpy's `SeedSequence`. The trainer needs two such seeds per step
(D's and G's latents), and one `SeedSequence` costs 15 to 40 us inside the training loop, a share of
a small model's step that shows in `ganscale bench overhead`. `StepSeeds` gives the same numbers for
a block of consecutive steps at once: `derive_seeds` runs SeedSequence's hash (O'Neill's seed_seq_fe
as numpy implements it: a 4-word pool, `hashmix`, `mix`, then `generate_state`) on arrays, one
element per step. The test suite checks it against `SeedSequence` itself.
"""

from __future__ import annotations

import numpy as np

_MASK32 = 0xFFFFFFFF
_POOL_SIZE = 4
_INIT_A, _MULT_A = 0x43B0D7E5, 0x931E8875
_INIT_B, _MULT_B = 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R = 0xCA01F9DD, 0x4973F715
_XSHIFT = 16


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from non-negative integers (seed, step, phase, ...), the same on every machine."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def _words(value: int) -> list[int]:
    """SeedSequence's entropy words of one integer: 32-bit words, least significant first (0 is [0])."""
    if value < 0:
        raise ValueError(f"seed parts must be non-negative, got {value}")
    words = [value & _MASK32]
    while value := value >> 32:
        words.append(value & _MASK32)
    return words


def derive_seeds(*parts: int | np.ndarray) -> np.ndarray:
    """`derive_seed` for many part tuples at once: each part an integer, or an array of integers in
    [0, 2**32) (one entropy word each), all arrays of one length. Returns int64 seeds."""
    arrays = [part for part in parts if isinstance(part, np.ndarray)]
    n = len(arrays[0]) if arrays else 1
    if any(a.size and (a.min() < 0 or a.max() > _MASK32) for a in arrays):
        raise ValueError("array seed parts must lie in [0, 2**32)")
    entropy: list[np.ndarray] = []  # every word as a uint64 array of n: arrays wrap silently, numpy scalars warn
    for part in parts:
        if isinstance(part, np.ndarray):
            entropy.append(part.astype(np.uint64))
        else:
            entropy.extend(np.full(n, word, np.uint64) for word in _words(int(part)))
    hash_const = _INIT_A

    def hashmix(value):
        nonlocal hash_const
        value = value ^ hash_const
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = (value * hash_const) & _MASK32
        return value ^ (value >> _XSHIFT)

    def mix(x, y):
        # uint64 arithmetic wraps modulo 2**64, which 2**32 divides: the low word is SeedSequence's uint32.
        result = (x * _MIX_MULT_L - y * _MIX_MULT_R) & _MASK32
        return result ^ (result >> _XSHIFT)

    pool = [hashmix(entropy[i] if i < len(entropy) else np.zeros(n, np.uint64)) for i in range(_POOL_SIZE)]
    for src in range(_POOL_SIZE):
        for dst in range(_POOL_SIZE):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for word in entropy[_POOL_SIZE:]:
        for dst in range(_POOL_SIZE):
            pool[dst] = mix(pool[dst], hashmix(word))
    # generate_state(1, uint64): two 32-bit words from the pool, the first the low half.
    hash_const = _INIT_B
    state = []
    for word in pool[:2]:
        word = word ^ hash_const
        hash_const = (hash_const * _MULT_B) & _MASK32
        word = (word * hash_const) & _MASK32
        state.append(word ^ (word >> _XSHIFT))
    return ((state[0] | (state[1] << np.uint64(32))) >> np.uint64(1)).astype(np.int64)


class StepSeeds:
    """`derive_seed(seed, step, *tail)` for any step, derived `BLOCK` consecutive steps at a time."""

    BLOCK = 1024

    def __init__(self, seed: int):
        self.seed = seed
        self._blocks: dict[tuple, list[int]] = {}

    def __call__(self, step: int, *tail: int) -> int:
        first = step - step % self.BLOCK
        if first + self.BLOCK > _MASK32:  # beyond one entropy word per step: the reference, one at a time
            return derive_seed(self.seed, step, *tail)
        key = (first, *tail)
        block = self._blocks.get(key)
        if block is None:
            if len(self._blocks) >= 16:  # a training walks forward: old blocks are not asked for again
                self._blocks.clear()
            steps = np.arange(first, first + self.BLOCK, dtype=np.uint64)
            block = self._blocks[key] = derive_seeds(self.seed, steps, *tail).tolist()
        return block[step - first]
