"""The tensorflow engine's training loop and run directory: the torch trainer's order (D step(s), G step, EMA, logs,
samples, image metrics, checkpoints) and its files (config.yaml, metrics.jsonl, tensorboard/, samples/, checkpoints/,
summary.json).

One process drives every replica, so every decision (skip a step, stop after a signal, write an output) is taken
once, on the host. A checkpoint is a tf.train.Checkpoint folder `checkpoints/step-N.tf` (written in a staging folder
and renamed, then marked complete, as the torch engine's): G, D, G_ema, both optimizers and the step counters. The
data and the noise are functions of the step (feed.py), so they resume exactly from the step alone.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

from ganscale import checkpoint
from ganscale.config import Config, ConfigError, to_yaml
from ganscale.ema import ema_beta
from ganscale.fault import NonFiniteTraining, Preempted, RunDirectoryTakenOver, StopSignals, injected_fault, told_by
from ganscale.models import meta_networks
from ganscale.observe import RunLog
from ganscale.outputs import write_output
from ganscale.preflight import cross_rank_batchnorm
from ganscale.rundir import config_to_write
from ganscale.runlock import LOCK_NAME, LockWatch
from ganscale.tf.feed import Feed, training_data
from ganscale.tf.models import build_discriminator, build_generator
from ganscale.tf.step import Steps, adam
from ganscale.trainer import PHASE_D, PHASE_G, PHASE_SAMPLES, lr_factor, per_rank_batchnorm
from ganscale.watchdog import Watchdog

CHECKPOINT_PREFIX = "ckpt"  # inside step-N.tf: ckpt.index and ckpt.data-*


class Training:
    """G, D, G_ema and their optimizers on the replicas of `strategy`, at `self.step`. `rank` and `workers`: this
    process among the worker processes (tf.workers; rank 0 is the chief), or the only one."""

    def __init__(self, cfg: Config, strategy: tf.distribute.Strategy, run_dir: Path, resume: Path | None = None,
                 run_lock: LockWatch | None = None, rank: int = 0, workers: int = 1):
        self.cfg, self.strategy, self.run_dir = cfg, strategy, Path(run_dir)
        self.rank, self.chief = rank, rank == 0
        self.run_lock = run_lock  # the chief's hold on the run directory (or its watch of the launcher's)
        if run_lock is not None:
            run_lock.stops_run = True  # the stop says it: the lock's own warning would say it twice
        self.replicas = strategy.num_replicas_in_sync
        self.multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
        self.global_batch = cfg.train.batch_size
        sync_bn = cross_rank_batchnorm(cfg, self.replicas)
        # The torch engine's rule, on its networks (this engine's have the same layers; a replica is a rank there).
        warning = per_rank_batchnorm(cfg, self.replicas, *meta_networks(cfg)) if self.chief else None
        if warning:
            print(f"ganscale: warning: {warning}", file=sys.stderr, flush=True)
        tf.config.experimental.enable_tensor_float_32_execution(cfg.train.tf32)
        keras.utils.set_random_seed(cfg.train.seed)  # the initial weights: the same on any number of replicas
        with strategy.scope():
            self.G, self.D = build_generator(cfg, sync_bn), build_discriminator(cfg)
            self.G_ema = build_generator(cfg, False, name="G_ema")
            self.G_ema.set_weights(self.G.get_weights())
            scaled = cfg.train.precision == "fp16"
            self.opt_g = adam(cfg.optim.g.lr, tuple(cfg.optim.g.betas), loss_scaling=scaled)
            self.opt_d = adam(cfg.optim.d.lr, tuple(cfg.optim.d.betas), loss_scaling=scaled)
            self.opt_g.build(self.G.trainable_variables)
            self.opt_d.build(self.D.trainable_variables)
            self.counters = tf.Variable([0, 0, 0], dtype=tf.int64)  # step, skipped steps, consecutive skips
        self.steps = Steps(strategy, self.G, self.D, self.opt_g, self.opt_d, cfg.loss.kind, self.global_batch,
                           cfg.train.grad_clip)
        self.state = tf.train.Checkpoint(G=self.G, D=self.D, G_ema=self.G_ema, opt_g=self.opt_g, opt_d=self.opt_d,
                                         counters=self.counters)
        self._ema_pairs = list(zip(self.G_ema.trainable_variables, self.G.trainable_variables))
        self._ema_buffers = list(zip(self.G_ema.non_trainable_variables, self.G.non_trainable_variables))
        self._update_ema = tf.function(self._ema_update)
        if resume is not None:
            self.restore(resume)
        self.step, self.skipped_steps, self.consecutive_skips = (int(v) for v in self.counters.numpy())
        self.feed = Feed(cfg, strategy, training_data(cfg))
        self.stats: dict[str, float] = {}
        self.stop_signal: str | None = None
        # The torch engine's: a worker without progress for fault.hang_timeout_s (or, after a stop signal, that has
        # not left within fault.exit_timeout_s) writes its stacks to RUN_DIR/diagnostics/, names the workers behind
        # and exits 5; the others wait in TensorFlow's collectives, which have no deadline of their own.
        self.watchdog = Watchdog(rank, workers, cfg.fault.hang_timeout_s, self.run_dir / "diagnostics",
                                 cfg.fault.exit_timeout_s)
        self.inject_fault = injected_fault(stopping=lambda: self.stop_signal is not None)

    # ------------------------------------------------------------------------------------------- one iteration
    def iteration(self) -> None:
        """D's loss.n_critic steps, then G's, then G_ema; the step counters move."""
        cfg, step = self.cfg, self.step
        self.watchdog.mark(f"step {step}: start")
        self.inject_fault(step, self.rank)
        factor = lr_factor(step, cfg.train.steps, cfg.optim.decay_start)
        self.opt_d.learning_rate.assign(cfg.optim.d.lr * factor)
        self.opt_g.learning_rate.assign(cfg.optim.g.lr * factor)
        skipped_before = self.skipped_steps
        for critic in range(cfg.loss.n_critic):
            self.watchdog.mark(f"step {step}: D step {critic + 1} of {cfg.loss.n_critic}")
            d = self.steps.discriminator(self.feed.reals(step * cfg.loss.n_critic + critic),
                                         self.feed.latents(step, PHASE_D + critic))
            self.skipped_steps += not d.applied
        self.watchdog.mark(f"step {step}: G step")
        g = self.steps.generator(self.feed.latents(step, PHASE_G))
        self.skipped_steps += not g.applied
        self.step = step + 1
        if g.applied:  # a skipped G step leaves G_ema as it was too
            beta = ema_beta(self.global_batch, self.step * self.global_batch, cfg.train.ema_half_life_images,
                            cfg.train.ema_rampup)
            with self.strategy.scope():
                self._update_ema(tf.constant(beta, tf.float32))
        self.consecutive_skips = self.consecutive_skips + 1 if self.skipped_steps > skipped_before else 0
        self.stats = {"loss_d": d.loss, "penalty_d": 0.0, "grad_norm_d": d.grad_norm,
                      "loss_g": g.loss, "l1_g": 0.0, "grad_norm_g": g.grad_norm}

    def _ema_update(self, beta: tf.Tensor) -> None:
        """G_ema moves towards G (ganscale.ema's lerp); its BatchNorm statistics are G's."""
        for ema, weight in self._ema_pairs:
            ema.assign(ema + (1.0 - beta) * (weight - ema))
        for ema, buffer in self._ema_buffers:
            ema.assign(buffer)

    def stops_agreed(self, writes: bool) -> tuple[bool, bool]:
        """(whether any worker was asked to stop, whether the chief's lock on the run directory is another run's):
        one all-reduce across the workers (one process decides alone). `writes`: this iteration writes to the run
        directory, so the chief reads its lock now rather than trusting the lock's thread (every RENEW_S)."""
        lost = self.run_lock is not None and self.run_lock.is_lost(read_now=writes)
        flags = [float(self.stop_signal is not None), float(lost)]
        if self.multi_worker:
            self.watchdog.mark(f"step {self.step}: all-reduce of the stop flags")
            flags = self._agree(tf.constant(flags)).numpy().tolist()
        return flags[0] > 0, flags[1] > 0

    @tf.function
    def _agree(self, flags: tf.Tensor) -> tf.Tensor:
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, self.strategy.run(lambda: flags), axis=None)

    # ------------------------------------------------------------------------------------------- checkpoints
    def save(self) -> Path | None:
        """The chief's checkpoint folder. Every worker writes (TensorFlow requires it of MultiWorkerMirroredStrategy),
        the others into a temporary folder they then remove: the run directory is the chief's alone."""
        self.watchdog.mark(f"step {self.step}: checkpoint")
        self.counters.assign([self.step, self.skipped_steps, self.consecutive_skips])
        if not self.chief:
            with tempfile.TemporaryDirectory(prefix="ganscale-tf-worker-") as scratch:
                self.state.write(str(Path(scratch) / CHECKPOINT_PREFIX))
            return None
        return checkpoint.save_folder(lambda folder: self.state.write(str(folder / CHECKPOINT_PREFIX)),
                                      self.run_dir, self.step, self.cfg.checkpoint.keep)

    def restore(self, path: Path) -> None:
        try:
            self.state.read(str(path / CHECKPOINT_PREFIX)).assert_existing_objects_matched()
        except (tf.errors.OpError, AssertionError, ValueError) as e:
            raise ConfigError("--resume", f"{path} does not fit this config's networks "
                              f"({str(e).splitlines()[0][:200]})",
                              "resume with the config the run was trained with") from None

    # ------------------------------------------------------------------------------------------- samples
    def samples(self, n: int) -> np.ndarray:
        """G_ema's samples of the fixed sample latents: images channels-first (N, C, H, W), or 2D points."""
        return self.draw(self.feed.global_latents(0, PHASE_SAMPLES, n))

    def draw(self, z: np.ndarray) -> np.ndarray:
        """G_ema's samples of latents `z` (eval mode): images channels-first, as the torch engine's, or 2D points."""
        drawn = self.G_ema(tf.constant(z, tf.float32), training=False).numpy()
        return drawn if drawn.ndim == 2 else drawn.transpose(0, 3, 1, 2)


