"""ganscale.randomness: a network's own noise and dropout, per sample, so that N ranks train as one process."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from dist_helpers import max_relative_difference, record_steps, run_ranks, train_and_collect
from ganscale import randomness
from ganscale.randomness import batch_seeds, sample_seeds, seeds_from

TOLERANCE = 1e-5  # max |difference| relative to each tensor's scale, fp32, as tests/test_distributed.py
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "noise_injection" / "nets.py"


def _latents(n: int = 6, z_dim: int = 4) -> Tensor:
    return torch.randn(n, z_dim, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("draw", [randomness.normal, randomness.uniform])
def test_a_sample_s_noise_depends_on_its_seed_and_salt_alone(draw):
    seeds, x = sample_seeds(_latents()), torch.zeros(6, 3, 16, 16)
    noise = draw(x, salt=1, seeds=seeds)
    assert noise.shape == x.shape and noise.dtype == x.dtype
    for i in range(6):  # alone, or in another batch: the same values
        assert torch.equal(draw(x[i:i + 1], salt=1, seeds=seeds[i:i + 1]), noise[i:i + 1])
    assert torch.equal(draw(x[[4, 2]], salt=1, seeds=seeds[[4, 2]]), noise[[4, 2]])
    assert not torch.equal(noise[0], noise[1])
    assert not torch.equal(draw(x, salt=2, seeds=seeds), noise)
    assert draw(x, salt=1, shape=(1, 16, 16), seeds=seeds).shape == (6, 1, 16, 16)
    assert draw(x.bfloat16(), salt=1, seeds=seeds).dtype == torch.bfloat16


def test_noise_has_its_distribution():
    x, seeds = torch.zeros(4096, 64), sample_seeds(torch.randn(4096, 1, generator=torch.Generator().manual_seed(1)))
    uniform, normal = randomness.uniform(x, 0, seeds=seeds), randomness.normal(x, 0, seeds=seeds)
    assert 0 <= uniform.min() and uniform.max() < 1
    assert uniform.mean().item() == pytest.approx(0.5, abs=0.005)
    assert normal.mean().item() == pytest.approx(0.0, abs=0.01)
    assert normal.std().item() == pytest.approx(1.0, abs=0.01)
    assert torch.isfinite(normal).all()
    assert (normal > 1.96).float().mean().item() == pytest.approx(0.025, abs=0.002)  # the tails too
    kept = randomness.dropout(torch.ones(4096, 64), 0.3, salt=0, seeds=seeds)
    assert kept.unique().tolist() == [0.0, pytest.approx(1 / 0.7)]
    assert (kept == 0).float().mean().item() == pytest.approx(0.3, abs=0.005)


def test_batch_seeds_are_the_trainer_s_per_sample_seeds_and_none_outside_its_steps():
    z = _latents()
    x = torch.zeros(6, 5)
    assert batch_seeds(x) is None
    with seeds_from(z):
        assert torch.equal(batch_seeds(x), sample_seeds(z))  # a G's rows: its samples' own seeds
        rows = batch_seeds(torch.zeros(18, 5))  # a D's [real, fake, interpolates]
        with pytest.raises(ValueError, match="not whole blocks"):
            batch_seeds(torch.zeros(7, 5))
    assert batch_seeds(x) is None
    assert torch.equal(rows[:6], sample_seeds(z))
    assert len(set(rows.tolist())) == 18  # a sample's real, fake and interpolated rows draw differently
    with seeds_from(z[[4, 1]]):  # the same samples in another micro-batch (another rank): the same seeds
        assert torch.equal(batch_seeds(torch.zeros(6, 5)), rows[[4, 1, 10, 7, 16, 13]])


def test_without_seeds_it_draws_from_torch_s_rng_as_torch_s_dropout_does():
    x = torch.ones(4, 256)
    torch.manual_seed(3)
    first = [randomness.normal(x, 0), randomness.uniform(x, 0), randomness.dropout(x, 0.5, 0)]
    torch.manual_seed(3)
    assert torch.equal(first[0], torch.randn(4, 256))
    assert not torch.equal(randomness.dropout(x, 0.5, 0), first[2])
    layer = randomness.SampleDropout(0.5, salt=0)
    assert torch.equal(layer.eval()(x), x)
    with seeds_from(_latents(4)):  # in the trainer's step: from the seeds, like the function
        assert torch.equal(layer.train()(x), randomness.dropout(x, 0.5, 0, batch_seeds(x)))


def test_it_compiles_into_one_graph_with_the_trainer_s_seeds():
    def forward(x: Tensor) -> Tensor:
        return randomness.dropout(x, 0.5, 1) + randomness.normal(x, 2, shape=(1, 8))

    compiled = torch.compile(forward, fullgraph=True, backend="aot_eager")  # fullgraph: no break, no Python RNG
    x = torch.ones(6, 8)
    for z in (_latents(), _latents() + 1):
        with seeds_from(z):
            assert torch.equal(compiled(x), forward(x))


def _example():
    """examples/noise_injection/nets.py, imported from its file."""
    spec = importlib.util.spec_from_file_location("noise_injection_nets", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_s_noise_and_dropout_are_per_sample():
    """examples/noise_injection: G's noise and D's dropout masks are a sample's own, whatever batch (or rank's
    micro-batch) it is in; its noise changes G's output."""
    nets = _example()
    torch.manual_seed(0)
    G, D = nets.NoiseInjectionGenerator(width=8), nets.DropoutDiscriminator(width=8)
    for injection in G.modules():
        if isinstance(injection, nets.NoiseInjection):
            nn.init.ones_(injection.weight)
    z = _latents(6, 32)
    images = G(z)
    assert images.shape == (6, 1, 8, 8) and images.abs().max() <= 1
    assert torch.allclose(G(z[[4, 2]]), images[[4, 2]], atol=1e-6)
    assert not torch.allclose(G(torch.cat([z[:, :1] + 1, z[:, 1:]], 1)), G(z.clone()), atol=1e-3)  # other seeds
    both = torch.cat([images, images.flip(0)])  # [real, fake] as D's step sees them
    with seeds_from(z):
        logits = D(both)
    with seeds_from(z[[4, 2]]):
        assert torch.allclose(D(both[[4, 2, 10, 8]]), logits[[4, 2, 10, 8]], atol=1e-6)
    assert logits.shape == (12, 1)
    with seeds_from(z):
        assert not torch.equal(D(both), D.eval()(both))  # the dropout is on in training


