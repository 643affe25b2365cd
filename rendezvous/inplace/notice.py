"""SIGTERM as a notice to leave the job, not a kill: what the in-place agent does about it.

Kubernetes stops a pod (deletion, eviction, drain) with SIGTERM to the container's PID 1,
the agent, and SIGKILLs it once ``terminationGracePeriodSeconds`` has passed. torch's agent
stops its workers on SIGTERM at once, so the grace was never used. The in-place agent
instead keeps its workers training while a controller that leads the job hands this node's
work over (planned shrink: checkpoint, the next round without this node, the workers hand
their shards to survivors), and stops them itself only when that has not happened
``TERM_MARGIN_S`` before the grace runs out. With nobody to hand over to, or nothing to hand
over, it stops at once. Either way it exits ``LEFT_JOB``.

Pure: the agent passes in the clock and what it sees of the job.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

DEFAULT_TERM_GRACE = timedelta(seconds=30)
"""Kubernetes' default ``terminationGracePeriodSeconds``; ``regroup-run --term-grace`` should
say the pod's own."""
TERM_MARGIN_S = 3.0
"""Seconds before the grace ends at which a node still in the job stops its workers (torch's
shutdown: SIGTERM, then SIGKILL) and leaves the rendezvous, ahead of the kubelet's SIGKILL."""


@dataclass(frozen=True)
class StopNotice:
    """The agent was told to stop (SIGTERM)."""

    since: float
    """Unix time of the SIGTERM."""
    by: float
    """Unix time the grace ends (the kubelet's SIGKILL), as far as the agent knows it."""
    stop_at: float
    """Unix time after which the agent, if still in the job, stops its workers and leaves;
    ``since`` when it does so at once."""
    reason: str
    """Why it waits for a hand-off until ``stop_at``, or why not."""

    @property
    def hands_over(self) -> bool:
        """The agent waits for the controller to leave this node out and hand its work over."""
        return self.stop_at > self.since


def take_notice(now: float, grace: timedelta, *, controller: bool, in_round: bool) -> StopNotice:
    """What a SIGTERM at ``now`` means, with ``grace`` to go: wait for a hand-off while a
    controller leads the job (``control/controller`` exists) and this node has ranks in its
    round; otherwise stop at once."""
    seconds = grace.total_seconds()
    by = now + seconds
    if not controller:
        return StopNotice(now, by, now, "no controller leads the job: nobody will hand this node's work over")
    if not in_round:
        return StopNotice(now, by, now, "this node has no place in the job's round: it has nothing to hand over")
    if seconds <= TERM_MARGIN_S:
        return StopNotice(now, by, now, f"a grace of {seconds:g}s leaves no time for a hand-off")
    return StopNotice(
        now, by, by - TERM_MARGIN_S, "a controller leads the job: training on until it leaves this node out"
    )


def overdue(notice: StopNotice, now: float) -> str:
    """Why the agent stops its workers and leaves the job at ``now`` ("" while it may wait)."""
    if now < notice.stop_at:
        return ""
    if notice.hands_over:
        return (
            f"not left out of the job within its grace of {notice.by - notice.since:g}s "
            f"(less {TERM_MARGIN_S:g}s to stop its workers)"
        )
    return notice.reason
