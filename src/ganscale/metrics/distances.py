"""Distances between a real and a generated feature set (N, D): FD, KID, precision/recall, density/coverage.

Pure functions of two tensors, computed in float64 on the features' device (a GPU does the k-NN distances
of 10,000 x 2,500 Inception features in about a second; one CPU thread takes minutes). Every rank that
calls them with the same gathered features gets the same numbers. `progress` is called after each block
of distances (the trainer marks its hang watchdog there: long local work is not a hang).

- Frechet distance (Heusel et al. 2017) between Gaussian fits; the matrix square root comes from
  symmetric eigen-decompositions (no scipy): tr sqrt(S1 S2) = sum sqrt(eig(sqrt(S1) S2 sqrt(S1))).
- KID (Binkowski et al. 2018), as torch-fidelity computes it: unbiased MMD^2 with the cubic
  polynomial kernel k(x, y) = (x.y / D + 1)^3, averaged over random subsets.
- Improved precision/recall (Kynkaanniemi et al. 2019, k = 3): a k-NN ball around every point of
  each set; precision = share of generated points inside some real ball, recall the reverse.
- Density/coverage (Naeem et al. 2020, k = 5): balls around real points only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

PR_NEIGHBOURS = 3  # Kynkaanniemi et al.
DC_NEIGHBOURS = 5  # Naeem et al.
KID_SUBSETS = 100  # torch-fidelity's defaults
KID_SUBSET_SIZE = 1000
_ROWS_PER_CHUNK = 1024  # distance matrices are built in row chunks to bound memory


def _f64(features: torch.Tensor) -> torch.Tensor:
    if features.ndim != 2:
        raise ValueError(f"features must be (N, D), got shape {tuple(features.shape)}")
    return features.detach().to(torch.float64)


def gaussian_fit(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and unbiased covariance (N - 1) of a feature set, as pytorch-fid computes them."""
    x = _f64(features)
    if x.shape[0] < 2:
        raise ValueError("a Gaussian fit needs at least 2 feature vectors")
    return x.mean(0), torch.cov(x.T).reshape(x.shape[1], x.shape[1])


def _psd_sqrt(matrix: torch.Tensor) -> torch.Tensor:
    values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
    return (vectors * values.clamp_min(0).sqrt()) @ vectors.T  # tiny negative eigenvalues are rounding


def frechet_distance_from_fits(mu1: torch.Tensor, sigma1: torch.Tensor, mu2: torch.Tensor,
                               sigma2: torch.Tensor) -> float:
    """||mu1 - mu2||^2 + tr(S1) + tr(S2) - 2 tr sqrt(S1 S2)."""
    mu1, sigma1, mu2, sigma2 = (t.to(torch.float64) for t in (mu1, sigma1, mu2, sigma2))
    root1 = _psd_sqrt(sigma1)
    # sqrt(S1) S2 sqrt(S1) is symmetric PSD and similar to S1 S2, so its eigenvalues are those of S1 S2.
    middle = root1 @ sigma2 @ root1
    trace_sqrt_product = torch.linalg.eigvalsh((middle + middle.T) / 2).clamp_min(0).sqrt().sum()
    distance = (mu1 - mu2).square().sum() + sigma1.trace() + sigma2.trace() - 2 * trace_sqrt_product
    return float(distance.clamp_min(0))  # >= 0 in exact arithmetic


def frechet_distance(real: torch.Tensor, fake: torch.Tensor) -> float:
    return frechet_distance_from_fits(*gaussian_fit(real), *gaussian_fit(fake))


def _polynomial_kernel(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x @ y.T / x.shape[1] + 1) ** 3


