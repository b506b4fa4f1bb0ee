"""One optimizer step of D or G across the replicas, as on the torch engine.

Each replica runs its micro-steps and sums its gradients; every loss is averaged over the global batch
(`compute_average_loss(..., global_batch_size=)`), so the sum over replicas and micro-steps is the global batch's
mean. The gradients and losses are then summed across replicas in one all-reduce, which makes them identical on
every replica: the gradient norm is the global one, clipping by it is the same everywhere, and the decision to
skip a non-finite step is taken once, on the host, from those agreed values. Only then are the optimizer's
updates applied (a second replica call), or not at all, on every replica alike.

train.precision=fp16 wraps each Adam in Keras' LossScaleOptimizer (dynamic scale): the loss is multiplied by the
scale before the gradients are taken, and the summed gradients divided by it before their norm and clipping. A
skipped step halves the scale on every replica, as its own non-finite branch (and torch's GradScaler) does; an
applied one goes through its apply_gradients, which divides the scale out again and grows it every
`dynamic_growth_steps` finite steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import keras
import tensorflow as tf

SUM = tf.distribute.ReduceOp.SUM


class ReducedAdam(keras.optimizers.Adam):
    """Adam whose gradients arrive already summed across replicas (`Steps` reduces them itself, to clip by the
    global norm and agree on skipping first): Keras' own all-reduce in `apply_gradients` would sum them again."""

    def _all_reduce_sum_gradients(self, grads_and_vars):
        return grads_and_vars


Optimizer = ReducedAdam | keras.optimizers.LossScaleOptimizer


def adam(lr: float, betas: tuple[float, float], loss_scaling: bool = False) -> Optimizer:
    inner = ReducedAdam(learning_rate=lr, beta_1=betas[0], beta_2=betas[1], epsilon=1e-8)  # torch's eps
    return keras.optimizers.LossScaleOptimizer(inner) if loss_scaling else inner


def loss_scale(optimizer: Optimizer) -> tf.Tensor | float:
    """What the loss is multiplied by before its gradients are taken: the dynamic scale under fp16, else 1."""
    return optimizer.dynamic_scale if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) else 1.0


def d_losses(kind: str, real: tf.Tensor, fake: tf.Tensor) -> tf.Tensor:
    """Per-sample D losses (ganscale.objectives.d_loss is their mean)."""
    if kind == "nonsaturating":
        return tf.nn.softplus(-real) + tf.nn.softplus(fake)
    if kind == "hinge":
        return tf.nn.relu(1 - real) + tf.nn.relu(1 + fake)
    return 0.5 * (tf.square(real - 1) + tf.square(fake))  # lsgan


def g_losses(kind: str, fake: tf.Tensor) -> tf.Tensor:
    """Per-sample G losses (ganscale.objectives.g_loss is their mean)."""
    if kind == "nonsaturating":
        return tf.nn.softplus(-fake)
    if kind == "hinge":
        return -fake
    return 0.5 * tf.square(fake - 1)  # lsgan


def clip_by_global_norm(grads: list[tf.Tensor], clip: float) -> tuple[list[tf.Tensor], tf.Tensor]:
    """(clipped gradients, pre-clip norm), scaled as torch.nn.utils.clip_grad_norm_ does; clip 0: unchanged."""
    norm = tf.linalg.global_norm(grads)
    if clip <= 0:
        return grads, norm
    scale = tf.minimum(clip / (norm + 1e-6), 1.0)
    return [g * scale for g in grads], norm


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    applied: bool


