"""`ganscale verify`: N processes against one, through the CLI on real processes (gloo, CPU), and its cause
catalogue on its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from ganscale import config
from test_cli import clean_env, explain, ganscale
from test_randomness import NETS

# A small ring8 MLP (the recipe's R1 and maxout D included): a few seconds a run.
SMALL_RING8 = ["--set", "model.g_width=32", "--set", "model.d_width=32", "--set", "model.g_layers=2",
               "--set", "model.d_layers=2", "--set", "train.batch_size=16", "--set", "data.size=500"]


def verify(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ganscale", "verify", *args], cwd=cwd, env={**clean_env(), **(env or {})},
                          capture_output=True, text=True, timeout=400)


def test_both_runs_compute_fp32_without_tf32():
    """On a GPU, TF32 convolutions round by the batch's shape, which differs between 1 and N processes: verify
    turns TF32 off for both runs, whatever the user set."""
    from ganscale.verify import plan

    cfg, sets, _ = plan("digits", ("train.tf32=true",), 2, 4)
    assert not cfg.train.tf32 and sets[-1] == "train.tf32=false"


@pytest.mark.slow
def test_the_digits_recipe_on_two_processes_is_equal(tmp_path):
    result = verify("digits", "--run-dir", "kept", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    verdict = result.stdout.strip().splitlines()[-1]
    assert verdict.startswith("EQUAL: 2 processes train as 1 process; largest relative difference"), explain(result)
    assert "criterion: every optimizer step's losses within 1e-05" in result.stdout  # stated, with the precision's
    for run in ("one", "n2"):  # both runs kept where --run-dir says, with their per-step fingerprints
        assert len((tmp_path / "kept" / run / "fingerprints.jsonl").read_text().splitlines()) == 3 * 4  # D, G and after, per step


@pytest.mark.slow
def test_per_rank_batchnorm_is_different_and_named(tmp_path):
    result = verify("digits", "--steps", "2", "--set", "parallel.sync_bn=false", cwd=tmp_path)
    assert result.returncode == 1, explain(result)
    assert "DIFFERENT: 2 processes do not train as 1 process" in result.stdout
    # G's per-rank statistics change G's samples, which D's first step judges: what differs first is G's output
    assert "first divergence: step 1, D's update: G's output (the samples D judges) differs" in result.stdout
    assert "first tensor that differs: G's output (the samples D judges)" in result.stdout
    assert "probable cause: BatchNorm statistics per rank" in result.stdout
    assert "Fix: --set parallel.sync_bn=true" in result.stdout
    assert not list(tmp_path.iterdir())  # without --run-dir: a temporary folder, removed


@pytest.mark.slow
def test_randomness_per_rank_is_found_at_the_step_it_starts(tmp_path):
    """Per-rank noise in every layer from the third step (0-based step 2) on: the steps before are equal, so the
    divergence is found from the per-step fingerprints, not from the end state."""
    result = verify("ring8", *SMALL_RING8, cwd=tmp_path, env={"GANSCALE_INJECT_FAULT": "noise@0:2"})
    assert result.returncode == 1, explain(result)
    assert "first divergence: step 3, D's update" in result.stdout, explain(result)
    assert "probable cause: randomness drawn from the per-rank RNG inside a network" in result.stdout
    assert "own RNG stream in step 3 " in result.stdout  # the step the divergence names


USER_CONFIG = """
model:
  kind: custom
  generator: noisy_nets:NoisyGenerator
  generator_args: {{z_dim: 4, width: 16, draw: {draw}}}
  discriminator: noisy_nets:DropoutDiscriminator
  discriminator_args: {{width: 16}}
  z_dim: 4
