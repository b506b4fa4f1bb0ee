"""Parallel strategies: functions that take a single-device network and return it wrapped.

The training loop sees only `Wrapped`: call it, switch gradient sync off for all but the last
micro-step (and spectral norm's power iteration for all but the first), freeze or unfreeze it, take its
gradient norm, build its optimizer, and move full (unsharded) model and optimizer state in and out for
checkpoints. It never asks which strategy it has.

Strategies (per network, `parallel.generator` / `parallel.discriminator`):
  ddp    full replica per rank, gradients all-reduced (DistributedDataParallel).
  zero1  ddp + optimizer state sharded over ranks (ZeroRedundancyOptimizer, ZeRO stage 1).
  zero2  gradients and optimizer state sharded, parameters kept whole between forward and backward
         (FSDP2 `fully_shard`, reshard_after_forward=False).
  fsdp   parameters, gradients and optimizer state sharded (FSDP2, ZeRO stage 3).
  hsdp   fsdp within each shard group, replicated across groups (FSDP2 on a 2-D device mesh: the
         all-gathers stay inside a group, e.g. a node; gradients are reduce-scattered within the group
         and all-reduced across groups).
With `parallel.cpu_offload`, FSDP2 networks keep their shards and optimizer state in host memory.

Checkpoint state is always the full, unsharded form with optimizer state keyed by parameter name,
so a checkpoint written under one strategy or world size loads under another.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils.spectral_norm import SpectralNorm

from ganscale.config import ParallelConfig
from ganscale.models.spectral import power_iteration_paused, spectral_norms
from ganscale.parallel.syncbn import average_batchnorm_stats, convert_batchnorm
from ganscale.runtime import Runtime
from ganscale.versions import ddp_no_buffer_sync

# torch's sharding stack (DTensor, FSDP2, ZeRO, the distributed state-dict API) takes ~1 s of CPU to import: each
# is imported where it is used, so a command that only checks a config or launches workers starts without it.
if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    from torch.distributed.fsdp import OffloadPolicy



@dataclass(frozen=True)
class Capabilities:
    """What a strategy can take: preflight asks this instead of listing strategy names."""
    fully_sharded: bool      # FSDP2: parameters are DTensor shards (cpu_offload; no channels-last weights)
    compiles: bool           # torch.compile computes what eager does (no hooks or stages to cross)
    double_backward: bool    # R1 / the gradient penalty through it, as D
    sharded_checkpoint: bool # torch's distributed state-dict API writes its shards (checkpoint.format=sharded)


CAPABILITIES = {
    "ddp": Capabilities(fully_sharded=False, compiles=True, double_backward=True, sharded_checkpoint=True),
    "zero1": Capabilities(fully_sharded=False, compiles=True, double_backward=True, sharded_checkpoint=False),
    # FSDP2 crashes on, or silently leaves empty, a double backward's D gradients
    "zero2": Capabilities(fully_sharded=True, compiles=False, double_backward=False, sharded_checkpoint=True),
    "fsdp": Capabilities(fully_sharded=True, compiles=False, double_backward=False, sharded_checkpoint=True),
    "hsdp": Capabilities(fully_sharded=True, compiles=False, double_backward=False, sharded_checkpoint=True),
    # the input gradient would have to flow back through every stage twice
    "pipeline": Capabilities(fully_sharded=False, compiles=False, double_backward=False, sharded_checkpoint=False),
}
FULLY_SHARDED = tuple(name for name, can in CAPABILITIES.items() if can.fully_sharded)


def state_dict_options(saving: bool = False) -> StateDictOptions:
    """Full (unsharded) state; `saving`: gathered into rank 0's host memory only."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=saving)


