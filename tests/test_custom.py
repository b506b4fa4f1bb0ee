"""The user's own GAN: G, D, data set and loss from a package written here, trained like a shipped recipe."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dist_helpers import (assert_same_functions, max_relative_difference, record_steps, resume_point, run_ranks,
                          train_and_collect)
from test_cli import explain, ganscale
from test_distributed import TOLERANCE, _assert_same_states

NETS = '''
import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self, z_dim, width=16, n_classes=0):
        super().__init__()
        self.embed = nn.Embedding(n_classes, z_dim) if n_classes else None
        self.net = nn.Sequential(nn.Linear(z_dim, width), nn.LeakyReLU(0.2), nn.Linear(width, 64), nn.Tanh())

    def forward(self, z, labels=None):
        if self.embed is not None:
            z = z * self.embed(labels)
        return self.net(z).view(-1, 1, 8, 8)


class Discriminator(nn.Module):
    def __init__(self, width=16, n_classes=0):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.LeakyReLU(0.2))
        self.head = nn.Linear(width, 1)
        self.embed = nn.Embedding(n_classes, width) if n_classes else None

    def forward(self, x, labels=None):
        h = self.body(x)
        logits = self.head(h).squeeze(1)
        return logits if self.embed is None else logits + (self.embed(labels) * h).sum(1)


def make_discriminator(width=16, n_classes=0):
    return Discriminator(width, n_classes)


class ScaledByItem(Generator):
    """A forward that needs real values: it cannot run on torch's meta device."""

    def forward(self, z, labels=None):
        return super().forward(z / max(1.0, z.abs().max().item()), labels)


class GainFromTensor(Discriminator):
    """An __init__ that needs real values (`float` of a tensor is `.item()`): it cannot be built on the meta device."""

    def __init__(self, width=16, n_classes=0):
        super().__init__(width, n_classes)
        self.gain = float(torch.tensor(2.0).sqrt())

    def forward(self, x, labels=None):
        return super().forward(x, labels) * self.gain


class WrongShape(Generator):
    def forward(self, z, labels=None):
        return self.net(z)


class DoubleG(Generator):
    def forward(self, z, labels=None):
        return super().forward(z, labels).double()


class BFloat16G(Generator):
    def forward(self, z, labels=None):
        return super().forward(z, labels).to(torch.bfloat16)


class BatchOf2G(Generator):
    def forward(self, z, labels=None):
        return self.net(z).view(2, 1, 8, 8)


class ShapeBug(Generator):
    def forward(self, z, labels=None):
        return self.net[2](self.net[0](z).T)  # the user's bug: .T


class LabelsG(Generator):
    def forward(self, z, labels):
        return super().forward(z, labels)


class MetaG(Generator):
    def __init__(self, z_dim, width=16, n_classes=0):
        super().__init__(z_dim, width, n_classes)
        self.to("meta")


class LazyD(Discriminator):
    def __init__(self, width=16, n_classes=0):
        super().__init__(width, n_classes)
        self.body = nn.Sequential(nn.Flatten(), nn.LazyLinear(width), nn.LeakyReLU(0.2))


class FrozenD(Discriminator):
    def __init__(self, width=16, n_classes=0):
        super().__init__(width, n_classes)
        self.requires_grad_(False)


class ColumnD(Discriminator):
    def forward(self, x, labels=None):
        return self.head(self.body(x))


class TwoLogits(Discriminator):
    def forward(self, x, labels=None):
        return torch.cat([self.head(self.body(x))] * 2, 1)


class NoDoubleBackward(Discriminator):
    def forward(self, x, labels=None):
        return torch.nn.functional.relu(self.head(self.body(x.detach()))).squeeze(1)


class NoisyGenerator(Generator):
    def forward(self, z, labels=None):
        return super().forward(z + 0.1 * torch.randn_like(z), labels)  # the rank's own stream


class BatchNormG(Generator):
    """BatchNorm1d: no statistics from one sample."""

    def __init__(self, z_dim, width=16, n_classes=0):
        super().__init__(z_dim, width, n_classes)
        self.net = nn.Sequential(nn.Linear(z_dim, width, bias=False), nn.BatchNorm1d(width), nn.LeakyReLU(0.2),
                                 nn.Linear(width, 64), nn.Tanh())


class OwnGeneratorG(Generator):
    """Noise from a torch.Generator of its own, seeded alike on every rank."""

    def __init__(self, z_dim, width=16, n_classes=0):
        super().__init__(z_dim, width, n_classes)
        self.noise = torch.Generator().manual_seed(0)

    def forward(self, z, labels=None):
        return super().forward(z + 0.1 * torch.randn(z.shape, generator=self.noise), labels)


class NumpyRoundTripG(Generator):
    def forward(self, z, labels=None):
        return torch.from_numpy(super().forward(z, labels).detach().numpy())


class LatentDimG(Generator):
    """The latent size under another conventional name, with a default."""

    def __init__(self, latent_dim=12, width=16):
        super().__init__(latent_dim, width)


class RankDropoutDiscriminator(Discriminator):
    def forward(self, x, labels=None):
        return self.head(torch.nn.functional.dropout(self.body(x), 0.2, self.training)).squeeze(1)  # the rank's own


class DropoutDiscriminator(Discriminator):
    def forward(self, x, labels=None):
        from ganscale import randomness

        h = randomness.dropout(self.body(x), 0.2, salt=1)  # per sample, from its global position
        return self.head(h).squeeze(1)


class FrozenInputLayer(Generator):
    """The user froze G's first layer: it stays as built."""

    def __init__(self, z_dim, width=16, n_classes=0):
        super().__init__(z_dim, width, n_classes)
        self.net[0].requires_grad_(False)


class FrozenFeatures(Discriminator):
    """Fixed random features (frozen by the user), then a trained head."""

    def __init__(self, width=16, n_classes=0):
        super().__init__(width, n_classes)
        self.body[1].requires_grad_(False)


class UnusedEmbedding(Generator):
    """An embedding left from a conditional variant that forward does not use (`frozen`: the user froze it)."""

    def __init__(self, z_dim, width=16, n_classes=0, frozen=False):
        super().__init__(z_dim, width, n_classes)
        self.class_embed = nn.Embedding(10, z_dim).requires_grad_(not frozen)


class AuxHead(Discriminator):
    """An auxiliary head that forward does not use."""

    def __init__(self, width=16, n_classes=0):
        super().__init__(width, n_classes)
        self.aux = nn.Linear(width, 10)


NOT_A_FACTORY = 3
'''

DATA = '''
import torch
from torch.utils.data import Dataset


