"""Pipeline parallelism (parallel/pipeline.py): G and D split into stages over ranks, proven equal to one process.

The reference is one process on the same global batch and noise, in as many micro-steps as a pipeline
replica has micro-batches. Most cases use networks WITHOUT BatchNorm (mlp and dcgan with batchnorm off),
where micro-steps change nothing but rounding. BatchNorm normalises each micro-batch on its own, so the
one case with BatchNorm in G (mlp-bn, one pipeline replica) shows the pipeline equals one process at the
same micro-batch. Spectral norm in D (dcgan) refines its estimate in the first micro-batch of each pass only,
as the trainer does in a step's first micro-step: once per step, whatever the micro-batches.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dist_helpers import max_relative_difference, run_ranks
from ganscale import objectives
from ganscale.models.dcgan import DCGANDiscriminator, DCGANGenerator
from ganscale.models.mlp import MLPDiscriminator, MLPGenerator
from ganscale.models.spectral import power_iteration_paused, spectral_norms
from ganscale.parallel import Wrapped
from ganscale.parallel.traffic import TrafficMeter
from ganscale.parallel.pipeline import PipelinedGAN, balanced_ranges, pipeline_mesh, split

BATCH, Z_DIM, LOSS = 16, 8, "nonsaturating"
ADAM = dict(lr=1e-2, betas=(0.5, 0.999))

# Parameters after Adam steps: micro-batch sums in another order differ by rounding, and Adam's first steps
# scale small gradients up, so a tensor of a few elements can differ by ~1e-5 of its size (seen: 1.1e-5).
TOLERANCE = 3e-5


def _networks(kind: str, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    if kind.startswith("dcgan"):
        return DCGANGenerator(Z_DIM, 1, 8, 4, batchnorm=False), DCGANDiscriminator(1, 8, 4, spectral=True)
    G = MLPGenerator(Z_DIM, 2, 16, 3, batchnorm=kind == "mlp-bn")
    for layer, after in zip(G.net, G.net[1:]):
        if isinstance(after, nn.BatchNorm1d):
            # No bias before BatchNorm (as DCGAN's G): its true gradient is 0, and Adam's first step turns the
            # rounding noise in it into a full-size step whose sign depends on the summation order.
            layer.register_parameter("bias", None)
    return G, MLPDiscriminator(2, 16, 3)


def _batch(kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    shape = (BATCH, 1, 8, 8) if kind.startswith("dcgan") else (BATCH, 2)
    return (torch.randn(shape, generator=gen), torch.randn(BATCH, Z_DIM, generator=gen),
            torch.randn(BATCH, Z_DIM, generator=gen))


def _precision(kind: str):
    """bf16 cases run the passes under CPU autocast (as train.precision=bf16 does)."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind.endswith("bf16"))


def _power_iteration(micro: int, net: nn.Module):
    """Spectral norm's power iteration in a step's first micro-step only (as Wrapped.power_iteration)."""
    return contextlib.nullcontext() if micro == 0 else power_iteration_paused(spectral_norms(net))


