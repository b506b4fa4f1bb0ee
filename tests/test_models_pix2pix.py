"""pix2pix networks: the reference's sizes and shapes, norm variants, init, and learning on synthetic facades."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ganscale import objectives
from ganscale.config import ConfigError
from ganscale.data.paired import PairedImages
from ganscale.data.synthetic import write_synthetic_facades
from ganscale.models.pix2pix import DownBlock, PatchDiscriminator, SampleDropout, UNetGenerator, UpBlock


def count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.fixture(scope="module")
def unet256() -> UNetGenerator:
    torch.manual_seed(0)
    return UNetGenerator()


def test_reference_parameter_counts(unet256):
    assert count(unet256) == 54_413_955
    assert count(PatchDiscriminator()) == 2_768_705


def test_reference_shapes(unet256):
    with torch.no_grad():
        assert unet256(torch.randn(1, 3, 256, 256)).shape == (1, 3, 256, 256)
        assert PatchDiscriminator()(torch.randn(1, 6, 256, 256)).shape == (1, 1, 30, 30)


def test_reference_structure(unet256):
    """8 levels, widths 64..512, dropout only in the three inner 512-wide decoder blocks, Tanh out, no bias before BN."""
    assert [b.conv.out_channels for b in unet256.down] == [64, 128, 256, 512, 512, 512, 512, 512]
    assert [b.conv.out_channels for b in unet256.up] == [512, 512, 512, 512, 256, 128, 64, 3]
    assert [isinstance(b.dropout, SampleDropout) for b in unet256.up] == [False, True, True, True, False, False, False, False]
    assert all(b.dropout.p == 0.5 for b in unet256.up if isinstance(b.dropout, SampleDropout))
    assert isinstance(unet256.up[-1].norm, nn.Tanh)
    assert isinstance(unet256.down[0].act, nn.Identity) and isinstance(unet256.down[0].norm, nn.Identity)
    assert isinstance(unet256.down[-1].norm, nn.Identity)  # innermost: no norm
    convs = [m for m in unet256.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d))]
    assert [c.bias is not None for c in convs] == [False] * 15 + [True]  # only the image-producing conv
    assert [name for name, _ in unet256.named_children()] == ["down", "up"]


def test_init_is_normal_002(unet256):
    weights = torch.cat([m.weight.flatten() for m in unet256.modules() if isinstance(m, nn.Conv2d)])
    assert weights.mean().abs() < 1e-3 and abs(weights.std().item() - 0.02) < 1e-3
    bn = torch.cat([m.weight for m in unet256.modules() if isinstance(m, nn.BatchNorm2d)])
    assert abs(bn.mean().item() - 1) < 5e-3 and abs(bn.std().item() - 0.02) < 5e-3
    assert all((m.bias == 0).all() for m in unet256.modules() if isinstance(m, nn.BatchNorm2d))


def test_instance_norm_variant_builds_and_runs():
    G = UNetGenerator(norm="instance")  # 256: the innermost level is 1x1 and has no norm, so it runs at batch 1
    norms = [m for m in G.modules() if isinstance(m, nn.InstanceNorm2d)]
    assert norms and all(not n.affine and not n.track_running_stats for n in norms)
    assert not any(isinstance(m, nn.BatchNorm2d) for m in G.modules())
    assert all(m.bias is not None for m in G.modules() if isinstance(m, (nn.Conv2d, nn.ConvTranspose2d)))
    D = PatchDiscriminator(norm="instance")
    with torch.no_grad():
        assert G(torch.randn(1, 3, 256, 256)).shape == (1, 3, 256, 256)
        assert D(torch.randn(1, 6, 256, 256)).shape == (1, 1, 30, 30)


@pytest.mark.parametrize("norm", ["batch", "instance", "none"])
def test_small_resolutions_and_norms(norm):
    G = UNetGenerator(resolution=64, ngf=8, norm=norm)
    assert len(G.down) == len(G.up) == 6
    assert sum(isinstance(b.dropout, SampleDropout) for b in G.up) == 1  # one 8*ngf decoder block below the innermost
    out = G(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 3, 64, 64) and out.abs().max() <= 1
    assert PatchDiscriminator(ndf=8, norm=norm)(torch.randn(2, 6, 64, 64)).shape == (2, 1, 6, 6)
    assert UNetGenerator(1, 2, resolution=32, ngf=4, norm=norm)(torch.randn(2, 1, 32, 32)).shape == (2, 2, 32, 32)


def test_bad_norm_and_resolution_are_config_errors():
    with pytest.raises(ConfigError, match="model.norm"):
        UNetGenerator(resolution=64, ngf=4, norm="group")
    with pytest.raises(ConfigError, match="power of two"):
        UNetGenerator(resolution=96, ngf=4)


def test_blocks_run_in_child_order():
    """The forward is down[0..n-1] then up[0..n-1]: a pipeline split can follow named_children()."""
    G = UNetGenerator(resolution=32, ngf=4).eval()
    order: list[nn.Module] = []
    for block in [*G.down, *G.up]:
        block.register_forward_hook(lambda module, inputs, output: order.append(module))
    G(torch.randn(1, 3, 32, 32))
    assert order == [*G.down, *G.up]
    assert all(isinstance(b, DownBlock) for b in G.down) and all(isinstance(b, UpBlock) for b in G.up)


def test_learns_synthetic_facades_labels_to_photo(tmp_path):
    """pix2pix's objective (BCE + 100 L1, D on concat(input, output)) lowers L1 on synthetic facades in a short run."""
    folder = write_synthetic_facades(tmp_path / "facades", n=16, seed=0, size=(128, 64))
    data = PairedImages(folder, load_size=72, crop_size=64, direction="BtoA", seed=0)
    torch.manual_seed(0)
    G, D = UNetGenerator(resolution=64, ngf=16, norm="instance"), PatchDiscriminator(ndf=16, norm="instance")
    opt_g = torch.optim.Adam(G.parameters(), 2e-4 * 5, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), 2e-4, betas=(0.5, 0.999))
    l1_history = []
    for step in range(60):
        keys = [((step * 4 + j) % len(data), step * 4 + j) for j in range(4)]
        source, target = (torch.stack(t) for t in zip(*(data[k] for k in keys)))
        fake = G(source)
        logits = D(torch.cat([torch.cat([source, target], 1), torch.cat([source, fake.detach()], 1)]))
        real_logits, fake_logits = logits.chunk(2)
        opt_d.zero_grad()
        (0.5 * objectives.d_loss("nonsaturating", real_logits, fake_logits)).backward()
        opt_d.step()
        l1 = F.l1_loss(fake, target)
        loss_g = objectives.g_loss("nonsaturating", D(torch.cat([source, fake], 1))) + 100 * l1
        opt_g.zero_grad()
        loss_g.backward()
        opt_g.step()
        l1_history.append(l1.item())
    first, last = sum(l1_history[:5]) / 5, sum(l1_history[-5:]) / 5
    assert last < 0.4 * first, (first, last)  # measured: 0.37 -> 0.09
