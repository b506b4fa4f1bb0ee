"""Which samples each rank gets at each micro-step: a pure function of (seed, batch index, rank).

The stream is the concatenation of per-epoch permutations of the data set; global batch i is
positions [i*B, (i+1)*B) of it. Within a global batch, micro-step m of rank r takes the slice
starting at (m * world + r) * micro_batch. Resuming needs only the batch index.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, TensorDataset

from ganscale.fault import StopSignals


@dataclass(frozen=True)
class Slicing:
    """How a global batch is cut into micro-batches over ranks."""

    rank: int
    world: int
    micro_batch: int
    accumulation: int

    @property
    def global_batch(self) -> int:
        return self.world * self.micro_batch * self.accumulation

    def offset(self, micro_step: int) -> int:
        """First position, within the global batch, of this rank's micro-batch `micro_step`."""
        return (micro_step * self.world + self.rank) * self.micro_batch

    def take(self, global_tensor: torch.Tensor, micro_step: int) -> torch.Tensor:
        start = self.offset(micro_step)
        return global_tensor[start:start + self.micro_batch]


class _RankSampler(Sampler[list[int]]):
    """Yields this rank's index list for every micro-step, forever, from global batch `start`."""

    def __init__(self, size: int, slicing: Slicing, seed: int, start: int, keyed_by_position: bool = False):
        self.size, self.slicing, self.seed, self.start = size, slicing, seed, start
        self.keyed_by_position = keyed_by_position  # yield (index, stream position) keys, for seeded augmentation
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            self._perms = {e: p for e, p in self._perms.items() if e >= epoch - 1}
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.size, generator=generator)
        return self._perms[epoch]

    def _first(self, batch: int, micro_step: int) -> int:
        """Stream position of this rank's micro-batch's first sample."""
        return batch * self.slicing.global_batch + self.slicing.offset(micro_step)

    def index_tensor(self, batch: int, micro_step: int) -> torch.Tensor:
        """Data set indices of this rank's micro-batch: a slice of each epoch's permutation it touches
        (almost always one; the stream runs on through epochs without dropping or repeating a sample)."""
        first = self._first(batch, micro_step)
        end = first + self.slicing.micro_batch
        parts = []
        for epoch in range(first // self.size, (end - 1) // self.size + 1):
            start_of_epoch = epoch * self.size
            parts.append(self._perm(epoch)[max(first - start_of_epoch, 0):min(end - start_of_epoch, self.size)])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def indices(self, batch: int, micro_step: int) -> list[int]:
        return self.index_tensor(batch, micro_step).tolist()

    def _micro_steps(self) -> Iterator[tuple[int, int]]:
        """(global batch, micro-step) of every micro-step, forever, from global batch `start`."""
        batch = self.start
        while True:
            for micro_step in range(self.slicing.accumulation):
                yield batch, micro_step
            batch += 1

    def index_tensors(self) -> Iterator[torch.Tensor]:
        """Every micro-step's indices as a tensor (in-memory data: one gather per field)."""
        return (self.index_tensor(batch, micro_step) for batch, micro_step in self._micro_steps())

    def __iter__(self) -> Iterator[list]:
        for batch, micro_step in self._micro_steps():
            indices = self.indices(batch, micro_step)
            if self.keyed_by_position:
                first = self._first(batch, micro_step)
                indices = [(index, first + j) for j, index in enumerate(indices)]
            yield indices


Sample = tuple[torch.Tensor, ...]  # one micro-batch: (images,), (images, labels) or (input, target)


def _leave_stops_to_trainer(worker_id: int) -> None:
    """In each DataLoader worker: ignore the stop signals (SIGTERM, SIGINT, SIGHUP). A job scheduler signals the
    whole process group, as a closing terminal does; a worker killed by it made the trainer's next batch raise
    ("DataLoader worker ... is killed by signal") before the agreed stop could checkpoint, and the run was lost.
    The trainer stops its workers itself, and a worker whose trainer died exits on its own (DataLoader's watchdog
    of the parent)."""
    for sig in StopSignals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class GlobalBatches:
    """Iterator over global batches; each item is this rank's list of micro-batches on `device`,
    each micro-batch a tuple of tensors (the data set's fields)."""

    def __init__(self, dataset: Dataset, slicing: Slicing, seed: int, device: torch.device,
                 workers: int = 0, start: int = 0):
        self.slicing, self.device, self.position = slicing, device, start
        self._loader_batches = None  # the DataLoader's iterator, where there is one
        sampler = _RankSampler(len(dataset), slicing, seed, start, getattr(dataset, "keyed_by_position", False))
        if isinstance(dataset, TensorDataset) and workers == 0:
            # In-memory data: index the tensors directly, no per-sample collation.
            self._micro = (tuple(t[idx] for t in dataset.tensors) for idx in sampler.index_tensors())
        else:
            # Its own generator for the workers' base seed: drawn from the global stream, it would shift what a
            # network draws from it, and `ganscale verify` would see a draw no network made.
            loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers,
                                worker_init_fn=_leave_stops_to_trainer, pin_memory=device.type == "cuda",
                                persistent_workers=workers > 0, generator=torch.Generator().manual_seed(seed))
            self._loader_batches = iter(loader)
            self._micro = (tuple(batch) for batch in self._loader_batches)

    def __iter__(self) -> GlobalBatches:
        return self

    def close(self) -> None:
        """Stop the DataLoader's worker processes now: they ignore SIGTERM (`_leave_stops_to_trainer`), so left to
        the interpreter's exit, which terminates and joins its children, they would keep it waiting forever."""
        self._micro.close()
        loader_batches, self._loader_batches = self._loader_batches, None
        # The iterator's own shutdown (which its finaliser would run, if nothing else held it: with pinned memory on
        # CUDA something does) asks the workers to stop and joins them for a few seconds; a worker still alive then
        # is killed, as the SIGTERM that the shutdown sends it is ignored.
        getattr(loader_batches, "_shutdown_workers", lambda: None)()
        for worker in getattr(loader_batches, "_workers", []):
            if worker.is_alive():
                worker.kill()
                worker.join()

    def __next__(self) -> list[Sample]:
        self.position += 1
        return [tuple(t.to(self.device, non_blocking=True) for t in next(self._micro))
                for _ in range(self.slicing.accumulation)]
