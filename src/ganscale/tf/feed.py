"""Global batches and noise, built on the host and cut into each replica's micro-batches.

What every sample is depends only on its global position: global batch i holds the same samples as on the torch
engine (its seeded permutations, ganscale.data.stream), and each phase of each step draws its whole global batch
of latents from one stateless seed derived from (seed, step, phase). Replica r's micro-step m then takes the
contiguous slice at (m x replicas + r) x micro_batch, as rank r does on the torch engine (`Slicing`): 1 x 2b and
2 x b train on the same samples with the same noise.

The data sets held in memory (digits, mnist, the 2D mixtures) are indexed as one array. Image files (data.kind
folder or zip) are decoded by the torch engine's readers, a global batch at a time on the host when the step asks
for it: the same pixels as on the torch engine, in the same order, from any number of replicas.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf
from torch.utils.data import Dataset, TensorDataset

from ganscale.config import Config
from ganscale.data import Slicing, build_dataset
from ganscale.data.stream import _RankSampler
from ganscale.seeds import StepSeeds


def training_data(cfg: Config) -> np.ndarray | ImageFiles:
    """The data set, indexed by an array of sample indices: images channels-last (N, H, W, C), 2D points (N, 2).
    In memory whole where the torch engine holds it so; image files are read when a batch is drawn."""
    dataset = build_dataset(cfg)
    if not isinstance(dataset, TensorDataset):
        return ImageFiles(dataset)
    samples = dataset.tensors[0].numpy()
    return samples if samples.ndim == 2 else np.ascontiguousarray(samples.transpose(0, 2, 3, 1))


class ImageFiles:
    """A data set of image files (ganscale.data.folder.ImageFolder, ganscale.data.archive.ImageZip, or a
    data.max_images subset of one) whose samples are decoded when they are indexed."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, indices: np.ndarray) -> np.ndarray:
        return np.stack([self.dataset[int(i)][0].numpy().transpose(1, 2, 0) for i in indices])


def split_seed(seed: int) -> tf.Tensor:
    """A 63-bit derived seed as the two int32 words a stateless TensorFlow RNG takes."""
    return tf.constant([seed & 0x7FFFFFFF, seed >> 31], dtype=tf.int32)


class Feed:
    """The global batches and latents of every step, as per-replica values of shape (accumulation, micro, ...)."""

    def __init__(self, cfg: Config, strategy: tf.distribute.Strategy, samples: np.ndarray | ImageFiles):
        self.strategy, self.samples = strategy, samples
        replicas = strategy.num_replicas_in_sync
        self.z_dim, self.global_batch = cfg.model.z_dim, cfg.train.batch_size
        self.micro, self.accumulation = cfg.micro_batch(replicas), cfg.accumulation_steps(replicas)
        # The torch engine's order: its sampler over one "rank" taking the whole global batch at once.
        self._order = _RankSampler(len(samples), Slicing(0, 1, self.global_batch, 1), cfg.train.seed, 0)
        self._seed_of = StepSeeds(cfg.train.seed)

    def reals(self, batch: int) -> tf.distribute.DistributedValues:
        """Global batch `batch` of the data stream (D's `critic`-th batch of step s is s x n_critic + critic)."""
        # The indices are cut, and each replica's share read: a worker decodes only its own replicas' images.
        return self.distribute(self._order.index_tensor(batch, 0).numpy(), lambda share: self.samples[share])

    def global_latents(self, step: int, phase: int, n: int | None = None) -> np.ndarray:
        seed = split_seed(self._seed_of(step, phase))
        return tf.random.stateless_normal((n or self.global_batch, self.z_dim), seed).numpy()

    def latents(self, step: int, phase: int) -> tf.distribute.DistributedValues:
        return self.distribute(self.global_latents(step, phase))

    def distribute(self, global_batch: np.ndarray,
                   take: Callable[[np.ndarray], np.ndarray] = lambda share: share) -> tf.distribute.DistributedValues:
        """Replica r gets its micro-batches stacked: micro-step m is `take` of the slice at (m x replicas + r) x
        micro. Only this process's replicas are asked for."""
        replicas = self.strategy.num_replicas_in_sync

        def replica_share(context: tf.distribute.ValueContext) -> tf.Tensor:
            r = context.replica_id_in_sync_group
            starts = [(m * replicas + r) * self.micro for m in range(self.accumulation)]
            return tf.constant(np.stack([take(global_batch[s:s + self.micro]) for s in starts]))

        return self.strategy.experimental_distribute_values_from_function(replica_share)
