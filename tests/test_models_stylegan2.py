"""StyleGAN2's networks: shapes, their defining operations, and per-sample randomness that makes N ranks one process."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from dist_helpers import assert_same_functions, record_steps, run_ranks, train_and_collect
from ganscale import config, randomness
from ganscale.config import ConfigError
from ganscale.models import build_networks
from ganscale.models.stylegan2 import (EqualLinear, MinibatchStd, ModulatedConv2d, StyleGAN2Discriminator,
                                       StyleGAN2Generator)

Z_DIM = 16
TINY = {"channel_base": 128, "channel_max": 16}


def count(network: torch.nn.Module) -> int:
    return sum(p.numel() for p in network.parameters())


def generator(resolution: int = 16, **kwargs) -> StyleGAN2Generator:
    torch.manual_seed(0)
    return StyleGAN2Generator(resolution, Z_DIM, 3, mapping_layers=2, **{**TINY, **kwargs})


def with_noise(G: StyleGAN2Generator) -> StyleGAN2Generator:
    """G whose noise inputs have a visible strength (they start at zero)."""
    with torch.no_grad():
        for name, p in G.named_parameters():
            if name.endswith("noise_strength"):
                p.fill_(0.5)
    return G


@pytest.mark.parametrize("resolution", [8, 16, 32, 64])
@pytest.mark.parametrize("n_classes", [0, 10])
def test_shapes_for_each_resolution(resolution, n_classes):
    G = generator(resolution, n_classes=n_classes)
    D = StyleGAN2Discriminator(resolution, 3, n_classes, mbstd_group=2, mapping_layers=2, **TINY)
    labels = torch.arange(4) % 10 if n_classes else None
    images = G(torch.randn(4, Z_DIM), labels)
    assert images.shape == (4, 3, resolution, resolution)
    assert G.num_ws == 2 * int(math.log2(resolution)) - 2  # two per resolution, the 4x4 one less
    assert D(images, labels).shape == (4, 1)


def test_resolutions_outside_8_to_1024_are_refused_naming_the_key():
    for resolution in (4, 12, 2048):
        with pytest.raises(ConfigError, match="data.resolution"):
            StyleGAN2Generator(resolution, Z_DIM)
        with pytest.raises(ConfigError, match="data.resolution"):
            StyleGAN2Discriminator(resolution)


def test_the_conditional_outputs_depend_on_the_label():
    G = generator(n_classes=10).eval()
    D = StyleGAN2Discriminator(16, 3, 10, mbstd_group=2, mapping_layers=2, **TINY)
    z = torch.randn(2, Z_DIM).repeat(2, 1)
    labels = torch.tensor([0, 0, 3, 3])
    images = G(z, labels)
    assert not torch.allclose(images[:2], images[2:])
    logits = D(images[:2].repeat(2, 1, 1, 1), labels)
    assert not torch.allclose(logits[:2], logits[2:])


def test_demodulation_gives_unit_variance_outputs_whatever_the_style():
    torch.manual_seed(0)
    x = torch.randn(8, 64, 16, 16)
    w = torch.randn(8, 32)
    for demodulate in (True, False):
        conv = ModulatedConv2d(64, 32, 3, 32, demodulate=demodulate)
        with torch.no_grad():
            conv.affine.bias.fill_(5.0)  # styles near 5: a plain modulated conv's output grows 5x
            out = conv(x, w)
        std = out[:, :, 1:-1, 1:-1].std(dim=(0, 2, 3))  # inside the zero padding
        if demodulate:
            assert torch.allclose(std, torch.ones_like(std), atol=0.1), std
        else:
            assert std.mean() > 3


def test_equalised_learning_rate_scales_weights_and_their_gradients_at_run_time():
    torch.manual_seed(0)
    layer = EqualLinear(400, 8, bias_init=1, lr_mul=0.01)
    # Stored at scale 1 / lr_mul, used at lr_mul / sqrt(fan_in): the used weight has the He-init scale.
    used = layer.weight * layer.weight_gain
    assert abs(layer.weight.std().item() * 0.01 - 1) < 0.05
    assert abs(used.std().item() * math.sqrt(400) - 1) < 0.05
    x = torch.randn(5, 400)
    assert torch.allclose(layer(x), F.linear(x, used, layer.bias * 0.01))
    assert torch.allclose(layer.bias * 0.01, torch.ones(8))
    layer(x).sum().backward()
    plain = used.detach().requires_grad_()
    F.linear(x, plain).sum().backward()
    assert torch.allclose(layer.weight.grad, plain.grad * 0.01 / math.sqrt(400))  # the learning rate, scaled


def test_truncation_psi_0_gives_w_avg_and_psi_1_the_identity():
    G = generator()
    G(torch.randn(4, Z_DIM))  # a training forward tracks w_avg
    assert G.w_avg.abs().sum() > 0
    w = G.mapping(torch.randn(6, Z_DIM))
    assert torch.equal(G.truncate(w, 1.0), w)
    assert torch.allclose(G.truncate(w, 0.0), G.w_avg.expand(6, -1))
    assert torch.allclose(G.truncate(w, 0.5), (w + G.w_avg) / 2)
    G.eval()
    images = G(torch.randn(6, Z_DIM), psi=0.0)  # every sample the average one (noise strengths start at 0)
    assert torch.allclose(images, images[:1].expand_as(images), atol=1e-6)
    assert not torch.allclose(G(torch.randn(6, Z_DIM))[0], images[0])


def test_w_avg_is_the_same_whatever_batch_g_saw():
    G = generator()
    G(torch.randn(4, Z_DIM))
    first = G.w_avg.clone()
    G(torch.randn(8, Z_DIM))
    assert torch.equal(G.w_avg, first)  # a function of the weights, not of the batch a rank happened to get


def test_style_mixing_with_probability_0_equals_no_mixing():
    z = torch.randn(8, Z_DIM)
    unmixed = generator(style_mixing=0.0).train()(z)
    assert torch.equal(unmixed, generator(style_mixing=0.0).eval()(z))
    assert torch.equal(generator(style_mixing=0.9).eval()(z), unmixed)  # mixing is for training only
    mixed = generator(style_mixing=1.0).train()(z)
    assert not torch.allclose(mixed, unmixed)


def test_tanh_output_squashes_the_linear_output_everywhere_g_draws():
    z = torch.randn(8, Z_DIM)
    linear, squashed = generator().eval(), generator(output="tanh").eval()
    assert torch.allclose(squashed(z), torch.tanh(linear(z)))
    ws = linear.mapping(z)[:, None].expand(-1, linear.num_ws, -1)  # sampling's style-mixing grid draws this way
    seeds = randomness.sample_seeds(z)
    assert torch.allclose(squashed.synthesize(ws, seeds), torch.tanh(linear.synthesize(ws, seeds)))
    cfg = config.build({"model": {"kind": "stylegan2", "g_output": "tanh", "channel_base": 128, "channel_max": 16},
                        "data": {"resolution": 8}})
    assert build_networks(cfg)[0].output == "tanh"


class DrawingImages(torch.utils.data.Dataset):
    """Images `blank` of whose pixels are exactly -1, each item drawing from torch's, numpy's and python's RNG."""

    def __init__(self, blank: float):
        self.image = torch.where(torch.arange(64).reshape(1, 8, 8) < blank * 64, -1.0, 0.5)

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i):
        import random

        import numpy as np
        torch.rand(1), np.random.rand(), random.random()
        return (self.image,)