class Blobs(Dataset):
    """Deterministic 1x8x8 images in [-1, 1], with a class each (`relabel`: {index: label} overrides some;
    `spoil`: {index: how} makes some unlike item 0: an extra field, a smaller image, values out of range, a NaN,
    or an item whose reading raises)."""

    def __init__(self, size=96, labels=False, scale=1.0, classes=10, relabel=None, spoil=None, dtype="float32"):
        g = torch.Generator().manual_seed(0)
        self.images = ((torch.rand(size, 1, 8, 8, generator=g) * 2 - 1) * scale).to(getattr(torch, dtype))
        self.classes = torch.arange(size) % classes
        self.labels, self.relabel, self.spoil = labels, relabel or {}, spoil or {}

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        label = self.relabel.get(i, int(self.classes[i]))
        item = (self.images[i], label) if self.labels else (self.images[i],)
        how = self.spoil.get(i)
        if how == "extra field":
            item = item + (i,)
        elif how == "smaller":
            item = (item[0][:, :4, :4],) + item[1:]
        elif how == "bright":
            item = (item[0] * 255,) + item[1:]
        elif how == "nan":
            item = (item[0].clone().index_fill_(2, torch.tensor([3]), float("nan")),) + item[1:]
        elif how == "unreadable":
            raise OSError(f"cannot read image file img_{i:04d}.png\\n(more detail)")
        return item if self.labels else item[0] if len(item) == 1 else item


def make_dataset(size=96, labels=False, scale=1.0, classes=10, relabel=None, spoil=None, dtype="float32",
                 shuffled_by=None, unit_range=False):
    blobs = Blobs(size, labels, scale, classes, relabel, spoil, dtype)
    if unit_range:  # torchvision's ToTensor's range
        blobs.images = (blobs.images + 1) / 2
    if shuffled_by == "torch":  # the process's own generators: each rank's
        blobs.images = blobs.images[torch.randperm(size)]
    elif shuffled_by == "numpy":
        import numpy

        blobs.images = blobs.images[numpy.random.permutation(size)]
    return blobs
'''

LOSSES = '''
import torch
import torch.nn.functional as F


class Hinge:
    def d_loss(self, real, fake):
        return F.relu(1 - real).mean() + F.relu(1 + fake).mean()

    def g_loss(self, fake):
        return -fake.mean()


class PyFloat(Hinge):
    def g_loss(self, fake):
        return float(-fake.mean())


class NotScalar(Hinge):
    def g_loss(self, fake):
        return -fake


class ForColumns:
    """Written for (B, 1) logits."""

    def d_loss(self, real, fake):
        return (F.binary_cross_entropy_with_logits(real, torch.ones(real.shape[0], 1))
                + F.binary_cross_entropy_with_logits(fake, torch.zeros(fake.shape[0], 1)))

    def g_loss(self, fake):
        return F.binary_cross_entropy_with_logits(fake, torch.ones(fake.shape[0], 1))


class Summed(Hinge):
    def g_loss(self, fake):
        return F.softplus(-fake).sum()


class Detached(Hinge):
    def g_loss(self, fake):
        return -fake.mean().detach()


class InPlace(Hinge):
    def d_loss(self, real, fake):
        real.clamp_(-10, 10)
        return F.relu(1 - real).mean() + F.relu(1 + fake).mean()


class NeedsMargin(Hinge):
    def __init__(self, margin):
        self.margin = margin


class BuggyInit(Hinge):
    def __init__(self, margin=1.0):
        self.margin = margin.value  # the user's bug
'''

CONFIG = '''
name: blobs
model:
  kind: custom
  generator: {package}.nets:Generator
  generator_args: {{z_dim: 8, width: 16}}
  discriminator: {package}.nets:make_discriminator
  discriminator_args: {{width: 16}}
  z_dim: 8
data: {{kind: custom, dataset: {package}.data:make_dataset, dataset_args: {{size: 96}}, resolution: 8, channels: 1}}
loss: {{kind: "{package}.losses:Hinge"}}
train: {{steps: 3, batch_size: 8, seed: 3, ema_half_life_images: 50, device: cpu}}
log: {{every: 1, sample_every: 0, tensorboard: false, step_times: false, samples: 4}}
checkpoint: {{every: 0}}
'''


def write_user_gan(folder: Path, package: str) -> Path:
    """A user's package (nets, data, losses) and a config.yaml beside it; returns the YAML path."""
    (folder / package).mkdir(parents=True)
    for name, text in (("__init__", ""), ("nets", NETS), ("data", DATA), ("losses", LOSSES)):
        (folder / package / f"{name}.py").write_text(textwrap.dedent(text))
    yaml_path = folder / "config.yaml"
    yaml_path.write_text(CONFIG.format(package=package))
    return yaml_path


CLASSES = {"model.task": "class-conditional", "model.n_classes": 10, "model.generator_args": "{z_dim: 8, n_classes: 10}",
           "model.discriminator_args": "{n_classes: 10}", "data.dataset_args": "{size: 96, labels: true}"}


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    {},                                                          # ddp, the user's hinge loss
    {"parallel.generator": "fsdp", "loss.r1_gamma": 1},          # G sharded; R1 through the user's D
    CLASSES,                                                     # class-conditional: G(z, labels), D(x, labels)
], ids=["ddp", "fsdp-g-r1", "class-conditional"])
def test_a_user_gan_on_two_ranks_equals_one_process(tmp_path, case):
    recipe = str(write_user_gan(tmp_path / "code", f"user_gan_{len(case)}"))
    one = run_ranks(train_and_collect, 1, case, str(tmp_path / "one"), None, None, recipe)[0]
    two = run_ranks(train_and_collect, 2, case, str(tmp_path / "two"), None, None, recipe)
    assert one["summary"]["steps"] == 3
    labels = torch.arange(4) % 10
    conditions = (labels,) if case is CLASSES else ()
    inputs = {"G": (torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), *conditions),
              "D": (torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(2)) * 2 - 1, *conditions)}
    assert_same_functions(case, one, two, inputs, recipe)
    for rank in two:
        assert max_relative_difference(one["D"], rank["D"]) <= TOLERANCE


def _initial_states(trainer) -> dict:
    return {net: {k: v.clone() for k, v in getattr(trainer, net).model_state().items()} for net in ("G", "D")}


@pytest.mark.parametrize("world", [1, 2])
def test_parameters_the_user_froze_stay_as_built(tmp_path, world):
    """On one process D's step unfroze them (trained by Adam); on two, DDP had left them out and the replicas
    differed. zero1 on two: its optimizer state is keyed by the trained parameters' names."""
    recipe = str(write_user_gan(tmp_path / "code", f"frozen_user_gan_{world}"))
    case = {"model.generator": f"frozen_user_gan_{world}.nets:FrozenInputLayer",
            "model.discriminator": f"frozen_user_gan_{world}.nets:FrozenFeatures", "parallel.discriminator": "zero1"}
    for rank in run_ranks(train_and_collect, world, case, str(tmp_path / "run"), _initial_states, None, recipe):
        assert rank["summary"]["steps"] == 3
        initial = rank["extra"]
        for net, frozen, trained in (("G", "net.0.weight", "net.2.weight"), ("D", "body.1.weight", "head.weight"),
                                     ("G_ema", "net.0.weight", "net.2.weight")):
            built = initial[net[0]]
            assert torch.equal(rank[net][frozen], built[frozen]), net
            assert not torch.equal(rank[net][trained], built[trained]), net


@pytest.mark.parametrize("override, key, said", [
    ("model.generator={pkg}.nets:UnusedEmbedding", "model.generator",
     "G.class_embed.weight gets no gradient from G's loss"),
    ("model.discriminator={pkg}.nets:AuxHead", "model.discriminator",
     "D.aux.weight, D.aux.bias get no gradient from D's loss"),
], ids=["G", "D"])
def test_a_parameter_forward_does_not_use_is_refused_before_anything_is_written(tmp_path, override, key, said):
    """On two ranks DDP waited for its gradient (an internal error, after the run directory was written); refused
    on any world size, so that 1 and N ranks train the same networks. Frozen by the user, it trains."""
    from ganscale import config as config_mod
    from ganscale import preflight

    package = f"unused_param_gan_{key[6]}"
    recipe = write_user_gan(tmp_path, package)
    result = ganscale("train", str(recipe), "--set", override.format(pkg=package), "--nproc", "2",
                      "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, explain(result)
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and f"'{key}'" in message[0] and said in message[0], explain(result)
    assert "freeze" in message[0] and "requires_grad_(False)" in message[0], explain(result)
    assert not (tmp_path / "run").exists()
    if key == "model.generator":
        frozen = config_mod.load(str(recipe), [override.format(pkg=package),
                                               "model.generator_args={z_dim: 8, frozen: true}"])
        preflight.check(frozen, 2, False)


PAIRED = '''
import torch
from torch import nn
from torch.utils.data import Dataset

