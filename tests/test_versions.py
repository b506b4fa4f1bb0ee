"""ganscale.versions: the supported torch range, each feature's first version, and what an older torch is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ganscale import config, preflight, versions
from ganscale.config import ConfigError

VERSIONS_PY = Path(versions.__file__)


@pytest.mark.parametrize("text, parsed", [("2.14.1+cu130", (2, 14, 1)), ("2.13.0+cpu", (2, 13, 0)),
                                          ("2.16.0a0+git1234", (2, 16, 0)), ("2.11", (2, 11, 0))])
def test_parse_reads_local_and_pre_release_versions(text, parsed):
    assert versions.parse(text) == parsed


def test_parse_refuses_what_is_not_a_version():
    with pytest.raises(ValueError):
        versions.parse("nightly")


def test_the_range_takes_2_11_through_2_15_and_later_releases_but_not_older_ones():
    assert [versions.in_range(v) for v in ("2.10.0", "2.11.0", "2.13.0+cpu", "2.15.0", "2.16.0")] == \
        [False, True, True, True, True]
    assert [versions.checked(v) for v in ("2.10.0", "2.11.0", "2.15.0", "2.16.0")] == [False, True, True, False]
    assert versions.in_range(torch.__version__) and versions.checked(torch.__version__)


def test_lacking_names_each_feature_older_than_its_first_version():
    assert versions.lacking("2.11.0") == ["grid-sample-double-backward", "launcher-grace"]
    assert versions.lacking("2.12.1") == []
    assert versions.lacking("2.5.1") == ["fsdp", "sharded-checkpoint", "grid-sample-double-backward", "launcher-grace"]
    assert "pipeline" in versions.lacking("2.3.1") and "pipeline" not in versions.lacking("2.4.0")


def test_a_private_api_read_only_from_2_11_on_is_unknown_before_not_lacking():
    assert versions.unread("2.10.0") == ["compile-callbacks", "flight-recorder"]
    assert versions.unread("2.11.0") == [] and versions.unread("2.16.0") == []


def test_ddp_keyword_follows_the_2_13_rename(monkeypatch):
    import inspect

    from torch.nn import parallel

    chosen = versions.ddp_no_buffer_sync()
    assert set(chosen) <= set(inspect.signature(parallel.DistributedDataParallel).parameters)  # this torch takes it
    if versions.parse(torch.__version__)[:2] >= (2, 13):
        assert chosen == {"forward_sync_buffers": False}

    class Before213:  # DDP's signature in torch 2.11 and 2.12
        def __init__(self, module, device_ids=None, broadcast_buffers=True):
            pass
    monkeypatch.setattr(parallel, "DistributedDataParallel", Before213)
    assert versions.ddp_no_buffer_sync() == {"broadcast_buffers": False}


@pytest.mark.parametrize("overrides, key", [
    (["parallel.generator=fsdp", "parallel.discriminator=fsdp", "train.batch_size=64"], "parallel.generator"),
    (["parallel.discriminator=zero2"], "parallel.discriminator"),
    (["checkpoint.format=sharded"], "checkpoint.format"),
])
def test_an_option_whose_feature_an_older_torch_lacks_is_refused_by_name(monkeypatch, overrides, key):
    cfg = config.load(None, overrides)
    preflight.check(cfg, 2, False)  # fine on this torch
    monkeypatch.setattr(versions, "running", lambda: "2.5.1")
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 2, False)
    assert info.value.key == key
    assert "needs torch >= 2.6" in info.value.problem and "2.5.1" in info.value.problem
    assert "torch>=2.6" in info.value.fix


def test_the_grid_sample_feature_says_whether_this_torch_differentiates_ada_twice():
    """R1 differentiates D's input gradient through ADA's geometric resampling: torch 2.11 has no derivative
    for grid_sample's backward, 2.12 on have one. The table's entry must say what this torch does."""
    from ganscale import augment

    images = torch.rand(2, 3, 8, 8, requires_grad=True)
    augmented = augment.ada(images, 1.0, ["rotate", "xfrac"], 3)
    (gradient,) = torch.autograd.grad(augmented.square().sum(), images, create_graph=True)
    if "grid-sample-double-backward" in versions.lacking(torch.__version__):
        with pytest.raises(RuntimeError, match="grid_sampler_2d_backward"):
            gradient.square().sum().backward()
    else:
        gradient.square().sum().backward()
        assert images.grad.abs().sum() > 0


@pytest.mark.parametrize("overrides, torch_version, refused", [
    (["augment.kind=ada", "loss.r1_gamma=1"], "2.11.0", True),
    (["augment.kind=ada", "loss.r1_gamma=1", "augment.ada_ops=[xflip]"], "2.11.0", True),
    (["augment.kind=ada", "loss.r1_gamma=1", "augment.ada_ops=[brightness,contrast]"], "2.11.0", False),
    (["augment.kind=ada", "loss.r1_gamma=0"], "2.11.0", False),
    (["augment.kind=diffaugment", "loss.r1_gamma=1"], "2.11.0", False),
    (["augment.kind=ada", "loss.r1_gamma=1"], "2.12.1", False),
])
def test_r1_through_ada_resampling_is_refused_on_a_torch_without_its_double_backward(monkeypatch, overrides,
                                                                                    torch_version, refused):
    cfg = config.load("digits", overrides)
    monkeypatch.setattr(versions, "running", lambda: torch_version)
    if not refused:
        preflight.check(cfg, 1, False)
        return
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 1, False)
    assert info.value.key == "augment.ada_ops" and "needs torch >= 2.12" in info.value.problem
    assert "torch>=2.12" in info.value.fix and "keep only colour operations" in info.value.fix


def test_pipeline_is_refused_on_a_torch_without_pipelining(monkeypatch):
    monkeypatch.setattr(versions, "running", lambda: "2.3.1")
    cfg = config.load(None, ["parallel.generator=pipeline", "parallel.discriminator=pipeline"])
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 2, False)
    assert info.value.key == "parallel.generator" and "torch.distributed.pipelining" in info.value.problem


def test_the_refusal_is_one_line_and_exit_2_from_the_cli(tmp_path):
    """Through `ganscale train`, with a torch that reports 2.5.1 (the version string only is faked)."""
    code = ("import sys, torch; torch.__version__ = '2.5.1'; from ganscale.cli import main; "
            "sys.argv = ['ganscale', 'train', '--run-dir', sys.argv[1], '--set', 'parallel.discriminator=fsdp']; main()")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "parallel.discriminator" in result.stderr and "needs torch >= 2.6" in result.stderr


def test_bootstrap_loads_the_module_by_path_without_ganscale():
    """scripts/bootstrap.sh reads the range before ganscale is installed: loaded by path in an isolated Python
    (no PYTHONPATH, no ganscale importable), the file still answers."""
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('v', sys.argv[1]); "
            "m = sys.modules['v'] = importlib.util.module_from_spec(spec); sys.modules['ganscale'] = None; spec.loader.exec_module(m); "
            "print(m.in_range('2.14.1'), m.in_range('2.10.0'))")
    result = subprocess.run([sys.executable, "-I", "-c", code, str(VERSIONS_PY)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_the_loopback_override_matches_this_torch_and_a_renamed_method_is_refused(monkeypatch):
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import DynamicRendezvousHandler

    from ganscale import loopback

    loopback.overridable()  # this torch (2.13 or 2.14.1) has the method the override replaces
    monkeypatch.delattr(DynamicRendezvousHandler, "_create_tcp_store_server")
    with pytest.raises(ConfigError) as info:
        loopback.register()
    assert info.value.key == "--nproc" and "127.0.0.1" in info.value.problem and "torchrun" in info.value.fix


# ------------------------------------------------------------------------------------ scripts/bootstrap.sh
CHECKOUT = Path(__file__).parents[1]
BOOTSTRAP = CHECKOUT / "scripts" / "bootstrap.sh"
FAKE_PIP = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../pip.log"
"""