def _unbiased_mmd2(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    m = x.shape[0]
    k_xx, k_yy, k_xy = _polynomial_kernel(x, x), _polynomial_kernel(y, y), _polynomial_kernel(x, y)
    within = (k_xx.sum() - k_xx.diagonal().sum() + k_yy.sum() - k_yy.diagonal().sum()) / (m * (m - 1))
    return within - 2 * k_xy.sum() / (m * m)


def kernel_inception_distance(real: torch.Tensor, fake: torch.Tensor, subsets: int = KID_SUBSETS,
                              subset_size: int = KID_SUBSET_SIZE, seed: int = 0) -> tuple[float, float]:
    """(mean, std) of the unbiased MMD^2 over `subsets` random subsets of min(subset_size, N_real, N_fake)."""
    x, y = _f64(real), _f64(fake)
    size = min(subset_size, x.shape[0], y.shape[0])
    if size < 2:
        raise ValueError("KID needs at least 2 feature vectors in each set")
    rng = torch.Generator().manual_seed(seed)
    values = torch.stack([_unbiased_mmd2(x[torch.randperm(x.shape[0], generator=rng)[:size]],
                                         y[torch.randperm(y.shape[0], generator=rng)[:size]])
                          for _ in range(subsets)])
    return float(values.mean()), float(values.std(unbiased=False))


def _nothing() -> None:
    pass


def _pairwise_distances(a: torch.Tensor, b: torch.Tensor, progress: Callable[[], None]):
    """Yield (row offset, Euclidean distance block) of a against b, chunk by chunk."""
    for start in range(0, a.shape[0], _ROWS_PER_CHUNK):
        yield start, torch.cdist(a[start:start + _ROWS_PER_CHUNK], b, compute_mode="donot_use_mm_for_euclid_dist")
        progress()


def knn_radii(features: torch.Tensor, k: int, progress: Callable[[], None] = _nothing) -> torch.Tensor:
    """Distance of every point to its k-th nearest neighbour in its own set (itself excluded)."""
    x = _f64(features)
    if x.shape[0] <= k:
        raise ValueError(f"k-NN radii with k={k} need more than {k} points, got {x.shape[0]}")
    radii = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    for start, block in _pairwise_distances(x, x, progress):
        radii[start:start + block.shape[0]] = block.kthvalue(k + 1, dim=1).values  # the 1st is the point itself
    return radii


def _ball_hits(points: torch.Tensor, centres: torch.Tensor, radii: torch.Tensor,
               progress: Callable[[], None]) -> torch.Tensor:
    """(len(points),) count of the centres' balls (closed) that contain each point."""
    hits = torch.empty(points.shape[0], dtype=torch.float64, device=points.device)
    for start, block in _pairwise_distances(points, centres, progress):
        hits[start:start + block.shape[0]] = (block <= radii).sum(1).to(torch.float64)
    return hits


def precision_recall(real: torch.Tensor, fake: torch.Tensor, k: int = PR_NEIGHBOURS,
                     progress: Callable[[], None] = _nothing) -> tuple[float, float]:
    x, y = _f64(real), _f64(fake)
    precision = (_ball_hits(y, x, knn_radii(x, k, progress), progress) > 0).double().mean()
    recall = (_ball_hits(x, y, knn_radii(y, k, progress), progress) > 0).double().mean()
    return float(precision), float(recall)


def density_coverage(real: torch.Tensor, fake: torch.Tensor, k: int = DC_NEIGHBOURS,
                     progress: Callable[[], None] = _nothing) -> tuple[float, float]:
    x, y = _f64(real), _f64(fake)
    radii = knn_radii(x, k, progress)
    density = _ball_hits(y, x, radii, progress).sum() / (k * y.shape[0])
    nearest_fake = torch.cat([block.min(1).values for _, block in _pairwise_distances(x, y, progress)])
    coverage = (nearest_fake < radii).double().mean()  # Naeem et al.: strictly inside
    return float(density), float(coverage)


def all_distances(real: torch.Tensor, fake: torch.Tensor, seed: int = 0,
                  progress: Callable[[], None] = _nothing) -> dict[str, float]:
    """Every measure of this module, by name (the keys written to eval.json and metrics.jsonl)."""
    kid_mean, kid_std = kernel_inception_distance(real, fake, seed=seed)
    progress()
    precision, recall = precision_recall(real, fake, progress=progress)
    density, coverage = density_coverage(real, fake, progress=progress)
    return {"fd": frechet_distance(real, fake), "kid": kid_mean, "kid_std": kid_std, "precision": precision,
            "recall": recall, "density": density, "coverage": coverage}
