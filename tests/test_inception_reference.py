"""ganscale's FID Inception-v3 against torch-fidelity (and pytorch-fid on torchvision's Inception3) with random
weights, through scripts/verify_inception.py. The reference checks need the references' wheels or unpacked
sources, never the network; they skip unless given:

    pip download torch-fidelity pytorch-fid torchvision --no-deps -d /tmp/ref
    GANSCALE_TORCH_FIDELITY_SRC=/tmp/ref/torch_fidelity-*.whl \\
    GANSCALE_PYTORCH_FID_SRC=/tmp/ref/pytorch_fid-*.whl GANSCALE_TORCHVISION_SRC=/tmp/ref/torchvision-*.whl \\
    OMP_NUM_THREADS=1 pytest tests/test_inception_reference.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from ganscale.config import ConfigError
from ganscale.metrics.inception import InceptionFeatures, resize_like_tensorflow1

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "verify_inception.py"


def _verify_module():
    spec = importlib.util.spec_from_file_location("verify_inception", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def _source(var: str) -> str | None:
    path = os.environ.get(var)
    return path if path and Path(path).exists() else None


def test_tensorflow_resize_has_no_half_pixel_offset():
    row = torch.tensor([0.0, 1.0, 2.0, 3.0]).view(1, 1, 1, 4).expand(1, 1, 4, 4)
    up = resize_like_tensorflow1(row, size=8)  # source x = i * 4 / 8, the last one clamped to the edge
    assert torch.equal(up[0, 0, 0], torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.0]))
    assert torch.equal(up[0, 0, :, 3], up[0, 0, :, 3][:1].expand(8))  # constant along y stays constant
    x = torch.rand(2, 3, 7, 7)
    assert torch.equal(resize_like_tensorflow1(x, size=7), x)
    assert torch.equal(resize_like_tensorflow1(torch.arange(8.0).view(1, 1, 1, 8).expand(1, 1, 8, 8), size=4)[0, 0, 0],
                       torch.tensor([0.0, 2.0, 4.0, 6.0]))  # downsampling: every other sample, no antialiasing


def test_unknown_preprocessing_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="pytorch-fid, torch-fidelity"):
        InceptionFeatures(tmp_path / "unused.pth", preprocess="clean-fid")


@pytest.mark.skipif(_source("GANSCALE_TORCH_FIDELITY_SRC") is None,
                    reason="set GANSCALE_TORCH_FIDELITY_SRC to torch-fidelity's wheel or unpacked source")
def test_features_equal_torch_fidelity_and_pytorch_fid_with_random_weights():
    verify = _verify_module()
    pytorch_fid, torchvision = _source("GANSCALE_PYTORCH_FID_SRC"), _source("GANSCALE_TORCHVISION_SRC")
    def stubbed():
        return {name for name in sys.modules if name.split(".")[0] in ("torch_fidelity", "pytorch_fid", "torchvision")}
    before, threads = stubbed(), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = verify.run(os.environ["GANSCALE_TORCH_FIDELITY_SRC"], pytorch_fid if torchvision else None,
                          torchvision if pytorch_fid else None, sizes=(299, 32), log=lambda *a: None)
    finally:
        torch.set_num_threads(threads)
    checks = {row.check for row in rows}
    assert {"network", "torch-fidelity", "default-vs-tf"} <= checks
    assert ("pytorch-fid" in checks) == bool(pytorch_fid and torchvision)
    for row in rows:
        if row.gated:
            assert row.rel <= verify.DEFAULT_RTOL, row
        else:  # pytorch-fid's and torch-fidelity's preprocessings really differ (the option is not a no-op)
            assert row.rel > 1e-3, row
    assert stubbed() == before  # the stub packages and loaded reference modules are gone again