def train(cfg: Config, strategy: tf.distribute.Strategy, run_dir: Path, resume: Path | None,
          run_lock: LockWatch | None = None, rank: int = 0, workers: int = 1) -> dict:
    """Train to train.steps on the replicas of `strategy`: this process's (`devices.strategy`), or every worker's
    (`devices.multi_worker`, where only the chief, rank 0, writes the run directory); the summary. `run_lock`: the
    chief's hold on the run directory: once another run holds it, every worker stops (RunDirectoryTakenOver)."""
    training = Training(cfg, strategy, run_dir, resume, run_lock, rank, workers)
    if training.chief:
        _write_config(training)
    outputs = Outputs(training)
    stop = StopSignals(lambda name: setattr(training, "stop_signal", name))
    with stop as signals, training.watchdog.watching(signals.wakeup):
        return _fit(training, outputs)


def _write_config(training: Training) -> None:
    training.run_dir.mkdir(parents=True, exist_ok=True)
    resolved = to_yaml(training.cfg)
    written = config_to_write(training.run_dir, training.step, resolved)
    if written is not None:
        write_output(written, lambda tmp: tmp.write_text(resolved), "--run-dir")


def _fit(training: Training, outputs: Outputs) -> dict:
    cfg = training.cfg
    outputs.begin()
    while training.step < cfg.train.steps:
        training.iteration()
        final = training.step == cfg.train.steps
        checkpoint_due = bool(cfg.checkpoint.every and training.step % cfg.checkpoint.every == 0)
        writes = (final or checkpoint_due or outputs.log_due(final) or outputs.sample_due(final)
                  or outputs.score_due(final) or training.stop_signal is not None)
        # Agreed before anything of the step is written: a run whose directory another run took writes nothing more.
        stopping, taken_over = training.stops_agreed(writes)
        if taken_over:
            error = RunDirectoryTakenOver.at(training.run_dir, training.run_dir / LOCK_NAME, training.step)
            raise error if training.chief else told_by(0, error)
        outputs.log_metrics(final)
        if training.consecutive_skips >= cfg.fault.max_consecutive_skips:
            outputs.close("non-finite")
            raise NonFiniteTraining(f"{training.consecutive_skips} consecutive steps had non-finite losses or "
                                    f"gradients (last: {training.stats}); lower optim.*.lr or set train.grad_clip")
        if outputs.sample_due(final) and training.chief:
            outputs.write_samples()
        if outputs.score_due(final):
            outputs.score_images()  # collective: every worker scores its share
        if final or stopping or checkpoint_due:
            training.save()
        if stopping and not final:
            outputs.close("preempted")
            raise Preempted(f"stopped at step {training.step} on request ({training.stop_signal or 'on another worker'}); checkpoint "
                            "written; continue with --resume auto")
    return outputs.close()


