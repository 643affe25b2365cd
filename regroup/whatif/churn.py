"""The churn a job sees and the job's shape: what ``regroup whatif`` is asked about.

Rates are for the whole job at its full size, as a platform team observes them ("a reclaim
every 20 minutes"); every field is validated at construction with a message naming its
command-line option.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from regroup.controller.settings import JobDefaults

DEFAULT_NOTICE = timedelta(minutes=2)
"""AWS spot's interruption notice (GKE and AKS give 30 s)."""
DEFAULT_REPLACE_AFTER = timedelta(minutes=5)
"""From a node leaving the job to its replacement joining: a new cloud VM booting and
pulling the image takes a few minutes."""
DEFAULT_PROCESS_START = timedelta(seconds=60)
"""A restarted worker's start before it can rendezvous: Python and torch imports, the CUDA
context, the model built (used only when the spans record no restart)."""


class WhatIfError(ValueError):
    """An input is invalid or missing; the message names the option or the file."""


def _every(value: timedelta | None, option: str) -> float:
    """Events per second for ``--X-every value`` (0 when not given)."""
    if value is None:
        return 0.0
    if value <= timedelta(0):
        raise WhatIfError(f"{option}: must be positive, got {value}")
    return 1.0 / value.total_seconds()


@dataclass(frozen=True)
class Churn:
    """What happens to the job's nodes."""

    reclaim_every: timedelta | None = None
    """Mean time between reclaim notices (a spot reclaim, a drain): the node leaves after ``notice``."""
    loss_every: timedelta | None = None
    """Mean time between abrupt node losses (no notice)."""
    flaky_every: timedelta | None = None
    """Mean time between nodes going bad: the node's rank crashes at every start until the
    restart-storm rule cordons it."""
    joins_every: timedelta | None = None
    """Mean time between grows. None: every node that leaves (reclaimed, lost, cordoned) is
    replaced after ``replace_after``, one grow each; given when nodes come back in batches
    that one join window gathers."""
    notice: timedelta = DEFAULT_NOTICE
    """How long before a reclaimed node goes away its notice comes."""
    replace_after: timedelta = DEFAULT_REPLACE_AFTER
    """From a node leaving the job to its replacement joining."""
    restart_storm: int = JobDefaults().storm_restarts
    """K of the job's restart-storm rule: a flaky node crashes K times before its cordon."""

    def __post_init__(self) -> None:
        for option, value in (
            ("--reclaim-every", self.reclaim_every),
            ("--loss-every", self.loss_every),
            ("--flaky-every", self.flaky_every),
            ("--joins-every", self.joins_every),
        ):
            _every(value, option)
        if self.notice < timedelta(0):
            raise WhatIfError(f"--notice: must not be negative, got {self.notice}")
        if self.replace_after < timedelta(0):
            raise WhatIfError(f"--replace-after: must not be negative, got {self.replace_after}")
        if self.restart_storm < 1:
            raise WhatIfError(f"--restart-storm: must be at least 1, got {self.restart_storm}")

    @property
    def reclaims(self) -> float:
        """Reclaims per second."""
        return _every(self.reclaim_every, "--reclaim-every")

    @property
    def losses(self) -> float:
        """Abrupt losses per second."""
        return _every(self.loss_every, "--loss-every")

    @property
    def flaky(self) -> float:
        """Nodes going bad per second."""
        return _every(self.flaky_every, "--flaky-every")

    @property
    def departures(self) -> float:
        """Nodes leaving the job per second (a flaky node leaves at its cordon)."""
        return self.reclaims + self.losses + self.flaky

    @property
    def joins(self) -> float:
        """Grows per second: ``joins_every``, or one per departure."""
        return self.departures if self.joins_every is None else _every(self.joins_every, "--joins-every")


@dataclass(frozen=True)
class JobShape:
    """The job asked about."""

    nodes: int
    """Its full size (a fixed-size job's size, an elastic job's max)."""
    spares: int = 0
    """Idle nodes a fixed-size job holds to replace a lost one at once."""
    min_nodes: int | None = None
    """An elastic job's min (None: the one ``regroup whatif`` recommends)."""
    checkpoint_every: timedelta | None = None
    """Periodic checkpoint interval of the restarting strategies (None: Young's optimum)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise WhatIfError(f"--nodes: must be at least 1, got {self.nodes}")
        if self.spares < 0:
            raise WhatIfError(f"--spares: must not be negative, got {self.spares}")
        if self.min_nodes is not None and not 1 <= self.min_nodes <= self.nodes:
            raise WhatIfError(f"--min-nodes: must be between 1 and --nodes ({self.nodes}), got {self.min_nodes}")
        if self.checkpoint_every is not None and self.checkpoint_every <= timedelta(0):
            raise WhatIfError(f"--checkpoint-every: must be positive, got {self.checkpoint_every}")
