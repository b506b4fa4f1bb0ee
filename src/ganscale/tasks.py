"""What G is given and what D judges: the one place where unconditional, class-conditional and paired
(image-to-image) GANs differ. The trainer's loop is the same for all three; it asks its task.

A sample from the data stream is a tuple of tensors: (images,), (images, labels) or (input, target).
Every method here is a pure function of its arguments (no communication).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ganscale.config import Config
from ganscale.data.stream import Sample
from ganscale.randomness import sample_seeds


class Unconditional:
    """G(z) -> image; D(image)."""

    grid_columns: int | None = None  # sample grid width (None: square)
    n_classes = 0  # classes G can be asked for (0: not class-conditional)
    # G's step judges the output D's step judged (one G forward per iteration), rather than fresh samples.
    same_fake_for_g = False

    def generate(self, G: nn.Module, real: Sample, z: Tensor, labels: Tensor | None) -> Tensor:
        return G(z)

    def real_images(self, real: Sample) -> Tensor:
        return real[0]

    def critic_view(self, real: Sample, images: Tensor) -> Tensor:
        """What D sees of `images` (real or generated) next to this sample."""
        return images

    def critic_conditions(self, real: Sample | None, labels: Tensor | None) -> tuple[Tensor, ...]:
        """Extra arguments of D (class labels) for the batch [real, fake], or [fake] when `real` is None; or ()."""
        return ()

    def real_labels(self, real: Sample) -> Tensor | None:
        """The classes of a batch of reals (D's condition when it judges them alone, as R1 does); None: none."""
        return None

    def reconstruction(self, fake: Tensor, real: Sample) -> Tensor | None:
        """A supervised term added to G's loss (pix2pix's L1); None here."""
        return None

    def preview(self, G: nn.Module, z: Tensor, label: int | None = None) -> Tensor:
        """Images for the sample grid, drawn from fixed inputs (of one class, if given)."""
        return G(z)

    def preview_labels(self, n: int, label: int | None = None, device: torch.device | None = None) -> Tensor | None:
        """The class of each of n sample grid cells; None: G takes no classes."""
        return None

    def from_noise(self, G: nn.Module, z: Tensor) -> Tensor:
        """A sample that is a function of its noise alone (for metrics gathered across ranks)."""
        return G(z)


class ClassConditional(Unconditional):
    """G(z, y) -> image; D(image, y) with a projection head. Generated samples get uniformly drawn classes;
    the preview grid has one class per row."""

    def __init__(self, n_classes: int, row: int = 8):
        self.n_classes, self.row = n_classes, row
        self.grid_columns = row

    def labels(self, n: int, generator: torch.Generator) -> Tensor:
        """Classes for n generated samples, drawn from `generator`."""
        return torch.randint(self.n_classes, (n,), generator=generator)

    def generate(self, G: nn.Module, real: Sample, z: Tensor, labels: Tensor | None) -> Tensor:
        return G(z, labels)

    def critic_conditions(self, real: Sample | None, labels: Tensor | None) -> tuple[Tensor, ...]:
        return (labels if real is None else torch.cat([real[1], labels]),)

    def real_labels(self, real: Sample) -> Tensor:
        return real[1]

    def preview(self, G: nn.Module, z: Tensor, label: int | None = None) -> Tensor:
        return G(z, self.preview_labels(len(z), label, z.device))

    def preview_labels(self, n: int, label: int | None = None, device: torch.device | None = None) -> Tensor:
        """`label` in every cell, else one class per grid row."""
        if label is not None:
            return torch.full((n,), label, dtype=torch.int64, device=device)
        return torch.arange(n, device=device) // self.row % self.n_classes

    def from_noise(self, G: nn.Module, z: Tensor) -> Tensor:
        # The class comes from the low-order digits of the last latent: uniform over the classes and,
        # unlike its value, practically independent of what G receives.
        classes = (torch.remainder(z[:, -1] * 2**16, 1.0) * self.n_classes).long().clamp(max=self.n_classes - 1)
        return G(z, classes)


class Paired(Unconditional):
    """pix2pix: G(input) -> output; D judges (input, output) concatenated on channels; G also minimises
    `l1_weight` x L1(output, target). G's randomness is its dropout, whose masks come from z's per-sample seeds."""

    grid_columns = 3  # input, output, target
    # As the reference trains: G translates the batch once; D's step judges the output detached, G's step
    # the same output (the same dropout mask), and G's BatchNorm statistics move once per iteration.
    same_fake_for_g = True

    def __init__(self, l1_weight: float, preview_pairs: list[Sample]):
        self.l1_weight = l1_weight
        self.preview_pairs = preview_pairs

    def generate(self, G: nn.Module, real: Sample, z: Tensor, labels: Tensor | None) -> Tensor:
        return G(real[0], sample_seeds(z))  # dropout masks by global sample position: the same on any rank

    def real_images(self, real: Sample) -> Tensor:
        return real[1]

    def critic_view(self, real: Sample, images: Tensor) -> Tensor:
        return torch.cat([real[0], images], dim=1)

    def reconstruction(self, fake: Tensor, real: Sample) -> Tensor:
        return self.l1_weight * F.l1_loss(fake.float(), real[1].float())

    def preview(self, G: nn.Module, z: Tensor, label: int | None = None) -> Tensor:
        """Rows of (input, output, target) triples for fixed, un-augmented pairs."""
        device = next(G.parameters()).device
        inputs = torch.stack([pair[0] for pair in self.preview_pairs]).to(device)
        targets = torch.stack([pair[1] for pair in self.preview_pairs]).to(device)
        outputs = G(inputs).to(inputs)  # FSDP2 with CPU offload: parameters on the CPU, outputs on the GPU
        return torch.stack([inputs, outputs, targets], dim=1).flatten(0, 1)


def build_task(cfg: Config, previews: bool = True,
               choose: Callable[[int], Sequence[int]] | None = None) -> Unconditional:
    """The config's task; `previews=False`: without reading pix2pix's fixed preview pairs from the data.
    `choose`: given the number of un-augmented pairs, the indices of those pix2pix previews (default: the first
    log.samples // 3, the training-time grid)."""
    task = cfg.model.conditioning
    if task == "class-conditional":
        return ClassConditional(cfg.model.n_classes)
    if task == "paired" and not previews:
        return Paired(cfg.loss.l1_weight, [])
    if task == "paired":
        from ganscale.data import build_dataset
        from ganscale.data.paired import PairedImages

        d = cfg.data
        fixed = build_dataset(cfg) if d.kind == "custom" else PairedImages(
            d.path, d.load_size, d.resolution, d.direction, augment=False, channels=d.channels)
        indices = choose(len(fixed)) if choose else range(min(len(fixed), max(1, cfg.log.samples // 3)))
        return Paired(cfg.loss.l1_weight, [fixed[i] for i in indices])
    return Unconditional()
