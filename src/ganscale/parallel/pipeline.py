"""Pipeline parallelism for a GAN: G and D each split into consecutive stages over a pipeline group.

Rank r of a pipeline group of P ranks holds part r of G and part r of D (`.net` children in
contiguous chunks, balanced by parameter count). Three pipelines run over those parts
(`torch.distributed.pipelining`):
  G step   [G_0 .. G_{P-1} | D_0 .. D_{P-1}]: 2P stages, two per rank (stage i on rank i mod P: the
           looped placement), D frozen; loss = g_loss(D's logits). Schedule: ScheduleLoopedBFS (gpipe)
           or ScheduleInterleaved1F1B (1f1b), the multi-stage forms of GPipe and 1F1B.
  fakes    [G_0 .. G_{P-1}] forward only, under no_grad (ScheduleGPipe without a loss).
  D step   [D_0 .. D_{P-1}] on micro-batches of [real_m, fake_m], loss = d_loss(real logits, fake logits).
           Schedule: ScheduleGPipe or Schedule1F1B.
Each micro-batch loss is divided by the number of micro-batches before backward, so the gradient
is that of the mean loss over the rank's batch; gradients are *added* to `.grad` (like backward),
nothing else is rescaled.

Hybrid dp x pp: a 2-D mesh ("dp", "pp"). After each pass the replicas average their parts'
gradients with one explicit all-reduce over the dp group (no DDP on the stage modules: the
collective stays visible here and runs once per pass, not per micro-batch).

What is exact and what is not (the promise: same training as one process, or say why not):
- Without BatchNorm the passes equal one process on the same batch up to float rounding.
- BatchNorm normalises each pipeline micro-batch on its own: the same training as one process only
  when that process uses the same micro-batch (`train.micro_batch` = batch / (dp x microbatches)).
  `parallel.sync_bn` is refused (preflight.check).
- No double backward goes through a pipeline: R1 and the gradient penalty are refused for a
  pipelined D (preflight.check).
- Spectral norm refines its estimate (power iteration) in a part's first micro-batch of a pass only: once
  per step, as the trainer's first micro-step does (models/spectral.py). The schedule runs the forwards,
  so a forward hook pauses it after the first.
- Stage shapes are given to the stages up front (static mode): torch's dynamic shape inference would
  run every stage once on uninitialised tensors, which corrupts BatchNorm statistics and spectral-norm
  vectors.
- Activations cross stages in float32 (each part casts its output): under bf16 autocast the receiving
  layer casts back, so the arithmetic is the same; the traffic is twice bf16's.

Checkpoints stay in the full, strategy-independent format: a part registers its layers under the
unsplit module's names (`net.3.weight`), and `model_state` / `optimizer_state` gather every part of
the pipeline group.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleLoopedBFS)

from ganscale import objectives
from ganscale.config import ConfigError, ParallelConfig
from ganscale.models.dcgan import DCGANDiscriminator, DCGANGenerator
from ganscale.models.mlp import MLPDiscriminator, MLPGenerator
from ganscale.models.spectral import power_iteration_in_first_forward
from ganscale.parallel import CAPABILITIES, Wrapped
from ganscale.runtime import Runtime

# schedule name -> (one stage per rank, several stages per rank)
SCHEDULES = {"gpipe": (ScheduleGPipe, ScheduleLoopedBFS), "1f1b": (Schedule1F1B, ScheduleInterleaved1F1B)}


# ------------------------------------------------------------------------------------------- split
class Part(nn.Module):
    """Consecutive layers of a network's `.net`, registered under the unsplit module's names."""

    def __init__(self, layers: dict[int, nn.Module], before: nn.Module | None = None, after: nn.Module | None = None):
        super().__init__()
        self.net = nn.Module()
        for index, layer in layers.items():
            self.net.add_module(str(index), layer)
        self.before, self.after = before, after  # no parameters or buffers: names stay the unsplit ones

    def forward(self, x: Tensor) -> Tensor:
        if self.before is not None:
            x = self.before(x)
        for layer in self.net.children():
            x = layer(x)
        if self.after is not None:
            x = self.after(x)
        return x.float()  # stage boundaries are declared float32 (see the module docstring)


def _ends(module: nn.Module, network: str) -> tuple[nn.Module | None, nn.Module | None]:
    """What the network's forward does around `.net` (as layers), for the first and last part."""
    if isinstance(module, DCGANGenerator):
        return nn.Unflatten(1, (module.z_dim, 1, 1)), None
    if isinstance(module, DCGANDiscriminator):
        return None, nn.Flatten(1)
    if isinstance(module, (MLPGenerator, MLPDiscriminator)):
        return None, None
    key = "parallel.generator" if network == "G" else "parallel.discriminator"
    others = ", ".join(name for name in CAPABILITIES if name != "pipeline")
    raise ConfigError(key, f"{type(module).__name__} is not a sequence of layers the pipeline can split",
                      f"set parallel.generator and parallel.discriminator to another strategy ({others}), or use "
                      "model.kind=mlp or dcgan with the pipeline strategy")


