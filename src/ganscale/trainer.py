"""The training loop, top to bottom: the iteration's phases (phases.py: D step(s), D reg, G step, G reg), each on
its global batch -> EMA -> logs, samples, checkpoints.

Every rank runs exactly this control flow. The decisions taken from local data or events (skip a
step with a non-finite loss or gradient, stop after a signal, stop when another run took the run directory
over) are agreed in one all-reduce per optimizer step; everything else (penalty steps, logging, samples,
checkpoints, the non-finite streak limit) is a function of the step counter and of agreed values, the same on
every rank.
What rank 0 alone writes (config, log, samples, checkpoint) is agreed where it is written: one broadcast
tells every rank whether it succeeded (`rank0_writes`), so a failed write stops all ranks with its error.
The checkpointer (checkpointer.py) and the reporter (observe/reporter.py: metrics, samples, image scores, the
summary) each decide their own cadence; `phase` carries a step phase's watchdog mark, timer and traffic meter.
"""

from __future__ import annotations

import contextlib
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ganscale import checkpoint, objectives, phases, usercode
from ganscale.augment import build_augmentation
from ganscale.checkpointer import Checkpointer
from ganscale.config import Config, to_yaml
from ganscale.data import GlobalBatches, Slicing, build_dataset
from ganscale.data.stream import Sample
from ganscale.ema import EmaUpdate, ema_beta, make_ema
from ganscale.finite import BufferSnapshot, refuse_non_finite
from ganscale.fault import (NonFiniteTraining, Preempted, RunDirectoryTakenOver, StopSignals, every_rank_or_none,
                            injected_fault, rank0_writes, told_by)
from ganscale.models import build_networks, output_warning
from ganscale.observe.fingerprints import fingerprints_for
from ganscale.observe.profile import StepProfiler
from ganscale.observe.reporter import Reporter
from ganscale.observe.timing import StepTimes
from ganscale.outputs import write_output
from ganscale.parallel import Layout, held_bytes, parallelize
from ganscale.parallel.speed import (choose_convolution_algorithms, compiled, fp32_in_tf32, in_layout,
                                     traffic_unmeasurable)
from ganscale.parallel.traffic import TrafficMeter
from ganscale.precision import Precision
from ganscale.preflight import cross_rank_batchnorm, has_batchnorm, penalty_through_batchnorm, reuses_fake
from ganscale.randomness import normal, sample_seeds, seeds_from
from ganscale.rundir import config_to_write
from ganscale.runlock import LOCK_NAME, LockWatch
from ganscale.runtime import Runtime, calm_gloo_polling, seed_rank_streams
from ganscale.seeds import StepSeeds
from ganscale.tasks import build_task
from ganscale.watchdog import Watchdog

# Noise streams: each phase of each step draws the whole global batch's latents from its own seed,
# and each rank keeps its slice. Ranks get different noise, and the union over ranks is the same
# whatever the world size, so 1 x 2b and 2 x b train identically.
PHASE_G, PHASE_D, PHASE_PATH_LENGTH, PHASE_R1, PHASE_SAMPLES = 0, 1, 2**19, 2**19 + 1, 2**20
PL_NOISE_SALT = 0x504C  # the path length's random images y, per sample (ganscale.randomness)
NOTHING = contextlib.nullcontext()  # reusable


def lr_factor(step: int, total_steps: int, decay_start: float) -> float:
    """Constant, then linear decay (pix2pix's rule): 1 until decay_start x total, then down towards 0."""
    constant = round(decay_start * total_steps)
    return 1.0 - max(0, step + 1 - constant) / (total_steps - constant + 1)


def per_rank_batchnorm(cfg: Config, world: int, generator: nn.Module, discriminator: nn.Module) -> str | None:
    """The warning for BatchNorm whose statistics stay per rank (more than one rank, parallel.sync_bn false, or unset
    where preflight.cross_rank_batchnorm leaves it off), or for cross-rank statistics over more samples than one
    process normalises; None where the run normalises as one process does.

    Allowed and documented (README, "Cross-rank BatchNorm"), but such a run is not the one the same config gives
    on one process, and the user must be told. Not for the pipeline: its BatchNorm normalises each pipeline
    micro-batch by design (README) and it refuses parallel.sync_bn.
    """
    if world == 1 or cfg.parallel.pipelined:
        return None
    with_batchnorm = [name for name, net in (("G", generator), ("D", discriminator))
                      if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())]
    if cross_rank_batchnorm(cfg, world):
        # Cross-rank statistics pool world x micro_batch samples; one process with the same config normalises
        # micro_batch. Unset, the micro-batch is batch / world per rank: pooled, one process's whole batch.
        micro = cfg.train.micro_batch
        if micro is None or not with_batchnorm:
            return None
        fix = (f"set train.micro_batch={micro // world} to normalise the {micro} samples one process does, or leave "
               "it unset" if micro % world == 0 else "leave train.micro_batch unset")
        return (f"BatchNorm in {' and '.join(with_batchnorm)} normalises {world} x {micro} samples together across "
                f"ranks (parallel.sync_bn), where one process with this config normalises {micro}: this run trains "
                f"differently from one process. Fix: {fix}")
    if cfg.train.micro_batch is not None:
        # A set micro-batch normalises the same samples together on any number of ranks (Slicing), so the weights
        # train as on one process; the running statistics, each rank updating its own with its share of the
        # micro-batches, do not, and G_ema draws every sample with them. Cross-rank statistics would normalise
        # world x micro_batch samples together instead: there is no fix to offer.
        if "G" not in with_batchnorm:  # D's running statistics are never used
            return None
        return (f"BatchNorm running statistics in G are updated per rank and averaged (parallel.sync_bn is off), "
                f"so G_ema's samples and scores differ from one process's; the weights train as on one process "
                f"(train.micro_batch={cfg.train.micro_batch} normalises the same samples together on any number "
                f"of ranks)")
    if not with_batchnorm:
        return None
    fix = "--set parallel.sync_bn=true"
    if penalty_through_batchnorm(cfg):  # preflight.check refuses parallel.sync_bn=true with it
        fix += (" with loss.r1_gamma=0 and a loss.kind other than wgan-gp (their double backward cannot pass a "
                "cross-rank BatchNorm in D)")
    return (f"BatchNorm statistics in {' and '.join(with_batchnorm)} are per rank (each rank normalises its own "
            f"{cfg.micro_batch(world)} samples; parallel.sync_bn is off), so this {world}-rank run trains "
            f"differently from one process. Fix: {fix}")


