"""Randomness inside a network that is the same on N ranks as on one process.

A network that draws noise or dropout masks from torch's RNG (`torch.randn` in `forward`, `nn.Dropout`) draws
from its rank's stream: 2 ranks give a sample other noise than one process does, and train differently. Here a
sample's random values are a hash of its *seed* (a function of its global position in the batch, the step and
the phase), a `salt` naming the call site, and the element's index: the same for that sample on any rank, in any
micro-step and in any batch around it.

Where a forward gets its samples' seeds:
- a G that receives latents: `sample_seeds(z)` (the trainer draws z per global sample position, step and phase);
- any network the trainer runs (a D, or a G whose input is an image): `batch_seeds(x)`, the seeds of x's rows as
  the trainer set them around this forward (`seeds_from`); None outside the trainer's steps (a direct call).

Every function is integer tensor ops on the seeds' device: no Python RNG, no generator objects, so it runs on any
device and torch.compile and CUDA graphs take it. Without seeds, each falls back to torch's RNG, as torch's own
dropout does.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from ganscale.usercode import called_at

BITS = 0xFFFFFFFF  # the hash works on 32-bit values held in int64: no product overflows
_UNIT = 2.0 ** -24  # uniform values take a hash's top 24 bits: exact in float32, in [0, 1)

_latents: Tensor | None = None  # the latents of the micro-batch being forwarded (set by the trainer: seeds_from)


def sample_seeds(z: Tensor) -> Tensor:
    """One 32-bit seed per sample (int64), the bits of its latent vector's first value: the trainer draws latents
    per global sample position, step and phase, so a sample's seed is the same whichever rank draws it."""
    return z[:, 0].float().contiguous().view(torch.int32).long() & BITS


@contextmanager
def seeds_from(z: Tensor | None) -> Iterator[None]:
    """The trainer's, around a micro-step's forwards: `batch_seeds` gives their rows the seeds of latents `z`
    (this rank's micro-batch of them). Costs nothing for networks that do not ask."""
    global _latents
    outer, _latents = _latents, z
    try:
        yield
    finally:
        _latents = outer


