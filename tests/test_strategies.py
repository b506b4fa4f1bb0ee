"""Per-network strategies: each trains exactly as one process does, holds less, and checkpoints portably."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_helpers import max_relative_difference, run_ranks, train_and_collect
from test_cli import clean_env
from test_distributed import SMALL_DCGAN, SMALL_MLP, TOLERANCE

pytestmark = pytest.mark.slow

# Four equal hidden layers per network: ZeRO-1 shards whole tensors, so equal ones split evenly.
# Samples every 2 steps: G_ema runs forwards between EMA updates and checkpoints (it must stay sharded like G).
MLP_ADAM = {**SMALL_MLP, "model.g_width": 64, "model.d_width": 64, "model.g_layers": 5, "model.d_layers": 5,
            "log.sample_every": 2}
SHARDING = {"ddp": 1.0, "zero1": 0.55, "zero2": 0.55, "fsdp": 0.55, "hsdp": 0.55}  # max optimizer-state share per rank


def _with_bytes(rank, world, overrides, run_dir):
    from ganscale.parallel import optimizer_state_bytes, parameter_bytes

    def hook(trainer):
        return lambda: {"opt": {"G": optimizer_state_bytes(trainer.opt_g), "D": optimizer_state_bytes(trainer.opt_d)},
                        "params": {"G": parameter_bytes(trainer.G.module), "D": parameter_bytes(trainer.D.module)},
                        "ema_listed_once": trainer.update_ema.fixed}
    return train_and_collect(rank, world, overrides, run_dir, steps_hook=hook)


@pytest.mark.parametrize("generator, discriminator", [
    ("zero1", "ddp"), ("ddp", "zero1"), ("zero2", "ddp"), ("ddp", "zero2"), ("fsdp", "ddp"), ("ddp", "fsdp"),
    ("fsdp", "zero1"), ("fsdp", "fsdp")])
def test_strategy_on_two_ranks_equals_one_process(tmp_path, generator, discriminator):
    one = run_ranks(_with_bytes, 1, MLP_ADAM, str(tmp_path / "one"))[0]
    two = run_ranks(_with_bytes, 2, {**MLP_ADAM, "parallel.generator": generator,
                                    "parallel.discriminator": discriminator}, str(tmp_path / "two"))
    for rank in two:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(one[net], rank[net]) <= TOLERANCE, net
    for net, strategy in (("G", generator), ("D", discriminator)):
        held = [rank["extra"]["opt"][net] for rank in two]
        assert max(held) <= SHARDING[strategy] * one["extra"]["opt"][net], (net, strategy, held)
        params = [rank["extra"]["params"][net] for rank in two]
        assert max(params) <= (0.55 if strategy in ("zero2", "fsdp") else 1.0) * one["extra"]["params"][net]
    # The EMA lists G's tensors once unless G is sharded into DTensors (their local shards are made per call);
    # G_ema equal to one process's (above) holds for both ways.
    assert all(rank["extra"]["ema_listed_once"] == (generator not in ("zero2", "fsdp")) for rank in two)


def test_hsdp_on_a_two_by_two_mesh_equals_one_process(tmp_path):
    """4 ranks: parameters sharded within each pair, the two pairs replicas of each other."""
    one = run_ranks(train_and_collect, 1, MLP_ADAM, str(tmp_path / "one"))[0]
    four = run_ranks(train_and_collect, 4, {**MLP_ADAM, "parallel.generator": "hsdp", "parallel.discriminator": "hsdp",
                                            "parallel.mesh": "[2,2]"}, str(tmp_path / "four"))
    for rank in four:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(one[net], rank[net]) <= TOLERANCE, net
    traffic = four[0]["summary"]["communicated_bytes"]
    assert traffic["d_step"]["all_reduce"] > 1000  # gradients are all-reduced across the two replica groups


PIPELINE = {"parallel.generator": "pipeline", "parallel.discriminator": "pipeline"}
CLIPPED = {**MLP_ADAM, "train.grad_clip": 0.002}  # below the gradient norms: every step is clipped


@pytest.mark.parametrize("overrides", [
    {"parallel.generator": "zero1", "parallel.discriminator": "fsdp", "train.micro_batch": 4},
    {"parallel.generator": "zero2", "parallel.discriminator": "zero2", "train.micro_batch": 4},
    PIPELINE], ids=["zero1-fsdp-accumulated", "zero2-accumulated", "pipeline"])
def test_clipping_and_accumulation_under_sharding_equal_one_process(tmp_path, overrides):
    """The clip uses the global gradient norm over all shards and stages, not one rank's part."""
    one = run_ranks(train_and_collect, 1, CLIPPED, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, {**CLIPPED, **overrides}, str(tmp_path / "two"))
    assert one["summary"]["final"]["grad_norm_d"] > 0.002 and one["summary"]["final"]["grad_norm_g"] > 0.002
    for rank in two:
        assert rank["summary"]["final"]["grad_norm_d"] == pytest.approx(one["summary"]["final"]["grad_norm_d"], rel=1e-4)
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(one[net], rank[net]) <= TOLERANCE, net