def _reference(kind: str, accumulation: int) -> dict:
    """One process, the whole batch in `accumulation` micro-steps (the trainer's D step then G step, each with
    its Adam step); spectral norm refines its estimate in each step's first micro-step, as the trainer's does."""
    G, D = _networks(kind)
    real, z_d, z_g = _batch(kind)
    with torch.no_grad():
        images = G(z_g)  # before any step (BatchNorm: batch statistics of the whole batch)
    G.load_state_dict(_networks(kind)[0].state_dict())  # forget the running statistics of that forward
    opt_g, opt_d = torch.optim.Adam(G.parameters(), **ADAM), torch.optim.Adam(D.parameters(), **ADAM)
    losses = torch.zeros(2)
    for micro, (real_m, z_m) in enumerate(zip(real.chunk(accumulation), z_d.chunk(accumulation))):
        with torch.no_grad(), _precision(kind), _power_iteration(micro, G):
            fake = G(z_m)
        with _precision(kind), _power_iteration(micro, D):
            real_logits, fake_logits = D(torch.cat([real_m, fake.float()])).split(real_m.shape[0])
        loss_d = objectives.d_loss(LOSS, real_logits, fake_logits) / accumulation
        loss_d.backward()
        losses[0] += loss_d.detach()
    grad_norm_d = torch.nn.utils.get_total_norm([p.grad for p in D.parameters()])
    opt_d.step()
    opt_d.zero_grad(set_to_none=True)
    D.requires_grad_(False)
    for micro, z_m in enumerate(z_g.chunk(accumulation)):
        with _precision(kind), _power_iteration(micro, G), _power_iteration(micro, D):
            logits = D(G(z_m))
        loss_g = objectives.g_loss(LOSS, logits) / accumulation
        loss_g.backward()
        losses[1] += loss_g.detach()
    D.requires_grad_(True)
    grad_norm_g = torch.nn.utils.get_total_norm([p.grad for p in G.parameters()])
    opt_g.step()
    # Full states as a ddp run on one rank writes them to a checkpoint.
    return {"G": Wrapped(G, G).model_state(), "D": Wrapped(D, D).model_state(),
            "opt_g": Wrapped(G, G).optimizer_state(opt_g), "opt_d": Wrapped(D, D).optimizer_state(opt_d),
            "losses": losses.tolist(), "grad_norms": [grad_norm_d.item(), grad_norm_g.item()], "images": images}