def batch_seeds(x: Tensor) -> Tensor | None:
    """The seeds of x's rows in the trainer's step (None outside one): x's rows are a network input's rows, k
    blocks of the micro-batch's b samples (G: [samples]; D: [real, fake] or [real, fake, interpolates]). Row r
    is sample r mod b: block 0 has `sample_seeds(z)`, block k > 0 a hash of it and k, so a sample's real and
    fake rows draw differently."""
    if _latents is None:
        return None
    seeds, rows = sample_seeds(_latents), x.shape[0]
    if rows % len(seeds):
        raise ValueError(f"batch_seeds: a tensor of {rows} rows is not whole blocks of the micro-batch's "
                         f"{len(seeds)} samples; call it on the network's input (or a tensor with the input's rows)")
    return torch.cat([seeds, *(random_bits(seeds, -block, ()) for block in range(1, rows // len(seeds)))])


def random_bits(seeds: Tensor, salt: int, shape: Sequence[int]) -> Tensor:
    """Uniform 32-bit values (int64) of shape (len(seeds), *shape): each a hash of (its sample's seed, `salt`, its
    index), so a sample's values do not depend on the batch around it. Give each call site its own salt."""
    index = torch.arange(math.prod(shape), device=seeds.device, dtype=torch.int64).view(1, *shape)
    x = (seeds.view(-1, *[1] * len(shape)) * 0x7FEB352D + (salt * 0x2C1B3C6D & BITS) + index) & BITS
    for _ in range(2):  # a 32-bit integer hash (xor-shift, multiply) of good avalanche
        x = ((x >> 16) ^ x) * 0x45D9F3B & BITS
    return (x >> 16) ^ x


def uniform(x: Tensor, salt: int, shape: Sequence[int] | None = None, seeds: Tensor | None = None) -> Tensor:
    """Values in [0, 1) of shape (len(x), *shape) (default: x's shape), x's dtype and device, per row of x from its
    seed (`seeds`, default `batch_seeds(x)`; neither: torch's RNG)."""
    shape, seeds = _per_row(x, shape, seeds)
    if seeds is None:
        return torch.rand(len(x), *shape, dtype=x.dtype, device=x.device)
    return ((random_bits(seeds, salt, shape) >> 8).float() * _UNIT).to(x.dtype)


def normal(x: Tensor, salt: int, shape: Sequence[int] | None = None, seeds: Tensor | None = None) -> Tensor:
    """Standard normal values of shape (len(x), *shape), as `uniform` (Box-Muller on two of its values)."""
    shape, seeds = _per_row(x, shape, seeds)
    if seeds is None:
        return torch.randn(len(x), *shape, dtype=x.dtype, device=x.device)
    u = (random_bits(seeds, salt, (2, *shape)) >> 8).float() * _UNIT
    radius = torch.sqrt(-2.0 * torch.log1p(-u[:, 0]))  # 1 - u in (0, 1]: finite
    return (radius * torch.cos(2 * math.pi * u[:, 1])).to(x.dtype)


def dropout(x: Tensor, p: float, salt: int, seeds: Tensor | None = None) -> Tensor:
    """Dropout of x's elements with probability p (the kept ones scaled by 1 / (1 - p)), each sample's mask from its
    seed (`seeds`, default `batch_seeds(x)`; neither: torch's RNG)."""
    _, seeds = _per_row(x, None, seeds)
    if seeds is None:
        return F.dropout(x, p, training=True)
    keep = random_bits(seeds, salt, x.shape[1:]) >= round(p * 2**32)
    return x * keep.to(x.dtype) / (1 - p)


def _per_row(x: Tensor, shape: Sequence[int] | None, seeds: Tensor | None) -> tuple[Sequence[int], Tensor | None]:
    return (x.shape[1:] if shape is None else shape), (batch_seeds(x) if seeds is None else seeds)


class SampleDropout(nn.Module):
    """`dropout` as a layer, identity in eval mode; `salt`: this layer's, distinct from the network's others."""

    def __init__(self, p: float, salt: int):
        super().__init__()
        self.p, self.salt = p, salt

    def forward(self, x: Tensor, seeds: Tensor | None = None) -> Tensor:
        return dropout(x, self.p, self.salt, seeds) if self.training else x

    def extra_repr(self) -> str:
        return f"p={self.p}, salt={self.salt}"


@dataclass
class ProcessDraws:
    """What code drew from this process's random generators (torch's default one and numpy's global one, which each
    rank seeds for itself): `drawn`, and the first torch op that drew with its place in the user's code (`at`); and
    the first that drew from a torch.Generator of the code's own (`own_at`)."""

    drawn: bool = False
    at: str = ""
    own_at: str = ""


def _said(op, place: str | None) -> str:
    """"aten.randn_like at my_gan/nets.py:30 in forward", for a message."""
    return str(op).removesuffix(".default") + (f" at {place}" if place else "")


class _SeededOps(TorchDispatchMode):
    """Records the first seeded op that draws from torch's default generator (given none), and the first that draws
    from a generator of the code's own."""

    def __init__(self, draws: ProcessDraws):
        super().__init__()
        self.draws = draws

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            own = kwargs.get("generator") not in (None, torch.default_generator)
            if own and not self.draws.own_at:
                self.draws.own_at = _said(func, called_at())
            elif not own and not self.draws.at:
                self.draws.at = _said(func, called_at())
        return func(*args, **kwargs)


@contextmanager
def process_draws() -> Iterator[ProcessDraws]:
    """Within: whether the code inside draws from this process's random generators (on the CPU), and where; the
    generators are put back as they were at the start, so the check itself changes no run's randomness. Not Python's
    `random`, which imports draw from (scikit-learn's) and ganscale does not seed."""
    states = (torch.get_rng_state(), np.random.get_state())
    draws = ProcessDraws()
    try:
        with _SeededOps(draws):
            yield draws
    finally:
        after = (torch.get_rng_state(), np.random.get_state())
        draws.drawn = bool(draws.at) or not (
            torch.equal(states[0], after[0]) and np.array_equal(states[1][1], after[1][1])
            and states[1][2:] == after[1][2:])
        torch.set_rng_state(states[0])
        np.random.set_state(states[1])
