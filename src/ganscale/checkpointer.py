"""Everything a resume needs, in one place: what a training checkpoint holds (G, D, G_ema, both optimizers, the
scaler, the step counters, the path lengths' running mean, the data position, every rank's RNG streams), when one
is written, and loading it back.
The file format (atomic, completion markers, DCP shards, keep-k) is checkpoint.py's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from ganscale import checkpoint
from ganscale.config import CheckpointConfig, ConfigError, to_yaml
from ganscale.fault import ReplicaDivergence, every_rank_or_none, told_by
from ganscale.models import changed_networks, changed_settings
from ganscale.runtime import seed_rank_streams
from ganscale.seeds import derive_seed

if TYPE_CHECKING:
    from ganscale.trainer import Trainer


class Checkpointer:
    """Saves `training` on its cadence (`checkpoint.every`, and the last step this process trains) and loads it
    at a resume. Every method is a collective: every rank calls it at the same step."""

    def __init__(self, cfg: CheckpointConfig, training: Trainer):
        self.cfg, self.training = cfg, training

    def due(self, step: int, last_step: bool) -> bool:
        """Whether `step` writes a checkpoint: every `checkpoint.every` steps, and the last (the run's, or after
        an agreed stop)."""
        return bool(self.cfg.every and step % self.cfg.every == 0) or last_step

    def save(self, step: int, last_step: bool) -> Path | None:
        """Write `step`'s checkpoint when it is due, after the checks that precede every save (BatchNorm statistics
        made one, nothing non-finite, replicas bitwise identical); older ones are pruned to `checkpoint.keep`.
        The path written (on rank 0, or every rank for a sharded one), else None."""
        if not self.due(step, last_step):
            return None
        training = self.training
        training.ready_for_outputs()
        if self.cfg.check_replicas:
            check_replicas({"G": training.G.replicated(), "D": training.D.replicated(),
                            "G_ema": training.G.replicated(training.G_ema)}, group=training.G.replica_group)
        training.watchdog.mark(f"step {step}: replica check and RNG all-gather for the checkpoint")
        rng_states = checkpoint.gather_rng_states()  # collective
        if self.cfg.format == "sharded":  # every rank writes its own shards: collective
            return checkpoint.save_sharded(self._sharded_state(), self.state_dict(rng_states, {}), training.run_dir,
                                           step, self.cfg.keep)
        networks = {"G": training.G.model_state(saving=True), "D": training.D.model_state(saving=True),
                    "G_ema": training.G.model_state(training.G_ema, saving=True),
                    "opt_g": training.G.optimizer_state(training.opt_g, saving=True),
                    "opt_d": training.D.optimizer_state(training.opt_d, saving=True)}
        path = None
        with training.rank0_writes("checkpoint"):  # collective on leaving: one broadcast
            if training.runtime.is_main:  # the states above: gathered into its host memory
                path = checkpoint.save(self.state_dict(rng_states, networks), training.run_dir, step, self.cfg.keep)
        return path

    def state_dict(self, rng_states: list[dict], networks: dict[str, dict]) -> dict:
        """Everything a resume needs; `networks` holds the full model and optimizer states."""
        training = self.training
        return {"step": training.step, "data_position": training.batches.position,
                "skipped_steps": training.skipped_steps, "consecutive_skips": training.consecutive_skips,
                "pl_mean": training.pl_mean,
                "world_size": training.runtime.world, **networks, "scaler": training.precision.state_dict(),
                "augment": training.augment.state_dict(),
                "rng": rng_states, "config": to_yaml(training.cfg)}

    def _sharded_state(self) -> dict:
        """This rank's shards of G (with G_ema), D and their optimizers, for torch.distributed.checkpoint."""
        training = self.training
        return {"G": training.G.sharded_state(training.opt_g, training.G_ema),
                "D": training.D.sharded_state(training.opt_d)}

    def load(self, path: Path) -> list:
        """Load the training state of checkpoint `path`; returns its per-rank RNG states, restored last
        (`restore_rank_streams`)."""
        training = self.training
        # Checked first (ConfigError naming the file: not intact, not a ganscale checkpoint, a field missing or not as
        # ganscale writes it: `checkpoint._check_contents`). Rank 0
        # verifies its content; the others, reading the same file, check only that they see all of it. A rank that
        # cannot (a run directory on a disk its node does not share) stops every rank, naming itself.
        sharded, verify = checkpoint.is_sharded(path), training.runtime.is_main
        with every_rank_or_none("read the checkpoint", training.watchdog.mark):  # collective on leaving: one all-reduce
            state = (checkpoint.load_meta(path, verify=verify) if sharded else
                     checkpoint.load(path, require=checkpoint.RESUME_KEYS, fix=checkpoint.RESUME_FIX, verify=verify))
        if sharded:  # DCP's load is a collective itself
            self._fit_checkpoint(path, state, sharded)
        else:  # the same config and file on every rank: a misfit is the same error everywhere, agreed and said once
            with every_rank_or_none("fit the checkpoint", training.watchdog.mark):  # collective on leaving: one all-reduce
                self._fit_checkpoint(path, state, sharded)
        training.precision.load_state_dict(state["scaler"])
        training.step, training.skipped_steps = int(state["step"]), int(state["skipped_steps"])
        training.consecutive_skips = int(state.get("consecutive_skips", 0))  # older checkpoints lack it
        training.pl_mean = float(state.get("pl_mean", 0.0))  # likewise
        training.augment.load_state_dict(state.get("augment", {}))  # ADA's p; older checkpoints lack it
        if state["data_position"] != training.step * training.cfg.loss.n_critic:  # a multiple of step (checked)
            raise ConfigError("loss.n_critic", f"checkpoint {path} was written with loss.n_critic="
                              f"{state['data_position'] // training.step}, not {training.cfg.loss.n_critic}",
                              "resume with the loss.n_critic the checkpoint was written with")
        return state["rng"]

    def _fit_checkpoint(self, path: Path, state: dict, sharded: bool) -> None:
        """Load checkpoint `path` (its `state`, and its shards) into G, D, G_ema and the optimizers; a ConfigError
        naming the first tensor that does not fit."""
        G, D, training = self.training.G, self.training.D, self.training
        try:
            if sharded:  # any strategy or world size: DCP reads the shards this rank needs
                shards = self._sharded_state()
                checkpoint.load_sharded(path, shards)  # collective
                G.load_sharded_state(shards["G"], training.opt_g, training.G_ema)
                D.load_sharded_state(shards["D"], training.opt_d)
            else:
                G.load_model_state(state["G"])
                D.load_model_state(state["D"])
                G.load_model_state(state["G_ema"], training.G_ema)
                G.load_optimizer_state(training.opt_g, state["opt_g"])
                D.load_optimizer_state(training.opt_d, state["opt_d"])
            training.configure_optimizers()  # the config's lr, betas and weight decay, not the checkpoint's
        except checkpoint.UnreadableCheckpoint as e:  # a crafted or foreign item: no misfit of the networks
            raise ConfigError(str(path), f"this checkpoint cannot be used (unreadable: {e})",
                              "it was not written by ganscale, or was altered: resume from another checkpoint with "
                              "--resume PATH, or start a new run (another --run-dir)") from None
        except (RuntimeError, ValueError, KeyError) as e:
            first = " ".join(str(e).strip().splitlines()[:2]).replace("\t", "")[:300]  # torch's headline and first tensor
            changed = changed_networks(training.cfg, state["config"])
            if changed:
                raise ConfigError(str(path), f"does not fit the networks this run builds ({first}): {changed}",
                                  "restore the code the run was trained with, or start a new run (another "
                                  "--run-dir)") from None
            settings = changed_settings(training.cfg, state["config"])  # what to set back, before torch's words
            raise ConfigError(str(path), f"does not fit this run's model/optimizer config ("
                              + (f"{settings}: {first})" if settings else f"{first})"),
                              f"resume with the config the checkpoint was written with ({written_with(path)})") from None

    def restore_rank_streams(self, saved: list) -> None:
        """Every rank's RNG streams as they were at the checkpoint (`load`'s return)."""
        runtime = self.training.runtime
        if len(saved) == runtime.world:
            checkpoint.set_rng_state(saved[runtime.rank], cuda=runtime.device.type == "cuda")
        else:  # another world size: per-rank streams cannot carry over; reseed them deterministically
            seed_rank_streams(derive_seed(self.training.cfg.train.seed, self.training.step), runtime)