def balanced_ranges(weights: list[int], stages: int) -> list[range]:
    """Split layers into `stages` contiguous ranges minimising the largest parameter count.

    A range starts at a layer with parameters; parameter-free layers (activations) stay with the
    layer before them, so no part is only an activation and an in-place activation never receives
    a stage's input.
    """
    starts = [i for i, w in enumerate(weights) if w > 0]
    starts[0] = 0  # leading parameter-free layers go with the first unit
    units = [sum(weights[a:b]) for a, b in zip(starts, [*starts[1:], len(weights)])]
    n = len(units)
    # best[k][j]: smallest largest-part weight for units[:j] in k parts; cut[k][j]: where the last part starts
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], sum(units[i:j]))
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds, j = [n], n
    for k in range(stages, 0, -1):
        j = cut[k][j]
        bounds.append(j)
    bounds.reverse()  # unit indices [0, ..., n]
    layer_bounds = [starts[u] if u < n else len(weights) for u in bounds]
    return [range(a, b) for a, b in zip(layer_bounds, layer_bounds[1:])]


def split(module: nn.Module, stages: int, network: str) -> list[Part]:
    """Every part of a network (each rank keeps its own); raises ConfigError if it has too few layers."""
    before, after = _ends(module, network)
    layers = list(module.net.children())
    weights = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    with_parameters = sum(w > 0 for w in weights)
    if stages > with_parameters:
        raise ConfigError("parallel.pipeline_stages",
                          f"{network} has {with_parameters} layers with parameters, fewer than {stages} stages",
                          f"use at most {with_parameters} pipeline stages, or a deeper model")
    ranges = balanced_ranges(weights, stages)
    return [Part({i: layers[i] for i in r}, before if k == 0 else None, after if k == stages - 1 else None)
            for k, r in enumerate(ranges)]


def pipeline_mesh(world: int, stages: int, device_type: str, mesh: tuple[int, int] | None = None) -> DeviceMesh:
    """The 2-D mesh (dp, pp): `world / stages` pipeline replicas of `stages` ranks (a replica's ranks are consecutive).

    Creating it makes process groups: a collective every rank calls at the same point.
    """
    if stages < 1 or world % stages:
        raise ConfigError("parallel.pipeline_stages", f"{stages} stages do not divide the world size {world}",
                          f"use a number of stages that divides {world}")
    shape = (world // stages, stages)
    if mesh is not None and tuple(mesh) != shape:
        raise ConfigError("parallel.mesh", f"{list(mesh)} is not [pipeline replicas, pipeline_stages] = {list(shape)}",
                          f"set parallel.mesh=[{shape[0]}, {shape[1]}] or remove it")
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "pp"))


