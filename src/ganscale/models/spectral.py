"""Spectral norm's power iteration: once per network step, whatever the accumulation or world size.

torch's spectral-norm parametrization refines its estimate of the largest singular value
(`n_power_iterations` power-method steps, updating its `_u`/`_v` buffers in place) in every forward
while the parametrization module is in training mode. A step taken in k accumulation micro-steps would refine
it k times where the same step in one micro-step refines it once, and k depends on the world size
when `train.micro_batch` is set. So after a step's first forward the parametrizations are held in eval
mode: every later micro-step normalises by the same estimate the whole batch's single forward uses
(the weights do not change within a step), exactly as without accumulation.

The classic `torch.nn.utils.spectral_norm` (a forward pre-hook, refining while its layer is in training mode) is
paused with the same result through its own `n_power_iterations`, set to 0 for the duration: its layer's training
flag stays as it is, since a layer's own forward may read it. Dynamo guards on both (parallel/speed.py).

Only the parametrization modules change mode: the networks, and their BatchNorm, stay in training mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn.utils.parametrizations import _SpectralNorm
from torch.nn.utils.spectral_norm import SpectralNorm


def spectral_norms(module: nn.Module) -> list[nn.Module | SpectralNorm]:
    """The spectral norms in `module`: torch's parametrizations (their `training` flag runs the power iteration),
    then its classic forward pre-hooks."""
    modules = list(module.modules())
    return [*(m for m in modules if isinstance(m, _SpectralNorm)),
            *(hook for m in modules for hook in m._forward_pre_hooks.values() if isinstance(hook, SpectralNorm))]


@contextlib.contextmanager
def power_iteration_paused(norms: list[nn.Module | SpectralNorm]) -> Iterator[None]:
    """Inside: the spectral norms normalise by their current estimate without refining it."""
    modes = [m.training if isinstance(m, nn.Module) else m.n_power_iterations for m in norms]
    for m in norms:
        if isinstance(m, nn.Module):
            m.train(False)
        else:  # with no power-method step, the hook computes what it computes in eval mode
            m.n_power_iterations = 0
    try:
        yield
    finally:
        for m, mode in zip(norms, modes):
            if isinstance(m, nn.Module):
                m.train(mode)
            else:
                m.n_power_iterations = mode


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
