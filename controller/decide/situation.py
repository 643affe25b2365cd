"""What starting or advancing a re-form reads, gathered once per decision."""

from __future__ import annotations

from dataclasses import dataclass

from controller.decide.health import Health
from controller.decide.out import Out
from controller.jobconfig import JobConfig
from controller.settings import ControllerSettings
from controller.snapshot import JobSnapshot


@dataclass(frozen=True)
class Situation:
    """One job with a valid configuration at one moment, and the decision being collected."""

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
