"""Differentiable augmentation of every image D sees: ADA (Karras et al. 2020) and DiffAugment (Zhao et al. 2020).

The trainer passes through `Augmentation.__call__` each tensor D receives: [real, fake, (interpolates)] in D's
step (R1 and the gradient penalty differentiate through it, with respect to the un-augmented images), and G's
samples in G's step (G's gradient flows back through it). Every operation is plain torch (affine_grid,
grid_sample, a 4x4 colour matrix, masks), so it runs on any device and its backward is autograd's.

Per-sample randomness comes from the sample's seed (`randomness.batch_seeds`, the global position of the sample
in the step), hashed with one salt per operation: a sample is augmented alike in a batch of 4 or alone, on any
rank, so 2 ranks train as 1 process. Outside the trainer (no seeds) it draws from torch's RNG.

ADA's operations here, 12 of the paper's 18 (its default "bgc" pipeline): pixel blitting (x-flip, 90-degree
rotations, integer translation), general geometric (isotropic scaling, arbitrary rotation (before and after the
anisotropic scaling), anisotropic scaling, fractional translation: one affine grid_sample with reflection padding,
bilinear, without the paper's 2x-upsampled low-pass resampling) and colour (brightness, contrast, luma flip, hue
rotation, saturation: one 4x4 colour matrix). Not in: image-space filtering (4 operations), additive noise and
cutout. On grey images hue rotation and saturation act as the identity (they rotate or scale chroma only), as in
the reference.

A D input that concatenates several images on channels (pix2pix: input and output) is augmented as one: every
image of a sample gets the same geometric and colour transform.

ADA's probability p moves towards the target of r_t = E[sign(D(real))] (`AdaptiveAugment.adjust`), from each D
step's mean sign agreed over all ranks in the step's own agreement all-reduce (trainer._finish_step).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ganscale import randomness
from ganscale.config import AugmentConfig, Config

ADA_SALT, DIFFAUGMENT_SALT = 0xADA000, 0xD1FF00  # + one offset per draw below (other call sites: randomness.py)
SCALE_STD, ANISO_STD, XFRAC_STD, XINT_MAX = 0.2, 0.2, 0.125, 0.125  # the reference's strengths
BRIGHTNESS_STD, CONTRAST_STD, SATURATION_STD = 0.2, 0.5, 1.0
TRANSLATION_RATIO, CUTOUT_RATIO = 0.125, 0.5  # DiffAugment's
LUMA_AXIS = (1 / math.sqrt(3),) * 3  # hue rotates about it, luma flip mirrors along it
GEOMETRIC = ("xflip", "rotate90", "xint", "scale", "rotate", "aniso", "xfrac")


class _Draws:
    """Per-sample random values of one augmentation call: each draw its own salt, all from the samples' seeds."""

    def __init__(self, images: Tensor, base_salt: int, seeds: Tensor | None):
        self.images, self.salt = images, base_salt
        self.seeds = randomness.batch_seeds(images) if seeds is None else seeds

    def uniform(self, offset: int, shape: tuple[int, ...] = ()) -> Tensor:
        return randomness.uniform(self.images, self.salt + offset, shape, self.seeds)

    def normal(self, offset: int, shape: tuple[int, ...] = ()) -> Tensor:
        return randomness.normal(self.images, self.salt + offset, shape, self.seeds)

    def chosen(self, offset: int, p: float) -> Tensor:
        """Which samples this operation applies to (probability p each), as a float mask of shape (N,)."""
        return (self.uniform(offset) < p).float()


# ----------------------------------------------------------------------------------------------------- ADA
def resamples(a: AugmentConfig) -> bool:
    """Whether augmentation `a` moves pixels through grid_sample (ADA's geometric operations)."""
    return a.kind == "ada" and any(op in GEOMETRIC for op in a.ada_ops)


def ada(images: Tensor, p: float, ops: tuple[str, ...] | list[str], channels: int,
        seeds: Tensor | None = None) -> Tensor:
    """ADA's pipeline on `images` (N, k x channels, H, W), each of `ops` applied to each sample with probability
    p; `seeds`: the samples' (default `randomness.batch_seeds(images)`). p = 0 returns `images` itself."""
    if p <= 0:
        return images
    x = images.float()  # angles and matrices in float32 whatever the precision around
    draws = _Draws(x, ADA_SALT, seeds)
    if any(op in ops for op in GEOMETRIC):
        x = _resample(x, _geometric_matrix(draws, p, ops, x.shape[-1], x.shape[-2]))
    if any(op not in GEOMETRIC for op in ops):
        x = _recolour(x, _colour_matrix(draws, p, ops), channels)
    return x.to(images.dtype)