from ganscale.randomness import dropout


class Translator(nn.Module):
    """A tiny image-to-image G with dropout whose masks come from the trainer's per-sample seeds."""

    def __init__(self, width=8):
        super().__init__()
        self.encode = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.InstanceNorm2d(width), nn.LeakyReLU(0.2))
        self.decode = nn.Sequential(nn.Conv2d(width, 1, 3, padding=1), nn.Tanh())

    def forward(self, x, seeds=None):
        return self.decode(dropout(self.encode(x), 0.5, salt=0, seeds=seeds) if self.training else self.encode(x))


class PatchCritic(nn.Module):
    """D on input and output concatenated on channels: one logit per 4x4 patch."""

    def __init__(self, width=8):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(2, width, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(width, 1, 3, padding=1))

    def forward(self, x):
        return self.net(x)


class Pairs(Dataset):
    """Deterministic (input, target) 1x8x8 pairs in [-1, 1]: the target is the input mirrored and dimmed."""

    def __init__(self, size=64):
        self.inputs = torch.rand(size, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, i):
        return self.inputs[i], self.inputs[i].flip(-1) * 0.5
'''

PAIRED_CASE = {"model.kind": "custom", "model.task": "paired", "model.generator": "user_paired:Translator",
               "model.discriminator": "user_paired:PatchCritic", "model.z_dim": 4, "data.kind": "custom",
               "data.dataset": "user_paired:Pairs", "data.resolution": 8, "data.channels": 1, "loss.l1_weight": 10,
               "train.steps": 3, "train.batch_size": 8, "train.seed": 3, "log.every": 1, "log.sample_every": 0,
               "log.tensorboard": "false", "checkpoint.every": 0}


@pytest.mark.slow
@pytest.mark.parametrize("slicing", [{}, {"train.micro_batch": 2}], ids=["reusing-fake", "accumulating"])
def test_a_user_paired_gan_on_two_ranks_equals_one_process(tmp_path, slicing):
    """model.task=paired: the user's G(input, seeds) with per-sample dropout, a patch D on (input, output) and
    (input, target) pairs from the user's data set, with pix2pix's L1 term: 2 ranks train as one process, with G's
    step judging D's step's output (the paired default) or, accumulating micro-batches, fresh outputs."""
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "user_paired.py").write_text(textwrap.dedent(PAIRED))
    case = {**PAIRED_CASE, **slicing, "code_path": f"[{tmp_path / 'code'}]"}
    one = run_ranks(train_and_collect, 1, case, str(tmp_path / "one"), record_steps)[0]
    two = run_ranks(train_and_collect, 2, case, str(tmp_path / "two"), record_steps)
    assert one["summary"]["steps"] == 3 and len(one["extra"]) == 6
    inputs = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(1)) * 2 - 1
    seeds = torch.arange(4) * 7919  # fixed per-sample dropout seeds
    assert_same_functions(case, one, two, {"G": (inputs, seeds), "D": (torch.cat([inputs, inputs.flip(-1)], 1),)})
    for rank in two:
        for a, b in zip(one["extra"], rank["extra"], strict=True):  # every step's loss and gradients
            assert abs(a["loss"] - b["loss"]) <= TOLERANCE * abs(a["loss"])
            assert max_relative_difference({"grad": a["grad"]}, {"grad": b["grad"]}) <= TOLERANCE
        assert max_relative_difference(one["D"], rank["D"]) <= TOLERANCE


NOISY = '''
import torch
from torch import nn

from ganscale.randomness import normal, sample_seeds


class NoisyGenerator(nn.Module):
    """Noise injection per sample from the trainer's seeds (equal on any number of ranks)."""

    def __init__(self, z_dim, width=16):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(z_dim, width), nn.LeakyReLU(0.2))
        self.strength = nn.Parameter(torch.full((width,), 0.1))
        self.out = nn.Sequential(nn.Linear(width, 64), nn.Tanh())

    def forward(self, z):
        h = self.inp(z)
        return self.out(h + self.strength * normal(h, salt=1, seeds=sample_seeds(z))).view(-1, 1, 8, 8)


class DroppingDiscriminator(nn.Module):
    """Dropout from torch's RNG: the rank's own stream, which a resume must restore."""

    def __init__(self, width=16):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.LeakyReLU(0.2), nn.Dropout(0.2))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.body(x)).squeeze(1)