# ------------------------------------------------------------------------------------------ 2 ranks vs 1 process
QUIET = {"train.batch_size": 16, "train.steps": 4, "log.every": 100, "log.sample_every": 0, "checkpoint.every": 0,
         "log.tensorboard": "false"}
RING8 = {**QUIET, "model.kind": "mlp", "data.kind": "ring8", "data.size": 500, "model.z_dim": 4}
DIGITS = {**QUIET, "data.kind": "digits", "model.z_dim": 32}


NETS = '''
import torch
from torch import nn

from ganscale import randomness
from ganscale.randomness import batch_seeds, sample_seeds


class NoisyGenerator(nn.Module):
    """An MLP G with StyleGAN-like noise injection after each hidden layer; `draw`: how it draws the noise."""

    def __init__(self, z_dim, width=32, draw="per_sample"):
        super().__init__()
        self.draw = draw
        self.hidden = nn.ModuleList([nn.Linear(z_dim, width), nn.Linear(width, width)])
        self.strength = nn.Parameter(torch.full((2, width), 0.5))
        self.out = nn.Linear(width, 2)

    def forward(self, z):
        h = z
        for i, layer in enumerate(self.hidden):
            h = torch.relu(layer(h))
            if self.draw == "per_sample":
                noise = randomness.normal(h, salt=i, seeds=sample_seeds(z))
            else:  # the rank's RNG stream: another noise on 2 ranks than on one process
                noise = torch.randn_like(h)
            h = h + self.strength[i] * noise
        return self.out(h)


class DropoutDiscriminator(nn.Module):
    """An MLP D with dropout whose masks come from the trainer's per-row seeds (batch_seeds)."""

    def __init__(self, width=32):
        super().__init__()
        self.hidden, self.out = nn.Linear(2, width), nn.Linear(width, 1)

    def forward(self, x):
        h = torch.nn.functional.leaky_relu(self.hidden(x), 0.2)
        return self.out(randomness.dropout(h, 0.3, salt=0, seeds=batch_seeds(x)))
'''


