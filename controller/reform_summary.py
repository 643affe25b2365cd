"""One line per finished re-form, for people: the ``Resized`` Event and ``regroup status``.

``4 → 3 nodes: reclaim of n3, 0 steps lost, 1.2 s``: node counts before and after, the
cause with the nodes that left or joined, the steps lost, and the time from the first
evidence of the signal to the trainers' first step at the new size.
"""

from __future__ import annotations

from regroup.records import ReformCause, ReformOutcome, ReformPlan

_CAUSES = {
    ReformCause.RECLAIM: "reclaim of",
    ReformCause.NODE_LOST: "loss of",
    ReformCause.RESTART_STORM: "restart storm on",
    ReformCause.GROW: "grow with",
}
"""How each cause reads before the nodes it concerns (``ReformPlan.cause``); any other
cause (``manual``) reads ``manual: n5 left``."""


def reform_end(plan: ReformPlan) -> float:
    """When the re-form ended: the trainer's resume, or the moment the plan was given up."""
    return plan.resumed_at if plan.outcome == ReformOutcome.COMPLETED and plan.resumed_at else plan.finished_at


def reform_seconds(plan: ReformPlan) -> float:
    """Detection to resume (or to the end of an abandoned plan)."""
    return max(0.0, reform_end(plan) - plan.detected_at)


def resize_message(plan: ReformPlan) -> str:
    """``4 → 3 nodes: reclaim of n3, 0 steps lost, 1.2 s`` for a finished ``plan``."""
    before, after = plan.nodes_before, plan.nodes_after
    left = sorted(set(before) - set(after))
    joined = sorted(set(after) - set(before))
    what = _CAUSES.get(plan.cause)
    grow = plan.cause == ReformCause.GROW
    if what is None:
        moves = [f"{', '.join(nodes)} {verb}" for nodes, verb in ((left, "left"), (joined, "joined")) if nodes]
        cause = f"{plan.cause.value}: {'; '.join(moves)}" if moves else plan.cause.value
    else:
        main, other = (joined, left) if grow else (left, joined)
        cause = f"{what} {', '.join(main)}" if main else plan.cause.value
        if other:
            cause += f" ({', '.join(other)} {'left' if grow else 'joined'})"
    if plan.lost_steps < 0:
        lost = "steps lost unknown"
    else:
        lost = f"{plan.lost_steps} step{'' if plan.lost_steps == 1 else 's'} lost"
    fallback = f", unplanned: {plan.fallback}" if plan.fallback else ""
    return f"{len(before)} → {len(after)} nodes: {cause}, {lost}, {reform_seconds(plan):.1f} s{fallback}"