@dataclass
class Layout:
    """How this job's ranks are arranged, and the options every strategy shares.

    Built once per job on every rank; the 2-D mesh is created on first use (creating one makes process
    groups, a collective: every rank asks for it at the same point, when the first hsdp network is wrapped).
    """
    runtime: Runtime
    options: ParallelConfig
    cross_rank_batchnorm: bool = False  # preflight.cross_rank_batchnorm: parallel.sync_bn as it applies to this run

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """[replica groups, ranks per group]; by default a group is a node (torchrun's LOCAL_WORLD_SIZE)."""
        if self.options.mesh is not None:
            return tuple(self.options.mesh)
        group = int(os.environ.get("LOCAL_WORLD_SIZE", self.runtime.world))
        return (self.runtime.world // group, group)

    @cached_property
    def mesh(self) -> DeviceMesh:
        return init_device_mesh(self.runtime.device.type, self.mesh_shape, mesh_dim_names=("replicate", "shard"))

    @cached_property
    def flat_mesh(self) -> DeviceMesh:
        """Every rank in one dimension, on the run's device type, for zero2 and fsdp. Without it FSDP2 picks
        the device type from the torch build (a CUDA build: a 'cuda' mesh, even for a CPU run)."""
        return DeviceMesh.from_group(dist.group.WORLD, self.runtime.device.type)  # no new process group

    def offload(self) -> OffloadPolicy:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        return CPUOffloadPolicy() if self.options.cpu_offload else OffloadPolicy()


def is_sharded(tensor: Tensor) -> bool:
    """Whether `tensor` is a DTensor (an FSDP2 shard). A DTensor exists only once its module is loaded: asking
    about a replica's tensors loads nothing."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's part of a tensor (the tensor itself unless it is sharded)."""
    return tensor.to_local() if is_sharded(tensor) else tensor


class Wrapped:
    """A network as the trainer uses it, whatever the strategy. This base class is a full replica."""

    pipeline = None       # the PipelinedGAN running this network's passes (parallel/pipeline.py), if any
    replica_group = None  # the ranks that hold the same tensors (None: all of them)

    def __init__(self, module: nn.Module, net: nn.Module):
        self.module = module  # the network (sharded in place under FSDP): weights, EMA, saving
        self.net = net        # what forward goes through (may communicate)
        self.forward = net    # the same, or its compiled form (parallel/speed.py)
        # A forward that will give this network no gradient (under no_grad, or while it is frozen) needs
        # nothing of DDP's forward (arming the gradient reduction, bucket bookkeeping: ~60 us a call on a
        # CPU): it runs the replica itself. FSDP2's and SyncBatchNorm's communication live in the module.
        self.forward_without_grad = net.module if isinstance(net, DistributedDataParallel) else net
        self.frozen = False
        # What the optimizer updates and trainable() toggles: a parameter the user froze (requires_grad False
        # when ganscale gets the network) stays frozen, out of DDP, the optimizer and the gradient norm.
        self.trained_names = [name for name, p in module.named_parameters() if p.requires_grad]
        # DDP: values summed over the ranks by the next gradient all-reduce (see GradientCarrier), or None.
        self.carrier = getattr(net, "carrier", None) if isinstance(net, DistributedDataParallel) else None

    def __call__(self, *args, **kwargs) -> Tensor:
        if self.frozen or not torch.is_grad_enabled():
            return self.forward_without_grad(*args, **kwargs)
        return self.forward(*args, **kwargs)

    def begin_iteration(self) -> None:
        """Before a step's first forward; compiled CUDA graphs replace it (parallel/speed.py) to mark the
        iteration, so a replay may reuse the previous step's output memory."""

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Around forward *and* backward of a micro-step: off for every micro-step but the last."""
        if enabled or not isinstance(self.net, DistributedDataParallel):
            return contextlib.nullcontext()
        return self.net.no_sync()

    def power_iteration(self, enabled: bool) -> contextlib.AbstractContextManager:
        """Around a micro-step: spectral norm refines its estimate only where enabled, in a step's first
        micro-step, so that a step refines it once whatever the accumulation (models/spectral.py)."""
        if enabled or not self.spectral_norms:
            return contextlib.nullcontext()
        return power_iteration_paused(self.spectral_norms)

    @cached_property
    def spectral_norms(self) -> list[nn.Module | SpectralNorm]:
        """The network's spectral norms (parametrizations and classic hooks), listed once."""
        return spectral_norms(self.module)

    @cached_property
    def parameters(self) -> list[nn.Parameter]:
        """The network's trained parameters, listed once (walking the module tree costs ~10 us a call). The
        optimizer holds these same tensors, so they live as long as the training does."""
        return self._trained()

    def _trained(self) -> list[nn.Parameter]:
        trained = set(self.trained_names)
        return [p for name, p in self.module.named_parameters() if name in trained]

    def carry_with_gradients(self, values: Tensor) -> None:
        """Collective, inside the next backward that reduces gradients: sum `values` over the ranks in
        the same all-reduce as the gradients (DDP with a carrier). Without a carrier (one process, FSDP,
        pipeline, low-precision gradients) nothing is sent: the caller all-reduces the values itself."""
        if self.carrier is not None:
            self.carrier.outgoing = values

    def carried(self) -> list[float] | None:
        """The sums of the values handed to `carry_with_gradients`, once that backward has run (None if
        nothing was carried)."""
        return None if self.carrier is None else self.carrier.take()

    def trainable(self, flag: bool) -> None:
        """Freeze (False) or unfreeze the trained parameters: D is frozen during the G step so G's loss flows
        through it."""
        if self.frozen == (not flag):
            return  # already so (D's step unfreezes a D that G's step left unfrozen)
        for p in self.parameters:
            p.requires_grad_(flag)
        self.frozen = not flag

    def shard_like(self, module: nn.Module) -> nn.Module:
        """Place another network of the same shape (G_ema) the way this one is placed."""
        return module.to(next(self.module.parameters()).device)

    def held(self, module: nn.Module | None = None) -> list[tuple[str, Tensor]]:
        """Every parameter and buffer this rank holds of the network (or of one placed like it): shards, when sharded."""
        module = module or self.module
        return [*module.named_parameters(), *module.named_buffers()]

    def replicated(self, module: nn.Module | None = None) -> list[tuple[str, Tensor]]:
        """Tensors that must be identical on every rank (for the replica check)."""
        return self.held(module)

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        return optimizer_class(self.parameters, **kwargs)

    def model_state(self, module: nn.Module | None = None, saving: bool = False) -> dict[str, Tensor]:
        """Full state dict of this network (or of one sharded like it). Collective when sharded. `saving`: for
        rank 0 to write, in host memory, and {} on the other ranks: no GPU holds a full copy of a sharded network."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(module or self.module, options=state_dict_options(saving))

    def load_model_state(self, state: dict[str, Tensor], module: nn.Module | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(module or self.module, state, options=state_dict_options())

    def optimizer_state(self, optimizer: torch.optim.Optimizer, saving: bool = False) -> dict:
        """Full optimizer state keyed by parameter name. Collective when sharded. `saving`: as for model_state."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.module, optimizer, options=state_dict_options(saving))

    def sharded_state(self, optimizer: torch.optim.Optimizer, ema: nn.Module | None = None) -> dict:
        """This rank's part of the network's (and its EMA's) weights and optimizer state, as DTensor shards
        (or plain tensors when replicated), for torch.distributed.checkpoint."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state = {"model": get_model_state_dict(self.module), "optim": get_optimizer_state_dict(self.module, optimizer)}
        if ema is not None:
            state["ema"] = get_model_state_dict(ema)
        return state

    def load_sharded_state(self, state: dict, optimizer: torch.optim.Optimizer, ema: nn.Module | None = None) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.module, state["model"])
        set_optimizer_state_dict(self.module, optimizer, state["optim"])
        if ema is not None:
            set_model_state_dict(ema, state["ema"])

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, state, options=state_dict_options())

    def synchronise_batchnorm(self, *modules: nn.Module) -> None:
        """Collective: average BatchNorm running statistics of `modules` over the ranks that hold them."""
        average_batchnorm_stats(*modules)

    def grad_norm(self, max_norm: float) -> Tensor:
        """The gradient norm before clipping; clips to `max_norm` when it is > 0."""
        grads = [p.grad for p in self.parameters if p.grad is not None]
        if not grads:  # nothing to measure or clip (get_total_norm's answer: 0)
            return torch.zeros(())
        # One foreach kernel over every gradient, as clip_grad_norm_ does, without its per-call grouping
        # of tensors by device and dtype (a network's gradients share both here): ~50 us less per call.
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.parameters, max_norm, norm)  # skips missing gradients
        return norm


class ShardedOptimizerState(Wrapped):
    """ZeRO-1: each rank keeps the optimizer state (Adam's moments) of its share of the parameters,
    steps that share, and broadcasts the updated parameters; gradients are still all-reduced by DDP."""

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(self.parameters, optimizer_class=optimizer_class, **kwargs)

    def optimizer_state(self, optimizer: torch.optim.Optimizer, saving: bool = False) -> dict:
        optimizer.consolidate_state_dict(to=0)  # collective: every rank sends its shard to rank 0 (saving or not)
        if dist.get_rank() != 0:
            return {}
        by_index = optimizer.state_dict()  # the trained parameters, numbered in module.parameters() order
        names = self.trained_names
        return {"state": {names[i]: s for i, s in by_index["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in by_index["param_groups"]]}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        index = {name: i for i, name in enumerate(self.trained_names)}
        optimizer.load_state_dict({
            "state": {index[name]: s for name, s in state["state"].items()},
            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in state["param_groups"]]})


class FullyShardedWrapped(Wrapped):
    """FSDP2: parameters live as DTensor shards; forward all-gathers them, backward reduce-scatters
    gradients, so gradients and optimizer state are sharded too. `reshard_after_forward=False`
    keeps the gathered parameters until backward (ZeRO-2); True frees them (ZeRO-3)."""

    def __init__(self, module: nn.Module, **shard_options):
        super().__init__(module, module)
        self.shard_options = shard_options  # reshard_after_forward, mesh, offload_policy
        from torch.distributed.fsdp import fully_shard

        # FSDP2 warns on every forward of a network whose output is a view (a user's G ending in .view()): an
        # in-place op on it would skip the all-gather. The trainer makes none, and preflight refuses a loss that does.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor",
                                category=UserWarning)
        fully_shard(module, **shard_options)

    def gradient_sync(self, enabled: bool) -> contextlib.AbstractContextManager:
        if enabled:
            return contextlib.nullcontext()
        return _fsdp_no_sync(self.module)

    def shard_like(self, module: nn.Module) -> nn.Module:
        """Sharded on the same mesh as this network. Always resharded after its forward: a module that runs no
        backward (G_ema) would otherwise stay gathered after one under ZeRO-2, its shards no longer like G's."""
        from torch.distributed.fsdp import fully_shard

        module.to(next(self.module.parameters()).device)
        fully_shard(module, **{**self.shard_options, "reshard_after_forward": True})
        return module

    @property
    def parameters(self) -> list[nn.Parameter]:
        """Listed afresh: FSDP2 registers the sharded or the gathered form of each parameter, by state."""
        return self._trained()

    def replicated(self, module: nn.Module | None = None) -> list[tuple[str, Tensor]]:
        return list((module or self.module).named_buffers())  # parameters are sharded by design

    def grad_norm(self, max_norm: float) -> Tensor:
        params = [p for p in self.parameters if p.grad is not None]
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)  # the global norm over all shards
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        return norm.full_tensor() if is_sharded(norm) else norm


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module):
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its shard, for a sharded optimizer)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard in .optim
    return sum(local(t).numel() * t.element_size() for state in inner.state.values() for t in state.values()
               if isinstance(t, Tensor))