@pytest.mark.parametrize("installed, wanted, requirement", [
    ("2.14.1+cu130", "2.14", None), ("2.14.0", "2.14", None), ("2.14.1+cu130", "2.14.1", None),
    ("2.14.1+cu130", "2.14.1+cu130", None), ("2.13.0+cpu", "", None), ("2.16.0", "", None),
    ("2.13.0+cpu", "2.14", "torch==2.14.*"), ("2.14.0", "2.14.1", "torch==2.14.1"),
    ("2.14.1+cpu", "2.14.1+cu130", "torch==2.14.1+cu130"), ("2.10.0", "", "torch==2.13.0"),
    (None, "", "torch==2.13.0"), (None, "2.14", "torch==2.14.*"),
])
def test_bootstrap_keeps_a_torch_that_fits_and_names_the_one_it_installs(installed, wanted, requirement):
    chosen, line = versions.bootstrap_torch(installed, wanted, "/v")
    assert chosen == requirement
    assert (line == "") == (requirement is None or installed is None)  # a replacement says so; a new venv is quiet
    if line:
        assert line.startswith("ganscale: ") and "\n" not in line and f"torch {installed} in /v" in line


@pytest.mark.parametrize("wanted", ["2.10.0", "2.10", "nightly", "2.14.1foo"])
def test_bootstrap_refuses_a_torch_asked_for_outside_the_range(wanted):
    with pytest.raises(ValueError) as info:
        versions.bootstrap_torch("2.13.0", wanted, "/v")
    line = str(info.value)
    assert f"GANSCALE_TORCH={wanted}" in line and "2.11 through 2.15" in line and "unset it" in line


