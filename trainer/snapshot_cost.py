"""What in-memory snapshots cost: host memory, checked before any is taken, and step time,
measured so that ``every: auto`` spaces them to stay under ``STALL_BUDGET``."""

from __future__ import annotations

import math
import statistics
from collections import deque
from pathlib import Path

from torch import nn

from regroup.trainer.config import ConfigError

STALL_BUDGET = 0.02
"""With ``every: auto``: the share of step time snapshots may cost."""
QUIET_STEPS = 4
"""With ``every: auto``: steps timed without snapshots before the first one."""
MAX_AUTO_EVERY = 1000


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


def check_host_memory(needed_per_rank: int, ranks_on_node: int, available: int) -> None:
    """Refuse (``SnapshotMemoryError``) when the node's ranks' snapshots would not fit in 90%
    of the host memory available; the message names the setting that turns them off."""
    needed = needed_per_rank * ranks_on_node
    if needed > 0.9 * available:
        gib = 1 << 30
        raise SnapshotMemoryError(
            f"snapshot.every: in-memory snapshots need {needed_per_rank / gib:.2f} GiB of host memory per rank "
            f"({ranks_on_node} on this node: {needed / gib:.2f} GiB) and {available / gib:.2f} GiB is available; "
            "give the pod more memory, or set snapshot.every: 0 to train without them "
            "(a node lost without notice then costs the steps since the last committed checkpoint)"
        )


def state_bytes(model: nn.Module) -> int:
    """This rank's share of model + AdamW state (parameters and two moments), in bytes."""
    total = 0
    for param in model.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        total += local.numel() * local.element_size()
    return 3 * total


def interval_for(cost: float) -> int:
    """Steps between snapshots that keep a snapshot's ``cost`` (a share of one step) under
    ``STALL_BUDGET`` of the step time."""
    return max(1, min(MAX_AUTO_EVERY, math.ceil(cost / STALL_BUDGET - 1e-9)))


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

    def cost(self) -> float:
        """Extra time of the steps one snapshot overlaps, as a share of a step without one
        (0 until both kinds were seen). A world's first step warms up: not in the baseline."""
        if not self.has_baseline() or not self.busy:
            return 0.0
        base = statistics.median(list(self.quiet)[1:])
        extra = max(0.0, statistics.median(self.busy) - base)
        return extra * self._busy_per_snapshot / base if base > 0 else 0.0