def _geometric_matrix(draws: _Draws, p: float, ops, width: int, height: int) -> Tensor:
    """Inverse 3x3 transform per sample: output pixel -> input pixel, pixel units about the image centre."""
    n = len(draws.images)
    m = torch.eye(3, device=draws.images.device).repeat(n, 1, 1)
    if "xflip" in ops:
        flip = torch.floor(draws.uniform(0) * 2) * draws.chosen(1, p)
        m = m @ _scale(1 - 2 * flip, torch.ones_like(flip))
    if "rotate90" in ops:
        quarter = torch.floor(draws.uniform(2) * 4) * draws.chosen(3, p)
        m = m @ _rotate(-math.pi / 2 * quarter)
    if "xint" in ops:
        shift = (draws.uniform(4, (2,)) * 2 - 1) * XINT_MAX * draws.chosen(5, p)[:, None]
        m = m @ _translate(-torch.round(shift[:, 0] * width), -torch.round(shift[:, 1] * height))
    if "scale" in ops:
        s = torch.exp2(draws.normal(6) * SCALE_STD * draws.chosen(7, p))
        m = m @ _scale(1 / s, 1 / s)
    p_rotate = 1 - math.sqrt(max(1 - p, 0))  # two rotations: together probability p of any rotation
    if "rotate" in ops:
        m = m @ _rotate(-(draws.uniform(8) * 2 - 1) * math.pi * draws.chosen(9, p_rotate))
    if "aniso" in ops:
        s = torch.exp2(draws.normal(10) * ANISO_STD * draws.chosen(11, p))
        m = m @ _scale(1 / s, s)
    if "rotate" in ops:
        m = m @ _rotate(-(draws.uniform(12) * 2 - 1) * math.pi * draws.chosen(13, p_rotate))
    if "xfrac" in ops:
        shift = draws.normal(14, (2,)) * XFRAC_STD * draws.chosen(15, p)[:, None]
        m = m @ _translate(-shift[:, 0] * width, -shift[:, 1] * height)
    return m


def _resample(x: Tensor, inverse: Tensor) -> Tensor:
    """`x` through the per-sample inverse transforms (pixel units), bilinear, reflection padding."""
    width, height = x.shape[-1], x.shape[-2]
    to_pixels = torch.diag(torch.tensor([width / 2, height / 2, 1.0], device=x.device))
    to_unit = torch.diag(torch.tensor([2 / width, 2 / height, 1.0], device=x.device))
    theta = (to_unit @ inverse @ to_pixels)[:, :2, :]  # in grid_sample's [-1, 1] coordinates
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="reflection", align_corners=False)


def _colour_matrix(draws: _Draws, p: float, ops) -> Tensor:
    """4x4 colour transform per sample (RGB and an offset), composed in the reference's order."""
    n, device = len(draws.images), draws.images.device
    eye = torch.eye(4, device=device).repeat(n, 1, 1)
    luma = torch.tensor([*LUMA_AXIS, 0.0], device=device)
    luma_outer = torch.outer(luma, luma)
    c = eye
    if "brightness" in ops:
        b = draws.normal(20) * BRIGHTNESS_STD * draws.chosen(21, p)
        c = _translate3(b) @ c
    if "contrast" in ops:
        s = torch.exp2(draws.normal(22) * CONTRAST_STD * draws.chosen(23, p))
        c = _scale3(s) @ c
    if "lumaflip" in ops:
        flip = torch.floor(draws.uniform(24) * 2) * draws.chosen(25, p)
        c = (eye - 2 * luma_outer * flip[:, None, None]) @ c
    if "hue" in ops:
        theta = (draws.uniform(26) * 2 - 1) * math.pi * draws.chosen(27, p)
        c = _rotate_about_luma(theta) @ c
    if "saturation" in ops:
        s = torch.exp2(draws.normal(28) * SATURATION_STD * draws.chosen(29, p))
        c = (luma_outer + (eye - luma_outer) * s[:, None, None]) @ c
    return c


