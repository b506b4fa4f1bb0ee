"""The Python API (`ganscale.train`) and the examples: from one process, with --nproc-like workers, under torchrun,
and bad Python objects refused with one clear error."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from test_cli import clean_env, explain, ganscale, metrics
from test_custom import write_user_gan

from ganscale import api, config
from ganscale.config import ConfigError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_a_config_as_settings_loads_back_the_same():
    """A dict or a Config reaches `--nproc` workers as every option over the default recipe."""
    for name in config.recipe_names():
        cfg = config.load(name, ["model.generator_args={z_dim: 8, rate: 1.0e-05, tag: '123'}"] if name == "digits"
                          else [])
        assert config.load(config.DEFAULT_RECIPE, list(api.settings(cfg))) == cfg, name


def closure():
    class Local:
        pass

    return Local


@pytest.mark.parametrize("argument, make, said", [
    ("generator", lambda package: (lambda z: z), "lambda"),
    ("generator", lambda package: closure(), "inside a function"),
    ("dataset", lambda package: type("Made", (), {"__module__": "__main__"}), "__main__"),
    ("loss", lambda package: package.losses.Hinge(), "not bound to a name"),
    ("discriminator", lambda package: package.nets.NOT_A_FACTORY, "not a class or a function"),
])
def test_objects_workers_cannot_import_are_refused_naming_the_argument(tmp_path, monkeypatch, argument, make, said):
    write_user_gan(tmp_path, "api_refused")
    monkeypatch.syspath_prepend(str(tmp_path))
    import api_refused.losses
    import api_refused.nets

    with pytest.raises(ConfigError) as refused:
        api.train("digits", **{argument: make(api_refused)}, run_dir=tmp_path / "run")
    assert refused.value.key == f"train({argument}=...)" and said in refused.value.problem
    assert "top level of a module" in str(refused.value) or "pass" in refused.value.fix
    assert not (tmp_path / "run").exists()


SCRIPT = '''
import json, sys
import ganscale
from ganscale.api import WorkersFailed
from {package}.nets import Generator, make_discriminator, Exploding
from {package}.data import make_dataset
from {package}.losses import Hinge

def train(run, generator=Generator, **options):
    return ganscale.train({config!r}, overrides=["train.steps=3"], run_dir=run, generator=generator,
                          discriminator=make_discriminator, dataset=make_dataset, loss=Hinge, **options)

try:
    train("exploded", generator=Exploding)
except RuntimeError as e:
    print("failed:", e)
results = {{"one": train("one"), "two": train("two", nproc=2), "again": train("again")}}
print(json.dumps(results))
'''

EXPLODING = '''

class Exploding(Generator):
    """Checked fine on preflight's 2 and 4 latents; fails in training (batch 8), after the process group started."""
    def forward(self, z, labels=None):
        if len(z) == 8:
            raise RuntimeError("exploded in training")
        return super().forward(z, labels)
