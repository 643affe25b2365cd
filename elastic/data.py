"""A ``DataLoader``'s order that does not depend on the world size.

``Sampler`` takes the place of ``DistributedSampler`` as a loader's ``sampler``. The
data of epoch ``e`` is the dataset in one order, shuffled by (seed, e), the same on every
rank; step ``s`` of the run trains positions ``[k*G, (k+1)*G)`` of its epoch's order
(``k``: the step within the epoch, ``G``: the global batch), and each rank loads its
contiguous share of them, micro-batch by micro-batch, as ``Run`` splits every batch. So
which samples a step trains, and in which epoch, is a function of the step alone: a
re-formed world of any size goes on from the very next sample, and the loader keeps its
workers, pinned memory and collate function.

The sampler learns the world, the step and the epoch from the ``Run`` that iterates the
loader (``run.batches(loader)``), so a loader built once, outside the training function,
keeps its persistent workers across re-forms.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, Sampler as TorchSampler

from regroup.elastic.world.batching import BatchPlan
from regroup.elastic.state import MisuseError


@dataclass(frozen=True)
class Span:
    """The steps a loader's pass covers, and how each rank splits them."""

    plan: BatchPlan
    first: int
    """The first step of the pass."""
    end: int
    """The step after the last (within one epoch)."""
    steps_per_epoch: int


class Sampler(TorchSampler[int]):
    """``DataLoader(dataset, batch_size=..., sampler=elastic.Sampler(dataset, seed=0), ...)``
    in place of ``DistributedSampler``: this rank's samples of every step, in an order
    shuffled per epoch by ``seed`` (``shuffle=False``: the dataset's order) that does not
    depend on the world size.

    Through ``run.batches(loader)`` a step trains ``global_batch`` samples (``Run``'s), split
    over the ranks; the loader's ``batch_size`` is the most a rank runs in one forward (the
    micro-batch, as ``max_micro_batch``), and the run sets the loader's batches to the
    step's micro-batches. An epoch is ``len(dataset) // global_batch`` steps (the
    remainder is left out, as ``drop_last`` does). ``set_epoch`` is accepted and ignored:
    the epoch follows from the step. Iterated on its own (an evaluation loop), it yields
    this rank's contiguous part of the dataset in order, every sample once over the ranks."""

    def __init__(self, data_source: Sized | int, *, shuffle: bool = True, seed: int = 0) -> None:
        self.size = data_source if isinstance(data_source, int) else len(data_source)
        if self.size < 1:
            raise MisuseError("elastic.Sampler: the dataset is empty")
        self.shuffle = shuffle
        self.seed = seed
        self._span: Span | None = None
        self._order: tuple[int, torch.Tensor] | None = None

    # --- what the run tells it ------------------------------------------------------------

    def steps_per_epoch(self, global_batch: int) -> int:
        steps = self.size // global_batch
        if steps < 1:
            raise MisuseError(
                f"elastic.Sampler: the dataset has {self.size} samples, fewer than one global batch of {global_batch}"
            )
        return steps

    def cover(self, span: Span | None) -> None:
        """The steps the loader's pass loads (the run sets it before ``iter(loader)`` and
        clears it when the pass ends)."""
        self._span = span

    def set_epoch(self, epoch: int) -> None:
        """Accepted for ``DistributedSampler``'s callers; the epoch follows from the step."""

    # --- the order ----------------------------------------------------------------------

    def order(self, epoch: int) -> torch.Tensor:
        """The dataset indices of ``epoch``, in the order it trains them (every rank alike)."""
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                indices = torch.randperm(self.size, generator=generator)
            else:
                indices = torch.arange(self.size)
            self._order = (epoch, indices)
        return self._order[1]

    def batches(self, span: Span) -> Iterator[tuple[list[int], range]]:
        """(dataset indices, global sample ids) of each micro-batch of this rank in ``span``."""
        plan, per_epoch = span.plan, span.steps_per_epoch
        for step in range(span.first, span.end):
            epoch, within = divmod(step, per_epoch)
            order = self.order(epoch)
            for micro in range(plan.accumulation):
                ids = plan.micro_batch_ids(step, micro)
                start = within * plan.global_batch + (ids.start - step * plan.global_batch)
                yield order[start : start + plan.micro_batch].tolist(), ids

    def _part(self) -> range:
        """This rank's contiguous part of the dataset, for a pass outside the run."""
        rank, size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        per_rank = -(-self.size // size)
        return range(min(rank * per_rank, self.size), min((rank + 1) * per_rank, self.size))

    # --- torch's sampler protocol ------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        span = self._span  # read at the pass's first index: the run covers it until the pass ends
        if span is None:
            yield from self._part()
            return
        for indices, _ in self.batches(span):
            yield from indices

    def __len__(self) -> int:
        if self._span is None:
            return len(self._part())
        return (self._span.end - self._span.first) * self._span.plan.per_rank


def sampler_of(loader: Any) -> Sampler:
    """The ``elastic.Sampler`` a loader draws from (``MisuseError`` if none, or if the
    loader does not batch it: ``batch_size=None``)."""
    found = getattr(loader, "sampler", None)
    if not isinstance(found, Sampler):
        raise MisuseError(
            "run.batches(loader): the loader must draw from an elastic.Sampler: "
            "DataLoader(dataset, batch_size=..., sampler=elastic.Sampler(dataset, seed=...), ...)"
        )
    if not isinstance(getattr(loader, "batch_sampler", None), BatchSampler):
        raise MisuseError("run.batches(loader): the loader must make batches (batch_size=N, no batch_sampler=)")
    return found


def fit_batches(loader: Any, micro_batch: int) -> None:
    """Make the loader's batches the step's micro-batches (its ``BatchSampler`` cuts the
    sampler's indices, which come micro-batch after micro-batch)."""
    loader.batch_sampler.batch_size = micro_batch
    loader.batch_sampler.drop_last = False
