#!/usr/bin/env python
"""Check ganscale's FID Inception-v3 (src/ganscale/metrics/inception.py) against reference implementations,
with RANDOM weights (no real weights file is needed or downloaded).

Why random weights prove something: both sides load the very same state-dict file, so equal 2048-d pool
features mean the architecture (layers, strides, paddings, pools, BN eps, branch order in the concats),
the state-dict key mapping and the preprocessing agree. What stays unverified: the values in the real
pt_inception-2015-12-05 / weights-inception-2015-12-05 file (not available offline here).

References, loaded from their wheels (or unpacked sources) without installing anything or importing their
package __init__ (torch-fidelity's imports torchvision, for which there is no CPU build here):

* torch-fidelity's FeatureExtractorInceptionV3 (feature '2048'; uint8 0..255 images at any size, resized
  to 299 with a TensorFlow-1.x-exact bilinear, then (x - 128) / 128). Required.
* pytorch-fid's InceptionV3 (block 3 = 2048 pool features; float 0..1 images, F.interpolate bilinear to
  299, then 2x - 1), built on torchvision's real Inception3 code from a torchvision wheel (only its pure
  Python model files are executed; the compiled ops are never loaded). Optional: --pytorch-fid and
  --torchvision together.

Checks (each prints max abs and relative difference; "relative" = max abs / max |reference|):

  network          ganscale's FIDInceptionV3 on the exact 299x299 tensor torch-fidelity's network sees
                   vs torch-fidelity's features: architecture + key mapping (torch-fidelity's file)
  torch-fidelity   ganscale end to end (images u / 127.5 - 1, preprocess="torch-fidelity") vs
                   torch-fidelity on the uint8 images u, at every --sizes
  pytorch-fid      ganscale end to end (default preprocessing, pytorch-fid's file) vs pytorch-fid
                   on u / 255, at every --sizes
  default-vs-tf    ganscale's default (pytorch-fid) preprocessing vs torch-fidelity: informational,
                   how far the two tools' preprocessings are apart (not gated)

Exit status 1 if a gated check exceeds --rtol, 2 on usage errors.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/verify_inception.py \
        --torch-fidelity-wheel /tmp/tf/torch_fidelity-0.4.0-py3-none-any.whl \
        [--pytorch-fid /tmp/tf/pytorch_fid-0.3.0-py3-none-any.whl --torchvision /tmp/tf/torchvision-*.whl]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import platform
import sys
import tempfile
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))

from ganscale.metrics import inception as gi  # noqa: E402

DEFAULT_SIZES = (299, 32, 64, 128, 512)
DEFAULT_RTOL = 1e-4


# --- loading the references without installing them -------------------------------------------------------------

def unpacked(path: str | Path, package: str, workdir: Path) -> Path:
    """The folder holding `package/`: from a wheel (extracted under workdir), a folder holding `package/`
    (an unpacked wheel or a site-packages), or the package folder itself."""
    path = Path(path)
    if path.is_file() and path.suffix == ".whl":
        out = workdir / path.stem
        with zipfile.ZipFile(path) as wheel:
            wheel.extractall(out)
        path = out
    if (path / package / "__init__.py").is_file():
        return path
    if path.name == package and (path / "__init__.py").is_file():
        return path.parent
    raise FileNotFoundError(f"no {package}/ package in {path}")


@contextlib.contextmanager
def isolated_modules(*prefixes: str):
    """Undo every sys.modules entry under `prefixes` made inside the block (stub packages included)."""
    def ours(name):
        return any(name == p or name.startswith(p + ".") for p in prefixes)
    saved = {k: v for k, v in sys.modules.items() if ours(k)}
    for k in saved:
        del sys.modules[k]
    try:
        yield
    finally:
        for k in [k for k in sys.modules if ours(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


def stub_package(name: str, folder: Path | None, **attrs) -> types.ModuleType:
    """A package module whose __init__ is never run: submodules import from `folder` as usual."""
    module = types.ModuleType(name)
    module.__path__ = [str(folder)] if folder is not None else []
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def load_torch_fidelity(root: Path) -> types.ModuleType:
    """torch_fidelity.feature_extractor_inceptionv3, with the package's __init__ (torchvision) skipped."""
    stub_package("torch_fidelity", root / "torch_fidelity")
    module = importlib.import_module("torch_fidelity.feature_extractor_inceptionv3")

    def refuse(url, *a, **k):
        raise RuntimeError(f"verify_inception never downloads ({url})")
    module.load_state_dict_from_url = refuse
    return module