def fake_venv(path: Path, torch_version: str | None) -> Path:
    """A venv without pip whose torch is only metadata, and a bin/pip that logs its arguments (to pip.log)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=60)
    if torch_version:
        (site,) = path.glob("lib/python*/site-packages")
        (site / f"torch-{torch_version}.dist-info").mkdir()
        (site / f"torch-{torch_version}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    (path / "bin" / "pip").write_text(FAKE_PIP)
    (path / "bin" / "pip").chmod(0o755)
    return path


def bootstrap(cwd: Path, tmp_path: Path, **variables: str) -> subprocess.CompletedProcess:
    """scripts/bootstrap.sh sourced from `cwd`; a venv it creates is a fake_venv (PYTHON's `-m venv`), and
    pip cannot reach an index whatever happens."""
    python = tmp_path / "python"
    python.write_text(f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then
  {sys.executable} -c 'import sys; sys.path.insert(0, sys.argv[1]); import test_versions as t; t.fake_venv(__import__("pathlib").Path(sys.argv[2]), None)' {Path(__file__).parent} "$3"
  exit
fi
exec {sys.executable} "$@"
""")
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GANSCALE_", "PIP_")) and k != "PYTHONPATH"}
    env.update(PYTHON=str(python), PIP_NO_INDEX="1", **variables)
    return subprocess.run(["bash", "-c", 'source "$0" && echo "cwd=$PWD"', str(BOOTSTRAP)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def stamped(venv: Path) -> Path:
    """`venv` as bootstrap leaves it after an install of the default extras."""
    (venv / ".ganscale-installed").write_text("test\n")
    return venv


def pip_calls(venv: Path) -> list[str]:
    log = venv / "pip.log"
    return log.read_text().splitlines() if log.exists() else []


def test_bootstrap_keeps_a_2_14_x_for_GANSCALE_TORCH_2_14_quietly(tmp_path):
    venv = stamped(fake_venv(tmp_path / "v", "2.14.1+cu130"))
    result = bootstrap(tmp_path, tmp_path, GANSCALE_VENV=str(venv), GANSCALE_TORCH="2.14")
    assert result.returncode == 0, result.stderr
    assert result.stderr == "" and result.stdout == f"cwd={tmp_path}\n" and pip_calls(venv) == []


def test_bootstrap_says_in_one_line_which_torch_it_replaces(tmp_path):
    venv = stamped(fake_venv(tmp_path / "v", "2.10.0"))
    result = bootstrap(tmp_path, tmp_path, GANSCALE_VENV=str(venv))
    assert result.returncode == 0, result.stderr
    assert result.stderr == (f"ganscale: torch 2.10.0 in {venv} is outside the supported range 2.11-2.15; "
                             "installing torch 2.13.0 (set GANSCALE_TORCH=... to choose)\n")
    assert pip_calls(venv) == ["install --quiet torch==2.13.0", f"install --quiet -e {CHECKOUT}[test]"]
    venv = stamped(fake_venv(tmp_path / "w", "2.13.0+cpu"))
    result = bootstrap(tmp_path, tmp_path, GANSCALE_VENV=str(venv), GANSCALE_TORCH="2.14")
    assert result.returncode == 0, result.stderr
    assert len(result.stderr.splitlines()) == 1 and "torch 2.13.0+cpu" in result.stderr and "2.14.*" in result.stderr
    assert pip_calls(venv)[0] == "install --quiet torch==2.14.*"


def test_bootstrap_refuses_GANSCALE_TORCH_outside_the_range_before_installing_anything(tmp_path):
    venv = stamped(fake_venv(tmp_path / "v", "2.13.0"))
    for target in (venv, tmp_path / "new"):
        result = bootstrap(tmp_path, tmp_path, GANSCALE_VENV=str(target), GANSCALE_TORCH="2.10.0")
        assert result.returncode == 2
        assert len(result.stderr.splitlines()) == 1 and "GANSCALE_TORCH=2.10.0 is outside" in result.stderr
    assert pip_calls(venv) == [] and not (tmp_path / "new").exists()


def test_bootstrap_reads_a_relative_GANSCALE_VENV_from_the_callers_directory(tmp_path):
    (tmp_path / "x").mkdir()
    result = bootstrap(tmp_path / "x", tmp_path, GANSCALE_VENV="venv")
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # a new venv's first install is the quiet, normal case
    assert pip_calls(tmp_path / "x" / "venv") == ["install --quiet torch==2.13.0",
                                                  f"install --quiet -e {CHECKOUT}[test]"]
    assert not (CHECKOUT / "venv").exists()
    # train.sh runs `ganscale train` where it was called: a config, data and --run-dir are the caller's paths
    assert result.stdout == f"cwd={tmp_path / 'x'}\n"


def test_bootstrap_refuses_a_GANSCALE_VENV_folder_that_is_not_a_venv(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "keep.txt").write_text("mine")
    result = bootstrap(tmp_path, tmp_path, GANSCALE_VENV="data")
    assert result.returncode == 2
    assert len(result.stderr.splitlines()) == 1 and f"GANSCALE_VENV={folder} is not a venv" in result.stderr
    assert [p.name for p in folder.iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()  # an empty folder becomes the venv
    assert bootstrap(tmp_path, tmp_path, GANSCALE_VENV="empty").returncode == 0
    assert (tmp_path / "empty" / "bin" / "python").exists()