def fingerprint(tensor: Tensor) -> Tensor:
    """A bitwise fingerprint of a tensor (int64): equal tensors give equal fingerprints."""
    flat = tensor.detach().contiguous().view(-1)
    ints = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    weights = torch.arange(1, ints.numel() + 1, dtype=torch.int64, device=flat.device) % 1_000_003
    return torch.stack([(ints.long() * weights).sum(), ints.long().sum()])


def check_replicas(tensors: dict[str, list[tuple[str, Tensor]]], group: dist.ProcessGroup | None = None) -> None:
    """Collective over `group` (default: all ranks): the named tensors are bitwise identical across its
    ranks, or every rank raises ReplicaDivergence naming the first that is not and the ranks that hold it apart."""
    if dist.get_world_size(group) == 1:
        return
    names, prints = [], []
    for prefix, named in tensors.items():
        for name, tensor in named:
            names.append(f"{prefix}.{name}")
            prints.append(fingerprint(tensor))
    if not prints:  # e.g. fully sharded networks without buffers: nothing is replicated (same on every rank)
        return
    local = torch.stack(prints)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(gathered))
    everyone = torch.stack(gathered)
    differs = (everyone != everyone[0]).any(2)  # [rank, tensor]: unlike the group's first rank
    first = differs.any(0).nonzero()
    if len(first):
        tensor = int(first[0])
        apart = [ranks[0], *(ranks[r] for r in differs[:, tensor].nonzero().flatten().tolist())]
        raise told_by(ranks[0], ReplicaDivergence(  # every rank found it in the same gather: one says it
            f"replicas differ: {names[tensor]} on ranks {', '.join(map(str, apart))} (it must be bitwise identical); "
            "nothing was saved from this step. Continue from the last checkpoint with --resume auto (or "
            "--max-restarts); if it recurs, run `ganscale doctor` on these machines"))


def written_with(path: Path) -> str:
    """The config file a run's checkpoint was written with (a resume that changed it wrote config.resumed-K.yaml)."""
    from ganscale.rundir import config_at

    step = checkpoint.step_of(Path(path))
    found = config_at(Path(path).parent.parent, step) if step is not None else None
    return str(found) if found is not None else "its run's config.yaml"