def _references(cases: list[tuple], world: int) -> dict:
    """One process per case, with as many micro-steps as all pipeline replicas have micro-batches."""
    return {(kind, world // stages * m): _reference(kind, world // stages * m) for kind, stages, _, m in cases}


def _pipelined(rank: int, world: int, cases: list[tuple], references: dict) -> list[dict]:
    """Each case (model kind, stages, schedule, micro-batches): a D pass and a G pass with Adam steps, then the
    full states; and a fresh engine loaded from the one-process reference's checkpoint states."""
    results = []
    for kind, stages, schedule, microbatches in cases:
        G, D = _networks(kind)
        real, z_d, z_g = _batch(kind)
        mesh = pipeline_mesh(world, stages, "cpu")
        gan = PipelinedGAN(G, D, mesh, microbatches=microbatches, schedule=schedule, loss_kind=LOSS,
                           device=torch.device("cpu"))
        share = BATCH // (world // stages)
        mine = slice(gan.dp_rank * share, (gan.dp_rank + 1) * share)  # this pipeline replica's shard of the batch
        opt_g = torch.optim.Adam(gan.parameters_of("G"), **ADAM)
        opt_d = torch.optim.Adam(gan.parameters_of("D"), **ADAM)
        initial = {"G": gan.model_state("G"), "D": gan.model_state("D")}
        ema = gan.split_like("G", _networks(kind)[0].eval())  # G_ema: split like G (eval: running statistics)
        images = gan.generate(z_g)  # forward only, on every rank of the pipeline group (replicas: the same z)
        G.load_state_dict(_networks(kind)[0].state_dict())  # forget the running statistics of that forward
        ema_images = gan.generate(z_g[:5], part=ema)  # a batch the micro-batches do not divide

        with _precision(kind):
            loss_d = gan.discriminator_pass(real[mine], z_d[mine])
        grads = {"G in D pass": [p.grad is not None for p in gan.parameters_of("G")],
                 "D in D pass": [p.grad is not None for p in gan.parameters_of("D")]}
        grad_norms = [gan.grad_norm("D")]
        opt_d.step()
        opt_d.zero_grad(set_to_none=True)
        with _precision(kind):
            loss_g = gan.generator_pass(z_g[mine])
        grads.update({"D in G pass": [p.grad is not None for p in gan.parameters_of("D")],
                      "G in G pass": [p.grad is not None for p in gan.parameters_of("G")]})
        grad_norms.append(gan.grad_norm("G"))
        opt_g.step()
        running = {k: v.clone() for k, v in gan.parts["G"].state_dict().items() if "running" in k}
        gan.average_batchnorm_stats(gan.parts["G"])  # replicas saw different micro-batches
        losses = torch.stack([loss_d, loss_g])
        dist.all_reduce(losses)  # every rank of a replica holds its replica's loss: the world mean is the batch mean

        # A checkpoint of a one-process (ddp) run loads into a differently initialised pipelined run.
        other = PipelinedGAN(*_networks(kind, seed=5), mesh, microbatches=microbatches, schedule=schedule,
                             loss_kind=LOSS, device=torch.device("cpu"))
        ref = references[(kind, world // stages * microbatches)]
        other_opt_g = torch.optim.Adam(other.parameters_of("G"), **ADAM)
        other.load_model_state("G", ref["G"])
        other.load_model_state("D", ref["D"])
        other.load_optimizer_state("G", other_opt_g, ref["opt_g"])
        results.append({"G": gan.model_state("G"), "D": gan.model_state("D"), "losses": (losses / world).tolist(),
                        "opt_g": gan.optimizer_state("G", opt_g), "opt_d": gan.optimizer_state("D", opt_d),
                        "initial": initial, "grads": grads, "running": running, "grad_norms": torch.stack(grad_norms).tolist(),
                        "images": images, "ema_images": ema_images, "ema_state": gan.model_state(ema),
                        "loaded": {"G": other.model_state("G"), "D": other.model_state("D"),
                                   "opt_g": other.optimizer_state("G", other_opt_g)}})
        # Bytes communicated by a second pass of each kind (the first one also warms up the stages' links).
        meter = TrafficMeter()
        meter.enabled = True
        with meter.measure("d_step"), _precision(kind):
            gan.discriminator_pass(real[mine], z_d[mine])
        with meter.measure("g_step"), _precision(kind):
            gan.generator_pass(z_g[mine])
        results[-1]["traffic"] = {phase: ({k: v for k, v in meter.by_phase[phase].items() if k != "ops"},
                                          gan.expected_bytes(phase, share, tuple(real.shape[1:])))
                                  for phase in ("d_step", "g_step")}
    return results


def _flat_optimizer_state(state: dict) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name, per in state["state"].items() for key, value in per.items()}


def _check(cases: list[tuple], ranks: list[list[dict]], references: dict) -> None:
    for case, *per_rank in zip(cases, *ranks):
        kind, stages, _, microbatches = case
        ref = references[(kind, len(per_rank) // stages * microbatches)]
        G, D = _networks(kind)
        # BatchNorm's batch statistics are summed in another order per micro-batch, and Adam scales that rounding
        # (4e-5 seen at another thread count): a looser bound for the case with BatchNorm.
        tolerance = 1e-4 if kind == "mlp-bn" else TOLERANCE
        # Replicas average BatchNorm's running averages; one process updates them in sequence (checked below).
        running = [k for k in ref["G"] if "running" in k] if len(per_rank) > stages else []
        for result in per_rank:
            # Full state dicts: the unsplit module's names, order and tensors.
            assert list(result["initial"]["G"]) == list(G.state_dict())
            assert all(torch.equal(result["initial"]["G"][k], v) for k, v in G.state_dict().items())
            assert all(torch.equal(result["initial"]["D"][k], v) for k, v in D.state_dict().items())
            assert all(torch.equal(result["ema_state"][k], v) for k, v in G.state_dict().items())
            # Sampling through G's stages (G_ema in eval mode: running statistics, like the unsplit eval forward).
            with torch.no_grad():
                assert torch.allclose(result["ema_images"], G.eval()(_batch(kind)[2][:5]), rtol=1e-5, atol=1e-6)
            if kind != "mlp-bn":  # BatchNorm: one micro-batch has the whole batch's statistics
                assert torch.allclose(result["images"], ref["images"], rtol=1e-5, atol=1e-6)
            # The same training as one process.
            assert max_relative_difference({k: v for k, v in ref["G"].items() if k not in running},
                                           {k: v for k, v in result["G"].items() if k not in running}) < tolerance, case
            assert max_relative_difference(ref["D"], result["D"]) < tolerance, case
            assert result["losses"] == pytest.approx(ref["losses"], rel=1e-5), case
            assert result["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5), case
            # Each pass fills its own network's gradients only.
            assert all(result["grads"]["D in D pass"]) and all(result["grads"]["G in G pass"])
            assert not any(result["grads"]["G in D pass"]) and not any(result["grads"]["D in G pass"])
            # Optimizer state in the format a ddp checkpoint has (names, groups, values).
            for opt in ("opt_g", "opt_d"):
                assert result[opt]["param_groups"] == ref[opt]["param_groups"]
                assert max_relative_difference(_flat_optimizer_state(ref[opt]), _flat_optimizer_state(result[opt])) < tolerance
            # The ddp checkpoint loaded into a pipelined run comes back bit for bit.
            for net in ("G", "D"):
                assert all(torch.equal(result["loaded"][net][k], v) for k, v in ref[net].items())
            assert result["loaded"]["opt_g"]["param_groups"] == ref["opt_g"]["param_groups"]
            assert all(torch.equal(a, b) for a, b in zip(_flat_optimizer_state(ref["opt_g"]).values(),
                                                          _flat_optimizer_state(result["loaded"]["opt_g"]).values()))
        # Pipeline replicas average their running statistics: each stage's mean over the replicas.
        for rank, result in enumerate(per_rank):
            same_stage = per_rank[rank % stages::stages]
            for k, v in result["running"].items():
                assert torch.allclose(result["G"][k], sum(r["running"][k] for r in same_stage) / len(same_stage))
        # Communication: what the analytic figure says, kind by kind, on every rank.
        for result in per_rank:
            for phase, (measured, expected) in result["traffic"].items():
                assert measured == {kind: n for kind, n in expected.items() if n}, (case, phase)
        # ... and the pipelined checkpoint loads into an unsplit network and its Adam (ddp on one rank).
        G_loaded, D_loaded = _networks(kind)
        opt = torch.optim.Adam(G_loaded.parameters(), **ADAM)
        Wrapped(G_loaded, G_loaded).load_model_state(per_rank[0]["G"])
        Wrapped(G_loaded, G_loaded).load_optimizer_state(opt, per_rank[0]["opt_g"])
        assert max_relative_difference({k: v for k, v in ref["G"].items() if k not in running},
                                       {k: v for k, v in G_loaded.state_dict().items() if k not in running}) < tolerance
        assert max_relative_difference(_flat_optimizer_state(ref["opt_g"]),
                                       _flat_optimizer_state(Wrapped(G_loaded, G_loaded).optimizer_state(opt))) < tolerance


@pytest.mark.slow
def test_two_stages_equal_one_process_and_checkpoints_are_portable():
    """2 ranks = one pipeline of 2 stages: GPipe and 1F1B (mlp), and 1F1B on DCGAN (convolutions, the latent
    reshape before G's first part, the flatten after D's last, spectral norm in D: one power iteration per
    pass, as one process with as many micro-steps). With BatchNorm in G (mlp-bn) the pipeline equals
    one process whose micro-batch is the pipeline's: statistics and running averages are per micro-batch.
    Under bf16 autocast (dcgan-bf16) activations cross stages in float32 and still equal one process."""
    cases = [("mlp", 2, "gpipe", 4), ("mlp", 2, "1f1b", 4), ("dcgan", 2, "1f1b", 2), ("mlp-bn", 2, "gpipe", 2),
             ("dcgan-bf16", 2, "gpipe", 2)]
    _check(cases, run_ranks(_pipelined, 2, cases, _references(cases, 2)), _references(cases, 2))


@pytest.mark.slow
def test_two_replicas_of_two_stages_equal_one_process():
    """4 ranks = dp 2 x pp 2: each replica pipelines half the batch, gradients averaged over the replicas; with
    BatchNorm in G (mlp-bn) the weights equal one process at the same micro-batch, and the replicas' running
    statistics are averaged (one process updates them sequentially: not the same numbers)."""
    cases = [("mlp", 2, "gpipe", 2), ("mlp", 2, "1f1b", 2), ("mlp-bn", 2, "1f1b", 2)]
    _check(cases, run_ranks(_pipelined, 4, cases, _references(cases, 4)), _references(cases, 4))


# ------------------------------------------------------------------------------------------- splitting
def test_stages_are_contiguous_balanced_and_keep_the_unsplit_names():
    G, _ = _networks("mlp")  # [Linear 8x16, Identity, ReLU] x 3 + Linear 16x2
    parts = split(G, 2, "G")
    names = [name for part in parts for name in part.state_dict()]
    assert names == list(G.state_dict())  # every tensor once, under its unsplit name, in order
    sizes = [sum(p.numel() for p in part.parameters()) for part in parts]
    assert sizes == [144 + 272, 272 + 34]  # the most even cut of 144, 272, 272, 34
    z = torch.randn(5, Z_DIM)
    assert torch.equal(parts[1](parts[0](z)), G(z))


def test_parameter_free_layers_stay_with_the_layer_before_them():
    assert balanced_ranges([10, 0, 10, 0, 0, 10], 3) == [range(0, 2), range(2, 5), range(5, 6)]
    assert balanced_ranges([0, 5, 0, 5, 90], 2) == [range(0, 4), range(4, 5)]


def test_dcgan_parts_do_the_reshapes_of_the_unsplit_forward():
    G, D = DCGANGenerator(Z_DIM, 1, 16, 4), DCGANDiscriminator(1, 16, 4)  # 3 convolutions each
    z = torch.randn(3, Z_DIM)
    g_parts, d_parts = split(G, 3, "G"), split(D, 3, "D")
    x = z
    for part in [*g_parts, *d_parts]:
        x = part(x)
    assert torch.allclose(x, D(G(z)), atol=1e-6)


# ------------------------------------------------------------------------------------------- refusals
def _pipelined_config(world: int, **changes):
    """A valid config with both networks on the pipeline strategy (not selectable from YAML until the trainer
    runs it: the section is built without validation), then `changes` as dotted keys."""
    from ganscale import config

    raw = {"name": "t", "model": {"kind": "mlp", "g_batchnorm": False}, "data": {"kind": "ring8"},
           "train": {"batch_size": 16}}
    for key, value in changes.items():
        section, leaf = key.split(".")
        if section != "parallel":
            raw.setdefault(section, {})[leaf] = value
    cfg = config.build(raw)
    parallel = {**cfg.parallel.model_dump(), "generator": "pipeline", "discriminator": "pipeline",
                **{k.split(".")[1]: v for k, v in changes.items() if k.startswith("parallel.")}}
    cfg.parallel = config.ParallelConfig.model_construct(**parallel)
    return cfg


def test_a_valid_pipelined_config_passes():
    from ganscale import preflight

    preflight.check(_pipelined_config(4, **{"parallel.mesh": (2, 2), "parallel.microbatches": 2}), 4, False)
    preflight.check(_pipelined_config(2, **{"model.kind": "dcgan", "data.kind": "digits", "model.g_batchnorm": True}), 2, False)


@pytest.mark.parametrize("world, changes, key, words", [
    (2, {"parallel.discriminator": "ddp"}, "parallel.discriminator", "one network only"),
    (3, {"train.batch_size": 12}, "parallel.pipeline_stages", "do not divide the world size 3"),
    (4, {"parallel.mesh": (1, 4)}, "parallel.mesh", "[pipeline replicas, pipeline_stages]"),
    (4, {"parallel.microbatches": 3}, "parallel.microbatches", "does not split"),
    (2, {"train.micro_batch": 4}, "train.micro_batch", "replace train.micro_batch"),
    (2, {"loss.r1_gamma": 1.0}, "parallel.discriminator", "double backward"),
    (2, {"loss.kind": "wgan-gp"}, "parallel.discriminator", "double backward"),
    (2, {"parallel.sync_bn": True}, "parallel.sync_bn", "each micro-batch"),
    (2, {"train.precision": "fp16"}, "train.precision", "own gradients"),
    (2, {"model.g_batchnorm": True, "parallel.microbatches": 16}, "parallel.microbatches", "one sample"),
    (5, {"parallel.pipeline_stages": 5, "model.d_layers": 2, "train.batch_size": 20}, "parallel.pipeline_stages",
     "D has 3 layers"),
])
def test_refused_pipeline_combinations_name_the_key(world, changes, key, words):
    from ganscale import config, preflight

    with pytest.raises(config.ConfigError) as refused:
        preflight.check(_pipelined_config(world, **changes), world, False)
    assert refused.value.key == key and words in str(refused.value)


def test_a_model_that_is_not_a_sequence_of_layers_is_refused():
    from ganscale import config

    with pytest.raises(config.ConfigError) as refused:
        split(nn.Linear(2, 2), 2, "D")
    assert refused.value.key == "parallel.discriminator"