'''


def _stop_then_resume(rank, world, overrides, root, recipe, stop, steps):
    """The straight run of `steps` steps, and a run stopped after `stop` steps then resumed (`--resume auto`)
    up to `steps`."""
    root, more = Path(root), {**overrides, "train.steps": steps}
    straight = train_and_collect(rank, world, more, str(root / "straight"), recipe=recipe)
    train_and_collect(rank, world, {**overrides, "train.steps": stop}, str(root / "stopped"), recipe=recipe)
    latest = resume_point(more, str(root / "stopped"), recipe)
    resumed = train_and_collect(rank, world, more, str(root / "stopped"), resume=latest, recipe=recipe)
    return {"latest": latest.name, "straight": straight, "resumed": resumed}


@pytest.mark.slow
def test_a_user_gan_stopped_and_resumed_on_two_ranks_equals_the_straight_run_bit_for_bit(tmp_path):
    """A user G with per-sample noise, a user D with torch's dropout (per-rank RNG streams) and a user data set
    of 5 batches an epoch: stopped after 3 steps and resumed to 8 (into the second epoch's shuffle), it trains
    exactly as 8 steps straight."""
    package = "resumed_user_gan"
    recipe = write_user_gan(tmp_path / "code", package)
    (tmp_path / "code" / package / "noisy.py").write_text(textwrap.dedent(NOISY))
    case = {"model.generator": f"{package}.noisy:NoisyGenerator", "model.generator_args": "{z_dim: 8}",
            "model.discriminator": f"{package}.noisy:DroppingDiscriminator", "model.discriminator_args": "{}",
            "data.dataset_args": "{size: 40}", "checkpoint.every": 100}
    for result in run_ranks(_stop_then_resume, 2, case, str(tmp_path), str(recipe), 3, 8):
        assert result["latest"] == "step-00000003.pt"
        assert result["resumed"]["summary"]["steps"] == 8
        for net in ("G", "D", "G_ema"):
            for key, value in result["straight"][net].items():
                assert torch.equal(value, result["resumed"][net][key]), f"{net}.{key}"


@pytest.mark.parametrize("slicing, noted", [
    ({"train.micro_batch": 2}, True),                              # accumulation turns the paired default off
    ({"train.micro_batch": 2, "train.reuse_fake": "false"}, False),  # chosen: nothing to say
    ({}, False),                                                   # the default holds
], ids=["turned-off", "chosen", "reused"])
def test_a_paired_run_says_once_when_its_default_reuse_of_g_s_output_is_turned_off(tmp_path, slicing, noted):
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "user_paired.py").write_text(textwrap.dedent(PAIRED))
    case = {**PAIRED_CASE, **slicing, "train.steps": 1, "code_path": f"[{tmp_path / 'code'}]"}
    result = ganscale("train", *(f"--set={k}={v}" for k, v in case.items()), "--run-dir", str(tmp_path / "run"),
                      cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    said = [line for line in result.stderr.splitlines() if "does not judge D's step's output" in line]
    assert len(said) == int(noted), explain(result)
    if noted:
        assert "paired" in said[0] and "accumulation" in said[0] and "one extra G forward per step" in said[0]


def test_a_user_gan_trains_through_the_cli_with_two_workers_from_another_folder(tmp_path):
    """The modules sit beside the YAML, not in the working directory: every worker finds them."""
    recipe = write_user_gan(tmp_path / "project", "cli_user_gan")
    (tmp_path / "elsewhere").mkdir()
    result = ganscale("train", str(recipe), "--nproc", "2", "--run-dir", str(tmp_path / "run"),
                      cwd=tmp_path / "elsewhere", timeout=300)
    assert result.returncode == 0, explain(result)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert str(tmp_path / "project") in saved  # the folder every resume searches, absolute
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("loss_d") == 3


def test_a_resume_from_another_folder_imports_the_code_the_run_started_with(tmp_path):
    """The package only in the current folder, the YAML elsewhere: the run records that folder, so a resume from a
    folder holding another package of the same name imports the run's own (the other one refuses to import)."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere" / "cwd_user_gan"
    (tmp_path / "configs").mkdir()
    recipe = write_user_gan(here, "cwd_user_gan").rename(tmp_path / "configs" / "config.yaml")
    elsewhere.mkdir(parents=True)
    (elsewhere / "__init__.py").write_text("raise ImportError('the other folder s package')\n")
    run = str(tmp_path / "run")
    started = ganscale("train", str(recipe), "--set", "train.steps=2", "--run-dir", run, cwd=here)
    assert started.returncode == 0, explain(started)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["code_path"] == [
        str(tmp_path / "configs"), str(here)]
    resumed = ganscale("train", "--run-dir", run, "--resume", "auto", "--set", "train.steps=3", cwd=elsewhere.parent)
    assert resumed.returncode == 0, explain(resumed)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("loss_d") == 3
    (here / "cwd_user_gan").rename(tmp_path / "away")  # the fix names the folders searched (not the current one)
    lost = ganscale("train", "--run-dir", run, "--resume", "auto", "--set", "train.steps=4", cwd=elsewhere.parent)
    assert lost.returncode == 2 and lost.stderr.count("\n") == 1, explain(lost)
    assert (f"Fix: put the module in a code_path folder ({tmp_path / 'configs'}, {here}) or on PYTHONPATH, and fix "
            "its import") in lost.stderr, explain(lost)


@pytest.mark.slow
def test_a_user_g_drawing_from_the_rank_stream_resumes_exactly_after_its_final_samples(tmp_path):
    """Through the CLI, resumed from the stopped run's last step, whose final samples drew from G_ema: a G drawing
    from the rank's stream, ganscale.randomness in D, the data set through a DataLoader worker; bit for bit."""
    recipe = write_user_gan(tmp_path, "resumed_user_gan")
    user = ["--set", "model.generator=resumed_user_gan.nets:NoisyGenerator",
            "--set", "model.discriminator=resumed_user_gan.nets:DropoutDiscriminator",
            "--set", "data.workers=1", "--set", "checkpoint.every=3", "--nproc", "2"]

    def train(run: str, steps: int, *more: str):
        result = ganscale("train", str(recipe), *user, "--set", f"train.steps={steps}", "--run-dir",
                          str(tmp_path / run), *more, cwd=tmp_path, timeout=300)
        assert result.returncode == 0, explain(result)
        # said once: by rank 0, not by the other rank or the launcher too
        assert result.stderr.count("model.generator's forward draws from torch's random generator") == 1, \
            explain(result)

    train("straight", 6)
    train("stopped", 3)
    train("stopped", 6, "--resume", "auto")
    straight, resumed = (torch.load(tmp_path / run / "checkpoints" / "step-00000006.pt", weights_only=True)
                         for run in ("straight", "stopped"))
    assert straight.keys() == resumed.keys()
    for key in straight.keys() - {"config"}:  # config: the stopped run's train.steps
        _assert_same_states(straight[key], resumed[key], key)


def test_a_user_g_that_cannot_run_on_meta_trains_and_samples_saying_what_was_not_estimated(tmp_path):
    recipe = write_user_gan(tmp_path, "item_user_gan")
    result = ganscale("train", str(recipe), "--nproc", "2", "--set", "model.generator=item_user_gan.nets:ScaledByItem",
                      "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, explain(result)
    said = [line for line in result.stderr.splitlines() if "activations were not estimated" in line]
    assert len(said) == 1 and "meta" in said[0] and "item()" in said[0], explain(result)
    drawn = ganscale("sample", str(tmp_path / "run"), "--n", "4", "--out", str(tmp_path / "grid.png"), cwd=tmp_path)
    assert drawn.returncode == 0 and (tmp_path / "grid.png").is_file(), explain(drawn)
    assert "drawing was not estimated" in drawn.stderr and "item()" in drawn.stderr, explain(drawn)


def test_a_user_d_that_cannot_be_built_on_meta_trains_with_its_memory_estimated(tmp_path):
    """The memory estimate built D on the meta device outside its guard: the run was refused as a bad
    model.discriminator_args. Built on the CPU and moved to meta, it is counted in full."""
    from ganscale import config as config_mod
    from ganscale import memory

    recipe = write_user_gan(tmp_path, "gain_user_gan")
    override = "model.discriminator=gain_user_gan.nets:GainFromTensor"
    result = ganscale("train", str(recipe), "--nproc", "2", "--set", override, "--run-dir", str(tmp_path / "run"),
                      cwd=tmp_path, timeout=300)
    assert result.returncode == 0 and "Traceback" not in result.stderr, explain(result)
    assert "error" not in result.stderr and "not estimated" not in result.stderr, explain(result)
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("loss_d") == 3
    estimate = memory.training_estimate(config_mod.load(str(recipe), [override]), 2)
    plain = memory.training_estimate(config_mod.load(str(recipe), []), 2)
    assert estimate.unestimated is None and estimate.total == plain.total > 0


@pytest.mark.parametrize("override, key, said", [
    ("model.generator=no_such_module:G", "model.generator", "No module named 'no_such_module'"),
    ("model.generator={pkg}.nets:Missing", "model.generator", "has no attribute 'Missing'"),
    ("model.generator={pkg}.nets:NOT_A_FACTORY", "model.generator", "not a class or a function"),
    ("model.generator=Generator", "model.generator", "module:attribute"),
    ("model.generator_args={{z_dim: 8, depth: 3}}", "model.generator_args", "depth"),
    ("model.generator={pkg}.nets:WrongShape", "model.generator", "(2, 64)"),
    ("model.z_dim=5", "model.generator", "in forward; set model.z_dim=8: generator_args builds G for z_dim=8, but "
     "the trainer draws latents of model.z_dim=5"),
    ("model.discriminator={pkg}.nets:TwoLogits", "model.discriminator", "one logit per sample"),
    # G's own faults name G, not D's first layer failing on them
    ("model.generator={pkg}.nets:DoubleG", "model.generator", "returns torch.float64 images"),
    ("model.generator={pkg}.nets:BFloat16G", "model.generator", "returns torch.bfloat16 images"),
    ("model.generator={pkg}.nets:BatchOf2G", "model.generator",
     "on 4 latents failed (RuntimeError: shape '[2, 1, 8, 8]' is invalid"),
    ("model.generator={pkg}.nets:MetaG", "model.generator", "builds net.0.weight on the meta device"),
    ("model.discriminator={pkg}.nets:LazyD", "model.discriminator", "lazy module body.1 (LazyLinear)"),
    ("model.discriminator={pkg}.nets:FrozenD", "model.discriminator", "D has no parameter to train"),
    ("model.discriminator={pkg}.nets:NoDoubleBackward", "loss.r1_gamma", "double backward"),
    ("data.dataset_args={{scale: 3.0}}", "data.dataset", "[-1, 1]"),
    ("data.dataset_args={{spoil: {{0: nan}}}}", "data.dataset", "item 0 holds NaN or infinite values"),
    ("data.dataset_args={{spoil: {{0: unreadable}}}}", "data.dataset", "item 0 failed to load (OSError: cannot read "
     "image file img_0000.png) at {pkg}/data.py:"),
    ("data.dataset_args={{dtype: uint8}}", "data.dataset", "holds a torch.uint8 tensor, not a floating-point one"),
    ("data.resolution=16", "data.dataset", "(1, 16, 16)"),
    ("model.task=class-conditional", "data.dataset", "(image, label)"),
    ("loss.kind={pkg}.losses:NotScalar", "loss.kind", "not a scalar"),
    # torch's warning about the float of a tensor is not printed above the one line
    ("loss.kind={pkg}.losses:PyFloat", "loss.kind", "g_loss returned float, not a scalar computed from the logits"),
    ("model.generator={pkg}.nets:NumpyRoundTripG", "model.generator", "G's output has no gradient: its forward cuts "
     "the graph to its parameters (.detach(), .numpy() or .item() and back, torch.no_grad)"),
    ("train.micro_batch=1", "train.micro_batch", "each rank trains on micro-batches of 1 sample, and "
     "{pkg}.nets:BatchNormG fails on one (ValueError: Expected more than 1 value per channel when training"),
    # D's logits are (B,): the loss is tried on them, not on (2, 1) stand-ins
    ("loss.kind={pkg}.losses:ForColumns", "loss.kind", "on logits of shape (2,) failed (ValueError: Target size"),
    ("loss.kind={pkg}.losses:Summed", "loss.kind", "g_loss is"),
    ("loss.kind={pkg}.losses:Detached", "loss.kind", "g_loss returned a scalar with no gradient to the logits"),
    ("loss.kind={pkg}.losses:Absent", "loss.kind", "has no attribute"),
    ("parallel.generator=pipeline", "parallel.generator", "another strategy (ddp, zero1, zero2, fsdp, hsdp)"),
    ("model.kind=dcgan", "model.generator", "model.kind=custom only"),
    # a config names only the user's own code: never the standard library's or an installed package's functions
    ("model.generator=subprocess:run", "model.generator", "is a module of Python's standard library"),
    ("data.dataset=json:loads", "data.dataset", "is a module of Python's standard library"),
    ("model.discriminator=torch.nn.init:zeros_", "model.discriminator", "an installed package"),
    ("loss.kind=torch.nn:BCELoss", "loss.kind", "an installed package"),
])
def test_bad_user_code_exits_2_naming_the_key_and_writes_nothing(tmp_path, override, key, said):
    package = f"bad_user_gan_{abs(hash(override)) % 10**8}"
    recipe = write_user_gan(tmp_path, package)
    extra = ["--set", "loss.r1_gamma=1"] if key == "loss.r1_gamma" else []
    if key == "train.micro_batch":  # BatchNorm1d in G; no warning of memory not estimated before the refusal
        extra += ["--set", f"model.generator={package}.nets:BatchNormG"]
    if override.startswith("parallel."):
        extra += ["--set", "parallel.discriminator=pipeline"]
    result = ganscale("train", str(recipe), "--set", override.format(pkg=package), *extra,
                      "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2, explain(result)
    assert "Traceback" not in result.stderr, explain(result)
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and f"'{key}'" in message[0] and said.format(pkg=package) in message[0], explain(result)
    assert not (tmp_path / "run").exists()


BOOM = {"boom": "import torch\n\nraise RuntimeError('oops in my module')\n",
        "needs_dep": "import torch\nimport no_such_dependency_xyz\n",
        "bad_syntax": "import torch\n\ndef G(:\n    pass\n"}


@pytest.mark.parametrize("override, key, file, line, fix", [
    # an error in the user's code: its place, not the contract (batch size, z_dim) it did not break
    ("model.generator={pkg}.nets:ShapeBug", "model.generator", "nets.py", "# the user's bug: .T",
     "Fix: fix the error at {at} in forward"),
    ("model.generator={pkg}.boom:G", "model.generator", "boom.py", "raise RuntimeError",
     "Fix: fix the error at {at} in <module>"),
    ("model.generator={pkg}.needs_dep:G", "model.generator", "needs_dep.py", "import no_such_dependency_xyz",
     "Fix: fix the error at {at} in <module>"),
    ("model.generator={pkg}.bad_syntax:G", "model.generator", "bad_syntax.py", "def G(:", "Fix: fix the error at {at}"),
    ("loss.kind={pkg}.losses:BuggyInit", "loss.kind", "losses.py", "# the user's bug", "building {pkg}.losses:BuggyInit "
     "failed (AttributeError: 'float' object has no attribute 'value'). Fix: fix the error at {at} in __init__"),
    # not the user's code failing: what to change
    ("model.generator={pkg}.nets:LabelsG", "model.generator", None, None, "has forward(z, labels), but "
     "model.task=unconditional calls G as forward(z). Fix: set model.task=class-conditional (with model.n_classes), "
     "which calls G as forward(z, labels)"),
    ("loss.kind={pkg}.losses:NeedsMargin", "loss.kind", None, None, "built with no arguments, but it needs some "
     "(missing a required argument: 'margin'). Fix: give its __init__ arguments defaults, or bind a configured "
     "instance to a name in its module (e.g. loss = NeedsMargin(...)) and name that in loss.kind"),
    ("model.generator=no_such_module_xyz:G", "model.generator", None, None, "Fix: put the module in a code_path"),
], ids=["forward-bug", "module-raises", "missing-dependency", "syntax-error", "loss-init-bug", "task",
        "loss-needs-arguments", "module-not-found"])
def test_an_error_in_user_code_names_its_place_and_a_fix_that_applies(tmp_path, override, key, file, line, fix):
    package = f"placed_gan_{abs(hash(override)) % 10**8}"
    recipe = write_user_gan(tmp_path, package)
    for name, text in BOOM.items():
        (tmp_path / package / f"{name}.py").write_text(text)
    at = None
    if file:
        lines = (tmp_path / package / file).read_text().splitlines()
        at = f"{package}/{file}:{next(i for i, text in enumerate(lines, 1) if line in text)}"
    result = ganscale("train", str(recipe), "--set", override.format(pkg=package), "--run-dir", str(tmp_path / "run"),
                      cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, explain(result)
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and f"'{key}'" in message[0] and fix.format(at=at, pkg=package) in message[0], explain(result)
    if file:
        assert "batch size" not in message[0] and "code_path" not in message[0], explain(result)


@pytest.mark.parametrize("override, said", [
    ("model.generator={pkg}.nets:NoisyGenerator", "model.generator's forward draws from torch's random generator "
     "(aten.randn_like at {pkg}/nets.py:{randn_like} in forward): each process has its own, so 1 and N processes train "
     "differently (`ganscale verify` shows where they part); draw per-sample noise and dropout with "
     "ganscale.randomness"),
    ("model.discriminator={pkg}.nets:RankDropoutDiscriminator", "model.discriminator's forward draws from torch's "
     "random generator (aten.bernoulli_.float at {pkg}/nets.py:{dropout} in forward)"),
    ("data.dataset_args={{shuffled_by: torch}}", "data.dataset draws from the process's random generators (torch's or "
     "numpy's) (aten.randperm at {pkg}/data.py:"),
    ("data.dataset_args={{shuffled_by: numpy}}", "data.dataset draws from the process's random generators (torch's or "
     "numpy's) while it is built or its first items read: each process has its own, so 1 and N"),
    ("model.generator={pkg}.nets:OwnGeneratorG", "model.generator's forward draws from a torch.Generator of its own "
     "(aten.randn.generator at {pkg}/nets.py:{own} in forward): every rank draws the same values, for other samples "
     "than one process would, so 1 and N processes train differently (`ganscale verify` shows where they part), and "
     "the checkpoints do not hold its state"),
    ("data.dataset_args={{unit_range: true}}", "data.dataset's images have no negative value in its first 16 items: "
     "[0, 1] images, where ganscale reads [-1, 1] (G's tanh spans both halves, sample grids show them pale); map them "
     "with image * 2 - 1"),
    ("model.discriminator={pkg}.nets:DropoutDiscriminator", None),  # ganscale.randomness: the sample's own
    ("train.steps=3", None),
])
def test_user_code_that_trains_but_not_as_meant_is_a_warning_naming_where(tmp_path, monkeypatch, override, said):
    """G's torch.randn_like, D's dropout, a data set shuffled by the process's RNG: on N processes each rank draws
    other values than one process does, so the run is not the same training: said before it starts (it was silent:
    only `ganscale verify` found it). The check leaves the process's generators as they were. Images in [0, 1]
    (they pass the [-1, 1] check) are said too."""
    from ganscale import config as config_mod
    from ganscale import preflight

    monkeypatch.chdir(tmp_path)
    package = f"drawing_gan_{abs(hash(override)) % 10**8}"
    cfg = config_mod.load(str(write_user_gan(tmp_path, package)), [override.format(pkg=package)])
    nets = (tmp_path / package / "nets.py").read_text().splitlines()
    lines = {name: next(n for n, text in enumerate(nets, 1) if marker in text)
             for name, marker in (("randn_like", "randn_like("), ("dropout", "dropout("), ("own", "generator=self."))}
    before = (torch.get_rng_state(), np.random.get_state()[1].copy())
    warnings = [str(warning) for warning in preflight.check(cfg, 2, False)]
    assert warnings == [] if said is None else (len(warnings) == 1
                                                and said.format(pkg=package, **lines) in warnings[0]), warnings
    assert torch.equal(before[0], torch.get_rng_state()) and (before[1] == np.random.get_state()[1]).all()


@pytest.mark.parametrize("arguments, said", [
    ("{latent_dim: 10}", "set model.z_dim=10: generator_args builds G for latent_dim=10, but the trainer draws latents "
     "of model.z_dim=8"),
    ("{}", "set model.z_dim=12: LatentDimG's latent_dim defaults to 12, but the trainer draws latents of model.z_dim=8")])
def test_a_latent_size_under_another_name_or_by_default_is_named_in_the_fix(tmp_path, arguments, said):
    """The advice read only a generator_args key named z_dim: G's latent_dim (or its default) got none."""
    from ganscale import config as config_mod
    from ganscale import preflight
    from ganscale.config import ConfigError

    package = f"latent_gan_{len(arguments)}"
    cfg = config_mod.load(str(write_user_gan(tmp_path, package)), [f"model.generator={package}.nets:LatentDimG",
                                                                    f"model.generator_args={arguments}"])
    with pytest.raises(ConfigError) as refused:
        preflight.check(cfg, 1, False)
    assert refused.value.key == "model.generator" and said in refused.value.fix, refused.value


@pytest.mark.parametrize("overrides, world, key", [
    (["train.micro_batch=1"], 2, "train.micro_batch"), (["train.batch_size=1"], 1, "train.batch_size"),
    (["train.micro_batch=2"], 2, None), (["train.micro_batch=1", "parallel.sync_bn=true"], 2, None),
    (["train.batch_size=2"], 2, None)])  # unset micro_batch: statistics span the ranks
def test_a_network_that_cannot_run_on_one_sample_is_refused_where_each_rank_trains_on_one(tmp_path, overrides,
                                                                                          world, key):
    """The preflight ran the user's networks on 2 and 4 samples only: a G with BatchNorm1d trained on micro-batches of
    1 was a traceback in the first step, after the run directory was written. Statistics across the ranks (sync_bn)
    have 2 samples."""
    from ganscale import config as config_mod
    from ganscale import preflight
    from ganscale.config import ConfigError

    package = f"one_sample_gan_{abs(hash(tuple(overrides))) % 10**8}"
    cfg = config_mod.load(str(write_user_gan(tmp_path, package)), [f"model.generator={package}.nets:BatchNormG",
                                                                    *overrides])
    if key is None:
        preflight.check(cfg, world, False)
        return
    with pytest.raises(ConfigError) as refused:
        preflight.check(cfg, world, False)
    assert refused.value.key == key and "(BatchNorm needs 2 samples per rank), set parallel.sync_bn=true, or use " \
        "GroupNorm or LayerNorm" in refused.value.fix, refused.value


def test_a_class_count_beyond_g_s_embedding_is_said_as_the_labels_it_is_given(tmp_path):
    """Random labels below G's 4 classes passed on 2 latents and failed on 4: blamed on the batch size."""
    from ganscale import config as config_mod
    from ganscale import preflight
    from ganscale.config import ConfigError

    overrides = [f"{k}={v}" for k, v in {**CLASSES, "model.generator_args": "{z_dim: 8, n_classes: 4}"}.items()]
    cfg = config_mod.load(str(write_user_gan(tmp_path, "few_classes_gan")), overrides)
    with pytest.raises(ConfigError) as refused:
        preflight.check(cfg, 1, False)
    assert "on 2 latents failed (IndexError: index out of range in self)" in refused.value.problem
    assert refused.value.fix.endswith("; it is given class labels up to model.n_classes - 1 = 9"), refused.value


def test_a_loss_is_checked_on_the_logits_d_returns_and_a_sum_is_refused(tmp_path):
    """The loss written for (B, 1) logits passes with a D returning (B, 1); a sum over samples is refused (on 2 ranks
    it would train otherwise than on one), saying so."""
    from ganscale import config as config_mod, preflight
    from ganscale.config import ConfigError

    recipe = str(write_user_gan(tmp_path, "logit_shape_gan"))
    columns = ["model.discriminator=logit_shape_gan.nets:ColumnD", "loss.kind=logit_shape_gan.losses:ForColumns"]
    preflight.check(config_mod.load(recipe, columns), 2, False)
    with pytest.raises(ConfigError) as refused:
        preflight.check(config_mod.load(recipe, ["loss.kind=logit_shape_gan.losses:Summed"]), 2, False)
    assert refused.value.key == "loss.kind" and "a sum over the samples, not a mean" in str(refused.value)
    assert "take the mean over the batch" in str(refused.value)
    # Changing D's logits in place: FSDP2 would skip D's all-gather in backward (its view-output warning, which the
    # trainer silences, is about that).
    with pytest.raises(ConfigError) as refused:
        preflight.check(config_mod.load(recipe, ["loss.kind=logit_shape_gan.losses:InPlace"]), 2, False)
    assert refused.value.key == "loss.kind" and "changes the logits it is given in place" in str(refused.value)


@pytest.mark.parametrize("label, more", [
    ("5", []),                                         # n_classes or more
    ("-1", ["--set", "data.workers=1"]),               # negative, read by a DataLoader worker
    ("2.5", ["--set", "data.workers=1", "--nproc", "2"]),  # not an integer, on one of two ranks
], ids=["too-large", "negative-in-a-worker", "fraction-on-two-ranks"])
def test_a_bad_label_found_while_training_exits_2_naming_the_item(tmp_path, label, more):
    """Item 0 passes the preflight; item 5's label is outside [0, n_classes): read while training, it is one line
    naming data.dataset, the item, its label and the classes (as a corrupt image is), not embedding's IndexError."""
    package = f"bad_label_gan_{abs(hash(label)) % 10**8}"
    recipe = write_user_gan(tmp_path, package)
    classes = {**CLASSES, "model.n_classes": 4, "model.generator_args": "{z_dim: 8, n_classes: 4}",
               "model.discriminator_args": "{n_classes: 4}",
               "data.dataset_args": f"{{size: 8, labels: true, classes: 4, relabel: {{5: {label}}}}}"}
    result = ganscale("train", str(recipe), *(f"--set={k}={v}" for k, v in classes.items()), "--set",
                      "train.steps=1", *more, "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, explain(result)
    assert "Traceback" not in result.stderr, explain(result)
    said = [line for line in result.stderr.splitlines() if "'data.dataset'" in line]
    assert len(said) == 1 and f"item 5's label is {label}, not an integer class in [0, 4)" in said[0], explain(result)
    assert (tmp_path / "run" / "config.yaml").is_file()  # what the run wrote before it read item 5 stays


@pytest.mark.parametrize("spoil, said", [
    ("extra field", "item 5 is (tensor(1, 8, 8), int); model task unconditional takes an image tensor"),
    ("smaller", "item 5 holds a torch.float32 tensor of shape (1, 4, 4), not (1, 8, 8)"),
    ("bright", "item 5 has values in [-2"),
    ("nan", "item 5 holds NaN or infinite values"),
    ("unreadable", "item 5 failed to load (OSError: cannot read image file img_0005.png) at {pkg}/data.py:"),
])
def test_an_item_unlike_item_0_is_refused_when_it_is_read(tmp_path, monkeypatch, spoil, said):
    """Only item 0 is checked before training; a later one with an extra field (trained on silently), a smaller
    image (torch's collate error), values out of range or NaN (trained on silently), or one whose __getitem__
    raises (a traceback) is refused as training reads it."""
    from ganscale import config as config_mod
    from ganscale.data.custom import user_dataset
    from ganscale.data.folder import BadItem

    package = f"spoiled_item_gan_{abs(hash(spoil)) % 10**8}"
    monkeypatch.chdir(tmp_path)  # the user's code is named relative to the current folder
    cfg = config_mod.load(str(write_user_gan(tmp_path, package)),
                          [f"data.dataset_args={{size: 8, spoil: {{5: {spoil}}}}}"])
    items = user_dataset(cfg)
    assert all(len(items[i]) == 1 for i in (0, 4, 6))
    with pytest.raises(BadItem) as refused:
        items[5]
    assert said.format(pkg=package) in refused.value.problem() and refused.value.key == "data.dataset"


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_floating_images_of_any_precision_are_read_as_float32(tmp_path, dtype):
    from ganscale import config as config_mod
    from ganscale.data.custom import user_dataset

    package = f"precise_item_gan_{dtype}"
    cfg = config_mod.load(str(write_user_gan(tmp_path, package)), [f"data.dataset_args={{size: 8, dtype: {dtype}}}"])
    assert user_dataset(cfg)[3][0].dtype == torch.float32


def test_a_float64_data_set_trains(tmp_path):
    """float64 images (numpy's default) reach D as float32, not torch's 'mat1 and mat2 must have the same dtype'."""
    recipe = write_user_gan(tmp_path, "double_data_gan")
    result = ganscale("train", str(recipe), "--set=data.dataset_args={size: 16, dtype: float64}", "--set",
                      "train.steps=1", "--run-dir", str(tmp_path / "run"), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, explain(result)


def _bad_item_on_rank_1(tmp_path: Path, package: str, spoil: str, *options: str) -> tuple[subprocess.CompletedProcess, str]:
    """`--nproc 2` training on a data set whose item 5 (rank 1's) is spoiled: the result, refused with exit 2 and
    no traceback, and its one line naming data.dataset."""
    recipe = write_user_gan(tmp_path, package)
    result = ganscale("train", str(recipe), f"--set=data.dataset_args={{size: 8, spoil: {{5: {spoil}}}}}", "--set",
                      "train.steps=2", "--nproc", "2", *options, "--run-dir", str(tmp_path / "run"), cwd=tmp_path,
                      timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stderr, explain(result)
    lines = [line for line in result.stderr.splitlines() if "'data.dataset'" in line]
    assert len(lines) == 1, explain(result)
    return result, lines[0]


def test_an_item_that_fails_to_load_on_one_of_two_ranks_exits_2_naming_it(tmp_path):
    """The user's own OSError reading item 5 (rank 1's): one line naming data.dataset, the item and the error's first
    line, exit 2 on every rank (not a traceback and rank 0's 'Connection closed by peer'), and no restart into the
    same item."""
    result, line = _bad_item_on_rank_1(tmp_path, "unreadable_item_gan", "unreadable", "--max-restarts", "1")
    assert line.startswith("ganscale: data error at 'data.dataset': item 5 failed to load (OSError: cannot read image "
                           "file img_0005.png) at unreadable_item_gan/data.py:") and " in __getitem__. Fix: make " \
        "__getitem__ return that item" in line, explain(result)
    # Rank 0 may reach its next collective before rank 1 has left: then it says why it stopped, quoting gloo.
    assert all("another rank failed first" in line for line in result.stderr.splitlines()
               if "Connection closed" in line), explain(result)
    assert "restarting the workers (" not in result.stderr, explain(result)


def test_an_item_unlike_item_0_found_while_training_exits_2_naming_it(tmp_path):
    """Read by a DataLoader worker on one of two ranks: one line naming data.dataset and the item, not torch's
    collate error."""
    result, line = _bad_item_on_rank_1(tmp_path, "smaller_item_gan", "smaller", "--set", "data.workers=1")
    assert "item 5 holds a torch.float32 tensor of shape (1, 4, 4)" in line, explain(result)
    assert "Fix: return from every item the fields" in line, explain(result)


SHIPPED_DATA = {"data.dataset": "null", "data.dataset_args": "{}"}  # data.dataset belongs to data.kind=custom


@pytest.mark.parametrize("overrides, said", [
    ({**CLASSES, **SHIPPED_DATA, "data.kind": "folder", "data.path": "."},  # the tester's: the model IS conditional
     ["model.kind=custom with model.task=class-conditional is class-conditional", "data.kind=folder has no class labels",
      "digits, mnist, zip with a dataset.json", "a data.kind=custom data set returning (image, label)",
      "set model.task=unconditional"]),
    ({**CLASSES, **SHIPPED_DATA, "data.kind": "digits"},
     ["and data.labels=false", "use data.labels=true with a data kind that has"]),
    ({**SHIPPED_DATA, "data.kind": "digits", "data.labels": "true"},
     ["model.kind=custom with model.task=unconditional takes no class labels", "set model.task=class-conditional"]),
    ({"data.labels": "true"}, ["data.kind=custom data set gives its labels itself", "set data.labels=false"]),
], ids=["conditional-on-folder", "conditional-on-unlabelled-digits", "unconditional-on-labels", "labels-on-custom"])
def test_class_labels_that_do_not_fit_a_user_model_exit_2_naming_its_task(tmp_path, overrides, said):
    """The labels rule names model.task for a custom model, never the shipped models' switches (model.kind=biggan)."""
    package = f"labels_user_gan_{abs(hash(str(overrides))) % 10**8}"
    recipe = write_user_gan(tmp_path, package)
    result = ganscale("train", str(recipe), *(f"--set={k}={v}" for k, v in overrides.items()),
                      "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, explain(result)
    message = result.stderr.strip().splitlines()
    assert len(message) == 1 and "'data.labels'" in message[0], explain(result)
    assert all(part in message[0] for part in said) and "biggan" not in message[0], explain(result)
    assert not (tmp_path / "run").exists()


def test_an_installed_nn_module_class_may_be_a_network_and_nothing_else_of_a_library():
    from ganscale import usercode
    from ganscale.config import ConfigError

    assert usercode.find("torch.nn:Linear", "model.generator", network=True) is torch.nn.Linear
    with pytest.raises(ConfigError, match="installed package"):
        usercode.find("torch.nn:Linear", "data.dataset")
    with pytest.raises(ConfigError, match="does not import"):  # a relative name: one line, not a traceback
        usercode.find(".nets:Generator", "model.generator", network=True)
    with pytest.raises(ConfigError, match="standard library"):  # refused before the module imports
        usercode.find("antigravity:geohash", "model.generator", network=True)
    assert "antigravity" not in sys.modules


def test_a_run_directory_s_config_cannot_make_sample_call_a_library_function(tmp_path):
    """A run directory may come from elsewhere: its config.yaml naming subprocess:run is refused, not called."""
    run = tmp_path / "run"
    trained = ganscale("train", "ring8", "--set", "train.steps=1", "--set", "model.g_width=8", "--set",
                       "model.d_width=8", "--run-dir", str(run), cwd=tmp_path)
    assert trained.returncode == 0, explain(trained)
    marker = tmp_path / "called"
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"].update(kind="custom", generator="subprocess:run", generator_args={"args": ["touch", str(marker)]})
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    result = ganscale("sample", str(run), "--out", str(tmp_path / "grid.png"), cwd=tmp_path)
    assert result.returncode == 2 and "standard library" in result.stderr, explain(result)
    assert not marker.exists()


def test_a_shipped_recipe_imports_no_file_of_the_current_directory(tmp_path):
    """Only a config that names the user's code searches their folders: a built-in recipe run from a folder that
    holds, say, an sklearn.py imports the installed packages, in the launcher and its workers (`python -m`)."""
    marker = tmp_path / "imported"
    for name in ("sklearn", "scipy", "mlxtend", "safetensors", "tensorboard", "tqdm", "pandas"):
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    result = ganscale("train", "digits", "--set", "train.steps=1", "--set", "model.g_width=8", "--set",
                      "model.d_width=8", "--nproc", "2", "--run-dir", str(tmp_path / "run"), cwd=tmp_path)
    assert result.returncode == 0, explain(result)
    assert not marker.exists(), marker.read_text()


def test_a_label_is_an_integer_class_of_any_integer_type_but_not_a_batch_of_one():
    import numpy as np

    from ganscale.data.custom import label_problem

    for fine in (3, np.int64(3), np.uint8(0), torch.tensor(2)):
        assert label_problem(fine, 0, 4) is None, fine
    for bad in (4, np.int64(-1), 2.0, True, torch.tensor([2]), torch.tensor(1.0)):
        assert label_problem(bad, 7, 4).startswith("item 7's label is "), bad


def test_a_checkpoint_the_user_s_changed_network_no_longer_fits_is_refused_naming_the_code(tmp_path):
    """The config is the run's own, the user's G code changed (a wider layer): resume and sample say that the code
    changed, not to resume with the config the checkpoint was written with (it is this one)."""
    recipe = write_user_gan(tmp_path, "changed_user_gan")
    run = tmp_path / "run"
    trained = ganscale("train", str(recipe), "--run-dir", str(run), "--set", "train.steps=1",
                       "--set", "checkpoint.every=1", cwd=tmp_path)
    assert trained.returncode == 0, explain(trained)
    with open(tmp_path / "changed_user_gan" / "nets.py", "a") as nets:
        nets.write("\n\nclass Wider(Generator):\n    def __init__(self, z_dim, width=16, n_classes=0):\n"
                   "        super().__init__(z_dim, width + 1, n_classes)\n\n\nGenerator = Wider\n")
    resumed = ganscale("train", "--run-dir", str(run), "--resume", "auto", "--set", "train.steps=2", cwd=tmp_path)
    drawn = ganscale("sample", str(run), "--out", str(tmp_path / "grid.png"), cwd=tmp_path)
    for refused in (resumed, drawn):
        lines = [line for line in refused.stderr.splitlines() if line.startswith("ganscale: ")]
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, explain(refused)
        assert "the code of model.generator (changed_user_gan.nets:Generator)" in lines[-1], explain(refused)
        assert "restore the code the run was trained with" in lines[-1], explain(refused)
    assert not (tmp_path / "grid.png").exists()