def _recolour(x: Tensor, c: Tensor, channels: int) -> Tensor:
    """Colour matrix `c` on every image of each sample (k images of `channels` concatenated on channels)."""
    n, total, height, width = x.shape
    x = x.reshape(n, total // channels, channels, height * width)
    if channels == 3:
        x = c[:, None, :3, :3] @ x + c[:, None, :3, 3:]
    else:  # grey (preflight allows 1 or 3): the matrix's mean action on a pixel with r = g = b
        grey = c[:, :3, :].mean(dim=1)
        x = x * grey[:, None, None, :3].sum(-1, keepdim=True) + grey[:, None, None, 3:]
    return x.reshape(n, total, height, width)


def _scale(sx: Tensor, sy: Tensor) -> Tensor:
    return _matrix3([[sx, 0, 0], [0, sy, 0], [0, 0, 1]], sx)


def _translate(tx: Tensor, ty: Tensor) -> Tensor:
    return _matrix3([[1, 0, tx], [0, 1, ty], [0, 0, 1]], tx)


def _rotate(theta: Tensor) -> Tensor:
    cos, sin = torch.cos(theta), torch.sin(theta)
    return _matrix3([[cos, -sin, 0], [sin, cos, 0], [0, 0, 1]], theta)


def _matrix3(rows: list[list], like: Tensor) -> Tensor:
    """A batch of matrices from rows of per-sample tensors (N,) and constants."""
    return torch.stack([torch.stack([v if isinstance(v, Tensor) else torch.full_like(like, v) for v in row], -1)
                        for row in rows], -2)


def _translate3(t: Tensor) -> Tensor:
    m = torch.eye(4, device=t.device).repeat(len(t), 1, 1)
    m[:, :3, 3] = t[:, None]
    return m


def _scale3(s: Tensor) -> Tensor:
    return torch.diag_embed(torch.stack([s, s, s, torch.ones_like(s)], -1))


def _rotate_about_luma(theta: Tensor) -> Tensor:
    """Rotation by theta about the grey axis (Rodrigues' formula), as 4x4 matrices."""
    x, y, z = LUMA_AXIS
    axis = torch.tensor(LUMA_AXIS, device=theta.device)
    cross = torch.tensor([[0.0, -z, y], [z, 0.0, -x], [-y, x, 0.0]], device=theta.device)
    sin, cos = torch.sin(theta)[:, None, None], torch.cos(theta)[:, None, None]
    r = cos * torch.eye(3, device=theta.device) + sin * cross + (1 - cos) * torch.outer(axis, axis)
    m = torch.eye(4, device=theta.device).repeat(len(theta), 1, 1)
    m[:, :3, :3] = r
    return m


# ----------------------------------------------------------------------------------------------------- DiffAugment
def diffaugment(images: Tensor, policy: tuple[str, ...] | list[str], channels: int,
                seeds: Tensor | None = None) -> Tensor:
    """DiffAugment's policy (color, translation, cutout: each on every sample) on `images` (N, k x channels, H, W);
    `seeds` as in `ada`."""
    x = images.float()
    draws = _Draws(x, DIFFAUGMENT_SALT, seeds)
    if "color" in policy:
        x = _diff_colour(x, draws, channels)
    if "translation" in policy:
        x = _diff_translation(x, draws)
    if "cutout" in policy:
        x = _diff_cutout(x, draws)
    return x.to(images.dtype)


def _diff_colour(x: Tensor, draws: _Draws, channels: int) -> Tensor:
    n, total, height, width = x.shape
    x = x.reshape(n, total // channels, channels, height, width)  # each image of a sample on its own
    per_sample = (n, 1, 1, 1, 1)
    x = x + (draws.uniform(0) - 0.5).view(per_sample)  # brightness
    mean = x.mean(dim=2, keepdim=True)
    x = (x - mean) * (draws.uniform(1) * 2).view(per_sample) + mean  # saturation
    mean = x.mean(dim=(2, 3, 4), keepdim=True)
    x = (x - mean) * (draws.uniform(2) + 0.5).view(per_sample) + mean  # contrast
    return x.reshape(n, total, height, width)


def _integers(draws: _Draws, offset: int, low: int, high: int) -> Tensor:
    """One integer in [low, high] per sample, shape (N, 1)."""
    return torch.floor(draws.uniform(offset, (1,)) * (high - low + 1)).long() + low


def _diff_translation(x: Tensor, draws: _Draws) -> Tensor:
    """Shift each sample by up to 1/8 of the image, zeros where it moved in from outside."""
    n, c, height, width = x.shape
    most_h, most_w = int(height * TRANSLATION_RATIO + 0.5), int(width * TRANSLATION_RATIO + 0.5)
    rows = torch.arange(height, device=x.device) + _integers(draws, 3, -most_h, most_h)  # source rows: (N, H)
    cols = torch.arange(width, device=x.device) + _integers(draws, 4, -most_w, most_w)
    inside = (((rows >= 0) & (rows < height))[:, None, :, None] & ((cols >= 0) & (cols < width))[:, None, None, :])
    x = torch.gather(x, 2, rows.clamp(0, height - 1)[:, None, :, None].expand(n, c, height, width))
    x = torch.gather(x, 3, cols.clamp(0, width - 1)[:, None, None, :].expand(n, c, height, width))
    return x * inside.to(x.dtype)


def _diff_cutout(x: Tensor, draws: _Draws) -> Tensor:
    """Zero a square of half the image's side at a random place (clipped at the borders) in each sample."""
    n, _, height, width = x.shape
    size_h, size_w = int(height * CUTOUT_RATIO + 0.5), int(width * CUTOUT_RATIO + 0.5)
    top = _integers(draws, 5, 0, height - size_h % 2) - size_h // 2
    left = _integers(draws, 6, 0, width - size_w % 2) - size_w // 2
    rows, cols = torch.arange(height, device=x.device), torch.arange(width, device=x.device)
    in_rows = (rows >= top) & (rows < top + size_h)
    in_cols = (cols >= left) & (cols < left + size_w)
    cut = in_rows[:, None, :, None] & in_cols[:, None, None, :]
    return x * (~cut).to(x.dtype)


# ----------------------------------------------------------------------------------------------------- in training
class NoAugmentation:
    """augment.kind=none: D sees the images as they are."""

    p = 0.0

    def __call__(self, images: Tensor) -> Tensor:
        return images

    def real_sign(self, real_logits: Tensor) -> Tensor | None:
        """The D step's term for the agreement all-reduce (None: the step has none)."""
        return None

    def adjust(self, mean_sign: float, interval_done: bool) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, float]:
        return {}

    def load_state_dict(self, state: dict[str, float]) -> None:
        pass


class DiffAugmentation(NoAugmentation):
    """augment.kind=diffaugment: the policy on every image D sees."""

    def __init__(self, cfg: AugmentConfig, channels: int):
        self.policy, self.channels = tuple(cfg.policy), channels

    def __call__(self, images: Tensor) -> Tensor:
        return diffaugment(images, self.policy, self.channels)


class AdaptiveAugmentation(NoAugmentation):
    """augment.kind=ada: ADA's pipeline at probability p, which moves every `augment.interval` steps by
    sign(r_t - target) x (reals D judged in the interval) / augment.speed_images, kept in [0, 1]; r_t is the mean
    of sign(D(real)) over those reals, on all ranks. Every rank holds the same p: it is computed from agreed values."""

    def __init__(self, cfg: AugmentConfig, channels: int, reals_per_d_step: int):
        self.cfg, self.channels, self.reals_per_d_step = cfg, channels, reals_per_d_step
        self.ops = tuple(cfg.ada_ops)
        self.p, self.sign_sum, self.d_steps = cfg.p, 0.0, 0

    def __call__(self, images: Tensor) -> Tensor:
        return ada(images, self.p, self.ops, self.channels)

    def real_sign(self, real_logits: Tensor) -> Tensor:
        return torch.sign(real_logits.detach().float()).mean()

    def adjust(self, mean_sign: float, interval_done: bool) -> None:
        """After a D step: its global mean sign (agreed; non-finite on a skipped step, then not counted); at the
        end of an interval, p moves."""
        if math.isfinite(mean_sign):
            self.sign_sum, self.d_steps = self.sign_sum + mean_sign, self.d_steps + 1
        if not interval_done or not self.d_steps:
            return
        r_t = self.sign_sum / self.d_steps
        step = self.d_steps * self.reals_per_d_step / self.cfg.speed_images
        direction = (r_t > self.cfg.target) - (r_t < self.cfg.target)
        self.p = min(max(self.p + direction * step, 0.0), 1.0)
        self.sign_sum, self.d_steps = 0.0, 0

    def metrics(self) -> dict[str, float]:
        return {"augment_p": self.p}

    def state_dict(self) -> dict[str, float]:
        return {"p": self.p, "sign_sum": self.sign_sum, "d_steps": self.d_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        if state:  # a checkpoint written without ADA starts from augment.p
            self.p, self.sign_sum, self.d_steps = float(state["p"]), float(state["sign_sum"]), int(state["d_steps"])


def build_augmentation(cfg: Config) -> NoAugmentation:
    a = cfg.augment
    if a.kind == "ada":
        return AdaptiveAugmentation(a, cfg.data.channels, cfg.train.batch_size)
    if a.kind == "diffaugment":
        return DiffAugmentation(a, cfg.data.channels)
    return NoAugmentation()