def load_pytorch_fid(root: Path, torchvision_root: Path, weights: Path) -> types.ModuleType:
    """pytorch_fid.inception on torchvision's own Inception3 (pure-Python files of the torchvision wheel;
    torchvision's __init__, transforms, io and compiled ops stubbed out); its weight download reads `weights`."""
    tv = torchvision_root / "torchvision"
    version = next((line.split("=", 1)[1].strip().strip("'\"") for line in (tv / "version.py").read_text().splitlines()
                    if line.startswith("__version__")), "0.0.0") if (tv / "version.py").is_file() else "0.0.0"
    stub_package("torchvision", tv, __version__=version)
    stub_package("torchvision.transforms", None)
    sys.modules["torchvision.transforms._presets"] = types.SimpleNamespace(ImageClassification=object)
    sys.modules["torchvision.utils"] = types.SimpleNamespace(_log_api_usage_once=lambda *a, **k: None)
    models = stub_package("torchvision.models", tv / "models")
    tv_inception = importlib.import_module("torchvision.models.inception")
    models.inception = tv_inception
    models.inception_v3 = tv_inception.inception_v3
    sys.modules["torchvision"].models = models
    stub_package("pytorch_fid", root / "pytorch_fid")
    module = importlib.import_module("pytorch_fid.inception")
    module.load_state_dict_from_url = lambda url, *a, **k: torch.load(weights, map_location="cpu", weights_only=True)
    return module


# --- random weights that keep activations O(1) ------------------------------------------------------------------

