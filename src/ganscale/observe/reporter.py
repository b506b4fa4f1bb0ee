"""What a run shows of itself, each on its own cadence: metrics (`log.every`), sample pictures
(`log.sample_every`) and image scores (`eval.every`), each also at the last step, and the summary at the end.
Every rank draws and scores its share; rank 0 alone writes, agreed where it writes (`rank0_writes`).
"""

from __future__ import annotations

import resource
import time
from typing import TYPE_CHECKING

import torch

from ganscale import checkpoint, slurm
from ganscale.data import build_dataset
from ganscale.data.mixtures import MIXTURE_MODES
from ganscale.fault import restart_count
from ganscale.metrics.images import ImageScorer
from ganscale.metrics.modes2d import PROTOCOL_SAMPLES, score_named
from ganscale.observe import RunLog
from ganscale.observe.samples import image_grid, scatter, write_png
from ganscale.outputs import write_output

if TYPE_CHECKING:
    from ganscale.trainer import Trainer


class Reporter:
    """Reports on `training`. Built before the run directory is written (its image scorer draws from the global
    RNG, which a resume restores after); `open` then starts the log in the run directory."""

    def __init__(self, training: Trainer):
        self.training, self.cfg = training, training.cfg
        self.sample_z = training.sample_latents(self.cfg.log.samples)
        # the whole data source, also when data.max_images trains on a subset (ADA's protocol)
        self.image_scorer = ImageScorer(self.cfg, build_dataset(self.cfg, whole=True), training.runtime.device,
                                        progress=lambda: training.watchdog.mark(
                                            f"step {training.step}: image metrics (local batches and distances)")
                                        ) if self.cfg.eval.every else None  # collective
        self.log: RunLog | None = None
        self.record: dict[str, float] = {}   # the last metrics logged
        self.quality: dict[str, float] = {}  # the last sample scores and image metrics
        self.begin()

    def open(self) -> None:
        """Start metrics.jsonl (cut back to the resumed step), TensorBoard and the progress bar, on rank 0."""
        training = self.training
        self.log = RunLog(training.run_dir, self.cfg.train.steps, training.step, self.cfg.log.tensorboard,
                          training.runtime.is_main)

    def begin(self) -> None:
        """Training starts: the summary's throughput counts from here."""
        self.start_step = self.logged_step = self.training.step
        self.started = time.perf_counter()

    def after_step(self) -> None:
        """Every step: the progress bar moves; the step whose traffic was measured prints it."""
        self.log.advance()
        if self.training.traffic.enabled and self.training.runtime.is_main:
            print(f"communicated per step  {self.training.traffic.report()}", flush=True)

    def log_metrics(self, step: int, final: bool, losses: dict[str, float]) -> None:
        """Collective when due (every `log.every` steps and the last): `losses` with the skip count, the bytes held
        and communicated and where the time went, into metrics.jsonl, TensorBoard and the console."""
        if step % self.cfg.log.every and not final:
            return
        training = self.training
        held = {f"held_bytes_{net.lower()}": sum(training.memory[0][net].values()) for net in ("G", "D")}
        sent = {f"comm_bytes_{phase}": n for phase, n in training.traffic.totals().items()}
        times = training.times.take(step - self.logged_step)  # this rank's; rank 0's are logged
        self.logged_step = step
        values = {**losses, "skipped_steps": training.skipped_steps, **held, **sent, **times}
        with training.rank0_writes("metrics"):  # collective on leaving: one broadcast
            self.record = self.log.log(step, values, training.global_batch)

    def due(self, step: int, final: bool) -> bool:
        """Whether `step` draws samples or scores images (`report`)."""
        return self._sample_due(step, final) or self._score_due(step, final)

    def _sample_due(self, step: int, final: bool) -> bool:
        return bool(self.cfg.log.sample_every and step % self.cfg.log.sample_every == 0) or final

    def _score_due(self, step: int, final: bool) -> bool:
        return self.image_scorer is not None and (step % self.cfg.eval.every == 0 or final)

    def report(self, step: int, final: bool) -> None:
        """Collective: the sample picture and the image scores that are due at `step`. Drawn beside the training's
        RNG streams, not from them: a G whose forward draws from them (torch.randn) trains the same whatever the
        sample cadence, and a run resumed from a stopped run's last step goes on as the uninterrupted one."""
        device = self.training.runtime.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            if self._sample_due(step, final):
                self.quality = self.write_samples()
            if self._score_due(step, final):
                self.quality = {**self.quality, **self.score_images()}

    def write_samples(self) -> dict[str, float]:
        """Every rank draws from G_ema (a collective when G_ema is sharded); rank 0 writes the picture.

        For the 2D mixtures it also scores 2,500 samples with the VEEGAN/PacGAN measures and returns them.
        """
        training, kind = self.training, self.cfg.data.kind
        training.ready_for_outputs()
        mixture = kind in MIXTURE_MODES
        z = training.sample_latents(PROTOCOL_SAMPLES) if mixture else self.sample_z
        with torch.no_grad():
            drawn = training.task.preview(training.G_ema, z).float().cpu()
        quality: dict[str, float] = {}
        with training.rank0_writes("samples"):  # collective on leaving: one broadcast
            if training.runtime.is_main:
                if mixture:
                    quality = score_named(kind, drawn).as_dict()
                    self.log.add_scalars("quality", quality, training.step)
                    picture = scatter(drawn, MIXTURE_MODES[kind]())
                else:
                    picture = image_grid(drawn, cols=training.task.grid_columns)
                write_output(training.run_dir / "samples" / f"step-{training.step:08d}.png",
                             lambda tmp: write_png(picture, tmp), "--run-dir")
                self.log.add_image("samples", picture, training.step)
        return quality

    def score_images(self) -> dict[str, float]:
        """Collective: image metrics of G_ema, every rank generating its share; rank 0 logs them."""
        training = self.training
        training.ready_for_outputs()
        training.watchdog.mark(f"step {training.step}: image metrics (features all-gathered)")
        scores = self.image_scorer.score(lambda z: training.task.from_noise(training.G_ema, z).float())
        with training.rank0_writes("image metrics"):  # collective on leaving: one broadcast
            if training.runtime.is_main:
                self.log.add_scalars("quality", scores, training.step)
                self.log.log_extra(training.step, {f"eval_{k}": v for k, v in scores.items()})
        return scores

    def close(self, stopped: str | None = None) -> dict:
        """Collective: the run's summary, written to summary.json by rank 0 (`stopped`: why it ended early)."""
        summary = self.summary(stopped)
        with self.training.rank0_writes("summary"):  # collective on leaving: one broadcast
            self.log.close(summary)
        return summary

    def summary(self, stopped: str | None = None) -> dict:
        training = self.training
        wall = time.perf_counter() - self.started
        device = training.runtime.device
        return {"steps": training.step, "world_size": training.runtime.world, "global_batch": training.global_batch,
                "micro_batch": training.slicing.micro_batch, "accumulation_steps": training.slicing.accumulation,
                "skipped_steps": training.skipped_steps, "stopped": stopped, "wall_s": wall,
                "restarts": restart_count(), "requeues": slurm.requeue_count(),
                "img_per_s": (training.step - self.start_step) * training.global_batch / max(wall, 1e-9),
                "final": self.record, "quality": self.quality, "held_bytes": training.memory,
                "communicated_bytes": {phase: dict(kinds) for phase, kinds in training.traffic.by_phase.items()},
                "communicated_at_start_up": training.traffic.start_up,  # the measured step carried one-time work
                "max_memory_allocated": (torch.cuda.max_memory_allocated(device)  # rank 0's peak
                                         if device.type == "cuda" else None),
                "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # rank 0's host peak
                "checkpoint": str(checkpoint.latest(training.run_dir))}