data: {{kind: ring8, size: 500}}
train: {{batch_size: 16}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("draw, verdict", [("rank_stream", "DIFFERENT"), ("per_sample", "EQUAL")])
def test_a_user_g_drawing_noise_from_the_rank_s_rng_is_different_and_named(tmp_path, draw, verdict):
    """A user's G (model.kind=custom, beside its YAML) with noise from torch.randn_like in forward: DIFFERENT, the
    per-rank randomness named; the same G drawing it with ganscale.randomness: EQUAL."""
    (tmp_path / "noisy_nets.py").write_text(NETS)
    (tmp_path / "config.yaml").write_text(USER_CONFIG.format(draw=draw))
    result = verify("config.yaml", "--steps", "2", cwd=tmp_path)
    assert result.returncode == (0 if verdict == "EQUAL" else 1), explain(result)
    assert f"{verdict}: 2 processes" in result.stdout, explain(result)
    if verdict == "DIFFERENT":
        # G's noise, from the start: named in G's samples, not in the gradients of D that judged them
        assert "first divergence: step 1, D's update: G's output (the samples D judges)" in result.stdout, explain(result)
        assert "probable cause: randomness drawn from the per-rank RNG inside a network" in result.stdout, explain(result)
        assert "own RNG stream in step 1 " in result.stdout, explain(result)  # the step the divergence names


SPECTRAL_NETS = """
from torch import nn
from torch.nn.utils import spectral_norm  # the classic API: a forward pre-hook, not a parametrization


class G(nn.Module):
    def __init__(self, z_dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(z_dim, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, z):
        return self.net(z)


class ClassicSpectralD(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(spectral_norm(nn.Linear(2, 16)), nn.LeakyReLU(0.2), spectral_norm(nn.Linear(16, 1)))

    def forward(self, x):
        return self.net(x)
"""


@pytest.mark.slow
def test_classic_spectral_norm_with_accumulation_on_two_processes_is_equal(tmp_path):
    """torch.nn.utils.spectral_norm's hook refines its estimate in every training-mode forward: paused after a
    step's first micro-step as the parametrization is, 2 processes accumulating 2 micro-steps train as 1 in 4."""
    (tmp_path / "sn_nets.py").write_text(SPECTRAL_NETS)
    (tmp_path / "config.yaml").write_text("model: {kind: custom, generator: 'sn_nets:G', generator_args: {z_dim: 4}, "
                                          "discriminator: 'sn_nets:ClassicSpectralD', z_dim: 4}\n"
                                          "data: {kind: ring8, size: 500}\ntrain: {batch_size: 16, micro_batch: 4}\n")
    result = verify("config.yaml", "--steps", "2", cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert "EQUAL: 2 processes" in result.stdout, explain(result)


@pytest.mark.parametrize("args, key", [
    (["--nproc", "1"], "--nproc"),
    (["--steps", "1"], "--steps"),
    (["--set", "train.batch_size=63"], "train.batch_size"),  # 2 processes cannot split it
    (["--set", "parallel.generator=hsdp", "--set", "parallel.mesh=[1,2]"], "parallel.mesh"),  # 1 process cannot
    (["--set", "train.engine=tensorflow"], "train.engine"),  # its fingerprints are the torch engine's
])
def test_configs_it_cannot_compare_exit_2_naming_the_key(tmp_path, args, key):
    result = verify(*args, "--run-dir", "kept", cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert result.stderr.count("\n") == 1 and f"'{key}'" in result.stderr, explain(result)
    assert not (tmp_path / "kept").exists()


def test_a_run_dir_that_holds_files_is_refused_and_kept(tmp_path):
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    result = verify("--run-dir", "kept", cwd=tmp_path)
    assert result.returncode == 2 and "'--run-dir'" in result.stderr, explain(result)
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["notes.txt"]


def _processes_naming(text: str) -> list[str]:
    """Command lines of this machine's processes that contain `text`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            command = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if text in command:
            found.append(command)
    return found


def test_sigterm_stops_verify_s_training_and_removes_its_temporary_folder(tmp_path):
    """SIGTERM (timeout's, Slurm's, Kubernetes') killed verify alone: its training went on under init and its
    temporary folder stayed."""
    import signal
    import time

    command = [sys.executable, "-m", "ganscale", "verify", "ring8", "--steps", "2000", "--set", "train.batch_size=8"]
    verifying = subprocess.Popen(command, cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
    started = verifying.stdout.readline()  # "training ... in FOLDER"
    folder = Path(started.rsplit(" in ", 1)[-1].strip())
    deadline = time.monotonic() + 120
    while not (folder / "one" / "metrics.jsonl").exists() and time.monotonic() < deadline:  # training, not starting
        time.sleep(0.2)
    verifying.send_signal(signal.SIGTERM)
    out, err = verifying.communicate(timeout=120)
    assert verifying.returncode == 128 + signal.SIGTERM, (started, out, err)
    assert err.strip().splitlines()[-1] == "ganscale: verify stopped by SIGTERM; its trainings were stopped first", err
    assert not folder.exists() and not _processes_naming(str(folder)), _processes_naming(str(folder))


# ------------------------------------------------------------------------------ the catalogue on its own
def _cause(overrides: list[str], nproc: int = 2, many: list[dict] = ()) -> str:
    from ganscale.verify import Evidence, probable_cause

    return probable_cause(Evidence(config.load("digits", overrides), nproc, list(many)))[0]


def test_batchnorm_causes_come_from_the_config():
    assert _cause(["parallel.sync_bn=false"]) == "BatchNorm statistics per rank"
    assert _cause(["parallel.sync_bn=true", "train.micro_batch=8"]) == (
        "cross-rank BatchNorm over another number of samples than one process")
    assert _cause([]) == "no known cause"  # cross-rank BatchNorm over what one process normalises
    assert _cause(["train.precision=bf16"]) == "a strategy or precision whose tolerance was exceeded"


def test_randomness_is_recognised_from_draws_from_the_first_step_on():
    from ganscale.verify import Evidence, probable_cause

    assert _cause([], many=[{"step": 1, "net": "D", "rng_drawn": False}]) == "no known cause"
    drawn = [{"step": 1, "net": "D", "rng_drawn": False}, {"step": 1, "net": "G", "rng_drawn": True}]
    cause, problem, _ = probable_cause(Evidence(config.load("digits", []), 2, drawn))
    assert cause == "randomness drawn from the per-rank RNG inside a network" and "in step 1 " in problem


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_shipped_recipe_draws_nothing_from_the_rank_stream_in_its_first_step(tmp_path, workers):
    """What lets step 1's draws name a network's randomness: the data stream (its DataLoader's workers' seed
    included) draws before the first fingerprint, and the trainer never."""
    run = tmp_path / "run"
    result = ganscale("train", "--set", "train.steps=2", "--set", "log.fingerprints=true", "--set",
                      f"data.workers={workers}", "--set", "log.tensorboard=false", "--run-dir", str(run), cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    records = [json.loads(line) for line in (run / "fingerprints.jsonl").read_text().splitlines()]
    assert [r["rng_drawn"] for r in records if r["net"] != "after"] == [False] * 4


BIASED_D_NETS = """
from torch import nn


class Generator(nn.Module):
    def __init__(self, z_dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(z_dim, 32), nn.LeakyReLU(0.2), nn.Linear(32, 64), nn.Tanh())

    def forward(self, z, labels=None):
        return self.net(z).view(-1, 1, 8, 8)


class Discriminator(nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1, bias=bias), nn.BatchNorm2d(8), nn.LeakyReLU(0.2),
                                 nn.Flatten(), nn.Linear(8 * 64, 1))

    def forward(self, x, labels=None):
        return self.net(x).squeeze(1)
"""
BIASED_D_CONFIG = """
model: {{kind: custom, generator: "biased_d:Generator", generator_args: {{z_dim: 8}}, z_dim: 8,
        discriminator: "biased_d:Discriminator", discriminator_args: {{bias: {bias}}}}}
train: {{batch_size: 16}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("bias, verdict", [(True, "DIFFERENT"), (False, "EQUAL")])
def test_a_bias_before_batchnorm_is_named_as_rounding_noise_adam_scales_up(tmp_path, bias, verdict):
    """A convolution with PyTorch's default bias before BatchNorm: the bias's gradient is zero up to rounding, Adam
    moves it by up to lr either way, and the running statistics part; the cause is named, not "no known cause"."""
    (tmp_path / "biased_d.py").write_text(BIASED_D_NETS)
    (tmp_path / "config.yaml").write_text(BIASED_D_CONFIG.format(bias=str(bias).lower()))
    result = verify("config.yaml", "--steps", "2", cwd=tmp_path)
    assert result.returncode == (0 if verdict == "EQUAL" else 1), explain(result)
    assert f"{verdict}: 2 processes" in result.stdout, explain(result)
    if verdict == "DIFFERENT":
        assert "probable cause: a bias whose gradient is rounding noise, which Adam scales up: D.net.0.bias's " \
               "gradient in step 1 is zero up to rounding" in result.stdout, explain(result)
        assert "build that layer with bias=False" in result.stdout


def test_rounding_noise_is_recognised_from_gradient_elements_that_differ():
    from ganscale.observe.fingerprints import rounding_noise
    from ganscale.verify import Evidence, probable_cause

    recorded = rounding_noise({"w": torch.tensor([1.0, -2.0, 1e-8]), "b": torch.tensor([0.0, 3e-7, 0.5])})
    assert recorded == {"w": [[2, pytest.approx(1e-8)]], "b": [[1, pytest.approx(3e-7)]]}  # zeros are not noise

    def step(noise):
        return {"step": 1, "net": "D", "rng_drawn": False, "grads": {}, "rounding_noise": noise}

    one, agreeing, parting = [step({"b": [[1, 3e-7]]})], [step({"b": [[1, 3.1e-7]]})], [step({"b": [[1, -2e-7]]})]
    cfg = config.load("digits", [])
    assert probable_cause(Evidence(cfg, 2, agreeing, one, 1))[0] == "no known cause"
    cause, problem, fix = probable_cause(Evidence(cfg, 2, parting, one, 1))
    assert cause == "gradient elements that are rounding noise, which Adam scales up"
    assert "element 1 of D.b's gradient in step 1 is 3.0e-07 on one process and -2.0e-07 on N" in problem
    assert "none in the config" in fix
    # Exactly 0 in one run (not recorded) and rounding noise in the other: the element Adam moves in one run only.
    cause, problem, _ = probable_cause(Evidence(cfg, 2, [step({"b": [[1, 3e-7], [4, 2e-9]]})], [step({"b": [[1, 3e-7]]})], 1))
    assert cause == "gradient elements that are rounding noise, which Adam scales up"
    assert "element 4 of D.b's gradient in step 1 is 0 or not near zero on one process and 2.0e-09 on N" in problem
    full = [[i, 1e-9] for i in range(8)]  # the first 8 of a tensor are kept
    assert probable_cause(Evidence(cfg, 2, [step({"b": full, "c": [[9, 5e-9]]})], [step({"b": full})], 1))[0] == (
        "gradient elements that are rounding noise, which Adam scales up")  # c recorded nothing: c's element 9 is 0
    # A bias whose whole gradient is rounding noise (a normalisation follows it) is the cause to name and fix.
    dead = [{**one[0], "grads": {"net.0.weight": [2.0, 0.1], "net.0.bias": [1e-8, 1e-9]}}]
    cause, problem, fix = probable_cause(Evidence(cfg, 2, parting, dead, 1))
    assert cause == "a bias whose gradient is rounding noise, which Adam scales up"
    assert "D.net.0.bias's gradient in step 1 is zero up to rounding (norm 1.0e-08" in problem and "bias=False" in fix
    assert probable_cause(Evidence(cfg, 2, [{**parting[0], "step": 3}], [{**one[0], "step": 3}], 2))[0] == (
        "no known cause")  # after the runs parted: not what parted them


def test_a_data_set_drawn_from_the_process_rng_is_recognised(monkeypatch):
    import ganscale.data
    from ganscale.verify import Evidence, probable_cause

    assert _cause([]) == "no known cause"  # the shipped digits: the same in every process
    monkeypatch.setattr(ganscale.data, "build_dataset", lambda cfg: TensorDataset(torch.rand(100, 1, 8, 8) * 2 - 1))
    cause, _, fix = probable_cause(Evidence(config.load("digits", []), 2, []))
    assert cause == "a data set whose items differ between processes" and "seeded from train.seed" in fix


def _user_gan_plan(tmp_path: Path, package: str, *overrides: str):
    """verify's plan for test_custom's user GAN (nets, data set) written under `package`: (config, preflight's
    warnings)."""
    from test_custom import write_user_gan

    from ganscale.verify import plan

    cfg, _, warnings = plan(str(write_user_gan(tmp_path, package)), overrides, 2, 2)
    return cfg, warnings


def _line_of(path: Path, call: str) -> int:
    return next(n for n, text in enumerate(path.read_text().splitlines(), 1) if f"{call}(" in text)


@pytest.mark.parametrize("network, key, op, call", [
    ("model.generator={pkg}.nets:NoisyGenerator", "model.generator", "aten.randn_like", "randn_like"),
    ("model.discriminator={pkg}.nets:RankDropoutDiscriminator", "model.discriminator", "aten.bernoulli_.float",
     "dropout"),
])
def test_the_randomness_cause_names_the_network_op_and_place_preflight_found(tmp_path, monkeypatch, network, key, op,
                                                                              call):
    """A user's G drawing torch.randn_like in forward: the verdict named D's gradient as the first tensor that
    differs and "a network" as the cause, while preflight had named G, its op and its line: the cause names them."""
    from ganscale.verify import Evidence, probable_cause

    monkeypatch.chdir(tmp_path)  # where `ganscale verify` runs: the place is said relative to it
    package = f"verify_drawing_{call}"
    cfg, warnings = _user_gan_plan(tmp_path, package, network.format(pkg=package))
    drawn = [{"step": 1, "net": "D", "rng_drawn": True}]
    cause, problem, _ = probable_cause(Evidence(cfg, 2, drawn, warnings=warnings))
    assert cause == "randomness drawn from the per-rank RNG inside a network"
    line = _line_of(tmp_path / package / "nets.py", call)
    assert problem.startswith(f"{key}'s forward drew from its rank's own RNG stream in step 1 ({op} at "
                              f"{package}/nets.py:{line} in forward): "), problem


def test_a_network_drawing_from_a_generator_of_its_own_is_the_cause_named(tmp_path, monkeypatch):
    """Such a G (preflight warns of it) draws no number from the rank's stream, so verify fell through to the
    rounding-noise cause, which said the runs were the same training up to rounding."""
    from ganscale.verify import Evidence, probable_cause

    monkeypatch.chdir(tmp_path)
    package = "verify_own_generator"
    cfg, warnings = _user_gan_plan(tmp_path, package, f"model.generator={package}.nets:OwnGeneratorG")
    one = many = [{"step": 1, "net": "D", "grads": {"net.0.weight": [2.0, 0.1]}}]
    cause, problem, fix = probable_cause(Evidence(cfg, 2, many, one, 1, warnings=warnings))
    assert cause == "randomness drawn from a torch.Generator a network holds", (cause, problem)
    line = _line_of(tmp_path / package / "nets.py", "randn")
    assert problem.startswith("model.generator's forward draws from a torch.Generator of its own (aten.randn.generator "
                              f"at {package}/nets.py:{line} in forward): every rank draws the same numbers"), problem
    assert "ganscale.randomness" in fix
    assert probable_cause(Evidence(cfg, 2, many, one, 1))[0] != cause  # without preflight's finding


@pytest.mark.parametrize("shuffled_by, said", [
    ("torch", ": data.dataset draws from the process's random generators (aten.randperm at {pkg}/data.py:{line} in "
              "make_dataset)"),
    ("numpy", ": data.dataset draws from the process's random generators"),  # numpy's draws have no op to name
])
def test_a_custom_data_set_drawn_from_the_process_rng_is_named_and_seeded_from_its_arguments(tmp_path, monkeypatch,
                                                                                              shuffled_by, said):
    """A data.kind=custom data set shuffled by the process's RNG in __init__: the fix said to seed it from train.seed,
    which a custom data set is never given (train's warning says data.dataset_args); and the draw preflight found is
    named."""
    from ganscale.verify import Evidence, probable_cause

    monkeypatch.chdir(tmp_path)
    package = f"verify_shuffled_by_{shuffled_by}"
    cfg, warnings = _user_gan_plan(tmp_path, package, f"data.dataset_args={{shuffled_by: {shuffled_by}}}")
    cause, problem, fix = probable_cause(Evidence(cfg, 2, [], warnings=warnings))
    assert cause == "a data set whose items differ between processes"
    line = _line_of(tmp_path / package / "data.py", "randperm")
    assert problem.endswith(said.format(pkg=package, line=line)), problem
    assert ("seeded from data.dataset_args (numpy.random.default_rng(seed), torch.Generator().manual_seed(seed))"
            in fix and "train.seed" not in fix), fix


def test_the_noise_fault_draws_from_the_rank_stream_from_its_step_on():
    from torch.nn.modules import module as module_hooks

    from ganscale.fault import _per_rank_noise, injected_fault

    layer = torch.nn.Linear(3, 3)
    x = torch.ones(2, 3)
    fire = injected_fault({"GANSCALE_INJECT_FAULT": "noise@0:1"})
    fire(0, 0)
    fire(1, 1)
    assert torch.equal(layer(x), layer(x))  # not yet, and not on another rank
    fire(1, 0)
    try:
        assert not torch.equal(layer(x), layer(x))
        assert torch.equal(layer.eval()(x), layer(x))  # training layers only
    finally:
        for key, hook in list(module_hooks._global_forward_hooks.items()):
            if hook is _per_rank_noise:
                del module_hooks._global_forward_hooks[key]


def test_a_resume_keeps_the_fingerprints_of_the_steps_before_its_checkpoint(tmp_path):
    """fingerprints.jsonl is cut back to the resumed step, as metrics.jsonl is: what the stopped run recorded up to
    its checkpoint stays, what it recorded after (redone by the resume) is replaced."""
    from ganscale.observe.fingerprints import read

    common = [*SMALL_RING8, "--set", "log.fingerprints=true", "--set", "checkpoint.every=2", "--run-dir", "run"]
    first = ganscale("train", "ring8", "--set", "train.steps=4", *common, cwd=tmp_path)
    assert first.returncode == 0, explain(first)
    before = (tmp_path / "run" / "fingerprints.jsonl").read_text()
    assert sorted({record["step"] for record in read(tmp_path / "run")}) == [1, 2, 3, 4]
    with open(tmp_path / "run" / "fingerprints.jsonl", "a") as f:  # a record written after the checkpoint
        f.write(json.dumps({"step": 5, "net": "after", "parameters": {}, "buffers": {}}) + "\n")
    resumed = ganscale("train", "--resume", "auto", "--set", "train.steps=6", *common, cwd=tmp_path)
    assert resumed.returncode == 0, explain(resumed)
    after = (tmp_path / "run" / "fingerprints.jsonl").read_text()
    assert after.startswith(before)
    records = read(tmp_path / "run")
    assert [r["step"] for r in records if r["net"] == "after"] == [1, 2, 3, 4, 5, 6]
    assert all(r["parameters"] for r in records if r["net"] == "after")  # the step-5 stand-in was replaced


def test_the_samples_d_judged_are_recorded_over_the_global_batch_in_d_steps_only(tmp_path):
    """G's samples of a D step, summed over its micro-batches (and, under N processes, over every rank's share by one
    all-reduce): their norm and sum are the whole batch's; G's steps record none; the next D step starts afresh."""
    from ganscale.observe import fingerprints

    net = torch.nn.Linear(2, 1)
    net.weight.grad, net.bias.grad = torch.ones(1, 2), torch.ones(1)
    recorder = fingerprints.StepFingerprints(tmp_path, True, torch.device("cpu"), {"D": net})
    batch = torch.randn(6, 3)
    for micro in batch.split(2):
        recorder.judged(micro)
    recorder.optimizer_step(0, "D", net, [0.5, 0.0])
    recorder.optimizer_step(0, "G", net, [0.5, 0.0])
    recorder.judged(batch[:1])
    recorder.optimizer_step(1, "D", net, [0.5, 0.0])
    recorder.file.close()
    d1, g1, d2 = fingerprints.read(tmp_path)
    whole = batch.double()
    assert d1["fakes"] == pytest.approx([float(whole.norm()), float(whole.sum())], rel=1e-12)
    assert "fakes" not in g1
    assert d2["fakes"] == pytest.approx([float(whole[:1].norm()), float(whole[:1].sum())], rel=1e-12)


def test_g_s_output_differing_is_the_first_difference_of_its_d_step():
    from ganscale.verify import TOLERANCES, compare_steps

    record = {"step": 1, "net": "D", "losses": [0.5, 0.0], "grads": {"net.0.weight": [2.0, 0.1]}, "fakes": [3.0, 1.0]}
    other = {**record, "losses": [0.6, 0.0], "grads": {"net.0.weight": [2.5, 0.1]}, "fakes": [3.3, 1.0]}
    exceeding = [(d.kind, d.what) for d in compare_steps([record], [other], TOLERANCES["fp32"]) if d.exceeds]
    assert exceeding == [("fakes", "G's output (the samples D judges)"), ("loss", "D's loss_d"),
                         ("gradient", "D.net.0.weight (gradient)")]


def test_a_non_finite_fingerprint_is_strict_json_and_still_differs_from_a_finite_one(tmp_path):
    """A non-finite loss or gradient is written as null (any JSON reader takes the file), read back as NaN, and a
    step where only one run was non-finite is a difference, not equal."""
    from ganscale.observe import fingerprints
    from ganscale.verify import TOLERANCES, compare_steps

    net = torch.nn.Linear(2, 1)
    net.weight.grad, net.bias.grad = torch.full((1, 2), float("inf")), torch.zeros(1)
    for run, loss in (("one", 0.5), ("many", float("nan"))):
        recorder = fingerprints.StepFingerprints(tmp_path / run, True, torch.device("cpu"), {"D": net})
        (tmp_path / run).mkdir()
        recorder.optimizer_step(0, "D", net, [loss, 0.0])
        recorder.file.close()
        for line in (tmp_path / run / fingerprints.FILE).read_text().splitlines():
            json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in fingerprints.jsonl"))
    one, many = fingerprints.read(tmp_path / "one"), fingerprints.read(tmp_path / "many")
    assert many[0]["losses"][0] != many[0]["losses"][0]  # NaN
    exceeding = [d.what for d in compare_steps(one, many, TOLERANCES["fp32"]) if d.exceeds]
    assert exceeding == ["D's loss_d"]  # the gradients: non-finite (weight) and zero (bias) in both runs


@pytest.mark.parametrize("recipe, sets", [
    ("digits", []), ("ring8", []), ("grid25", []), ("digits-biggan", []), ("digits-stylegan2", []),
    ("pix2pix", ["data.resolution=32", "data.load_size=36", "model.g_width=8", "model.d_width=8"]),
])
def test_no_shipped_network_has_a_bias_whose_gradient_is_rounding_noise(recipe, sets):
    """What verify would name as rounding noise Adam scales up, found at the source: a bias whose every gradient
    element is zero up to rounding (it feeds a BatchNorm, which subtracts it) in any shipped G or D."""
    from ganscale.models import build_networks
    from ganscale.tasks import ClassConditional, build_task

    cfg = config.load(recipe, sets)
    G, D = build_networks(cfg)
    task = build_task(cfg, previews=False)
    n, d = 8, cfg.data
    shape = (n, 2) if cfg.model.kind == "mlp" else (n, d.channels, d.resolution, d.resolution)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(shape, generator=generator) * 2 - 1
    labels = task.labels(n, generator) if isinstance(task, ClassConditional) else None
    real = (images, labels) if labels is not None else (images, images) if cfg.model.kind == "pix2pix" else (images,)
    fake = task.generate(G, real, torch.randn(n, cfg.model.z_dim, generator=generator), labels)
    judged = D(task.critic_view(real, fake), *task.critic_conditions(None, labels))
    (judged * torch.randn(judged.shape, generator=generator)).sum().backward()
    for net, network in (("G", G), ("D", D)):
        grads = {name: p.grad.abs().max().item() for name, p in network.named_parameters() if p.grad is not None}
        dead = [name for name, largest in grads.items() if name.endswith("bias") and largest <= 1e-6 * max(grads.values())]
        assert not dead, f"{recipe}'s {net}: biases whose gradient is rounding noise: {dead}"
