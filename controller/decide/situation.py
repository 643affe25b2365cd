"""What starting or advancing a re-form reads, gathered once per decision."""

from __future__ import annotations

from typing import NamedTuple

from regroup.controller.decide.health import Health
from regroup.controller.decide.out import Out
from regroup.controller.jobconfig import JobConfig
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import JobSnapshot


class Situation(NamedTuple):
    """One job with a valid configuration at one moment, and the decision being collected.

    A named tuple, not a frozen dataclass: it is made once or twice per decision, and a
    frozen dataclass sets each field through ``object.__setattr__`` (see ``Decision``)."""

    s: JobSnapshot
    now: float
    settings: ControllerSettings
    config: JobConfig
    health: Health
    """The job's nodes classified at ``now`` (restart storms included)."""
    out: Out
    plan_revision: int
    """The fencing token a new plan is written against: the snapshot's ``plan_revision``,
    or ``AFTER_PREVIOUS_PLAN`` once this decision has ended the plan in flight."""