def _user_networks(folder: Path, draw: str) -> dict:
    """model.kind=custom overrides for the MLPs above (`draw`: how G draws its noise), written to `folder`, or for
    examples/noise_injection's networks ("example")."""
    if draw == "example":
        return {"model.kind": "custom", "code_path": f"[{EXAMPLE.parent}]",
                "model.generator": "nets:NoiseInjectionGenerator", "model.generator_args": "{z_dim: 32, width: 8}",
                "model.discriminator": "nets:DropoutDiscriminator", "model.discriminator_args": "{width: 8}"}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "noisy_nets.py").write_text(NETS)
    return {"model.kind": "custom", "code_path": f"[{folder}]",
            "model.generator": "noisy_nets:NoisyGenerator", "model.generator_args": f"{{z_dim: 4, draw: {draw}}}",
            "model.discriminator": "noisy_nets:DropoutDiscriminator", "model.discriminator_args": "{}"}


def _one_and_two(tmp_path: Path, draw: str, one_process: dict, two_ranks: dict) -> tuple[dict, list[dict]]:
    """The user's networks trained on one process and on 2 ranks, with their per-step losses and gradients."""
    networks = _user_networks(tmp_path / "code", draw)
    one = run_ranks(train_and_collect, 1, {**one_process, **networks}, str(tmp_path / "one"), record_steps)[0]
    two = run_ranks(train_and_collect, 2, {**two_ranks, **networks}, str(tmp_path / "two"), record_steps)
    return one, two


def _differences(one: dict, two: dict) -> list[float]:
    """Per optimizer step, the relative difference of the losses; then of G, D and G_ema at the end."""
    losses = [abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(one["extra"], two["extra"], strict=True)]
    return losses + [max_relative_difference(one[net], two[net]) for net in ("G", "D", "G_ema")]


@pytest.mark.slow
@pytest.mark.parametrize("networks, one_process, two_ranks", [
    ("per_sample", RING8, {**RING8, "train.micro_batch": 4}),
    ("per_sample", {**RING8, "train.reuse_fake": "true"}, {**RING8, "train.reuse_fake": "true"}),
    ("example", DIGITS, {**DIGITS, "train.micro_batch": 4})], ids=["accumulating", "reusing-fake", "example"])
def test_per_sample_noise_in_g_and_dropout_in_d_train_on_two_ranks_as_on_one_process(tmp_path, networks, one_process,
                                                                                    two_ranks):
    """A user's networks (model.kind=custom): noise injection in G (seeds from its latents) and dropout in D (seeds
    the trainer sets per row), on 2 ranks of 2 micro-steps each (or with G's step judging D's step's fake) and on one process: the same losses at every
    step and the same weights."""
    one, two = _one_and_two(tmp_path, networks, one_process, two_ranks)
    assert len(one["extra"]) == 2 * RING8["train.steps"]
    assert max(_differences(one, two[0])) <= TOLERANCE
    assert max(_differences(one, two[1])) <= TOLERANCE


@pytest.mark.slow
def test_noise_from_the_rank_s_rng_stream_trains_otherwise_on_two_ranks(tmp_path):
    """Sensitivity of the test above: the same G drawing torch.randn_like in its forward differs from one process."""
    one, two = _one_and_two(tmp_path, "rank_stream", RING8, {**RING8, "train.micro_batch": 4})
    assert max(_differences(one, two[0])) > 100 * TOLERANCE