@pytest.mark.parametrize("overrides", [
    {"parallel.generator": "zero2", "parallel.discriminator": "fsdp", "train.micro_batch": 2},
    PIPELINE], ids=["fsdp-accumulated", "pipeline"])
def test_spectral_norm_under_accumulation_and_pipeline_micro_batches_equals_one_process(tmp_path, overrides):
    """D's spectral norm refines its estimate once per step whether the step is one micro-step, several under a
    sharded D (ddp: test_distributed), or a pipeline's micro-batches: vectors and weights as one process's."""
    spectral = {**SMALL_MLP, "model.d_spectral_norm": "true"}
    one = run_ranks(train_and_collect, 1, spectral, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, {**spectral, **overrides}, str(tmp_path / "two"))
    for rank in two:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(one[net], rank[net]) <= TOLERANCE, net


def test_bf16_under_fsdp_trains_as_one_process_within_bf16_rounding(tmp_path):
    bf16 = {**MLP_ADAM, "train.precision": "bf16"}
    one = run_ranks(train_and_collect, 1, bf16, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, {**bf16, "parallel.generator": "fsdp", "parallel.discriminator": "fsdp"},
                    str(tmp_path / "two"))
    fp32 = run_ranks(train_and_collect, 1, MLP_ADAM, str(tmp_path / "fp32"))[0]
    for net in ("G", "D"):
        sharded = max_relative_difference(one[net], two[0][net])
        assert sharded <= 1e-2, net
        assert sharded < max_relative_difference(one[net], fp32[net]) / 4, net  # far closer than fp32 is to bf16


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_of_two_stages_trains_as_one_process(tmp_path, schedule):
    """G and D each split over 2 ranks; 4 micro-batches per step run through the schedule."""
    one = run_ranks(train_and_collect, 1, MLP_ADAM, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, {**MLP_ADAM, **PIPELINE, "parallel.schedule": schedule}, str(tmp_path / "two"))
    for rank in two:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(one[net], rank[net]) <= TOLERANCE, net
        assert rank["summary"]["accumulation_steps"] == 1 and rank["summary"]["micro_batch"] == 16
    assert two[0]["summary"]["communicated_bytes"]["g_step"]["send_recv"] > 0  # activations cross the stages


def test_hybrid_data_parallel_over_two_pipelines_trains_as_one_process(tmp_path):
    """4 processes: 2 pipeline replicas (dp) x 2 stages (pp); each replica trains on half of the batch."""
    one = run_ranks(train_and_collect, 1, MLP_ADAM, str(tmp_path / "one"))[0]
    four = run_ranks(train_and_collect, 4, {**MLP_ADAM, **PIPELINE, "parallel.mesh": "[2,2]",
                                            "checkpoint.every": 5}, str(tmp_path / "four"))
    for rank in four:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(one[net], rank[net]) <= TOLERANCE, net
        assert rank["summary"]["micro_batch"] == 8
    assert four[0]["summary"]["communicated_bytes"]["d_step"]["all_reduce"] > 1000  # replicas average gradients


