"""Image metrics of a generator against reference features, computed by every rank together.

Work is split by sample position, never by rank count: sample i always comes from row i of one seeded
global noise stream, rank r generates and featurises the contiguous share [r * per, (r + 1) * per)
(per = ceil(n / world), the last share padded so every rank runs the same number of forwards, which
a sharded G_ema needs), and one all_gather gives every rank all n feature rows in order. Every rank
then computes the same numbers from the same rows, so the result does not depend on the world size
(beyond float rounding in the networks' batched arithmetic).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Subset

from ganscale.config import ConfigError
from ganscale.metrics.distances import DC_NEIGHBOURS, PR_NEIGHBOURS, _nothing, all_distances
from ganscale.metrics.features import FeatureExtractor

EVAL_BATCH = 500  # images per forward; bounds memory, not the result
REFERENCE_LIMIT = 10_000  # real images whose features form the reference set (a seeded subset beyond it)
FEWEST_REFERENCES = max(PR_NEIGHBOURS, DC_NEIGHBOURS) + 1  # a k-NN radius needs k neighbours besides the point


def check_reference_count(cfg, count: int, fix: str) -> None:
    """ConfigError naming the data where its `count` images (the whole source: the reference set ignores
    data.max_images) are too few for the k-NN radii of precision/recall and density/coverage, which would
    otherwise fail only after G's images were generated."""
    if count >= FEWEST_REFERENCES:
        return
    d = cfg.data
    key = {"custom": "data.dataset", "folder": "data.path", "zip": "data.path"}.get(d.kind, "data.kind")
    named = {"data.dataset": d.dataset, "data.path": d.path, "data.kind": d.kind}[key]
    raise ConfigError(key, f"{key}={named} holds {count} image{'s' * (count != 1)}, but density/coverage "
                      f"(k = {DC_NEIGHBOURS}) need at least {FEWEST_REFERENCES} reference images", fix)


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@torch.no_grad()
def gathered_features(images_at: Callable[[int, int], torch.Tensor], n: int, extractor: FeatureExtractor,
                      batch_size: int = EVAL_BATCH, progress: Callable[[], None] = _nothing) -> torch.Tensor:
    """Collective: (n, D) features of items 0..n-1 on every rank (on the extractor's device), each rank
    featurising its share; `progress` is called after each batch.

    `images_at(start, stop)` returns the images of positions start..stop-1; it is asked for positions up
    to ceil(n / world) * world (padding) and must answer them too (their features are dropped).
    """
    rank, world = _world()
    per = math.ceil(n / world)
    share = []
    for lo in range(rank * per, (rank + 1) * per, batch_size):  # the same count on every rank
        share.append(extractor(images_at(lo, min(lo + batch_size, (rank + 1) * per))))
        progress()
    local = torch.cat(share).float().contiguous()
    if world > 1:
        every_share = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(every_share, local)  # every rank takes part, in rank order = sample order
        local = torch.cat(every_share)
    return local[:n]


def dataset_features(dataset: Dataset, extractor: FeatureExtractor, limit: int | None = None,
                     batch_size: int = EVAL_BATCH, progress: Callable[[], None] = _nothing) -> torch.Tensor:
    """Collective: features of the first `limit` items (default all) of a data set of (image,) tuples."""
    n = len(dataset) if limit is None else min(limit, len(dataset))

    def images_at(start: int, stop: int) -> torch.Tensor:
        return torch.stack([dataset[min(i, n - 1)][0] for i in range(start, stop)])  # past n: padding
    return gathered_features(images_at, n, extractor, batch_size, progress)


def reference_features(dataset: Dataset, extractor: FeatureExtractor, limit: int | None = REFERENCE_LIMIT,
                       seed: int = 0, progress: Callable[[], None] = _nothing) -> torch.Tensor:
    """Collective: features of the training images, or of a seeded random `limit` of them (in data set order)."""
    if limit is not None and len(dataset) > limit:
        chosen = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed))[:limit]
        dataset = Subset(dataset, chosen.sort().values.tolist())
    return dataset_features(dataset, extractor, progress=progress)


def generated_features(generate: Callable[[torch.Tensor], torch.Tensor], z_dim: int, n: int, seed: int,
                       extractor: FeatureExtractor, device: torch.device | str | None = None,
                       batch_size: int = EVAL_BATCH, progress: Callable[[], None] = _nothing) -> torch.Tensor:
    """Collective: features of generate(z) for the n rows of the seeded noise stream randn(n, z_dim)."""
    _, world = _world()
    noise = torch.randn(n, z_dim, generator=torch.Generator().manual_seed(seed))
    padded = torch.cat([noise, noise.new_zeros(math.ceil(n / world) * world - n, z_dim)])
    device = torch.device(device) if device is not None else extractor.device
    return gathered_features(lambda lo, hi: generate(padded[lo:hi].to(device)), n, extractor, batch_size, progress)


def image_metrics(generate: Callable[[torch.Tensor], torch.Tensor], z_dim: int, n: int, seed: int,
                  extractor: FeatureExtractor, reference_features: torch.Tensor,
                  device: torch.device | str | None = None,
                  progress: Callable[[], None] = _nothing) -> dict[str, float | int | str]:
    """Collective: FD, KID, precision/recall, density/coverage of `generate` against the reference features.

    Call it on every rank with the same arguments; every rank returns the same dict: fd, kid, kid_std,
    precision, recall, density, coverage, samples, reference_samples, features (the extractor's name).
    `generate` must be deterministic per sample (G_ema in eval mode). `progress` is called after each batch
    and each block of distances (long local work: the trainer marks its hang watchdog there).
    """
    fake = generated_features(generate, z_dim, n, seed, extractor, device, progress=progress)
    return {**all_distances(reference_features, fake, seed=seed, progress=progress), "samples": n,
            "reference_samples": int(reference_features.shape[0]), "features": extractor.name}


SCORES = ("fd", "kid", "precision", "recall", "density", "coverage")


class ImageScorer:
    """Image metrics during training (`eval.every`): the extractor and the reference features are made
    once, at start (a collective: every rank computes its share of the reference features)."""

    def __init__(self, cfg, dataset: Dataset, device: torch.device, progress: Callable[[], None] = _nothing):
        from ganscale.metrics.features import build_extractor

        self.extractor = build_extractor(cfg.eval.extractor(cfg.data.kind), device, cfg.eval.inception_weights,
                                         inception_preprocess=cfg.eval.inception_preprocess)
        self.progress = progress
        self.reference = reference_features(dataset, self.extractor, seed=cfg.train.seed, progress=progress)
        self.samples, self.z_dim, self.seed, self.device = cfg.eval.samples, cfg.model.z_dim, cfg.train.seed, device

    def score(self, generate: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Collective: {fd_<features>, kid_<features>, precision, recall, density, coverage} of `generate`,
        on the same noise at every step (so successive values compare G_ema, not noise)."""
        result = image_metrics(generate, self.z_dim, self.samples, self.seed, self.extractor, self.reference,
                               device=self.device, progress=self.progress)
        name = self.extractor.name
        return {(f"{key}_{name}" if key in ("fd", "kid") else key): float(result[key]) for key in SCORES}
