"""Splitting a constant global batch over whatever world size this run has.

Step ``s`` always trains on global samples ``[s*G, (s+1)*G)``. Rank ``r`` of a world of
``W`` takes the contiguous share ``[s*G + r*G/W, s*G + (r+1)*G/W)`` and runs it as
``accumulation`` micro-batches, so the set of samples per step, and the mean loss over
them, do not depend on ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass


class BatchSplitError(ValueError):
    """The global batch cannot be split evenly over this world size."""


@dataclass(frozen=True)
class BatchPlan:
    """How one rank runs its share of each global batch."""

    global_batch: int
    world_size: int
    rank: int
    micro_batch: int
    """Samples per forward/backward on this rank."""
    accumulation: int
    """Micro-batches per optimizer step on this rank."""

    @property
    def per_rank(self) -> int:
        return self.micro_batch * self.accumulation

    def micro_batch_ids(self, step: int, micro: int) -> range:
        """Global sample ids of micro-batch ``micro`` of step ``step`` on this rank."""
        start = step * self.global_batch + self.rank * self.per_rank + micro * self.micro_batch
        return range(start, start + self.micro_batch)

    def step_ids(self, step: int) -> range:
        """Global sample ids this rank trains on in step ``step``."""
        start = step * self.global_batch + self.rank * self.per_rank
        return range(start, start + self.per_rank)


def workable_world_sizes(global_batch: int, limit: int | None = None) -> list[int]:
    """World sizes that split ``global_batch`` evenly (its divisors, up to ``limit``)."""
    top = global_batch if limit is None else min(global_batch, limit)
    return [w for w in range(1, top + 1) if global_batch % w == 0]


def plan_batches(global_batch: int, world_size: int, rank: int, max_micro_batch: int = 0) -> BatchPlan:
    """The micro-batch and accumulation for ``rank``; the micro-batch is the largest
    divisor of the rank's share that does not exceed ``max_micro_batch`` (0: no limit)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"bad rank {rank} of world size {world_size}")
    if global_batch % world_size:
        sizes = ", ".join(str(w) for w in workable_world_sizes(global_batch, limit=1024))
        raise BatchSplitError(
            f"batch.global_batch_size={global_batch} does not divide by world size {world_size}; "
            f"world sizes that work: {sizes}"
        )
    share = global_batch // world_size
    limit = share if max_micro_batch <= 0 else min(share, max_micro_batch)
    micro = max(d for d in range(1, limit + 1) if share % d == 0)
    return BatchPlan(global_batch, world_size, rank, micro, share // micro)