def test_sharded_generator_with_cross_rank_batchnorm_equals_one_process(tmp_path):
    one = run_ranks(train_and_collect, 1, {**SMALL_DCGAN, "train.micro_batch": 16}, str(tmp_path / "one"))[0]
    two = run_ranks(train_and_collect, 2, {**SMALL_DCGAN, "train.micro_batch": 8, "parallel.sync_bn": "true",
                                           "parallel.generator": "fsdp", "parallel.discriminator": "zero2"},
                    str(tmp_path / "two"))
    for net in ("G", "D", "G_ema"):
        assert max_relative_difference(one[net], two[0][net]) <= TOLERANCE, net


def _train_to(rank, world, overrides, run_dir, resume=None):
    return train_and_collect(rank, world, overrides, run_dir, resume=Path(resume) if resume else None)


@pytest.mark.parametrize("first, first_world, second, second_world", [
    ("zero1", 2, "ddp", 1), ("fsdp", 2, "ddp", 1), ("ddp", 1, "fsdp", 2), ("pipeline", 2, "ddp", 1),
    ("ddp", 1, "pipeline", 2)])
def test_checkpoint_written_by_one_strategy_resumes_under_another(tmp_path, first, first_world, second, second_world):
    from ganscale import checkpoint

    both = {"checkpoint.every": 10}
    straight = run_ranks(_train_to, 1, {**MLP_ADAM, "train.steps": 20}, str(tmp_path / "straight"))[0]
    run_ranks(_train_to, first_world, {**MLP_ADAM, **both, "train.steps": 10, "parallel.generator": first,
                                       "parallel.discriminator": first}, str(tmp_path / "run"))
    path = checkpoint.latest(tmp_path / "run")
    resumed = run_ranks(_train_to, second_world, {**MLP_ADAM, **both, "train.steps": 20, "parallel.generator": second,
                                                  "parallel.discriminator": second}, str(tmp_path / "run"), str(path))
    for rank in resumed:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(straight[net], rank[net]) <= TOLERANCE, net


@pytest.mark.parametrize("override", ["loss.r1_gamma=1", "loss.kind=wgan-gp"])
@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_penalty_on_a_sharded_discriminator_is_refused_before_start(tmp_path, strategy, override):
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "--nproc", "2", "--run-dir", str(tmp_path / "r"),
                             "--set", f"parallel.discriminator={strategy}", "--set", override],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "parallel.discriminator" in result.stderr and "zero1" in result.stderr
    assert not (tmp_path / "r").exists()