'''


@pytest.mark.slow
def test_the_api_trains_in_this_process_with_workers_and_again_and_the_cli_resumes_it(tmp_path):
    """In one script: a run that fails in training, then runs in this process, with 2 workers
    and in this process again (each leaves the process as it found it); the objects are recorded by import path,
    so `ganscale train --resume` continues the run."""
    recipe = write_user_gan(tmp_path / "code", "api_user_gan")
    with open(tmp_path / "code" / "api_user_gan" / "nets.py", "a") as nets:
        nets.write(EXPLODING)
    bare = config.load_raw(str(recipe))
    for section in ("model", "data", "loss"):  # the objects fill these in
        bare[section] = {k: v for k, v in bare[section].items() if k not in ("generator", "discriminator", "dataset",
                                                                                 "kind")}
    script = tmp_path / "work" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT.format(package="api_user_gan", config=bare))
    env = {**clean_env(), "PYTHONPATH": f"{tmp_path / 'code'}:{clean_env().get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, str(script)], cwd=script.parent, env=env, capture_output=True, text=True,
                            timeout=400)
    assert result.returncode == 0, explain(result)
    assert "failed: exploded in training" in result.stdout, explain(result)
    summaries = json.loads(result.stdout.strip().splitlines()[-1])
    assert [summaries[k]["world_size"] for k in ("one", "two", "again")] == [1, 2, 1]
    losses = [{k: v for k, v in summaries[run]["final"].items() if k.startswith("loss")} for run in ("one", "again")]
    assert losses[0] == losses[1] and losses[0]
    one, two = (metrics(script.parent / k)[-1] for k in ("one", "two"))
    assert one["loss_d"] == pytest.approx(two["loss_d"], rel=1e-5)
    saved = (script.parent / "two" / "config.yaml").read_text()
    assert "api_user_gan.nets:Generator" in saved and "api_user_gan.losses:Hinge" in saved
    resumed = ganscale("train", "--run-dir", str(script.parent / "two"), "--resume", "auto",
                       "--set", "train.steps=4", cwd=tmp_path, timeout=300)  # no PYTHONPATH: code_path finds it
    assert resumed.returncode == 0, explain(resumed)
    assert metrics(script.parent / "two")[-1]["step"] == 4


@pytest.mark.slow
def test_the_api_example_under_torchrun_with_two_processes(tmp_path):
    run = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(EXAMPLES / "api" / "train.py"), "--steps", "2", "--run-dir", str(run)],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, explain(result)
    assert result.stdout.count("trained 2 steps on 2 process(es)") == 1, explain(result)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2
    assert str(EXAMPLES / "conditional_gan") in (run / "config.yaml").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("example", ["conditional_gan", "noise_injection"])
def test_an_example_trains_through_the_cli_with_two_workers(tmp_path, example):
    run = tmp_path / "run"
    result = ganscale("train", str(EXAMPLES / example / "config.yaml"), "--nproc", "2", "--run-dir", str(run),
                      "--set", "train.steps=3", "--set", "log.every=1", cwd=tmp_path, timeout=300)
    assert result.returncode == 0, explain(result)
    assert [record["step"] for record in metrics(run) if "loss_d" in record] == [1, 2, 3]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2


def test_workers_reach_the_tensorflow_engine_s_checks(tmp_path):
    """`workers=` is `--workers`: refused on the torch engine, and on the tensorflow engine checked as the CLI
    checks it (TensorFlow's open servers need consent) before anything is written or TensorFlow is imported."""
    with pytest.raises(ConfigError) as torch_engine:
        api.train("digits", workers=2, run_dir=tmp_path / "a")
    assert torch_engine.value.key == "workers" and torch_engine.value.fix.startswith("use nproc=N for N processes")
    with pytest.raises(ConfigError) as tensorflow:
        api.train("digits", overrides=["train.engine=tensorflow"], workers=2, run_dir=tmp_path / "b")
    assert tensorflow.value.key == "parallel.tf_open_servers"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("arguments, key", [
    ({"nproc": 0}, "nproc"), ({"nproc": -1}, "nproc"), ({"nproc": "2"}, "nproc"), ({"max_restarts": -1}, "max_restarts"),
    ({"workers": 0}, "workers"), ({"overrides": "train.steps=4"}, "overrides"), ({"config": 123}, "config")])
def test_arguments_the_cli_checks_by_type_are_refused_naming_the_argument(tmp_path, arguments, key):
    with pytest.raises(ConfigError) as refused:
        api.train(**{"run_dir": tmp_path / "run", **arguments})
    assert refused.value.key == key
    assert not (tmp_path / "run").exists()


def test_a_run_in_this_process_leaves_its_excepthook_as_it_found_it():
    """torch's init_process_group chains a '[rankN]:' excepthook: each in-process run added one more prefix."""
    import sys

    from ganscale.runtime import start

    before = sys.excepthook
    for _ in range(2):
        runtime = start("cpu")
        runtime.close()
        assert sys.excepthook is before


def test_a_run_in_this_process_leaves_the_caller_s_random_numbers_as_it_found_them(tmp_path):
    """Training seeds torch's, numpy's and Python's global RNGs (initialisation, per-rank streams): a notebook's
    own random numbers after `ganscale.train` went on from the run's seed, not from where the caller left them."""
    import random

    import numpy as np
    import torch

    def draws():
        return torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]

    torch.manual_seed(11), np.random.seed(12), random.seed(13)
    expected = draws()
    torch.manual_seed(11), np.random.seed(12), random.seed(13)
    api.train("digits", overrides=["train.steps=2", "train.batch_size=8", "log.sample_every=0", "checkpoint.every=0",
                                   "log.tensorboard=false"], run_dir=tmp_path / "run")
    assert draws() == expected


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="CUDA's generators need a CUDA device")
def test_a_run_in_this_process_on_cuda_leaves_the_caller_s_cuda_random_numbers_as_it_found_them(tmp_path):
    """The CUDA branch of the restore above (torch.cuda.set_rng_state_all): scripts/gpu-check.sh runs it."""
    import torch

    torch.cuda.manual_seed_all(14)
    expected = torch.rand(3, device="cuda").tolist()
    torch.cuda.manual_seed_all(14)
    api.train("digits", overrides=["train.steps=2", "train.batch_size=8", "log.sample_every=0", "checkpoint.every=0",
                                   "log.tensorboard=false", "train.device=cuda"], run_dir=tmp_path / "run")
    assert torch.rand(3, device="cuda").tolist() == expected


@pytest.mark.parametrize("nproc", [None, 2])
def test_a_run_dir_that_is_a_file_is_refused_and_the_file_kept(tmp_path, nproc):
    """The CLI's --run-dir type refuses a file; the API's run_dir was a NotADirectoryError from run.lock. (A path
    below a file is the refused file operation, exit 7 in the CLI: tests/test_cli.py.)"""
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError) as refused:
        api.train("digits", run_dir=notes, nproc=nproc)
    assert refused.value.key == "run_dir" and f"'{notes}' is a file, not a folder" in str(refused.value)
    assert notes.read_text() == "mine" and list(tmp_path.iterdir()) == [notes]


@pytest.mark.parametrize("arguments, key, said", [
    ({"resume": "nowhere"}, "resume", "Fix: pass a checkpoint file, a run directory holding checkpoints/, or 'auto'"),
    ({"run_dir": "full"}, "run_dir", "Fix: choose a new or empty run_dir"),
    ({"max_restarts": 1, "nproc": 2, "overrides": ["train.engine=tensorflow"]}, "max_restarts",
     "Fix: drop max_restarts and continue a stopped run with resume='auto'")])
def test_api_errors_name_the_keyword_arguments_not_the_cli_s_options(tmp_path, monkeypatch, arguments, key, said):
    """A ConfigError from train named the CLI's options (--run-dir, --resume auto), which a Python caller never
    passed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as refused:
        api.train("digits", **arguments)
    assert refused.value.key == key and said in str(refused.value) and "--" not in str(refused.value), refused.value


def test_an_object_and_an_override_naming_the_same_network_are_refused(tmp_path):
    """The object won silently over overrides' model.generator."""
    from torch import nn

    with pytest.raises(ConfigError) as refused:
        api.train("digits", overrides=["model.generator=elsewhere:G"], generator=nn.Linear, run_dir=tmp_path / "run")
    assert refused.value.key == "generator" and "overrides' model.generator both name it" in refused.value.problem
    assert not (tmp_path / "run").exists()


def test_in_api_terms_keeps_torchrun_s_options_and_quoted_commands():
    error = ConfigError("--nproc", "`ganscale train --resume auto` ran under torchrun --max-restarts 2",
                        "pass --nproc 2, --set train.steps=5 or torchrun --nproc-per-node 2")
    said = api.in_api_terms(error)
    assert (said.key, said.problem, said.fix) == (
        "nproc", "`ganscale train --resume auto` ran under torchrun --max-restarts 2",
        "pass nproc=2, overrides=['train.steps=5'] or torchrun --nproc-per-node 2")


@pytest.mark.parametrize("value, said", [(lambda: __import__("numpy").int64(16), "a numpy.int64 (np.int64(16))"),
                                         (lambda: __import__("torch").Generator(), "a torch._C.Generator (")])
def test_a_config_value_yaml_cannot_hold_is_refused_naming_its_key(tmp_path, value, said):
    """A numpy number or a torch object among a dict config's arguments was a PydanticSerializationError without
    the option's name: the run's config.yaml, which workers and resumes read, cannot hold it."""
    settings = {"model": {"kind": "custom", "generator": "nets:G", "discriminator": "nets:D",
                          "generator_args": {"z_dim": 8, "nested": [1, value()]}}}
    with pytest.raises(ConfigError) as refused:
        api.train(settings, run_dir=tmp_path / "run")
    assert refused.value.key == "model.generator_args.nested[1]" and said in refused.value.problem
    assert not (tmp_path / "run").exists()