@pytest.mark.parametrize("blank, output, warned", [(0.875, "linear", True), (0.875, "tanh", False),
                                                    (0.3, "linear", False)])
def test_a_linear_output_on_mostly_blank_images_is_warned_leaving_every_rng_as_it_was(blank, output, warned):
    import random

    import numpy as np

    from ganscale.models import output_warning

    cfg = config.build({"model": {"kind": "stylegan2", "g_output": output}})
    before = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    warning = output_warning(cfg, DrawingImages(blank))
    assert (warning is not None) == warned
    if warned:
        assert warning.startswith("88% of the data's pixels are exactly -1") and "model.g_output=tanh" in warning
    assert torch.equal(torch.get_rng_state(), before[0]) and (np.random.get_state()[1] == before[1]).all()
    assert random.getstate() == before[2]


def test_training_a_linear_output_stylegan2_on_mnist_warns_once(tmp_path):
    from ganscale.cli import main

    args = ["train", "digits-stylegan2", "--run-dir", str(tmp_path / "run"), "--set", "data.kind=mnist",
            "--set", "data.max_images=64", "--set", "train.steps=1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.output.count("ganscale: warning: ") == 1 and "Fix: set model.g_output=tanh" in result.output
    tanh = CliRunner().invoke(main, [*args, "--set", "model.g_output=tanh", "--run-dir", str(tmp_path / "tanh")])
    assert tanh.exit_code == 0 and "warning" not in tanh.output


@pytest.mark.parametrize("style_mixing", [0.0, 0.5])
def test_noise_and_mixing_depend_on_the_sample_not_the_batch_split(style_mixing):
    G = with_noise(generator(style_mixing=style_mixing)).train()
    z = torch.randn(8, Z_DIM)
    with randomness.seeds_from(z):
        whole = G(z)
    parts = []
    for rows in (slice(0, 3), slice(3, 8)):  # any split: per-sample randomness needs no alignment
        with randomness.seeds_from(z[rows]):
            parts.append(G(z[rows]))
    assert torch.allclose(whole, torch.cat(parts), atol=1e-5)  # the grouped convolution rounds by batch
    assert torch.equal(G(z), whole)  # the same draws again: no RNG stream consumed
    quiet = generator(style_mixing=style_mixing).train()(z)
    assert not torch.allclose(whole, quiet)  # the noise is there


def test_minibatch_std_over_groups_equals_on_group_aligned_halves():
    torch.manual_seed(0)
    x = torch.randn(8, 5, 4, 4)
    mbstd = MinibatchStd(4)
    whole = mbstd(x)
    assert whole.shape == (8, 6, 4, 4)
    assert torch.allclose(whole, torch.cat([mbstd(x[:4]), mbstd(x[4:])]))
    assert not torch.allclose(whole, torch.cat([mbstd(x[:2]), mbstd(x[2:6]), mbstd(x[6:])]))  # other groups
    expected = x[:4].std(dim=0, unbiased=False).mean()
    assert torch.allclose(whole[0, 5, 0, 0], expected, atol=1e-4)
    with pytest.raises(ValueError, match="groups of 4"):
        mbstd(x[:6])


def test_digits_recipe_networks_and_their_parameter_counts():
    G, D = build_networks(config.load("digits-stylegan2"))
    assert G(torch.randn(4, 32)).shape == (4, 1, 16, 16)
    assert (count(G), count(D)) == (44_792, 53_009)  # as the README states
    G, D = build_networks(config.load("digits-stylegan2", ["model.conditional=true", "data.labels=true"]))
    assert (G.n_classes, D.cmap_dim) == (10, 32)
    with torch.device("meta"):  # the full-size defaults at 1024 px, without their memory
        assert (count(StyleGAN2Generator(1024, 512)), count(StyleGAN2Discriminator(1024))) == (30_370_060, 29_012_513)


@pytest.mark.parametrize("recipe, overrides, key", [
    ("digits-stylegan2", ["model.mbstd_group=3"], "model.mbstd_group"),  # 32 samples on one rank: not groups of 3
    ("digits-stylegan2", ["data.resolution=12"], "data.resolution"),
    ("digits-stylegan2", ["model.conditional=true"], "data.labels"),     # a conditional G needs labelled data
    ("digits", ["model.conditional=true"], "model.conditional"),          # DCGAN has no conditional switch
    ("digits-stylegan2", ["model.kind=dcgan", "loss.pl_weight=0"], "model.mapping_layers"),  # StyleGAN2's, unread
])
def test_preflight_refuses_through_the_cli_naming_the_key(tmp_path, recipe, overrides, key):
    from ganscale.cli import main

    run_dir = tmp_path / "run"
    args = ["train", recipe, "--run-dir", str(run_dir)]
    for override in overrides:
        args += ["--set", override]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert key in result.output and "Traceback" not in result.output
    assert not run_dir.exists()


@pytest.mark.slow
def test_the_digits_recipe_on_two_ranks_equals_one_process(tmp_path):
    """Noise inputs, style mixing and minibatch std (groups of 4 in micro-batches of 16 and 32), the
    non-saturating loss, R1 and path length regularisation in their own phases (step 0 runs all four, steps 1 and
    2 the main ones): 3 steps on 2 ranks compute what 1 process does."""
    steps = {"train.steps": 3, "checkpoint.every": 0, "log.every": 100, "log.sample_every": 0,
             "log.tensorboard": "false"}
    one = run_ranks(train_and_collect, 1, steps, str(tmp_path / "one"), record_steps, None, "digits-stylegan2")[0]
    two = run_ranks(train_and_collect, 2, steps, str(tmp_path / "two"), record_steps, None, "digits-stylegan2")
    assert one["summary"]["steps"] == 3 and [s["net"] for s in one["extra"]] == ["D", "D", "G", "G", "D", "G", "D", "G"]
    for first, other in zip(one["extra"][:3:2], two[0]["extra"][:3:2]):  # D's and G's first step: identical weights
        assert (first["grad"] - other["grad"]).abs().max() <= 1e-5 * first["grad"].abs().max(), first["net"]
    for step, other in zip(one["extra"], two[0]["extra"]):
        assert abs(step["loss"] - other["loss"]) <= 1e-5 * abs(step["loss"]), step["net"]
    # Then what the networks compute, not each parameter (whose near-zero gradients Adam scales up: dist_helpers).
    gen = torch.Generator().manual_seed(1)
    inputs = {"G": (torch.randn(16, 32, generator=gen),), "D": (torch.rand(16, 1, 16, 16, generator=gen) * 2 - 1,)}
    assert_same_functions(steps, one, two, inputs, "digits-stylegan2")
    for rank in two:
        assert torch.allclose(one["G"]["w_avg"], rank["G"]["w_avg"], atol=1e-5)