# ------------------------------------------------------------------------------------------- engine
class PipelinedGAN:
    """G and D pipelined over the "pp" dimension of `mesh`, replicated over its "dp" dimension.

    Build on every rank from identically initialised G and D. Inputs are the rank's batch (the same on
    every rank of a pipeline group: the first stage reads it, the others ignore it); the pipeline
    replica's batch is the dp shard of the global batch.

    What a training loop does differently from the other strategies:
    - shard data and noise by `dp_rank` over `replicas` (not by world rank); no gradient accumulation
      around the passes (the micro-batches are the accumulation);
    - optimizers over `parameters_of("G")` / `parameters_of("D")`; G_ema = `split_like("G", ema)`, whose
      `update_ema(ema_part, parts["G"], beta)` needs no communication;
    - BatchNorm statistics with `average_batchnorm_stats` (dp group); replica checks compare a rank with
      the ranks of its dp group only (other stages hold other layers).
    """

    def __init__(self, G: nn.Module, D: nn.Module, mesh: DeviceMesh, *, microbatches: int, schedule: str,
                 loss_kind: str, device: torch.device):
        if schedule not in SCHEDULES:
            raise ConfigError("parallel.schedule", f"unknown schedule {schedule!r}",
                              f"use one of {', '.join(SCHEDULES)}")
        self.mesh, self.device, self.loss_kind = mesh, torch.device(device), loss_kind
        self.pp, self.dp = mesh.get_group("pp"), mesh.get_group("dp")
        self.stages, self.replicas = mesh["pp"].size(), mesh["dp"].size()
        self.stage = mesh.get_local_rank("pp")
        self.microbatches, self.schedule_name = microbatches, schedule
        self.names = {"G": list(G.state_dict()), "D": list(D.state_dict())}  # the unsplit order, for full states
        self.parameter_names = {"G": [n for n, _ in G.named_parameters()], "D": [n for n, _ in D.named_parameters()]}
        self.z_dim = G.z_dim
        self._meta = {"G": [p.to("meta") for p in split(copy.deepcopy(G), self.stages, "G")],
                      "D": [p.to("meta") for p in split(copy.deepcopy(D), self.stages, "D")]}  # for stage shapes
        self.parts = {"G": split(G, self.stages, "G")[self.stage].to(self.device),
                      "D": split(D, self.stages, "D")[self.stage].to(self.device)}
        self._schedules: dict[tuple, object] = {}
        self._losses: list[Tensor] = []  # per micro-batch losses, recorded on the last stage
        self._scale_loss: Callable[[Tensor], Tensor] = lambda loss: loss

    # --------------------------------------------------------------------------- who is where
    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _global(self, stage: int) -> int:
        return dist.get_global_rank(self.pp, stage)

    @property
    def dp_rank(self) -> int:
        """Which shard of the global batch this rank's pipeline replica trains on."""
        return self.mesh.get_local_rank("dp")

    def parameters_of(self, network: str) -> list[nn.Parameter]:
        """This rank's parameters of G or D (for its optimizer)."""
        return list(self.parts[network].parameters())

    def split_like(self, network: str, module: nn.Module) -> Part:
        """This rank's part of a network shaped like G or D (G_ema), split at the same layers."""
        return split(module, self.stages, network)[self.stage].to(self.device)

    # --------------------------------------------------------------------------- stages
    def _stage(self, part: Part, index: int, count: int, shapes: list[torch.Size], backward: bool) -> PipelineStage:
        """A stage with its input and output shapes given (static mode: no shape-inference forward)."""
        first = index == 0
        inputs = torch.empty(shapes[index], device="meta").requires_grad_(backward and not first)
        outputs = torch.empty(shapes[index + 1], device="meta").requires_grad_(backward)
        return PipelineStage(part, index, count, self.device, input_args=inputs, output_args=outputs, group=self.pp)

    def _shapes(self, networks: tuple[str, ...], first_input: torch.Size) -> list[torch.Size]:
        """Activation shapes at every stage boundary of a pipeline through `networks`, per micro-batch."""
        x = torch.empty(first_input, device="meta")
        shapes = [x.shape]
        with torch.no_grad():
            for network in networks:
                for part in self._meta[network]:
                    x = part(x)
                    shapes.append(x.shape)
        return shapes

    def _micro(self, batch: int) -> int:
        if batch % self.microbatches:
            raise ConfigError("parallel.microbatches", f"the rank's batch {batch} does not split into "
                              f"{self.microbatches} micro-batches",
                              "make train.batch_size / pipeline replicas a multiple of parallel.microbatches")
        return batch // self.microbatches

    def _g_step_schedule(self, batch: int):
        key = ("g_step", batch)
        if key not in self._schedules:
            shapes = self._shapes(("G", "D"), torch.Size([self._micro(batch), self.z_dim]))
            count = 2 * self.stages
            stages = [self._stage(self.parts["G"], self.stage, count, shapes, True),
                      self._stage(self.parts["D"], self.stages + self.stage, count, shapes, True)]
            looped = SCHEDULES[self.schedule_name][1]
            self._schedules[key] = looped(stages, self.microbatches, loss_fn=self._g_objective, scale_grads=False)
        return self._schedules[key]

    def _d_step_schedule(self, sample_shape: torch.Size, batch: int):
        key = ("d_step", batch, tuple(sample_shape))
        if key not in self._schedules:
            shapes = self._shapes(("D",), torch.Size([2 * self._micro(batch), *sample_shape]))
            stage = self._stage(self.parts["D"], self.stage, self.stages, shapes, True)
            single = SCHEDULES[self.schedule_name][0]
            self._schedules[key] = single(stage, self.microbatches, loss_fn=self._d_objective, scale_grads=False)
        return self._schedules[key]

    def _forward_schedule(self, part: Part, batch: int):
        key = ("generate", id(part), batch)
        if key not in self._schedules:
            # Any batch (a sample grid): as many of the micro-batches as divide it. The D step's fakes, from the
            # rank's batch, use exactly `microbatches` (BatchNorm in G normalises each micro-batch).
            count = math.gcd(batch, self.microbatches)
            shapes = self._shapes(("G",), torch.Size([batch // count, self.z_dim]))
            stage = self._stage(part, self.stage, self.stages, shapes, False)
            self._schedules[key] = (ScheduleGPipe(stage, count), shapes[-1])
        return self._schedules[key]

    # --------------------------------------------------------------------------- objectives
    def _g_objective(self, logits: Tensor, _unused_target: Tensor) -> Tensor:
        loss = objectives.g_loss(self.loss_kind, logits)
        self._losses.append(loss.detach())
        return self._scale_loss(loss / self.microbatches)  # gradient of the mean over micro-batches

    def _d_objective(self, logits: Tensor, is_real: Tensor) -> Tensor:
        loss = objectives.d_loss(self.loss_kind, logits[is_real], logits[~is_real])
        self._losses.append(loss.detach())
        return self._scale_loss(loss / self.microbatches)

    def _mean_loss(self) -> Tensor:
        """The rank's mean loss, from the last stage to every rank of the pipeline group."""
        loss = torch.stack(self._losses).mean() if self.is_last else torch.zeros((), device=self.device)
        self._losses.clear()
        dist.broadcast(loss, src=self._global(self.stages - 1), group=self.pp)  # collective over the pipeline group
        return loss

    def _average_over_replicas(self, network: str) -> None:
        """Collective over the dp group: every replica's part gets the replicas' mean gradient."""
        if self.replicas == 1:
            return
        grads = [p.grad for p in self.parts[network].parameters() if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.dp)  # one all-reduce of the part's gradients per pass
        flat /= self.replicas
        for grad, averaged in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(averaged)

    # --------------------------------------------------------------------------- passes
    def generator_pass(self, z: Tensor, scale_loss: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """G step: gradients of the mean G loss over `z` (the rank's batch) into G's part; D gets none.

        `scale_loss` wraps each micro-batch's loss before backward (fp16: the GradScaler's `scale`).
        Returns the rank's mean loss on every rank of the pipeline group.
        """
        schedule = self._g_step_schedule(z.shape[0])
        self._scale_loss = scale_loss or (lambda loss: loss)
        self.parts["D"].requires_grad_(False)  # D's weights are not G's to update; G's loss flows through them
        try:
            args = (z.to(self.device),) if self.is_first else ()
            target = torch.zeros(z.shape[0], device=self.device) if self.is_last else None  # unused by the G loss
            # Spectral norm refines its estimate in each part's first micro-batch only (see the module docstring).
            with power_iteration_in_first_forward(self.parts["G"]), power_iteration_in_first_forward(self.parts["D"]):
                schedule.step(*args, target=target, return_outputs=False)  # p2p between neighbouring stages
        finally:
            self.parts["D"].requires_grad_(True)
        loss = self._mean_loss()
        self._average_over_replicas("G")
        return loss

    def discriminator_pass(self, real: Tensor, z: Tensor,
                           scale_loss: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """D step: fakes from G's stages (forward only, no gradient), then D's stages on [real, fake].

        Gradients of the mean D loss over the rank's batch go into D's part; G gets none.
        Returns the rank's mean loss on every rank of the pipeline group.
        """
        batch, sample_shape = real.shape[0], real.shape[1:]
        with power_iteration_in_first_forward(self.parts["G"]):  # in the first micro-batch only, as below
            fake = self.generate(z, broadcast=False)  # on the last stage only
        if self.is_last:
            dist.send(fake.contiguous(), dst=self._global(0), group=self.pp)  # the fakes go to D's first stage
        if self.is_first:
            fake = torch.empty(real.shape, device=self.device)
            dist.recv(fake, src=self._global(self.stages - 1), group=self.pp)
        schedule = self._d_step_schedule(sample_shape, batch)
        self._scale_loss = scale_loss or (lambda loss: loss)
        micro = self._micro(batch)
        # Micro-batch m of the pipeline is [real_m, fake_m]: one D forward per micro-batch, as the trainer does.
        is_real = torch.cat([torch.ones(self.microbatches, micro, dtype=torch.bool),
                             torch.zeros(self.microbatches, micro, dtype=torch.bool)], 1).flatten().to(self.device)
        args = ()
        if self.is_first:
            pairs = torch.cat([real.to(self.device).float().unflatten(0, (self.microbatches, micro)),
                               fake.unflatten(0, (self.microbatches, micro))], 1)
            args = (pairs.flatten(0, 1),)
        with power_iteration_in_first_forward(self.parts["D"]):  # in the first micro-batch only
            schedule.step(*args, target=is_real if self.is_last else None, return_outputs=False)  # p2p between stages
        loss = self._mean_loss()
        self._average_over_replicas("D")
        return loss

    @torch.no_grad()
    def generate(self, z: Tensor, part: Part | None = None, broadcast: bool = True) -> Tensor | None:
        """G(z) (or another part shaped like G's, e.g. G_ema's) through G's stages, forward only.

        With `broadcast` the images reach every rank of the pipeline group (a collective); without it
        only the last stage has them (the others get None).
        """
        part = part if part is not None else self.parts["G"]
        schedule, sample_shape = self._forward_schedule(part, z.shape[0])
        args = (z.to(self.device),) if self.is_first else ()
        images = schedule.step(*args)  # p2p between neighbouring stages
        if not broadcast:
            return images
        images = (images.contiguous() if self.is_last
                  else torch.empty((z.shape[0], *sample_shape[1:]), device=self.device))
        dist.broadcast(images, src=self._global(self.stages - 1), group=self.pp)
        return images

    # --------------------------------------------------------------------------- traffic
    def expected_bytes(self, phase: str, batch: int, sample_shape: tuple[int, ...]) -> dict[str, int]:
        """Payload bytes this rank communicates in one pass, by kind (as `traffic.TrafficMeter` counts them:
        a send and a receive each count their tensor). `phase`: "g_step" or "d_step"; `batch`: the rank's.

        Activations (forward) and their gradients (backward) cross each stage boundary once per micro-batch
        in float32; the D step first runs G's stages forward only and moves the fakes from the last stage to
        the first; the mean loss is broadcast; replicas all-reduce the stepped network's gradients.
        """
        micro, element = self._micro(batch), 4

        def crossings(shapes: list[torch.Size], indices: list[int], backward: bool) -> int:
            last = len(shapes) - 2  # the last stage's index
            count = sum((i > 0) * shapes[i].numel() + (i < last) * shapes[i + 1].numel() for i in indices)
            return count * (2 if backward else 1) * self.microbatches * element

        if phase == "g_step":
            shapes = self._shapes(("G", "D"), torch.Size([micro, self.z_dim]))
            p2p = crossings(shapes, [self.stage, self.stages + self.stage], backward=True)
            network = "G"
        else:
            fakes = self._shapes(("G",), torch.Size([micro, self.z_dim]))
            scores = self._shapes(("D",), torch.Size([2 * micro, *sample_shape]))
            p2p = crossings(fakes, [self.stage], backward=False) + crossings(scores, [self.stage], backward=True)
            p2p += (self.is_first or self.is_last) * batch * math.prod(sample_shape) * element
            network = "D"
        gradients = sum(p.numel() * p.element_size() for p in self.parts[network].parameters())
        return {"send_recv": p2p, "broadcast": element, "all_reduce": gradients if self.replicas > 1 else 0}

    def average_batchnorm_stats(self, *parts: Part) -> None:
        """Collective over the dp group: the pipeline replicas' BatchNorm running statistics averaged.

        Each rank averages its own parts with the ranks holding the same stage (the world-wide
        `parallel.average_batchnorm_stats` would mix different stages' layers). Call before sampling,
        evaluating or saving, as the trainer does for the other strategies.
        """
        stats = [b for part in parts for layer in part.modules() if isinstance(layer, nn.modules.batchnorm._BatchNorm)
                 for b in (layer.running_mean, layer.running_var) if b is not None]
        if self.replicas == 1 or not stats:  # the same on every rank of a dp group: same stage, same layers
            return
        flat = torch.cat([s.reshape(-1).double() for s in stats])
        dist.all_reduce(flat, group=self.dp)
        flat /= self.replicas
        for s, averaged in zip(stats, flat.split([s.numel() for s in stats])):
            s.copy_(averaged.view_as(s))

    # --------------------------------------------------------------------------- norms, states
    def grad_norm(self, network: str, max_norm: float = 0.0) -> Tensor:
        """The norm of the whole network's gradient (all parts); clips to `max_norm` when it is > 0."""
        params = [p for p in self.parts[network].parameters() if p.grad is not None]
        squares = torch.zeros((), device=self.device)
        for p in params:
            squares += p.grad.detach().float().square().sum()
        dist.all_reduce(squares, group=self.pp)  # sum of squares over the pipeline group's parts
        norm = squares.sqrt()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def _part(self, network: str | Part) -> tuple[str, Part]:
        if isinstance(network, Part):  # G_ema's part: G's names
            return "G", network
        return network, self.parts[network]

    def model_state(self, network: str | Part) -> dict[str, Tensor]:
        """The unsplit module's full state dict (CPU tensors) on every rank. Collective over the pipeline group."""
        name, part = self._part(network)
        gathered: list[dict] = [None] * self.stages  # type: ignore[list-item]
        local = {k: v.detach().cpu() for k, v in part.state_dict().items()}
        dist.all_gather_object(gathered, local, group=self.pp)
        merged = {k: v for state in gathered for k, v in state.items()}
        return {k: merged[k] for k in self.names[name]}

    def load_model_state(self, network: str | Part, state: dict[str, Tensor]) -> None:
        """Load this rank's part from a full state dict (no communication)."""
        _, part = self._part(network)
        part.load_state_dict({k: state[k] for k in part.state_dict()}, strict=True)

    def optimizer_state(self, network: str, optimizer: torch.optim.Optimizer) -> dict:
        """Full optimizer state keyed by parameter name (the unsplit names). Collective over the pipeline group."""
        names = [n for n, _ in self.parts[network].named_parameters()]
        by_index = optimizer.state_dict()
        local = {n: {k: v.cpu() if isinstance(v, Tensor) else v for k, v in by_index["state"][i].items()}
                 for i, n in enumerate(names) if i in by_index["state"]}
        gathered: list[dict] = [None] * self.stages  # type: ignore[list-item]
        dist.all_gather_object(gathered, local, group=self.pp)
        state = {k: v for part in gathered for k, v in part.items()}
        order = self.parameter_names[network]
        (group,) = by_index["param_groups"]  # one group per network, as the trainer builds it
        return {"state": {n: state[n] for n in order if n in state},
                "param_groups": [{**group, "params": list(order)}]}

    def load_optimizer_state(self, network: str, optimizer: torch.optim.Optimizer, state: dict) -> None:
        names = [n for n, _ in self.parts[network].named_parameters()]
        (group,) = state["param_groups"]
        optimizer.load_state_dict({
            "state": {i: state["state"][n] for i, n in enumerate(names) if n in state["state"]},
            "param_groups": [{**group, "params": list(range(len(names)))}]})


# ------------------------------------------------------------------------------------------- for the trainer
class PipelinedSampler(nn.Module):
    """G_ema as the trainer uses it: this rank's part of it (EMA updates, checkpoints), and sampling
    through G's stages (a collective over the pipeline group)."""

    def __init__(self, gan: PipelinedGAN, part: Part):
        super().__init__()
        self.part = part
        self._gan = gan  # not a module: its parts are G's and D's, not G_ema's

    def forward(self, z: Tensor) -> Tensor:
        return self._gan.generate(z, part=self.part)


def _part_of(module: nn.Module) -> nn.Module:
    return module.part if isinstance(module, PipelinedSampler) else module


class PipelineStages(Wrapped):
    """One network (G or D) of a PipelinedGAN behind the trainer's `Wrapped` interface. Its passes are
    not forwards: the trainer calls `pipeline.generator_pass` / `discriminator_pass` instead."""

    def __init__(self, gan: PipelinedGAN, network: str):
        super().__init__(gan.parts[network], gan.parts[network])
        self.pipeline, self.network = gan, network
        self.replica_group = gan.dp  # the ranks that hold the same stage

    def __call__(self, *args, **kwargs) -> Tensor:
        raise RuntimeError("a pipelined network runs through PipelinedGAN's passes, not a forward call")

    def shard_like(self, module: nn.Module) -> nn.Module:
        return PipelinedSampler(self.pipeline, self.pipeline.split_like(self.network, module))

    def held(self, module: nn.Module | None = None) -> list[tuple[str, Tensor]]:
        return super().held(_part_of(module or self.module))  # this rank's stage

    def make_optimizer(self, optimizer_class: type[torch.optim.Optimizer], **kwargs) -> torch.optim.Optimizer:
        return optimizer_class(self.pipeline.parameters_of(self.network), **kwargs)

    def model_state(self, module: nn.Module | None = None, saving: bool = False) -> dict[str, Tensor]:
        return self.pipeline.model_state(self.network if module is None else _part_of(module))  # in host memory

    def load_model_state(self, state: dict[str, Tensor], module: nn.Module | None = None) -> None:
        self.pipeline.load_model_state(self.network if module is None else _part_of(module), state)

    def optimizer_state(self, optimizer: torch.optim.Optimizer, saving: bool = False) -> dict:
        return self.pipeline.optimizer_state(self.network, optimizer)  # in host memory

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        self.pipeline.load_optimizer_state(self.network, optimizer, state)

    def synchronise_batchnorm(self, *modules: nn.Module) -> None:
        self.pipeline.average_batchnorm_stats(*(_part_of(m) for m in modules))

    def grad_norm(self, max_norm: float) -> Tensor:
        return self.pipeline.grad_norm(self.network, max_norm)


def pipeline_networks(G: nn.Module, D: nn.Module, runtime: Runtime, options: ParallelConfig,
                      loss_kind: str) -> tuple[PipelineStages, PipelineStages]:
    """G and D split into `options.pipeline_stages` stages over each pipeline group, replicated over the
    groups. Creates the (dp, pp) mesh: a collective every rank calls at the same point."""
    mesh = pipeline_mesh(runtime.world, options.pipeline_stages, runtime.device.type, options.mesh)
    gan = PipelinedGAN(G, D, mesh, microbatches=options.microbatches, schedule=options.schedule,
                       loss_kind=loss_kind, device=runtime.device)
    return PipelineStages(gan, "G"), PipelineStages(gan, "D")