class MicroStepMeans:
    """Means over one step's micro-batches of its loss terms, detached for reporting; a term a step
    does not have (no penalty, no reconstruction) is None in every micro-batch and stays None."""

    def __init__(self, micro_batches: int):
        self.micro_batches = micro_batches
        self.values: list[Tensor | None] = []

    def share(self, loss: Tensor) -> Tensor:
        """A micro-batch's part of the step's mean loss (no extra op without accumulation)."""
        return loss if self.micro_batches == 1 else loss / self.micro_batches

    def add(self, *terms: Tensor | None) -> None:
        shares = [None if t is None else self.share(t.detach()) for t in terms]
        self.values = shares if not self.values else [
            None if total is None else total + share for total, share in zip(self.values, shares)]


class Phase:
    """The step timer's part and the traffic meter's phase of one phase of a step, entered together (a slotted
    object, not a generator-based context manager: about ten phases run every step)."""

    __slots__ = ("timed", "metered")

    def __init__(self, timed: contextlib.AbstractContextManager, metered: contextlib.AbstractContextManager):
        self.timed, self.metered = timed, metered

    def __enter__(self) -> None:
        self.metered.__enter__()
        self.timed.__enter__()

    def __exit__(self, *exc) -> None:
        self.timed.__exit__(*exc)
        self.metered.__exit__(*exc)


