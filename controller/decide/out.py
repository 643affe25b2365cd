"""What one decision collects: the actions, and when to look again."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import timedelta

from regroup.controller.jobconfig import JobConfig
from regroup.controller.snapshot import Action, Alerts, Decision, WritePlan


class Out:
    """The actions a decision asks for, in order, and its requeue delays.

    A plain class with slots: made once per decision, where a dataclass's ``__init__``
    tested its default factories in turn."""

    __slots__ = ("actions", "requeue", "abandoned")

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self.requeue: list[float] = []
        """Seconds from now after which to look again."""
        self.abandoned = False
        """This decision ended the plan in flight without completing it (``writes.finish``)."""

    def again_in(self, seconds: float) -> None:
        """Look again ``seconds`` from now (at once when negative); the earliest wins."""
        self.requeue.append(max(0.0, seconds))

    def started(self) -> bool:
        """Whether this decision starts a re-form (writes a plan that is not an ended one)."""
        return any(isinstance(a, WritePlan) and not a.finished for a in self.actions)

    def decision(
        self, reason: str, node_count: int, config: JobConfig | None, alerts: Alerts, spare_count: int = 0,
        spares_wanted: int = 0,
    ) -> Decision:
        """The collected actions as the ``Decision`` for the job (spares only for a running one)."""
        # timedelta(0, seconds): positional, no keyword parsing once per decision.
        requeue = timedelta(0, min(self.requeue)) if self.requeue else None
        return Decision(
            actions=tuple(self.actions),
            reason=reason,
            requeue_after=requeue,
            node_count=node_count,
            min_nodes=config.min_nodes if config else 0,
            max_nodes=config.max_nodes if config else 0,
            alerts=alerts,
            spare_count=spare_count,
            spares_wanted=spares_wanted,
        )


def summarize(actions: Iterable[Action]) -> Mapping[str, int]:
    """Count of actions by type, for logs."""
    counts: dict[str, int] = {}
    for action in actions:
        counts[type(action).__name__] = counts.get(type(action).__name__, 0) + 1
    return counts