def parameter_bytes(module: nn.Module) -> int:
    """Bytes of parameters this rank holds between steps (its shard, when sharded)."""
    return sum(local(p).numel() * p.element_size() for p in module.parameters())


def held_bytes(wrapped: Wrapped, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds for one network: parameters, gradients (allocated during a step), optimizer state."""
    grads = sum(local(p).numel() * p.element_size() for p in wrapped.parameters)
    return {"params": parameter_bytes(wrapped.module), "grads": grads, "optim": optimizer_state_bytes(optimizer)}


def parallelize(module: nn.Module, strategy: str, layout: Layout) -> Wrapped:
    """Apply a network's strategy (see the module docstring); one process gets the plain network, unless
    it offloads to host memory (ZeRO-offload on one GPU: FSDP2 over a group of one)."""
    runtime = layout.runtime
    module.to(runtime.device)
    offloaded = layout.options.cpu_offload and strategy in FULLY_SHARDED
    if runtime.world == 1 and not offloaded:
        return Wrapped(module, module)
    if layout.cross_rank_batchnorm:
        module = convert_batchnorm(module, use_cuda=runtime.device.type == "cuda")
    if strategy in FULLY_SHARDED:
        return FullyShardedWrapped(module, reshard_after_forward=strategy != "zero2",
                                   mesh=layout.mesh if strategy == "hsdp" else layout.flat_mesh,
                                   offload_policy=layout.offload())
    net = data_parallel(module, runtime)
    return ShardedOptimizerState(module, net) if strategy == "zero1" else Wrapped(module, net)


def data_parallel(module: nn.Module, runtime: Runtime) -> DistributedDataParallel:
    """DDP: a full replica per rank, gradients averaged by all-reduce overlapped with backward.

    Buffers are not broadcast before each forward (that overwrote the second D forward's inputs with
    BatchNorm before torch 2.12, and it is a collective a rank-0-only forward would hang on); with
    `sync_bn` off the trainer averages BatchNorm statistics explicitly before evaluating or saving.
    The gradient all-reduce also carries the step's agreement values (GradientCarrier), where the
    gradients are fp32 or fp64: in a bf16 or fp16 bucket the loss sums would be rounded, so a network
    with low-precision parameters keeps DDP's own hook, and the trainer its separate all-reduce.
    """
    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    for param in module.parameters():
        if param.requires_grad and param.dim() > 1 and 1 in param.shape:
            param.register_hook(functools.partial(_in_strides_of, param))
    ddp = DistributedDataParallel(module, device_ids=device_ids, **ddp_no_buffer_sync())
    exact = all(p.dtype in (torch.float32, torch.float64) for p in module.parameters() if p.requires_grad)
    ddp.carrier = GradientCarrier(runtime.world) if exact else None  # decided alike on every rank (same dtypes)
    if ddp.carrier is not None:
        ddp.register_comm_hook(ddp.carrier, GradientCarrier.hook)
    return ddp


def _in_strides_of(param: Tensor, grad: Tensor) -> Tensor:
    """The gradient laid out as its parameter. A parameter with a size-1 dim (StyleGAN2 D's [1, C] output weight)
    gets from a penalty's double backward plus a plain term a gradient whose strides differ there; DDP copies it
    into its bucket all the same, but warns of impaired performance on every such step."""
    if grad.stride() == param.stride():
        return grad
    return grad.new_empty_strided(param.size(), param.stride()).copy_(grad)


class GradientCarrier:
    """DDP communication hook: DDP's gradient all-reduce, which can take a few more numbers along.

    The trainer agrees on every optimizer step's losses and stop flags in an all-reduce. Under DDP that
    would be a second collective per backward, and on a small model each costs as much as the gradients'
    own (waking gloo's threads, and waiting for the slower rank twice). Handed over before the backward,
    the values are appended to the last gradient bucket and summed with it instead: the same numbers,
    one collective. Gradients are averaged exactly as DDP's built-in hook does (divided by the world
    size, then summed); the carried values are summed.
    """

    def __init__(self, world: int):
        self.world = world
        self.outgoing: Tensor | None = None  # to send with the next backward's last bucket
        self.incoming: Tensor | None = None  # their sums, once that bucket is reduced

    @staticmethod
    def hook(carrier, bucket):  # unannotated: DDP compares annotations with its own types, and ours are strings
        return carrier.allreduce(bucket)  # looked up per call: a test may wrap one carrier's method

    def allreduce(self, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        """All-reduce one gradient bucket (and, with the last, the carried values)."""
        grads = bucket.buffer()
        outgoing = self.outgoing if bucket.is_last() else None
        flat = grads.div_(self.world)  # as DDP's own hook: average, then sum
        if outgoing is not None:
            self.outgoing = None
            flat = torch.cat([grads, outgoing.to(grads.dtype)])
        future = dist.all_reduce(flat, async_op=True).get_future()
        if outgoing is None:
            return future.then(lambda done: done.value()[0])

        def split(done: torch.futures.Future) -> Tensor:
            reduced = done.value()[0]
            self.incoming = reduced[grads.numel():]
            return reduced[:grads.numel()]
        return future.then(split)

    def take(self) -> list[float] | None:
        values, self.incoming = self.incoming, None
        return None if values is None else values.tolist()


__all__ = ["Layout", "Wrapped", "ShardedOptimizerState", "FullyShardedWrapped", "parallelize", "data_parallel",
           "optimizer_state_bytes", "parameter_bytes", "held_bytes", "local", "average_batchnorm_stats"]