class Trainer:
    def __init__(self, cfg: Config, runtime: Runtime, run_dir: Path, resume: Path | None = None,
                 run_lock: LockWatch | None = None):
        """`run_lock`: rank 0's hold on the run directory (or its watch on the `--nproc` launcher's); the run stops
        (RunDirectoryTakenOver) once it is lost."""
        self.cfg, self.runtime, self.run_dir = cfg, runtime, Path(run_dir)
        self.run_lock = run_lock
        if run_lock is not None:
            run_lock.stops_run = True  # the stop says it: the lock's own warning would say it twice
        world, device = runtime.world, runtime.device
        data_ranks = cfg.data_ranks(world)  # a pipeline's stages share one slice of the batch
        self.slicing = Slicing(runtime.rank // (world // data_ranks), data_ranks, cfg.micro_batch(world),
                               cfg.accumulation_steps(world))
        self.global_batch = cfg.train.batch_size
        self._noise = torch.Generator()  # latents and labels: reseeded per (step, phase), on the CPU
        self._seed_of = StepSeeds(cfg.train.seed)  # derive_seed(seed, step, ...), a block of steps at a time

        if cfg.names_user_code:  # the user's modules (networks, data, loss) import alike in every process
            usercode.search(cfg.code_path)
        choose_convolution_algorithms(cfg.train.cudnn_benchmark)
        fp32_in_tf32(cfg.train.tf32)
        # Same seed on every rank: identical init; in the memory layout the fast path asks for.
        generator, discriminator = (in_layout(net, cfg.train.channels_last) for net in build_networks(cfg))
        # Per-rank BatchNorm statistics are averaged after every iteration, not only before outputs: averaged only
        # there, an output's cadence (a sample, a stop's checkpoint) would change the statistics after it.
        self.batchnorm_per_rank = world > 1 and not cross_rank_batchnorm(cfg, world) and (
            has_batchnorm(generator) or has_batchnorm(discriminator))
        warning = per_rank_batchnorm(cfg, world, generator, discriminator)
        if warning and runtime.is_main:
            print(f"ganscale: warning: {warning}", file=sys.stderr, flush=True)
        ema = make_ema(generator)  # copied before sharding: a sharded module cannot be deep-copied
        if cfg.parallel.pipelined:  # the one capability branch: G and D split into stages of one pipeline
            from ganscale.parallel.pipeline import pipeline_networks  # torch's pipelining: slow to import

            self.G, self.D = pipeline_networks(generator, discriminator, runtime, cfg.parallel, cfg.loss.kind)
        else:
            layout = Layout(runtime, cfg.parallel, cross_rank_batchnorm(cfg, world))
            self.G = compiled(parallelize(generator, cfg.parallel.generator, layout), cfg.train.compile)
            self.D = compiled(parallelize(discriminator, cfg.parallel.discriminator, layout), cfg.train.compile)
        self.pipeline = self.G.pipeline  # None unless pipelined: its passes replace the micro-step loops
        calm_gloo_polling()  # every process group exists now (meshes, pipeline stages): see runtime.py
        self.G_ema = self.G.shard_like(ema)  # placed (and sharded, or split) exactly like G
        self.buffers = BufferSnapshot(G=self.G.module, D=self.D.module)  # what a skipped step puts back
        self.update_ema = EmaUpdate(self.G_ema, self.G.module)
        self.opt_g = self._adam(self.G, cfg.optim.g, fused=cfg.optim.fused)
        self.opt_d = self._adam(self.D, cfg.optim.d, fused=cfg.optim.fused)
        self.precision = Precision(cfg.train.precision, device)
        self.phases = phases.iteration_phases(cfg.loss)  # what an iteration runs (phases.py)
        self.configure_optimizers()
        self.augment = build_augmentation(cfg)  # every image D sees passes through it (ganscale.augment)
        self.pl_mean = 0.0  # path lengths' running mean: agreed over the ranks, saved in the checkpoint
        # The path length batch: the global batch / loss.pl_batch_shrink, cut like the global batch.
        self.pl_slicing = Slicing(self.slicing.rank, self.slicing.world,
                                  self.slicing.micro_batch // cfg.loss.pl_batch_shrink, self.slicing.accumulation)
        self.phase_steps = {"adversarial": {"D": self._critic_steps, "G": self._generator_phase},
                            "r1": {"D": self.r1_step}, "path_length": {"G": self.path_length_step}}
        self.stats: dict[str, float] = {}  # each phase's last values, logged (a lazy phase's until it runs again)
        self._reals: list[Sample] = []  # the iteration's last D batch: D reg and G main take it too
        self._g_stepped = False  # whether this iteration's G main step was taken (not skipped): G_ema follows

        self.step, self.skipped_steps, self.consecutive_skips = 0, 0, 0
        self.non_finite_steps = 0  # skipped steps that fp16's loss scale backing off does not explain
        self.stop_signal: str | None = None  # set by a signal on this rank
        self.stop_agreed = False             # set when any rank had a stop signal (agreed in _finish_step)
        self.taken_over = False              # set when rank 0 found the run directory's lock lost (agreed there too)
        self._verify_lock = False            # whether this iteration ends in writes: rank 0 reads its lock first
        self.memory: list[dict] = [{"G": {}, "D": {}}]  # bytes held per rank, measured after the first step
        self.traffic = TrafficMeter(traffic_unmeasurable(cfg.train.compile))  # bytes communicated per step, on one
        self.times = StepTimes(device, cfg.log.step_times)  # where each step's wall time goes
        self.profiler = StepProfiler(cfg.log.profile_steps, cfg.log.profile_after, self.run_dir, runtime.rank, device)
        # Test-only hook; a no-op unless GANSCALE_INJECT_FAULT is set.
        self.inject_fault = injected_fault(stopping=lambda: self.stop_signal is not None)
        self.watchdog = Watchdog(runtime.rank, runtime.world, cfg.fault.hang_timeout_s, self.run_dir / "diagnostics",
                                 exit_timeout_s=cfg.fault.exit_timeout_s)
        self.checkpointer = Checkpointer(cfg.checkpoint, self)
        seed_rank_streams(cfg.train.seed, runtime)
        saved_streams = self.checkpointer.load(resume) if resume is not None else None
        self.dataset = build_dataset(cfg)
        warning = output_warning(cfg, self.dataset) if runtime.is_main else None
        if warning:
            print(f"ganscale: warning: {warning}", file=sys.stderr, flush=True)
        self.task = build_task(cfg)  # what G is given and D judges (unconditional, classes, pairs)
        # G's output (and its classes) from the D step, kept with its graph for the G step: one G forward per
        # iteration.
        self.reuse_fake, note = reuses_fake(cfg, world, self.task.same_fake_for_g)
        if note and runtime.is_main:
            print(f"ganscale: note: {note}", file=sys.stderr, flush=True)
        self._fake_for_g: tuple[Tensor, Tensor | None, Tensor] | None = None
        self.batches = GlobalBatches(self.dataset, self.slicing, cfg.train.seed, device, cfg.data.workers,
                                     start=self.step * cfg.loss.n_critic)
        self.reporter = Reporter(self)  # metrics, samples, image scores (its scorer: collective), the summary
        # Last: building the data stream (a DataLoader draws its workers' seed) and the scorer's networks draw from
        # the global RNG. Restored any earlier, those draws would shift G's dropout masks against the stopped run.
        if resume is not None:
            self.checkpointer.restore_rank_streams(saved_streams)
        with self.rank0_writes("run directory"):  # collective on leaving: one broadcast
            if runtime.is_main:  # only now: a bad data set or checkpoint leaves nothing behind
                self.run_dir.mkdir(parents=True, exist_ok=True)
                resolved = to_yaml(cfg)
                written = config_to_write(self.run_dir, self.step, resolved)
                if written is not None:  # whole or not at all: a full disk left a 0-byte config.yaml
                    write_output(written, lambda tmp: tmp.write_text(resolved), "--run-dir")
            self.reporter.open()
        self.fingerprints = fingerprints_for(cfg.log.fingerprints, self.run_dir, runtime.is_main, device,
                                             {"G": self.G.module, "D": self.D.module, "G_ema": self.G_ema}, self.step)

    @staticmethod
    def _adam(net: Wrapped, opt_cfg, fused: bool) -> torch.optim.Optimizer:
        # lr and betas as configured; configure_optimizers applies the lazy regularisation correction
        return net.make_optimizer(torch.optim.Adam, lr=opt_cfg.lr, betas=tuple(opt_cfg.betas),
                                  weight_decay=opt_cfg.weight_decay, fused=fused)

    # ----------------------------------------------------------------------------------- noise
    def _global_latents(self, step: int, phase: int, n: int | None = None) -> Tensor:
        """Latents for the whole global batch (or `n` samples): the same on every rank."""
        self._noise.manual_seed(self._seed_of(step, phase))  # one generator, reseeded
        return self._on_device(torch.randn(n or self.global_batch, self.cfg.model.z_dim, generator=self._noise))

    def _on_device(self, drawn: Tensor) -> Tensor:
        """A tensor drawn on the CPU, on the run's device. On CUDA through pinned memory, without blocking: a copy
        from pageable memory waits for every kernel queued before it (a host synchronisation each step)."""
        if self.runtime.device.type != "cuda":
            return drawn
        return drawn.pin_memory().to(self.runtime.device, non_blocking=True)

    def sample_latents(self, n: int) -> Tensor:
        """Latents of the sample pictures and of the 2D mixtures' scores: the same at every step and on every rank."""
        return self._global_latents(0, PHASE_SAMPLES, n)

    def _global_labels(self, step: int, phase: int, n: int | None = None) -> Tensor | None:
        """Classes of the generated samples of the whole global batch (None for unconditional G)."""
        if not self.task.n_classes:  # unconditional G: no seed to derive, no generator to build
            return None
        self._noise.manual_seed(self._seed_of(step, phase, 2))
        return self._on_device(self.task.labels(n or self.global_batch, self._noise))

    def _global_uniform(self, step: int, phase: int) -> Tensor:
        gen = torch.Generator().manual_seed(self._seed_of(step, phase, 1))
        return self._on_device(torch.rand(self.global_batch, generator=gen))

    # ----------------------------------------------------------------------------------- loop
    def fit(self) -> dict:
        """Train to `train.steps`. Raises `Preempted` after a stop signal, `NonFiniteTraining` after too many skips."""
        try:
            with StopSignals(self._request_stop) as signals, self.watchdog.watching(signals.wakeup):
                return self._fit()
        finally:
            self.batches.close()

    def _request_stop(self, signal_name: str) -> None:
        self.stop_signal = signal_name

    def _fit(self) -> dict:
        """The loop of the module docstring; returns the summary."""
        cfg, start_step = self.cfg, self.step
        self.reporter.begin()
        while self.step < cfg.train.steps:
            step, counted_before = self.step, self.non_finite_steps
            self._begin_step(step, start_step)
            for phase in phases.steps_at(self.phases, step):  # a function of the step: the same on every rank
                self.stats.update(self.phase_steps[phase.computes][phase.network](phase, step))
            if self.taken_over:  # agreed in _finish_step: every rank stops here, before anything of the step is written
                raise self._taken_over_error(step + 1)
            self.precision.update()  # once per iteration, after both networks stepped
            self.consecutive_skips = self.consecutive_skips + 1 if self.non_finite_steps > counted_before else 0
            self.step = step + 1
            if self._g_stepped:  # a skipped G main step leaves G_ema as it was too
                with self.phase(part="optimizer"):
                    self.update_ema(ema_beta(self.global_batch, self.step * self.global_batch,
                                             cfg.train.ema_half_life_images, cfg.train.ema_rampup))
            if self.batchnorm_per_rank:  # the same on every rank
                self.synchronise_buffers()  # collective
            self.fingerprints.after_step(step)  # log.fingerprints: for `ganscale verify`
            if self.step == start_step + 1:  # optimizer state exists after the first step
                self.memory = self._memory_report()  # collective
            self.reporter.after_step()

            final = self.step == cfg.train.steps
            self.reporter.log_metrics(self.step, final, dict(self.stats))  # collective when due
            # Both decisions below come from values every rank agreed on in _finish_step's collective.
            if self.consecutive_skips >= cfg.fault.max_consecutive_skips:
                self.reporter.close(stopped="non-finite")  # collective
                raise told_by(0, NonFiniteTraining(  # agreed: every rank has it, rank 0 says it
                    f"{self.consecutive_skips} consecutive steps had non-finite losses or gradients{self._at_scale()} "
                    f"(last: {self.reporter.record or self.stats}); {self._non_finite_fix()}"))
            last_step = final or self.stop_agreed  # the last step this process trains: it saves
            if self.reporter.due(self.step, final) or self.checkpointer.due(self.step, last_step):
                with self.phase(part="outputs"):  # entered only then: on CUDA timing synchronises
                    self.reporter.report(self.step, final)  # collective when due
                    self.checkpointer.save(self.step, last_step)  # collective when due
            if self.stop_agreed and not final:
                self.reporter.close(stopped="preempted")  # collective
                requested = self.stop_signal or "another rank"
                raise told_by(0, Preempted(f"stopped at step {self.step} on request ({requested}); checkpoint "
                                           "written; continue with --resume auto"))
        self.profiler.close(self.step)
        return self.reporter.close()  # collective

    def _begin_step(self, step: int, start_step: int) -> None:
        """Before each step: its watchdog mark and timers, its learning rates, and the test-only fault hook."""
        self.profiler.step(step)  # log.profile_steps
        self.watchdog.mark(f"step {step}: start")
        self.times.begin_step()
        # Measure one iteration's communication: the third, as the first two also carry one-time work
        # (FSDP's lazy initialisation; DDP rebuilding its buckets in the second).
        self.traffic.enabled = step == min(start_step + 2, self.cfg.train.steps - 1)
        self.traffic.start_up = self.traffic.enabled and step < start_step + 2
        factor = lr_factor(step, self.cfg.train.steps, self.cfg.optim.decay_start)  # a function of the step
        for group in (*self.opt_g.param_groups, *self.opt_d.param_groups):
            group["lr"] = group["initial_lr"] * factor
        if self.run_lock is not None:
            # Rank 0 reads its lock before an iteration that writes (metrics, samples, a checkpoint; a stop signal's
            # checkpoint), not only every RENEW_S in the lock's thread: a run that lost it writes nothing more.
            after, final = step + 1, step + 1 == self.cfg.train.steps
            self._verify_lock = (final or after % self.cfg.log.every == 0 or self.reporter.due(after, final)
                                 or self.checkpointer.due(after, False) or self.stop_signal is not None)
        self.inject_fault(step, self.runtime.rank)

    def _stop_flags(self) -> list[float]:
        """This rank's stop flags for the step's agreement: a stop signal, and its lock lost (rank 0 only)."""
        return [float(self.stop_signal is not None), float(self._lock_lost())]

    def _lock_lost(self) -> bool:
        return self.run_lock is not None and self.run_lock.is_lost(read_now=self._verify_lock)

    def _taken_over_error(self, step: int) -> RunDirectoryTakenOver:
        error = RunDirectoryTakenOver.at(self.run_dir, self.run_dir / LOCK_NAME, step)
        return error if self.runtime.rank == 0 else told_by(0, error)  # rank 0 found it, and says it

    def phase(self, where: str | None = None, part: str | None = None, traffic: str | None = None) -> Phase:
        """One phase of a step, instrumented: the hang watchdog's mark (`where`, at this step), the step-time
        breakdown's `part` and the traffic meter's `traffic` phase, each where given."""
        if where is not None:
            self.watchdog.mark(f"step {self.step}: {where}")
        return Phase(self.times.part(part) if part else NOTHING, self.traffic.measure(traffic) if traffic else NOTHING)

    def _at_scale(self) -> str:
        """fp16: the loss scale the streak ended at (an overflow there is the gradients', not the scale's)."""
        return f" at fp16 loss scale {self.precision.loss_scale:g}" if self.precision.scaler.is_enabled() else ""

    def _non_finite_fix(self) -> str:
        newest = checkpoint.latest(self.run_dir)  # for the message only
        kept = f"the last good checkpoint, {newest.name}, is kept" if newest else "no checkpoint was written"
        return f"{kept}. Lower optim.*.lr, set train.grad_clip, or use train.precision=fp32"

    def _memory_report(self) -> list[dict]:
        """Collective: every rank's bytes held per network; printed once by rank 0."""
        mine = {"G": held_bytes(self.G, self.opt_g), "D": held_bytes(self.D, self.opt_d)}
        everyone: list = [None] * self.runtime.world
        dist.all_gather_object(everyone, mine)
        if self.runtime.is_main:
            for rank, nets in enumerate(everyone):
                line = "  ".join(f"{net}: params {b['params'] / 2**20:.2f} MiB, grads {b['grads'] / 2**20:.2f} MiB, "
                                 f"optimizer {b['optim'] / 2**20:.2f} MiB" for net, b in nets.items())
                print(f"rank {rank} holds  {line}", flush=True)
        return everyone

    # ----------------------------------------------------------------------------------- phases
    def _critic_steps(self, phase: phases.TrainingPhase, step: int) -> dict[str, float]:
        """D main: loss.n_critic D steps, each on a fresh global batch (kept for the phases after it)."""
        n_critic = self.cfg.loss.n_critic
        for critic in range(n_critic):
            with self.phase(part="data"):
                self._reals = next(self.batches)
            d_stats = self.discriminator_step(self._reals, step, critic)
            if critic < n_critic - 1:
                self.precision.update()
        return d_stats

    def _generator_phase(self, phase: phases.TrainingPhase, step: int) -> dict[str, float]:
        """G main (paired data: G translates the last D batch's inputs)."""
        skipped_before = self.skipped_steps
        g_stats = self.generator_step(step, self._reals)
        self._g_stepped = self.skipped_steps == skipped_before
        return g_stats

    def discriminator_step(self, reals: list[Sample], step: int, critic: int) -> dict[str, float]:
        with self.phase(f"D step {critic} (DDP all-reduce in backward)", traffic="d_step"):
            self.D.trainable(True)
            self.D.begin_iteration()  # compiled CUDA graphs: this step's replays may reuse the last step's outputs
            phase = PHASE_D + critic
            with_r1 = phases.folded_due(self.phases, "r1", step)  # same on every rank
            self.buffers.take("G", "D")
            with self.phase(part="d_forward_backward"):
                if self.pipeline is not None:
                    real, z = reals[0][0], self.slicing.take(self._global_latents(step, phase), 0)
                    with self.precision.autocast():
                        pass_loss = self.pipeline.discriminator_pass(real, z, scale_loss=self.precision.scale)
                    terms = [pass_loss, None, None]  # preflight refuses augmentation with the pipeline
                else:
                    terms = self._discriminator_micro_steps(reals, step, phase, with_r1)
            # A reused G forward is G's step's (its graph is): a skipped D step leaves G's buffers to that step.
            moved = ("D",) if self.reuse_fake else ("G", "D")
            loss_d, penalty_d, real_sign, grad_norm = self._finish_step(self.D, self.opt_d, terms, moved)
            # ADA's p moves on the sign of D(real) agreed in that step's all-reduce: the same p on every rank.
            self.augment.adjust(real_sign, critic == self.cfg.loss.n_critic - 1
                                and (step + 1) % self.cfg.augment.interval == 0)
        return {"loss_d": loss_d, "penalty_d": penalty_d, "grad_norm_d": grad_norm, **self.augment.metrics()}

    def _discriminator_micro_steps(self, reals: list[Sample], step: int, phase: int,
                                   with_r1: bool) -> list[Tensor | None]:
        """Forward and backward of every micro-batch; D's gradients are reduced in the last one's backward.
        Spectral norm (in G or D) refines its estimate in the first micro-step only: once per step, as a step
        of the whole batch in one micro-step does, whatever the accumulation (models/spectral.py).
        Returns the adversarial loss, the penalty (None on a step without one) and the mean sign of D(real) (None
        without ADA), means over micro-batches."""
        z_all, labels_all = self._global_latents(step, phase), self._global_labels(step, phase)
        alpha_all = self._global_uniform(step, phase) if self.cfg.loss.with_gradient_penalty else None
        accumulation = len(reals)
        means = MicroStepMeans(accumulation)
        for micro, real in enumerate(reals):
            z, labels = self._take(z_all, micro), self._take(labels_all, micro)
            with (self.D.gradient_sync(micro == accumulation - 1),  # no_sync covers forward and backward
                  self.G.power_iteration(micro == 0), self.D.power_iteration(micro == 0),
                  seeds_from(z)):  # the networks' own randomness, per sample (ganscale.randomness)
                with torch.set_grad_enabled(self.reuse_fake), self.precision.autocast():
                    fake = self.task.generate(self.G, real, z, labels)
                self.fingerprints.judged(fake)  # log.fingerprints: what verify names when G's output differs
                self._fake_for_g = (fake, labels, z) if self.reuse_fake else None
                adversarial, penalty, real_sign = self._d_objective(real, fake.detach(), labels, with_r1,
                                                                    self._take(alpha_all, micro))
                loss = adversarial if penalty is None else adversarial + penalty
                means.add(adversarial, penalty, real_sign)
                if micro == accumulation - 1:
                    self._offer_agreement(self.D, means.values)
                self.precision.scale(means.share(loss)).backward()
        return means.values

    def _take(self, global_tensor: Tensor | None, micro: int) -> Tensor | None:
        return None if global_tensor is None else self.slicing.take(global_tensor, micro)

    def _d_objective(self, sample: Sample, fake: Tensor, labels: Tensor | None, with_r1: bool,
                     alpha: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """D's loss on one micro-batch: one D forward over [real, fake, (interpolates)], augmented (the penalties
        differentiate through the augmentation), its penalty (R1, gradient penalty) or None, and ADA's sign of
        D(real) or None."""
        loss_cfg = self.cfg.loss
        real = self.task.critic_view(sample, self.task.real_images(sample))
        fake = self.task.critic_view(sample, fake)
        b = real.shape[0]
        if with_r1:
            real = real.detach().requires_grad_(True)
        parts = [real, fake]
        if alpha is not None:
            shape = [b] + [1] * (real.dim() - 1)
            interp = (alpha.view(shape) * real.detach() + (1 - alpha.view(shape)) * fake).requires_grad_(True)
            parts.append(interp)
        seen = self.augment(torch.cat(parts))
        with self.precision.autocast():
            logits = self.D(seen, *self.task.critic_conditions(sample, labels))
        real_logits, fake_logits, *interp_logits = logits.chunk(len(parts))  # a packed D (model.pack) gives b/pack each
        adversarial = objectives.d_loss(loss_cfg.kind, real_logits, fake_logits)
        penalty = None
        scale = self.precision.loss_scale  # known on the host (precision.py): reading it never waits for the GPU
        if with_r1:
            penalty = 0.5 * loss_cfg.r1_gamma * loss_cfg.r1_interval * objectives.r1_penalty(real_logits, real, scale)
        if alpha is not None:
            gp = loss_cfg.gp_weight * objectives.gradient_penalty(interp_logits[0], interp, scale)
            penalty = gp if penalty is None else penalty + gp
        return adversarial, penalty, self.augment.real_sign(real_logits)

    def generator_step(self, step: int, reals: list[Sample]) -> dict[str, float]:
        with self.phase("G step (DDP all-reduce in backward)", traffic="g_step"):
            self.D.trainable(False)  # G's loss flows through D; D's weights are not G's to update
            if self._fake_for_g is None:  # else G's output and saved activations from D's step are still needed
                self.G.begin_iteration()
                self.buffers.take("G", "D")
            else:  # G's buffers as they were before its forward in D's step
                self.buffers.take("D")
            with self.phase(part="g_forward_backward"):
                if self.pipeline is not None:
                    z = self.slicing.take(self._global_latents(step, PHASE_G), 0)
                    with self.precision.autocast():
                        terms = [self.pipeline.generator_pass(z, scale_loss=self.precision.scale), None]
                else:
                    terms = self._generator_micro_steps(reals, step)
            self.D.trainable(True)
            loss_g, reconstruction_g, grad_norm = self._finish_step(self.G, self.opt_g, terms, ("G", "D"))
        return {"loss_g": loss_g, "l1_g": reconstruction_g, "grad_norm_g": grad_norm}

    def _generator_micro_steps(self, reals: list[Sample], step: int) -> list[Tensor | None]:
        """Forward through G and the frozen D, backward into G; G's gradients are reduced in the last backward.
        Spectral norm refines its estimate in the first micro-step only, as in D's step (the frozen D's too:
        a step of the whole batch refines it in its one forward).
        Returns G's loss and its reconstruction part (None for tasks without one), means over micro-batches."""
        reused, self._fake_for_g = self._fake_for_g, None  # D's step's samples (with graph), classes, latents, if kept
        if reused is None:
            z_all, labels_all = self._global_latents(step, PHASE_G), self._global_labels(step, PHASE_G)
        accumulation = self.slicing.accumulation  # 1 when reused (preflight.reuse_fake_conflict)
        means = MicroStepMeans(accumulation)
        for micro, sample in enumerate(reals):
            z = reused[2] if reused is not None else self._take(z_all, micro)
            # D is frozen here: its forward skips DDP (Wrapped.__call__), but a compiled D still runs through
            # it, and must not arm a gradient reduction it would fire during the next D step's first no_sync
            # micro-step (an extra all-reduce per iteration).
            with (self.G.gradient_sync(micro == accumulation - 1), self.D.gradient_sync(False),
                  self.G.power_iteration(micro == 0), self.D.power_iteration(micro == 0), seeds_from(z)):
                with self.precision.autocast():
                    if reused is not None:
                        fake, labels, _ = reused
                    else:
                        labels = self._take(labels_all, micro)
                        fake = self.task.generate(self.G, sample, z, labels)
                    logits = self.D(self.augment(self.task.critic_view(sample, fake)),
                                    *self.task.critic_conditions(None, labels))
                loss = objectives.g_loss(self.cfg.loss.kind, logits)
                reconstruction = self.task.reconstruction(fake, sample)
                if reconstruction is not None:
                    loss = loss + reconstruction
                means.add(loss, reconstruction)
                if micro == accumulation - 1:
                    self._offer_agreement(self.G, means.values)
                self.precision.scale(means.share(loss)).backward()
        return means.values

    def r1_step(self, phase: phases.TrainingPhase, step: int) -> dict[str, float]:
        """D reg (loss.lazy_regularization=separate): R1 on the last D batch's reals, its own optimizer step."""
        with self.phase("D reg step (DDP all-reduce in backward)", traffic="d_step"):
            self.precision.update()  # D's optimizer stepped already in this iteration: the scaler's update first
            self.D.trainable(True)
            self.D.begin_iteration()
            self.buffers.take("D")
            with self.phase(part="d_forward_backward"):
                terms = self._r1_micro_steps(self._reals, step, phase)
            penalty, grad_norm = self._finish_step(self.D, self.opt_d, terms, ("D",))
        return {"penalty_r1": penalty, "grad_norm_d_reg": grad_norm}

    def _r1_micro_steps(self, reals: list[Sample], step: int, phase: phases.TrainingPhase) -> list[Tensor | None]:
        """Forward of D on the augmented reals and backward of gamma/2 x interval x R1 (the gradient with respect to
        the un-augmented reals), per micro-batch (D main refined spectral norm's estimate for this iteration
        already). Returns the penalty, mean over micro-batches."""
        weight = 0.5 * self.cfg.loss.r1_gamma * phase.interval
        z_all = self._global_latents(step, PHASE_R1)  # only the samples' seeds: augmentation draws from them
        means = MicroStepMeans(len(reals))
        for micro, sample in enumerate(reals):
            last = micro == len(reals) - 1
            with self.D.gradient_sync(last), self.D.power_iteration(False), seeds_from(self._take(z_all, micro)):
                real = self.task.critic_view(sample, self.task.real_images(sample)).detach().requires_grad_(True)
                labels = self.task.real_labels(sample)
                with self.precision.autocast():
                    logits = self.D(self.augment(real), *self.task.critic_conditions(None, labels))
                penalty = weight * objectives.r1_penalty(logits, real, self.precision.loss_scale)
                means.add(penalty)
                if last:
                    self._offer_agreement(self.D, means.values)
                # D's last bias does not reach the input gradient: a zero term gives DDP a gradient for every parameter
                loss = penalty + 0 * logits.float().sum()
                self.precision.scale(means.share(loss)).backward()
        return means.values

    def path_length_step(self, phase: phases.TrainingPhase, step: int) -> dict[str, float]:
        """G reg: path length regularisation, its own optimizer step. Then pl_mean moves towards the step's mean
        length over every rank, agreed in the step's one all-reduce (_finish_step), so it is the same everywhere."""
        with self.phase("G reg step (DDP all-reduce in backward)", traffic="g_step"):
            self.precision.update()  # G's optimizer stepped already in this iteration: the scaler's update first
            self.G.begin_iteration()
            self.buffers.take("G")
            skipped_before = self.skipped_steps
            with self.phase(part="g_forward_backward"):
                terms = self._path_length_micro_steps(step, phase)
            penalty, mean_length, grad_norm = self._finish_step(self.G, self.opt_g, terms, ("G",))
        if self.skipped_steps == skipped_before:  # a skipped step leaves pl_mean too
            self.pl_mean += self.cfg.loss.pl_decay * (mean_length - self.pl_mean)
        return {"penalty_pl": penalty, "pl_mean": self.pl_mean, "grad_norm_g_reg": grad_norm}

    def _path_length_micro_steps(self, step: int, phase: phases.TrainingPhase) -> list[Tensor | None]:
        """Per micro-batch of the path length batch: images and their ws, the path lengths (a gradient with its
        graph), weight x interval x (length - pl_mean)^2, backward (its double backward through G). pl_mean is the
        one before this step: the step's mean length is known only once the ranks have agreed on it.
        Returns the penalty and the mean length, means over micro-batches."""
        slicing, loss_cfg = self.pl_slicing, self.cfg.loss
        z_all = self._global_latents(step, PHASE_PATH_LENGTH, slicing.global_batch)
        labels_all = self._global_labels(step, PHASE_PATH_LENGTH, slicing.global_batch)
        weight = loss_cfg.pl_weight * phase.interval
        means = MicroStepMeans(slicing.accumulation)
        for micro in range(slicing.accumulation):
            last = micro == slicing.accumulation - 1
            z = slicing.take(z_all, micro)
            labels = None if labels_all is None else slicing.take(labels_all, micro)
            with self.G.gradient_sync(last), self.G.power_iteration(False), seeds_from(z):
                with self.precision.autocast():
                    images, ws = self.G(z, labels, return_ws=True)
                height, width = images.shape[2:]
                noise = normal(z, PL_NOISE_SALT, images.shape[1:], sample_seeds(z)) / math.sqrt(height * width)
                lengths = objectives.path_lengths(images, ws, noise, self.precision.loss_scale)
                penalty = weight * objectives.path_length_penalty(lengths, self.pl_mean)
                means.add(penalty, lengths.mean())
                if last:
                    self._offer_agreement(self.G, means.values)
                # G's output biases do not reach the gradient w.r.t. ws: a zero term gives DDP a gradient for each
                loss = penalty + 0 * images.float().sum()
                self.precision.scale(means.share(loss)).backward()
        return means.values

    def _agreement(self, terms: list[Tensor | None]) -> Tensor:
        """What the ranks sum once per optimizer step: the loss terms the step has, and the stop flags."""
        present = [t for t in terms if t is not None]
        return torch.cat([torch.stack(present), present[0].new_tensor(self._stop_flags())])

    def _offer_agreement(self, net: Wrapped, terms: list[Tensor | None]) -> None:
        """Before the backward that reduces `net`'s gradients: under DDP, the step's agreement all-reduce
        (`_finish_step`) is folded into that gradient all-reduce (one collective instead of two). The stop
        flag is read here, before that backward: a signal that arrives during it stops the run one
        optimizer step later, on every rank alike."""
        if net.carrier is not None:  # else _finish_step makes the agreement's own all-reduce
            net.carry_with_gradients(self._agreement(terms))

    def _finish_step(self, net: Wrapped, optimizer: torch.optim.Optimizer, terms: list[Tensor | None],
                     moved: tuple[str, ...]) -> tuple[float, ...]:
        """Clip, agree on skipping and stopping, step; a skipped step puts back the buffers of `moved` (the
        networks whose forwards it owns). Returns the global mean of each loss term (0 for an
        absent one: the same on every rank) and the pre-clip gradient norm."""
        with self.phase(part="optimizer"):
            self.precision.unscale_(optimizer)
            grad_norm = net.grad_norm(self.cfg.train.grad_clip)  # gradients are already averaged: same on all ranks
        # Summed over ranks, a non-finite loss or gradient norm on any rank is non-finite on every rank:
        # the skip decision needs no flag of its own, and is taken on Python floats (no more tensor ops).
        with self.phase("all-reduce of losses and skip/stop flags", part="sync"):
            if self.runtime.world == 1:  # its values already are the global ones: one device-to-host copy, no gloo
                present = [t.float() for t in terms if t is not None]
                *sums, norm = torch.stack([*present, grad_norm.to(present[0].device, torch.float32)]).tolist()
                norm_sum, sums = norm, [*sums, *self._stop_flags()]
            elif net.carrier is not None:  # DDP (a property of the strategy, the same on every rank):
                norm = norm_sum = grad_norm.item()  # of gradients already averaged: the same on every rank
                sums = net.carried()  # summed with the gradients in backward
                if sums is None:
                    raise RuntimeError(f"step {self.step}: DDP's gradient all-reduce carried no agreement values "
                                       "(was carry_with_gradients called before the last micro-step's backward?)")
            else:
                norm = grad_norm.item()
                packed = torch.cat([self._agreement(terms), grad_norm.to(device=self.runtime.device).view(1)])
                dist.all_reduce(packed)  # one collective: global mean losses, the skip and the stop decisions
                *sums, norm_sum = packed.tolist()
        *sums, stops, lost = sums
        skip = not all(math.isfinite(v) for v in (*sums, norm_sum))
        self.stop_agreed = self.stop_agreed or stops > 0
        self.taken_over = self.taken_over or lost > 0
        present_sums = iter(sums)  # in the order of the terms the step has
        means = [0.0 if t is None else next(present_sums) / self.runtime.world for t in terms]
        # log.fingerprints: a collective in a D step (G's samples over every rank) and for sharded gradients
        self.fingerprints.optimizer_step(self.step, "G" if net is self.G else "D", net.module, means)
        with self.phase(part="optimizer"):
            if skip:  # every rank alike: the parameters stay, and the buffers its forwards moved go back
                self.skipped_steps += 1
                self.non_finite_steps += not self.precision.backing_off(all(math.isfinite(v) for v in sums))
                self.buffers.restore(*moved)
                self.precision.skipped()
            else:
                self.precision.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        return (*means, norm)

    # ----------------------------------------------------------------------------------- outputs
    def rank0_writes(self, what: str):
        """`fault.rank0_writes` (a collective on leaving the block), marked for the hang watchdog."""
        return rank0_writes(what, lambda where: self.watchdog.mark(f"step {self.step}: {where}"))

    def synchronise_buffers(self) -> None:
        """Collective: make per-rank BatchNorm statistics one."""
        self.watchdog.mark(f"step {self.step}: all-reduce of BatchNorm statistics")
        self.G.synchronise_batchnorm(self.G.module, self.D.module, self.G_ema)

    def ready_for_outputs(self) -> None:
        """Collective, before sampling, evaluating or saving: BatchNorm statistics made one, and every rank stops
        (NonFiniteTraining, the tensor named) if any holds a non-finite parameter or buffer of G, D or G_ema."""
        self.synchronise_buffers()
        with every_rank_or_none("keep G, D and G_ema finite", self.watchdog.mark):  # collective: one all-reduce
            refuse_non_finite({"G": self.G.held(), "D": self.D.held(), "G_ema": self.G.held(self.G_ema)},
                              f"at step {self.step}", f"nothing of this step was saved; {self._non_finite_fix()}")

    def configure_optimizers(self) -> None:
        """The config's Adam settings on every parameter group (`initial_lr` is what the schedule scales), with
        StyleGAN2's lazy regularisation correction where a network has a regularisation phase of its own. Also
        after a resume: the optimizer state brings back the checkpoint's groups, whose lr, betas and weight decay
        would silently override what a resumed run's --set changed (and its config.resumed file records)."""
        for name, optimizer, settings in (("G", self.opt_g, self.cfg.optim.g), ("D", self.opt_d, self.cfg.optim.d)):
            lr, betas = phases.corrected_adam(settings.lr, tuple(settings.betas), phases.lazy_ratio(self.phases, name))
            for group in optimizer.param_groups:
                group.update(initial_lr=lr, betas=betas, weight_decay=settings.weight_decay)
