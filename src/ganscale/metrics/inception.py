"""The FID Inception-v3 (2048 pool features) in plain torch, loaded from a local weights file.

torchvision's Inception3 layout and parameter names (so pytorch-fid's `pt_inception-2015-12-05-*.pth`
and torch-fidelity's `weights-inception-2015-12-05-*.pth`, both ports of TensorFlow's FID graph,
load directly), with the FID graph's differences from torchvision that pytorch-fid patches in:
average pools in the mixed blocks do not count padding, and the last block (Mixed_7c) max-pools.
Preprocessing as pytorch-fid by default: bilinear resize to 299x299 (F.interpolate, half-pixel centres),
inputs in [-1, 1], grey repeated to RGB. `preprocess="torch-fidelity"` instead does what torch-fidelity and
the original TensorFlow FID graph do: images read as 0..255 (u = (x + 1) * 127.5), TensorFlow 1.x's bilinear
resize (no half-pixel offset), then (u - 128) / 128. The two differ by ~0.4% of the features at 299x299
(normalisation) and ~2% at 32x32 (resize), so FIDs are comparable only with the same preprocessing.
Checked with random weights against torch-fidelity 0.4.0 and pytorch-fid 0.3.0 (on torchvision's Inception3):
equal features, see scripts/verify_inception.py. Not checked against published FID numbers here (no real
weights file in this repository).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ganscale.checkpoint import read_failure
from ganscale.config import ConfigError

FID_RESOLUTION = 299
_PER_FORWARD = 50  # 299x299 activations are large: bound host/GPU memory per forward
PREPROCESSING = ("pytorch-fid", "torch-fidelity")


class BasicConv2d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, **conv):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **conv)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.conv(x)))


def _tf_avg_pool(x: torch.Tensor) -> torch.Tensor:
    return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)  # TensorFlow ignores the padding


class InceptionA(nn.Module):
    def __init__(self, in_channels: int, pool_features: int):
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch5x5_1 = BasicConv2d(in_channels, 48, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(48, 64, kernel_size=5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, padding=1)
        self.branch_pool = BasicConv2d(in_channels, pool_features, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1x1(x), self.branch5x5_2(self.branch5x5_1(x)),
                          self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                          self.branch_pool(_tf_avg_pool(x))], 1)


class InceptionB(nn.Module):
    def __init__(self, in_channels: int):
        super().__init__()
        self.branch3x3 = BasicConv2d(in_channels, 384, kernel_size=3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 64, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch3x3(x), self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                          F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    def __init__(self, in_channels: int, channels_7x7: int):
        super().__init__()
        c7 = channels_7x7
        self.branch1x1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch7x7_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7_2 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(in_channels, c7, kernel_size=1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seven = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        double = self.branch7x7dbl_1(x)
        for layer in (self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            double = layer(double)
        return torch.cat([self.branch1x1(x), seven, double, self.branch_pool(_tf_avg_pool(x))], 1)


class InceptionD(nn.Module):
    def __init__(self, in_channels: int):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch3x3_2 = BasicConv2d(192, 320, kernel_size=3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(in_channels, 192, kernel_size=1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, kernel_size=(1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, kernel_size=(7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, kernel_size=3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seven = x
        for layer in (self.branch7x7x3_1, self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4):
            seven = layer(seven)
        return torch.cat([self.branch3x3_2(self.branch3x3_1(x)), seven, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    def __init__(self, in_channels: int, max_pool: bool):
        super().__init__()
        self.max_pool = max_pool  # the FID graph's last block max-pools (pytorch-fid's FIDInceptionE_2)
        self.branch1x1 = BasicConv2d(in_channels, 320, kernel_size=1)
        self.branch3x3_1 = BasicConv2d(in_channels, 384, kernel_size=1)
        self.branch3x3_2a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(in_channels, 448, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, kernel_size=3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, kernel_size=(1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, kernel_size=(3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(in_channels, 192, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        three = self.branch3x3_1(x)
        double = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        pooled = F.max_pool2d(x, 3, stride=1, padding=1) if self.max_pool else _tf_avg_pool(x)
        return torch.cat([self.branch1x1(x), self.branch3x3_2a(three), self.branch3x3_2b(three),
                          self.branch3x3dbl_3a(double), self.branch3x3dbl_3b(double), self.branch_pool(pooled)], 1)


class FIDInceptionV3(nn.Module):
    """(N, 3, 299, 299) in [-1, 1] -> (N, 2048) pool3 features."""

    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, kernel_size=3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, kernel_size=3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, kernel_size=3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, kernel_size=1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, kernel_size=3)
        self.Mixed_5b = InceptionA(192, pool_features=32)
        self.Mixed_5c = InceptionA(256, pool_features=64)
        self.Mixed_5d = InceptionA(288, pool_features=64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, channels_7x7=128)
        self.Mixed_6c = InceptionC(768, channels_7x7=160)
        self.Mixed_6d = InceptionC(768, channels_7x7=160)
        self.Mixed_6e = InceptionC(768, channels_7x7=192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, max_pool=False)
        self.Mixed_7c = InceptionE(2048, max_pool=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, 3, stride=2)
        x = F.max_pool2d(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), 3, stride=2)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b, self.Mixed_6c,
                      self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):
            x = block(x)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)


def load_weights(model: FIDInceptionV3, path: Path) -> None:
    """Load pytorch-fid's or torch-fidelity's file; the 1008-way classifier (fc.*) is not needed for features."""
    fix = "pass pytorch-fid's pt_inception-2015-12-05-*.pth or torch-fidelity's weights file"
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the one line below says it all
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same message
        # one line, without torch's advice to load with weights_only=False (which would run the file's code)
        raise ConfigError("--inception-weights", f"cannot read {path} as a torch weights file: {read_failure(e)}",
                          fix) from None
    state = state.get("state_dict", state) if isinstance(state, dict) else state
    if not (isinstance(state, dict) and all(isinstance(k, str) and torch.is_tensor(v) for k, v in state.items())):
        raise ConfigError("--inception-weights", f"{path} holds a {type(state).__name__}, not a state dict of "
                          "named tensors", fix)
    state = {k: v for k, v in state.items() if not k.startswith(("fc.", "AuxLogits."))}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # a tensor of another shape: torch lists each on a line of its own
        first = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e))
        raise ConfigError("--inception-weights", f"{path} is not an FID Inception-v3 state dict ({first})",
                          fix) from None
    missing = [k for k in missing if not k.endswith("num_batches_tracked")]  # absent from old files; unused in eval
    if missing or unexpected:
        raise ConfigError("--inception-weights", f"{path} is not an FID Inception-v3 state dict (missing "
                          f"{missing[:3]}, unexpected {unexpected[:3]})", fix)


def resize_like_tensorflow1(x: torch.Tensor, size: int = FID_RESOLUTION) -> torch.Tensor:
    """TensorFlow 1.x's resize_bilinear(align_corners=False), as in the FID graph and torch-fidelity: source
    coordinate = output index * (in / out), no half-pixel offset, no antialiasing, edge rows repeated."""
    def taps(n_in: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        src = torch.arange(size, dtype=torch.float32, device=x.device) * torch.tensor(n_in / size, dtype=torch.float32)
        lo = src.long()
        return lo, (lo + 1).clamp_max(n_in - 1), src - lo.float()
    y_lo, y_hi, dy = taps(x.shape[-2])
    x_lo, x_hi, dx = taps(x.shape[-1])
    left, right = x[..., x_lo], x[..., x_hi]
    rows = left + (right - left) * dx
    top, bottom = rows[..., y_lo, :], rows[..., y_hi, :]
    return top + (bottom - top) * dy[:, None]


class InceptionFeatures:
    """(N, C, H, W) images in [-1, 1] (C = 1, 3 or 4) -> (N, 2048) FID pool features.

    `preprocess`: "pytorch-fid" (default; F.interpolate bilinear, [-1, 1] as is) or "torch-fidelity"
    (the TensorFlow FID graph's: 0..255 values, TF 1.x bilinear, (u - 128) / 128); see the module docstring.
    """

    name = "inception"

    def __init__(self, weights: Path, device: torch.device | str = "cpu", preprocess: str = "pytorch-fid"):
        if preprocess not in PREPROCESSING:
            raise ConfigError("preprocess", f"unknown Inception preprocessing {preprocess!r}",
                              f"use one of {', '.join(PREPROCESSING)}")
        self.device = torch.device(device)
        self.preprocess = preprocess
        model = FIDInceptionV3()
        load_weights(model, weights)
        self.model = model.eval().to(self.device)

    def _input(self, images: torch.Tensor) -> torch.Tensor:
        if self.preprocess == "torch-fidelity":
            return (resize_like_tensorflow1((images + 1) * 127.5) - 128) / 128
        return F.interpolate(images, size=(FID_RESOLUTION, FID_RESOLUTION), mode="bilinear", align_corners=False)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, torch.float32)
        if images.shape[1] == 1:
            images = images.expand(-1, 3, -1, -1)
        elif images.shape[1] != 3:
            images = images[:, :3]  # RGBA: drop alpha
        return torch.cat([self.model(self._input(chunk)) for chunk in images.split(_PER_FORWARD)])
