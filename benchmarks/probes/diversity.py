"""Mode-collapse measures for MNIST-like samples, and their trace over a run's checkpoints.

`classes_and_diversity`: the effective number of classes drawn (exp of the entropy of the shipped MNIST
classifier's predictions; 10 at best) and the mean pairwise pixel distance between two halves of the samples,
both on samples clamped to [-1, 1] (as a picture shows them) and resized to the classifier's 32 px.

    OMP_NUM_THREADS=1 python benchmarks/probes/diversity.py RUN_DIR [RUN_DIR ...]

prints, for every checkpoint of each run, G's and G_ema's classes and diversity (over the reals') on 1,000
samples. Results: benchmarks/results/mnist-stylegan2-collapse-20261126.md."""
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from ganscale import checkpoint
from ganscale.data.mnist import mnist
from ganscale.evaluate import fitted_generator
from ganscale.metrics import digits_classifier

SIDE = 32  # the MNIST classifier's input


def classes_and_diversity(images: torch.Tensor, classifier: torch.nn.Module) -> tuple[float, float]:
    images = images.float().clamp(-1, 1)  # a linear G's stray values do not count as diversity
    if images.shape[-1] != SIDE:
        images = F.interpolate(images, size=(SIDE, SIDE), mode="bilinear", align_corners=False)
    with torch.no_grad():
        predicted = classifier(images).argmax(1)
    share = torch.bincount(predicted, minlength=10).float() / len(predicted)
    share = share[share > 0]
    flat = images.flatten(1)
    half = len(flat) // 2
    return math.exp(-(share * share.log()).sum().item()), torch.cdist(flat[:half], flat[half:]).mean().item()


def trace(run_dirs: list[str]) -> None:
    classifier, _ = digits_classifier.load(dataset="mnist")
    reals = mnist(SIDE)[:][0]
    _, real_diversity = classes_and_diversity(reals[torch.randperm(len(reals), generator=torch.Generator().manual_seed(0))[:1000]],
                                              classifier)
    for run in map(Path, run_dirs):
        for source in sorted(checkpoint.checkpoint_dir(run).glob("step-*.pt")):
            state = checkpoint.load(source, require=checkpoint.GENERATOR_KEYS)
            cells = []
            for net in ("G", "G_ema"):
                cfg, generator = fitted_generator(run, source, state, nets=(net,))
                with torch.no_grad():
                    samples = generator.eval()(torch.randn(1000, cfg.model.z_dim, generator=torch.Generator().manual_seed(1)))
                classes, diversity = classes_and_diversity(samples, classifier)
                cells.append(f"{net}: classes {classes:4.1f} diversity {diversity / real_diversity:.2f}")
            print(run.name, source.name, " | ".join(cells), flush=True)


if __name__ == "__main__":
    trace(sys.argv[1:])