class Steps:
    """D's and G's optimizer steps on `strategy`, as tf.functions traced once."""

    def __init__(self, strategy: tf.distribute.Strategy, G: keras.Model, D: keras.Model, opt_g: Optimizer,
                 opt_d: Optimizer, loss_kind: str, global_batch: int, grad_clip: float):
        self.strategy, self.G, self.D, self.opt_g, self.opt_d = strategy, G, D, opt_g, opt_d
        self.loss_kind, self.global_batch, self.grad_clip = loss_kind, global_batch, grad_clip
        self._d_gradients = tf.function(lambda reals, z: strategy.run(self._d_replica, args=(reals, z)))
        self._g_gradients = tf.function(lambda z: strategy.run(self._g_replica, args=(z,)))
        self._apply_d = tf.function(lambda grads: strategy.run(self._apply, args=(opt_d, D, grads)))
        self._apply_g = tf.function(lambda grads: strategy.run(self._apply, args=(opt_g, G, grads)))
        self._skip_d, self._skip_g = (tf.function(lambda opt=opt: self._lower_scale(opt)) for opt in (opt_d, opt_g))
        self._buffers = G.non_trainable_variables
        self._snapshot = tf.function(lambda: [tf.identity(v) for v in self._buffers])

    def _average(self, per_sample: tf.Tensor) -> tf.Tensor:
        return tf.nn.compute_average_loss(per_sample, global_batch_size=self.global_batch)

    def _reduced(self, loss: tf.Tensor, grads: list[tf.Tensor],
                 scale: tf.Tensor | float = 1.0) -> tuple[tf.Tensor, tf.Tensor, list[tf.Tensor]]:
        """Loss and gradients summed over the replicas (one all-reduce), the gradients unscaled (`scale`: the loss
        scale they were taken at), then clipped by their global norm."""
        loss, *grads = tf.distribute.get_replica_context().all_reduce(SUM, [loss, *grads])
        grads, norm = clip_by_global_norm([g / scale for g in grads], self.grad_clip)
        return loss, norm, grads

    def _d_replica(self, reals: tf.Tensor, z: tf.Tensor):
        """This replica's micro-steps of D's step: G (BatchNorm in training mode) makes the fakes outside the tape;
        D judges reals and fakes in one forward."""
        weights, scale = self.D.trainable_variables, loss_scale(self.opt_d)
        loss, grads = 0.0, [tf.zeros_like(w) for w in weights]
        for micro in range(reals.shape[0]):  # unrolled: accumulation steps are few
            fake = self.G(z[micro], training=True)
            with tf.GradientTape() as tape:
                logits = tf.reshape(self.D(tf.concat([reals[micro], fake], 0), training=True), [-1])
                real, fake_logits = tf.split(logits, 2)
                micro_loss = self._average(d_losses(self.loss_kind, real, fake_logits))
                scaled = micro_loss * scale
            grads = [g + d for g, d in zip(grads, tape.gradient(scaled, weights))]
            loss += micro_loss
        return self._reduced(loss, grads, scale)

    def _g_replica(self, z: tf.Tensor):
        """This replica's micro-steps of G's step: through D, whose weights only pass the gradient on (frozen)."""
        weights, scale = self.G.trainable_variables, loss_scale(self.opt_g)
        loss, grads = 0.0, [tf.zeros_like(w) for w in weights]
        for micro in range(z.shape[0]):
            with tf.GradientTape() as tape:
                logits = tf.reshape(self.D(self.G(z[micro], training=True), training=True), [-1])
                micro_loss = self._average(g_losses(self.loss_kind, logits))
                scaled = micro_loss * scale
            grads = [g + d for g, d in zip(grads, tape.gradient(scaled, weights))]
            loss += micro_loss
        return self._reduced(loss, grads, scale)

    @staticmethod
    def _apply(optimizer: Optimizer, net: keras.Model, grads: list[tf.Tensor]) -> None:
        # The loss scale is a power of two: multiplied back in here and divided out by LossScaleOptimizer, exactly.
        scale = loss_scale(optimizer)
        optimizer.apply_gradients(zip([g * scale for g in grads], net.trainable_variables))

    @staticmethod
    def _lower_scale(optimizer: Optimizer) -> None:
        """A skipped step under fp16: LossScaleOptimizer's non-finite branch (half the scale, its growth count
        restarted), run here because the skip is decided on the host, not from the gradients it would check."""
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer.step_counter.assign(0)
            optimizer.dynamic_scale.assign(optimizer.dynamic_scale * 0.5)

    def _finish(self, outputs, apply, skip) -> StepResult:
        """The agreed loss and norm (the same on every replica: the first's), then the update on every replica or
        on none."""
        loss, norm, grads = outputs
        first = self.strategy.experimental_local_results
        loss, norm = float(first(loss)[0]), float(first(norm)[0])
        applied = math.isfinite(loss) and math.isfinite(norm)
        if applied:
            apply(grads)
        else:
            skip()
        return StepResult(loss, norm, applied)

    def discriminator(self, reals, z) -> StepResult:
        return self._guarded(lambda: self._finish(self._d_gradients(reals, z), self._apply_d, self._skip_d))

    def generator(self, z) -> StepResult:
        return self._guarded(lambda: self._finish(self._g_gradients(z), self._apply_g, self._skip_g))

    def _guarded(self, step) -> StepResult:
        """`step`, with G's BatchNorm statistics put back where it was skipped (its forwards moved them). The copy
        stays on the device (one graph call); only a skipped step assigns it back."""
        before = self._snapshot()
        result = step()
        if not result.applied:
            for variable, value in zip(self._buffers, before):
                variable.assign(value)
        return result