def randomise_(model: nn.Module, seed: int) -> None:
    """Kaiming-normal convs (ReLU gain), BN with random affine and running statistics near (0, 1): every
    parameter and buffer the features depend on differs between channels, so a swapped or misnamed tensor
    shows up, and activations neither explode nor vanish through the 94 conv layers."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * math.sqrt(2.0 / fan_in))
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(0.75 + 0.5 * torch.rand(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.75 + 0.5 * torch.rand(m.running_var.shape, generator=g))
            elif isinstance(m, nn.Linear):
                m.weight.copy_(0.01 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.01 * torch.randn(m.bias.shape, generator=g))


def random_torch_fidelity_file(tfm: types.ModuleType, seed: int, path: Path) -> None:
    """Write a torch-fidelity-format weights file (its own model's state dict, fc included) of random weights."""
    cls = tfm.FeatureExtractorInceptionV3
    cls.load_state_dict = lambda self, *a, **k: None  # the constructor's one load: skipped, nothing is read
    saved_url = tfm.load_state_dict_from_url
    tfm.load_state_dict_from_url = lambda *a, **k: {}
    try:
        model = cls("inception-v3-compat", ["2048"])
    finally:
        del cls.load_state_dict
        tfm.load_state_dict_from_url = saved_url
    randomise_(model, seed)
    torch.save(model.state_dict(), path)


# --- inputs and comparisons -------------------------------------------------------------------------------------

def test_images(size: int, seed: int) -> torch.Tensor:
    """(3, 3, size, size) uint8: uniform noise (the hardest case for a resize), a smooth image, a flat grey 127
    with saturated corners (0 and 255: the ends of the value range)."""
    g = torch.Generator().manual_seed(seed + size)
    noise = torch.randint(0, 256, (3, size, size), generator=g, dtype=torch.uint8)
    coarse = torch.rand(1, 3, 5, 5, generator=g)
    smooth = (F.interpolate(coarse, size=(size, size), mode="bicubic", align_corners=True)[0].clamp(0, 1) * 255).round()
    flat = torch.full((3, size, size), 127.0)
    q = max(size // 4, 1)
    flat[:, :q, :q], flat[:, -q:, -q:] = 0, 255
    return torch.stack([noise, smooth.to(torch.uint8), flat.to(torch.uint8)])


@dataclass
class Row:
    check: str
    size: int
    max_abs: float
    rel: float
    scale: float
    gated: bool

    def line(self, rtol: float) -> str:
        verdict = ("ok" if self.rel <= rtol else "FAIL") if self.gated else "info"
        return (f"{self.check:<15} {self.size:>5}  max|diff| {self.max_abs:10.3e}  rel {self.rel:10.3e}  "
                f"max|ref| {self.scale:8.3f}  {verdict}")


def compare(check: str, size: int, ours: torch.Tensor, ref: torch.Tensor, gated: bool = True) -> Row:
    assert ours.shape == ref.shape, (check, ours.shape, ref.shape)
    diff = (ours.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    return Row(check, size, diff, diff / scale, scale, gated)


def feature_summary(features: torch.Tensor) -> str:
    return (f"mean {features.mean():.3f}, std {features.std():.3f}, zero share {(features == 0).float().mean():.3f}, "
            f"std across images {features.std(0).mean():.3f}")


def run(torch_fidelity: str | Path, pytorch_fid: str | Path | None = None, torchvision: str | Path | None = None,
        sizes=DEFAULT_SIZES, seed: int = 0, log=print) -> list[Row]:
    """Every comparison, as rows (see the module docstring)."""
    rows: list[Row] = []
    supports_tf = "preprocess" in gi.InceptionFeatures.__init__.__code__.co_varnames
    with tempfile.TemporaryDirectory(prefix="verify-inception-") as tmp, \
            isolated_modules("torch_fidelity", "pytorch_fid", "torchvision"):
        work = Path(tmp)
        tfm = load_torch_fidelity(unpacked(torch_fidelity, "torch_fidelity", work))
        tf_file = work / "weights-inception-random.pth"
        random_torch_fidelity_file(tfm, seed, tf_file)
        # torch-fidelity's own, strict load path from its file; ganscale's loader from the same file
        reference = tfm.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"],
                                                    feature_extractor_weights_path=str(tf_file))
        ours = gi.InceptionFeatures(tf_file)
        ours_tf = gi.InceptionFeatures(tf_file, preprocess="torch-fidelity") if supports_tf else None
        stripped = {k: v for k, v in torch.load(tf_file, weights_only=True).items()
                    if not k.endswith("num_batches_tracked")}
        torch.save(stripped, work / "no-num-batches-tracked.pth")
        gi.InceptionFeatures(work / "no-num-batches-tracked.pth")  # files saved before BN counted batches load too

        pfid = pfid_file = None
        if pytorch_fid is not None:
            if torchvision is None:
                raise ValueError("--pytorch-fid needs --torchvision (pytorch-fid builds on torchvision's Inception3)")
            pfm = load_pytorch_fid(unpacked(pytorch_fid, "pytorch_fid", work),
                                   unpacked(torchvision, "torchvision", work), tf_file)
            # pytorch-fid's strict load of torch-fidelity's file into torchvision's Inception3 (+ FID blocks):
            # the two formats have the same keys and shapes. Its state dict, saved, is a pytorch-fid-format file.
            pfid = pfm.InceptionV3([pfm.InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).eval()
            net = pfm.fid_inception_v3()
            pfid_file = work / "pt_inception-random.pth"
            torch.save(net.state_dict(), pfid_file)
            ours_pfid = gi.InceptionFeatures(pfid_file)
            log(f"pytorch-fid (torchvision {sys.modules['torchvision'].__version__}) loaded torch-fidelity's file "
                f"strictly: {len(net.state_dict())} tensors, same names and shapes")

        for size in sizes:
            images = test_images(size, seed)
            with torch.no_grad():
                ref = reference(images)[0]
                log(f"size {size}: torch-fidelity features {feature_summary(ref)}")
                x = images.float() / 127.5 - 1  # ganscale's [-1, 1] images
                seen = (tfm.interpolate_bilinear_2d_like_tensorflow1x(images.float(), size=(299, 299),
                                                                      align_corners=False) - 128) / 128
                rows.append(compare("network", size, ours.model(seen), ref))
                if ours_tf is not None:
                    rows.append(compare("torch-fidelity", size, ours_tf(x), ref))
                if pfid is not None:
                    rows.append(compare("pytorch-fid", size, ours_pfid(x), pfid(images.float() / 255)[0].flatten(1)))
                rows.append(compare("default-vs-tf", size, ours(x), ref, gated=False))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torch-fidelity-wheel", required=True, metavar="PATH",
                   help="torch-fidelity wheel (pip download torch-fidelity --no-deps) or its unpacked source")
    p.add_argument("--pytorch-fid", metavar="PATH", help="pytorch-fid wheel or unpacked source (optional)")
    p.add_argument("--torchvision", metavar="PATH", help="torchvision wheel or unpacked source (with --pytorch-fid)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="input sizes (square), comma-separated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL, help="max |diff| / max |reference| allowed")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
          f"{args.threads} thread(s), seed {args.seed}")
    try:
        rows = run(args.torch_fidelity_wheel, args.pytorch_fid, args.torchvision,
                   [int(s) for s in args.sizes.split(",")], args.seed)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for row in rows:
        print(row.line(args.rtol))
    failed = [r for r in rows if r.gated and r.rel > args.rtol]
    print(f"{len(rows) - len(failed)}/{len(rows)} rows within rtol {args.rtol:g} (info rows not gated)"
          if not failed else f"{len(failed)} gated row(s) above rtol {args.rtol:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
