"""The kinds a re-form's records and spans name: its phases, causes, strategies and outcomes
(``regroup.records.ReformPlan`` holds them; ``regroup.records`` re-exports each)."""

from __future__ import annotations

import enum


class ReformPhase(enum.StrEnum):
    """Where a re-form stands (``ReformPlan.phase``); stored as the plain value."""

    CHECKPOINT = "checkpoint"
    """Waiting for the trainers' checkpoint ack (planned re-forms only)."""
    RENDEZVOUS = "rendezvous"
    """The next round is published; waiting for its members to form it."""
    RESUME = "resume"
    """The round formed; waiting for the trainer's first progress at the new size."""
    DONE = "done"
    """Finished, with an ``outcome``."""


class ReformCause(enum.StrEnum):
    """Why a re-form started (``ReformPlan.cause``, the span attribute ``regroup.cause``)."""

    RECLAIM = "reclaim"
    NODE_LOST = "node-lost"
    GROW = "grow"
    RESTART_STORM = "restart-storm"
    MANUAL = "manual"


class ReformStrategy(enum.StrEnum):
    """How a re-form answers its cause (``ReformPlan.strategy``, the span attribute
    ``regroup.strategy``); stored as the plain value, and kept a plain string on the plan so a
    reader keeps a strategy it does not know (one from a newer controller)."""

    ELASTIC = "elastic"
    """The world size changes (a shrink, a grow, a loss no waiting node could fill)."""
    REPLACE = "replace"
    """An unplanned loss answered by waiting nodes taking every lost position: same size."""
    MIGRATE = "migrate"
    """A planned reclaim answered likewise: the leaving node hands its shards over at the
    agreed step, and no step is lost."""


class ReformOutcome(enum.StrEnum):
    """How a re-form ended (``ReformPlan.outcome``)."""

    PENDING = ""
    """Not finished yet."""
    COMPLETED = "completed"
    TIMEOUT = "timeout"
    SUPERSEDED = "superseded"


DETECT_PHASE = "detect"
"""The traced phase before the decision: from the first sighting of the signal to the plan."""

TRACED_PHASES: tuple[str, ...] = (
    DETECT_PHASE,
    ReformPhase.CHECKPOINT.value,
    ReformPhase.RENDEZVOUS.value,
    ReformPhase.RESUME.value,
)
"""Child spans of a re-form's trace (``regroup.<phase>``), in the order they happen."""
