"""BigGAN-style conditional networks: shapes per resolution, spectral norm, conditioning, a hinge step."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

from ganscale import objectives
from ganscale.config import ConfigError
from ganscale.models import biggan
from ganscale.models.biggan import RESOLUTIONS, BigGANDiscriminator, BigGANGenerator
from ganscale.models.layers import ConditionalBatchNorm2d, SelfAttention
from ganscale.parallel.syncbn import CrossRankBatchNorm, convert_batchnorm

N_CLASSES, Z_DIM = 5, 24


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def pair(resolution: int, ch: int = 4, channels: int = 3, **kw) -> tuple[BigGANGenerator, BigGANDiscriminator]:
    torch.manual_seed(0)
    return (BigGANGenerator(resolution, ch, Z_DIM, N_CLASSES, channels, shared_dim=8, **kw),
            BigGANDiscriminator(resolution, ch, N_CLASSES, channels, **kw))


@pytest.mark.parametrize("resolution", RESOLUTIONS)
def test_shapes_for_each_resolution(resolution):
    G, D = pair(resolution)
    z, y = torch.randn(2, Z_DIM), torch.tensor([0, 3])
    x = G(z, y)
    assert x.shape == (2, 3, resolution, resolution) and x.abs().max() <= 1
    assert D(x, y).shape == (2, 1)
    assert len(G.blocks) == {8: 1, 16: 2, 32: 3, 64: 4, 128: 5, 256: 6}[resolution]
    assert len(D.blocks) == len(G.blocks) + 1  # down to 4x4, then one block at 4x4


def test_digits_size_runs_grey_8x8():
    G, D = pair(8, ch=8, channels=1, attn_resolution=8)
    y = torch.arange(N_CLASSES)
    x = G(torch.randn(N_CLASSES, Z_DIM), y)
    assert x.shape == (N_CLASSES, 1, 8, 8) and D(x, y).shape == (N_CLASSES, 1)


def test_spectral_norm_on_every_weight_layer():
    G, D = pair(32)
    for net in (G, D):
        layers = [m for m in net.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        assert layers and all(parametrize.is_parametrized(m, "weight") for m in layers)
    assert parametrize.is_parametrized(D.embed, "weight")
    assert not parametrize.is_parametrized(G.shared, "weight")  # BigGAN's shared embedding is plain


def test_one_self_attention_at_the_chosen_level():
    G, D = pair(64)  # default attn_resolution 32
    assert sum(isinstance(m, SelfAttention) for m in G.modules()) == 1
    assert sum(isinstance(m, SelfAttention) for m in D.modules()) == 1
    seen = {}
    G.attention.register_forward_hook(lambda m, i, o: seen.update(G=o.shape[-1]))
    D.attention.register_forward_hook(lambda m, i, o: seen.update(D=o.shape[-1]))
    y = torch.tensor([1, 2])
    D(G(torch.randn(2, Z_DIM), y), y)
    assert seen == {"G": 32, "D": 32}
    G8, D8 = pair(8)  # no 32x32 level: the nearest one (8 in G, 4 in D)
    assert G8.attention_after == 0 and D8.attention_after == 0
    G0, D0 = pair(32, attn_resolution=0)
    assert G0.attention is None and D0.attention is None


def test_attention_gamma_is_a_vector_and_weights_with_the_old_0d_one_still_load():
    """FSDP2 cannot shard a 0-d parameter; weights saved while gamma was one (e.g. exported) load as (1,)."""
    G, D = pair(16)
    for net in (G, D):
        assert net.attention.gamma.shape == (1,)
        old = {**net.state_dict(), "attention.gamma": torch.tensor(0.25)}
        net.load_state_dict(old)
        assert net.attention.gamma.shape == (1,) and net.attention.gamma.item() == 0.25


def test_output_depends_on_the_class_label():
    G, D = pair(16)
    G.eval()  # running statistics: rows cannot influence each other through the batch
    z = torch.randn(1, Z_DIM).expand(N_CLASSES, -1)
    x = G(z, torch.arange(N_CLASSES))
    assert all(not torch.allclose(x[0], x[c], atol=1e-4) for c in range(1, N_CLASSES))
    image = torch.randn(1, 3, 16, 16).expand(N_CLASSES, -1, -1, -1)
    logits = D(image, torch.arange(N_CLASSES)).flatten()
    assert len(set(round(v, 5) for v in logits.tolist())) == N_CLASSES


def test_gradients_reach_the_class_embeddings():
    G, D = pair(16)
    y = torch.tensor([0, 1, 2, 2])
    objectives.g_loss("hinge", D(G(torch.randn(4, Z_DIM), y), y)).backward()
    shared = G.shared.weight.grad
    assert shared is not None and shared[[0, 1, 2]].abs().sum(1).gt(0).all() and shared[[3, 4]].abs().sum() == 0
    embed = D.embed.parametrizations.weight.original.grad
    assert embed is not None and embed.abs().sum() > 0


def test_a_hinge_training_step_runs_and_updates_both():
    G, D = pair(16)
    opt_g = torch.optim.Adam(G.parameters(), 1e-4, betas=(0.0, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), 4e-4, betas=(0.0, 0.999))
    before_g = [p.detach().clone() for p in G.parameters()]
    before_d = [p.detach().clone() for p in D.parameters()]
    real, y_real = torch.rand(8, 3, 16, 16) * 2 - 1, torch.randint(0, N_CLASSES, (8,))
    for _ in range(2):
        y_fake = torch.randint(0, N_CLASSES, (8,))
        with torch.no_grad():
            fake = G(torch.randn(8, Z_DIM), y_fake)
        logits = D(torch.cat([real, fake]), torch.cat([y_real, y_fake]))  # one D pass, as the trainer does
        loss_d = objectives.d_loss("hinge", *logits.chunk(2))
        opt_d.zero_grad()
        loss_d.backward()
        opt_d.step()
        y_fake = torch.randint(0, N_CLASSES, (8,))
        loss_g = objectives.g_loss("hinge", D(G(torch.randn(8, Z_DIM), y_fake), y_fake))
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        assert torch.isfinite(loss_d) and torch.isfinite(loss_g)
    assert any(not torch.equal(a, b) for a, b in zip(before_g, G.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(before_d, D.parameters()))


def test_parameter_count_scales_with_width():
    small, large = pair(32, ch=8), pair(32, ch=16)
    for a, b in zip(small, large):
        assert 3.0 < count(b) / count(a) < 4.1  # conv weights grow with ch^2


def test_conditional_batchnorm_converts_to_cross_rank():
    G, _ = pair(16)
    G = convert_batchnorm(G, use_cuda=False)
    cbns = [m for m in G.modules() if isinstance(m, ConditionalBatchNorm2d)]
    assert cbns and all(isinstance(m.norm, CrossRankBatchNorm) for m in cbns)


def test_config_errors():
    with pytest.raises(ConfigError, match="data.resolution"):
        BigGANGenerator(48, 4, Z_DIM, N_CLASSES)
    with pytest.raises(ConfigError, match="data.resolution"):
        BigGANDiscriminator(512, 4, N_CLASSES)
    with pytest.raises(ConfigError, match="model.z_dim"):
        BigGANGenerator(256, 4, 6, N_CLASSES)  # 7 slots (4x4 input + 6 blocks)


def test_digits_recipe_sizes_match_the_docstring():
    G = BigGANGenerator(8, 32, 32, 10, 1, shared_dim=32, attn_resolution=8)
    D = BigGANDiscriminator(8, 32, 10, 1, attn_resolution=8)
    said = re.search(r"G has ([\d,]+) and D ([\d,]+) parameters at ch 32", biggan.__doc__)
    assert (count(G), count(D)) == tuple(int(n.replace(",", "")) for n in said.groups())