class Outputs:
    """metrics.jsonl, TensorBoard and the console (ganscale.observe.RunLog), sample grids and the summary."""

    def __init__(self, training: Training):
        self.training, self.cfg = training, training.cfg
        self.run_log = RunLog(training.run_dir, self.cfg.train.steps, training.step, self.cfg.log.tensorboard,
                              training.chief)
        self.record: dict[str, float] = {}
        self.quality: dict[str, float] = {}
        self.image_scorer = self._image_scorer() if self.cfg.eval.every else None  # collective (the reference)

    def _image_scorer(self):
        """The torch engine's image metrics (ganscale.metrics.images), on the CPU: every worker featurises its share
        of the data set once, here, and of G_ema's samples at each evaluation, in the workers' gloo group."""
        import torch

        from ganscale.data import build_dataset
        from ganscale.metrics.images import ImageScorer

        training = self.training
        training.watchdog.mark(f"step {training.step}: image metrics of the data set")
        # The whole data source, also when data.max_images trains on a subset (ADA's protocol).
        return ImageScorer(self.cfg, build_dataset(self.cfg, whole=True), torch.device("cpu"),
                           progress=lambda: training.watchdog.mark(
                               f"step {training.step}: image metrics (local batches and distances)"))

    def begin(self) -> None:
        self.start_step, self.started = self.training.step, time.perf_counter()

    def log_due(self, final: bool) -> bool:
        return final or self.training.step % self.cfg.log.every == 0

    def log_metrics(self, final: bool) -> None:
        training = self.training
        self.run_log.advance()
        if self.log_due(final):
            values = {**training.stats, "skipped_steps": training.skipped_steps}
            self.record = self.run_log.log(training.step, values, training.global_batch)

    def sample_due(self, final: bool) -> bool:
        every = self.cfg.log.sample_every
        return final or bool(every and self.training.step % every == 0)

    def write_samples(self) -> None:
        """The sample picture of G_ema (the torch engine's grid or scatter plot, and a mixture's mode scores)."""
        import torch

        from ganscale.data.mixtures import MIXTURE_MODES
        from ganscale.metrics.modes2d import PROTOCOL_SAMPLES, score_named
        from ganscale.observe.samples import image_grid, scatter, write_png

        training, kind = self.training, self.cfg.data.kind
        mixture = kind in MIXTURE_MODES
        drawn = torch.from_numpy(training.samples(PROTOCOL_SAMPLES if mixture else self.cfg.log.samples))
        if mixture:
            self.quality = score_named(kind, drawn).as_dict()
            self.run_log.add_scalars("quality", self.quality, training.step)
            picture = scatter(drawn, MIXTURE_MODES[kind]())
        else:
            picture = image_grid(drawn)
        write_output(training.run_dir / "samples" / f"step-{training.step:08d}.png",
                     lambda tmp: write_png(picture, tmp), "--run-dir")
        self.run_log.add_image("samples", picture, training.step)

    def score_due(self, final: bool) -> bool:
        return self.image_scorer is not None and (self.training.step % self.cfg.eval.every == 0 or final)

    def score_images(self) -> None:
        """Collective: image metrics of G_ema (fd and kid on eval.features, precision/recall, density/coverage), as
        the torch engine scores them; the chief logs them (metrics.jsonl's eval_*, TensorBoard's quality/)."""
        import torch

        training = self.training
        training.watchdog.mark(f"step {training.step}: image metrics (features all-gathered)")
        scores = self.image_scorer.score(lambda z: torch.from_numpy(training.draw(z.numpy())))
        self.run_log.add_scalars("quality", scores, training.step)  # the chief's log alone writes
        self.run_log.log_extra(training.step, {f"eval_{k}": v for k, v in scores.items()})
        self.quality = {**self.quality, **scores}

    def close(self, stopped: str | None = None) -> dict:
        training = self.training
        wall = time.perf_counter() - self.started
        summary = {"engine": "tensorflow", "steps": training.step, "world_size": training.replicas,
                   "global_batch": training.global_batch, "micro_batch": training.feed.micro,
                   "accumulation_steps": training.feed.accumulation, "skipped_steps": training.skipped_steps,
                   "stopped": stopped, "wall_s": wall,
                   "img_per_s": (training.step - self.start_step) * training.global_batch / max(wall, 1e-9),
                   "final": self.record, "quality": self.quality,
                   "checkpoint": str(checkpoint.latest(training.run_dir)) if training.chief else None}
        self.run_log.close(summary)
        return summary
