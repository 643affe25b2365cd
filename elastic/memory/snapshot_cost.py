"""What in-memory snapshots cost: host memory, checked before any is taken, and step time,
measured so that ``every: auto`` spaces them to stay under ``STALL_BUDGET``, never wider
than ``snapshot.max_every``."""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from regroup.elastic.settings import ConfigError

STALL_BUDGET = 0.02
"""With ``every: auto``: the share of step time snapshots may cost."""
QUIET_STEPS = 4
"""With ``every: auto``: steps timed without snapshots (the first of a world excluded: it
warms up) before a snapshot's cost is known."""


class SnapshotMemoryError(ConfigError):
    """Host memory cannot hold the snapshots; the message says what to do."""



def host_memory_available(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes of host memory this node can still give: MemAvailable, capped by the cgroup's limit."""
    available = 0
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text()) if limit != "max" else 0
        return available if limit == "max" else min(available, int(limit) - used)
    except (OSError, ValueError):  # no cgroup v2 limit readable: the node's figure stands
        return available


SNAPSHOT_COPIES = 4
"""Host memory the snapshots take, in the rank's share of the job's state (``share_bytes``):
two generations of its own copy and two of its sender's."""
REFORM_HEADROOM = 1.0
"""What an in-place re-form adds to the steady state (with snapshots) at its peak, in the
rank's state (``state_bytes``): the next world's model and optimizer are built while this
world's state is held. Measured by ``bench scale`` at every path and size
(docs/benchmarks.md) and asserted by tests/elastic/test_state_sizes.py."""


def memory_refusal(model: nn.Module, host_bytes: int, ranks_on_node: int) -> str | None:
    """Why this node's host memory cannot hold ``host_bytes`` of snapshots and a re-form's
    peak for each of its ``ranks_on_node`` ranks (``check_host_memory``); None if it can."""
    try:
        reform = int(REFORM_HEADROOM * state_bytes(model))
        check_host_memory(host_bytes, reform, ranks_on_node, host_memory_available())
    except SnapshotMemoryError as exc:
        return str(exc)
    return None


def check_host_memory(snapshots: int, reform: int, ranks_on_node: int, available: int) -> None:
    """Refuse (``SnapshotMemoryError``) when what the node's ranks add to their training
    state, ``snapshots`` and ``reform`` bytes each, would not fit in 90% of the host memory
    ``available``; the message says what each part is and the setting that turns them off."""
    needed = (snapshots + reform) * ranks_on_node
    if needed > 0.9 * available:
        gib = 1 << 30
        raise SnapshotMemoryError(
            f"snapshot.every: in-memory snapshots need {snapshots / gib:.2f} GiB of host memory per rank "
            f"({SNAPSHOT_COPIES}x its share of the job's state) and an in-place re-form {reform / gib:.2f} GiB "
            f"more (the next world's state while this one's is held); {ranks_on_node} on this node: "
            f"{needed / gib:.2f} GiB, and {available / gib:.2f} GiB is available; give the pod more memory, "
            "or set snapshot.every: 0 to train without them (a node lost without notice then costs the steps "
            "since the last committed checkpoint)"
        )


def _local_bytes(model: nn.Module) -> tuple[int, int]:
    """(sharded, replicated) bytes of this rank's parameters."""
    sharded = replicated = 0
    for param in model.parameters():
        if hasattr(param, "to_local"):
            local = param.to_local()
            sharded += local.numel() * local.element_size()
        else:
            replicated += param.numel() * param.element_size()
    return sharded, replicated


def state_bytes(model: nn.Module) -> int:
    """This rank's model + AdamW state (parameters and two moments) as it holds it: its
    shards, and replicated parameters (DDP) whole."""
    return 3 * sum(_local_bytes(model))


def share_bytes(model: nn.Module, world_size: int) -> int:
    """This rank's share of the job's model + AdamW state: its shards, and ``1/world_size``
    of the replicated state, which the snapshots keep once per job, split over the ranks."""
    sharded, replicated = _local_bytes(model)
    return 3 * (sharded + replicated // max(1, world_size))


@dataclass(frozen=True)
class Interval:
    """``every: auto``'s choice of the steps between snapshots, and why."""

    every: int
    """Steps between snapshots: what the cost asks for, capped at ``max_every``."""
    max_every: int
    """``snapshot.max_every``: the most steps a node lost without notice may cost."""
    wanted: int | None
    """Steps between snapshots that keep their cost under ``STALL_BUDGET`` (None: not measured yet)."""
    cost_share: float | None
    """What one snapshot costs, as a share of a step without one (None: not measured yet)."""

    @property
    def capped(self) -> bool:
        """The cost asks for wider spacing than ``max_every`` allows: snapshots cost more than the budget."""
        return self.wanted is not None and self.wanted > self.max_every

    @property
    def reason(self) -> str:
        if self.wanted is None or self.cost_share is None:
            return f"cost not measured yet: snapshot.max_every={self.max_every} until it is"
        share = f"a snapshot costs {self.cost_share:.1%} of a step"
        if self.capped:
            return (
                f"{share}, every {self.wanted} steps would keep it under {STALL_BUDGET:.0%}; "
                f"capped at snapshot.max_every={self.max_every}"
            )
        return f"{share}: every {self.every} keeps it under {STALL_BUDGET:.0%}"


def interval_for(cost: float | None, max_every: int) -> Interval:
    """Steps between snapshots that keep a snapshot's ``cost`` (a share of one step) under
    ``STALL_BUDGET`` of the step time, never more than ``max_every`` (the lost-step bound).
    ``cost`` None (not measured yet): ``max_every``, the widest the bound allows, which leaves
    steps without a snapshot to measure against."""
    if cost is None:
        return Interval(max_every, max_every, None, None)
    wanted = max(1, math.ceil(cost / STALL_BUDGET - 1e-9))
    return Interval(min(wanted, max_every), max_every, wanted, cost)


class CostMeter:
    """What a snapshot costs the loop, measured: the steps that ran while one was copied or
    exchanged (which takes cores on CPU; memory bandwidth and the GIL on GPU; the loop's
    waits for it included) against those that ran without."""

    def __init__(self, window: int = 16) -> None:
        self.quiet: deque[float] = deque(maxlen=window)
        self.busy: deque[float] = deque(maxlen=window)
        self._busy_steps = 0
        self._busy_per_snapshot = 1

    def record(self, step_s: float, busy: bool) -> None:
        (self.busy if busy else self.quiet).append(step_s)
        self._busy_steps += busy

    def snapshot_done(self) -> None:
        """A snapshot completed: the steps it overlapped are what one costs."""
        self._busy_per_snapshot, self._busy_steps = max(1, self._busy_steps), 0

    def has_baseline(self) -> bool:
        return len(self.quiet) >= QUIET_STEPS

    def measured(self) -> bool:
        """Both kinds of step were seen: ``cost`` means something. Every rank of a world sees
        the same kinds at the same steps, so all agree on it."""
        return self.has_baseline() and bool(self.busy)

    def cost(self) -> float:
        """Extra time of the steps one snapshot overlaps, as a share of a step without one
        (0 until both kinds were seen). A world's first step warms up: not in the baseline."""
        if not self.measured():
            return 0.0
        base = statistics.median(list(self.quiet)[1:])
        extra = max(0.0, statistics.median(self.busy) - base)
        return extra * self._busy_per_snapshot / base if base > 0 else 0.0