def test_bytes_held_per_rank_are_reported_once_and_in_metrics(tmp_path):
    import json

    ddp = run_ranks(train_and_collect, 2, {**MLP_ADAM, "log.every": 1}, str(tmp_path / "ddp"))[0]
    fsdp = run_ranks(train_and_collect, 2, {**MLP_ADAM, "log.every": 1, "parallel.generator": "fsdp",
                                            "parallel.discriminator": "fsdp"}, str(tmp_path / "fsdp"))[0]
    for summary in (ddp["summary"], fsdp["summary"]):
        assert len(summary["held_bytes"]) == 2 and set(summary["held_bytes"][0]) == {"G", "D"}
    full, sharded = ddp["summary"]["held_bytes"], fsdp["summary"]["held_bytes"]
    for rank in (0, 1):
        for kind in ("params", "grads", "optim"):
            assert sharded[rank]["G"][kind] <= 0.55 * full[rank]["G"][kind], (rank, kind)
    records = [json.loads(line) for line in (tmp_path / "fsdp" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["held_bytes_g"] == sum(sharded[0]["G"].values()) for r in records)


# ------------------------------------------------------------------------------------ communication
def _shapes(rank, world, overrides, run_dir):
    def hook(trainer):  # full shapes (a DTensor reports its global shape)
        return lambda: {net: [tuple(p.shape) for p in w.module.parameters()] for net, w in (("G", trainer.G), ("D", trainer.D))}
    return train_and_collect(rank, world, overrides, run_dir, steps_hook=hook)


def _analytic_traffic(g: str, d: str, shapes: dict, world: int) -> dict[str, dict[str, int]]:
    """Payload bytes of one iteration from first principles (fp32, W ranks, FSDP pads dim 0 to a multiple of W)."""
    full = {net: 4 * sum(math.prod(s) for s in shapes[net]) for net in shapes}
    padded = {net: 4 * sum(-(-s[0] // world) * world * math.prod(s[1:]) for s in shapes[net]) for net in shapes}

    def stepped(strategy, net, gathered_already=False):  # forward, backward and optimizer step
        return {"ddp": {"all_reduce": full[net]},
                "zero1": {"all_reduce": full[net], "broadcast": full[net]},  # each rank broadcasts its updated shard
                "zero2": {"all_gather": 0 if gathered_already else padded[net], "reduce_scatter": padded[net]},
                "fsdp": {"all_gather": 2 * padded[net], "reduce_scatter": padded[net]}}[strategy]

    def forward_only(strategy, net):  # G's forward for D's fakes (no grad); zero2 keeps it gathered for the G step
        return {"all_gather": padded[net]} if strategy in ("zero2", "fsdp") else {}

    def frozen_through(strategy, net):  # D in the G step: forward and backward to its input, no weight gradients
        return {"zero2": {"all_gather": padded[net]}, "fsdp": {"all_gather": 2 * padded[net]}}.get(strategy, {})

    def total(*parts, control):
        out = {"all_reduce": control}  # the one all-reduce per optimizer step: losses, skip and stop flags
        for part in parts:
            for kind, n in part.items():
                out[kind] = out.get(kind, 0) + n
        return out
    def control(strategy):
        # The agreement: the loss terms the step has (here no penalty, no reconstruction: one each) and the two
        # stop flags (a signal, rank 0's lost run lock); with DDP they ride on the gradient all-reduce, else an
        # all-reduce of their own adds the gradient norm.
        return 3 * 4 if strategy in ("ddp", "zero1") else 4 * 4
    return {"d_step": total(forward_only(g, "G"), stepped(d, "D"), control=control(d)),
            "g_step": total(stepped(g, "G", gathered_already=g == "zero2"), frozen_through(d, "D"),
                            control=control(g))}


@pytest.mark.parametrize("generator, discriminator", [
    ("ddp", "ddp"), ("zero1", "zero1"), ("zero2", "zero2"), ("fsdp", "fsdp"), ("fsdp", "ddp"), ("ddp", "zero2")])
def test_communicated_bytes_per_step_match_the_analytic_figure(tmp_path, generator, discriminator):
    import json

    rank0 = run_ranks(_shapes, 2, {**MLP_ADAM, "train.steps": 4, "log.every": 1, "parallel.generator": generator,
                                   "parallel.discriminator": discriminator}, str(tmp_path))[0]
    expected = _analytic_traffic(generator, discriminator, rank0["extra"], 2)
    measured = rank0["summary"]["communicated_bytes"]
    for phase in ("d_step", "g_step"):
        kinds = {k for k in (*expected[phase], *measured[phase]) if k != "ops" and (expected[phase].get(k) or measured[phase].get(k))}
        for kind in kinds:
            want, got = expected[phase].get(kind, 0), measured[phase].get(kind, 0)
            assert abs(got - want) <= 0.05 * want, (phase, kind, got, want)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for phase in ("d_step", "g_step"):
        want = sum(expected[phase].values())
        assert abs(records[-1][f"comm_bytes_{phase}"] - want) <= 0.05 * want, phase


@pytest.mark.parametrize("overrides, key", [
    (["parallel.generator=hsdp", "parallel.mesh=[2,2]"], "parallel.mesh"),      # 4 != 2 ranks
    (["parallel.mesh=[1,2]"], "parallel.mesh"),                                  # nobody uses the mesh
    (["parallel.generator=fsdp", "parallel.cpu_offload=true"], "parallel.cpu_offload"),  # CPU run
    (["parallel.cpu_offload=true"], "parallel.cpu_offload"),                     # nothing sharded to offload
    (["parallel.generator=pipeline"], "parallel.discriminator"),                 # G's pipeline runs through D's stages
    (["parallel.generator=pipeline", "parallel.discriminator=pipeline", "loss.r1_gamma=1"], "parallel.discriminator"),
    (["parallel.generator=pipeline", "parallel.discriminator=pipeline", "parallel.sync_bn=true"], "parallel.sync_bn"),
    (["parallel.generator=pipeline", "parallel.discriminator=pipeline", "parallel.pipeline_stages=3"],
     "parallel.pipeline_stages")])                                               # 3 stages on 2 ranks
def test_mesh_and_offload_mistakes_are_refused_before_start(tmp_path, overrides, key):
    args = [a for o in overrides for a in ("--set", o)]
    result = subprocess.run([sys.executable, "-m", "ganscale", "train", "--nproc", "2", "--run-dir", str(tmp_path / "r"), *args],
                            cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert key in result.stderr and "Fix:" in result.stderr
    assert not (tmp_path / "r").exists()


def _saved_states(rank, world, overrides, run_dir):
    def hook(trainer):
        def states():
            saved = {"G": trainer.G.model_state(saving=True), "opt_d": trainer.D.optimizer_state(trainer.opt_d, True)}
            full = {"G": trainer.G.model_state(), "opt_d": trainer.D.optimizer_state(trainer.opt_d)}
            return {"saved": saved, "full": full}
        return states
    return train_and_collect(rank, world, overrides, run_dir, steps_hook=hook)


def _meshes(rank, world, overrides, run_dir):
    def hook(trainer):
        meshes = [wrapped.shard_options["mesh"] for wrapped in (trainer.G, trainer.D)]
        return [(mesh.device_type, mesh.size()) if mesh is not None else None for mesh in meshes]
    return train_and_collect(rank, world, overrides, run_dir, steps_hook=hook)


def test_fsdp2_networks_are_sharded_on_the_run_s_device_type(tmp_path):
    """Without a mesh FSDP2 takes the device type from the torch build: on a CUDA build a CPU run's shards went to
    cuda:LOCAL_RANK (or failed in set_device on a machine without a GPU)."""
    overrides = {**SMALL_MLP, "train.steps": 1, "parallel.generator": "zero2", "parallel.discriminator": "fsdp",
                 "loss.r1_gamma": 0}
    for rank in run_ranks(_meshes, 2, overrides, str(tmp_path)):
        assert rank["extra"] == [("cpu", 2), ("cpu", 2)]


def test_checkpoint_states_are_gathered_into_rank_0_alone():
    """What a full checkpoint holds is gathered into rank 0's host memory only: no rank (no GPU) holds a full copy
    of a sharded network beside its shards while rank 0 writes."""
    import tempfile

    overrides = {**MLP_ADAM, "train.steps": 2, "parallel.generator": "zero2", "parallel.discriminator": "fsdp",
                 "loss.r1_gamma": 0}
    with tempfile.TemporaryDirectory() as run_dir:
        ranks = [r["extra"] for r in run_ranks(_saved_states, 2, overrides, run_dir)]
    assert ranks[1]["saved"]["G"] == {} and not ranks[1]["saved"]["opt_d"].get("state")
    saved, full = ranks[0]["saved"], ranks[0]["full"]
    assert saved["G"].keys() == full["G"].keys()
    assert all(torch.equal(saved["G"][k], full["G"][k]) and saved["G"][k].device.type == "cpu" for k in saved["G"])
    assert saved["opt_d"]["state"].keys() == full["opt_d"]["state"].keys()


# ------------------------------------------------------------------------------------ sharded checkpoints
@pytest.mark.parametrize("first, first_world, second, second_world", [("fsdp", 2, "ddp", 1), ("ddp", 1, "zero2", 2)])
def test_sharded_checkpoint_resumes_under_another_strategy_and_world_size(tmp_path, first, first_world, second,
                                                                         second_world):
    """Every rank writes its own shards (torch.distributed.checkpoint); DCP reshards them on load."""
    from ganscale import checkpoint

    sharded = {"checkpoint.every": 10, "checkpoint.format": "sharded"}
    straight = run_ranks(_train_to, 1, {**MLP_ADAM, "train.steps": 20}, str(tmp_path / "straight"))[0]
    run_ranks(_train_to, first_world, {**MLP_ADAM, **sharded, "train.steps": 10, "parallel.generator": first,
                                       "parallel.discriminator": first}, str(tmp_path / "run"))
    path = checkpoint.latest(tmp_path / "run")
    assert path.name == "step-00000010.dcp" and path.is_dir() and checkpoint.problem(path) is None
    assert len(list(path.glob("*.distcp"))) == first_world  # one shard file per rank
    resumed = run_ranks(_train_to, second_world, {**MLP_ADAM, **sharded, "train.steps": 20, "parallel.generator": second,
                                                  "parallel.discriminator": second}, str(tmp_path / "run"), str(path))
    for rank in resumed:
        for net in ("G", "D", "G_ema"):
            assert max_relative_difference(straight[net], rank[net]) <= TOLERANCE, net
    # One process reads the full networks back (export, sample, eval) whoever wrote which shard.
    full = checkpoint.load(path)
    assert set(full["G"]) == set(straight["G"]) and full["step"] == 10
    # A damaged shard is named, and the checkpoint is passed over.
    shard = sorted(path.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-8])
    assert "truncated" in checkpoint.problem(path) and shard.name in checkpoint.problem(path)


def test_sharded_checkpoints_are_refused_where_the_state_dict_api_does_not_reach(tmp_path):
    from ganscale import config, preflight
    from ganscale.config import ConfigError

    cfg = config.load(None, ["checkpoint.format=sharded", "parallel.generator=zero1"])
    with pytest.raises(ConfigError) as info:
        preflight.check(cfg, 2, False)
    assert info.value.key == "checkpoint.format" and "zero1" in str(info.value)


def test_cpu_offload_runs_host_memory_collectives_on_gloo_beside_nccl():
    """NCCL has no CPU backend; FSDP2's CPU offload all-reduces gradient norms (and fp16's inf checks) of host-memory
    gradients, which failed with 'No backend type associated with device type cpu'."""
    from ganscale.runtime import backend_for

    assert backend_for("auto", use_cuda=True, cpu_collectives=True) == "cpu:gloo,cuda:nccl"
    assert backend_for("nccl", use_cuda=True, cpu_collectives=True) == "cpu:gloo,cuda:nccl"
    assert backend_for("auto", use_cuda=True) == "nccl" and backend_for("auto", use_cuda=False) == "gloo"
    assert backend_for("gloo", use_cuda=True, cpu_collectives=True) == "gloo"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="FSDP2's CPU offload needs a CUDA device")
def test_cpu_offload_keeps_shards_and_optimizer_state_in_host_memory(tmp_path):
    """ZeRO-offload on one GPU: FSDP2 over a group of one (NCCL), parameters and Adam state on the CPU; BatchNorm's
    statistics, which fully_shard leaves on the GPU, beside them (samples and checkpoints check both for NaN)."""
    from ganscale import config, preflight
    from ganscale.runtime import start
    from ganscale.trainer import Trainer

    cfg = config.load(None, [f"{k}={v}" for k, v in {**MLP_ADAM, "train.device": "cuda", "parallel.generator": "fsdp",
                                                       "parallel.cpu_offload": "true", "model.g_batchnorm": "true",
                                                       "checkpoint.every": 2}.items()])
    preflight.check(cfg, 1, True)
    runtime = start("cuda", cpu_collectives=True)  # as launch.run_worker starts it for cpu_offload
    try:
        trainer = Trainer(cfg, runtime, tmp_path)
        summary = trainer.fit()
        assert {p.device.type for p in trainer.G.module.parameters()} == {"cpu"}
        assert {v.device.type for state in trainer.opt_g.state.values() for v in state.values()
                if hasattr(v, "device") and v.dim() > 0} == {"cpu"}
        assert summary["max_memory_allocated"] > 0
    finally:
        runtime.close()


def _r1_backward_under_ddp(rank: int, world: int) -> dict:
    """StyleGAN2 D's R1 backward (double backward plus a plain zero term, as the trainer's) under ganscale's DDP:
    the warnings it raises, and the output weight's gradient and strides."""
    import warnings

    from ganscale.models.stylegan2 import StyleGAN2Discriminator
    from ganscale.parallel import data_parallel
    from ganscale.runtime import Runtime

    torch.manual_seed(0)
    D = StyleGAN2Discriminator(8, 1, channel_base=64, channel_max=8)
    ddp = data_parallel(D, Runtime(rank, world, rank, torch.device("cpu"), owns_group=False))
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    logits = ddp(x)
    (grad,) = torch.autograd.grad(logits.sum(), x, create_graph=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (grad.square().sum() + 0 * logits.sum()).backward()
    return {"warnings": [str(w.message) for w in caught], "grad": D.out.weight.grad.clone(),
            "strides": D.out.weight.grad.stride()}


def test_ddp_takes_a_penalty_s_gradient_of_a_size_1_dim_weight_without_the_strides_warning():
    ranks = run_ranks(_r1_backward_under_ddp, 2)
    for rank in ranks:
        assert not [w for w in rank["warnings"] if "strides" in w], rank["warnings"]
        assert rank["strides"] == (8, 1)
    assert torch.equal(ranks[0]["grad"], ranks[1]["grad"])  # averaged over the ranks as before



def _view_output_warnings(rank, world, overrides, run_dir, recipe):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train_and_collect(rank, world, overrides, run_dir, recipe=recipe)
    return [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


@pytest.mark.slow
@pytest.mark.parametrize("recipe, sets", [
    ("digits", {}), ("digits-biggan", {"model.g_width": 4, "model.d_width": 4}), ("user's", {})])
def test_sharded_networks_train_without_torch_s_view_output_warning(tmp_path, recipe, sets):
    """FSDP2 warns, every forward on every rank, of a sharded module whose output is a view (an in-place op on it
    would skip its all-gather, which the trainer never makes and preflight refuses of a user's loss): DCGAN's D
    returned its 1x1 map flattened, and a user's G ending in .view() drew it too."""
    if recipe == "user's":
        from test_custom import write_user_gan

        recipe = str(write_user_gan(tmp_path / "code", "viewing_user_gan"))  # its G returns .view(-1, 1, 8, 8)
    overrides = {**sets, "parallel.generator": "fsdp", "parallel.discriminator": "fsdp", "train.steps": 1,
                 "train.batch_size": 8, "log.sample_every": 0, "checkpoint.every": 0, "log.tensorboard": "false"}
    assert run_ranks(_view_output_warnings, 2, overrides, str(tmp_path / "run"), recipe) == [[], []]


@pytest.mark.parametrize("steps, start_up", [(2, True), (3, False)])
def test_a_run_of_under_three_steps_says_its_measured_step_carries_one_time_work(tmp_path, steps, start_up):
    """The third step is measured, after the first steps' one-time work; a 2-step run measures its last, which
    printed DDP's start-up broadcast and extra all-reduces as the run's traffic per step without a word."""
    import json

    from dist_helpers import train_in_process
    from ganscale import config

    cfg = config.load(None, [f"{k}={v}" for k, v in {**SMALL_DCGAN, "train.steps": steps}.items()])
    trainer = train_in_process(cfg, tmp_path)
    assert trainer.traffic.start_up is start_up
    assert ("one-time work included" in trainer.traffic.report()) is start_up
    assert json.loads((tmp_path / "summary.json").read_text())["communicated_at_start_up"] is start_up
