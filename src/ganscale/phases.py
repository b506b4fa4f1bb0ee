"""The phases of one training iteration, as data: which network steps, on what, and how often.

An iteration is D main (n_critic adversarial steps), D reg (R1), G main (adversarial), G reg (path length), in
that order. A regularisation phase runs every `interval` iterations, its penalty scaled by the interval (lazy
regularisation, Karras et al. 2020). With loss.lazy_regularization=folded, R1 is added to D main's loss at the
iterations where it is due (one optimizer step); with `separate`, as StyleGAN2 trains, each regularisation phase
is its own forward, backward and optimizer step, and its network's Adam is corrected for the extra steps.
Which phases run is a function of the step counter alone: the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from ganscale.config import LossConfig


@dataclass(frozen=True)
class TrainingPhase:
    name: str             # as the watchdog marks it: "D main", "D reg", "G main", "G reg"
    network: str          # "D" or "G": whose loss it computes
    computes: str         # "adversarial", "r1" or "path_length"
    interval: int = 1     # runs at the iterations that are multiples of it
    own_step: bool = True # False: folded into its network's main phase (its loss, that optimizer step)

    def due(self, step: int) -> bool:
        return step % self.interval == 0

    @property
    def regularises(self) -> bool:
        return self.computes != "adversarial"


def iteration_phases(loss: LossConfig) -> tuple[TrainingPhase, ...]:
    """Every phase an iteration can run, in order (preflight refuses a folded path length phase)."""
    separate = loss.lazy_regularization == "separate"
    phases = [TrainingPhase("D main", "D", "adversarial")]
    if loss.r1_gamma > 0:
        phases.append(TrainingPhase("D reg", "D", "r1", loss.r1_interval, own_step=separate))
    phases.append(TrainingPhase("G main", "G", "adversarial"))
    if loss.pl_weight > 0:
        phases.append(TrainingPhase("G reg", "G", "path_length", loss.pl_interval, own_step=separate))
    return tuple(phases)


def steps_at(phases: tuple[TrainingPhase, ...], step: int) -> list[TrainingPhase]:
    """The phases iteration `step` runs as optimizer steps of their own, in order."""
    return [phase for phase in phases if phase.own_step and phase.due(step)]


def folded_due(phases: tuple[TrainingPhase, ...], computes: str, step: int) -> bool:
    """Whether the regularisation `computes` is folded into its main phase's loss at iteration `step`."""
    return any(p.computes == computes and not p.own_step and p.due(step) for p in phases)


def lazy_ratio(phases: tuple[TrainingPhase, ...], network: str) -> float:
    """StyleGAN2's c = k/(k+1) for a network whose regularisation phase of interval k is its own optimizer step
    (k + 1 steps every k iterations, so Adam takes lr x c and betas ** c, as NVlabs' training loop does at any
    k); 1 for a network without one."""
    intervals = [p.interval for p in phases if p.network == network and p.regularises and p.own_step]
    return intervals[0] / (intervals[0] + 1) if intervals else 1.0


def corrected_adam(lr: float, betas: tuple[float, float], ratio: float) -> tuple[float, tuple[float, float]]:
    """A network's Adam lr and betas under its lazy regularisation ratio `c` (lr x c, betas ** c)."""
    return lr * ratio, tuple(beta ** ratio for beta in betas)
