"""Spectral norm's power iteration: once per network step, whatever the accumulation or world size.

torch's spectral-norm parametrization refines its estimate of the largest singular value
(`n_power_iterations` power-method steps, updating its `_u`/`_v` buffers in place) in every forward
while the parametrization module is in training mode. A step taken in k accumulation micro-steps would refine
it k times where the same step in one micro-step refines it once, and k depends on the world size
when `train.micro_batch` is set. So after a step's first forward the parametrizations are held in eval
mode: every later micro-step normalises by the same estimate the whole batch's single forward uses
(the weights do not change within a step), exactly as without accumulation.

Only the parametrization modules change mode: the networks, and their BatchNorm, stay in training mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.utils.parametrizations import _SpectralNorm


def spectral_norms(module: nn.Module) -> list[nn.Module]:
    """The spectral-norm parametrizations in `module`: their `training` flag runs the power iteration."""
    return [m for m in module.modules() if isinstance(m, _SpectralNorm)]


@contextlib.contextmanager
def power_iteration_paused(norms: list[nn.Module]) -> Iterator[None]:
    """Inside: the parametrizations normalise by their current estimate without refining it."""
    modes = [m.training for m in norms]
    for m in norms:
        m.train(False)
    try:
        yield
    finally:
        for m, mode in zip(norms, modes):
            m.train(mode)


@contextlib.contextmanager
def power_iteration_in_first_forward(module: nn.Module) -> Iterator[None]:
    """Inside: `module`'s parametrizations refine their estimate in its first forward only. For forwards
    the caller does not run itself (a pipeline schedule's micro-batches): a forward hook pauses them."""
    norms = spectral_norms(module)
    with contextlib.ExitStack() as stack:
        def pause(*_) -> None:
            hook.remove()  # once: what is restored on leaving is the mode before the first forward
            stack.enter_context(power_iteration_paused(norms))

        hook = module.register_forward_hook(pause)
        stack.callback(hook.remove)  # for a block that ran no forward of `module`
        yield
