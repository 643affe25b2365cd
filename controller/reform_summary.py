"""One line per finished re-form, for people: its Event and ``regroup status``.

``4 → 3 nodes: spot reclaim of n3, 0 steps lost, 1.2 s`` (``Resized``): node counts before
and after, the cause with the nodes that left or joined, the steps lost, and the time from
the first evidence of the signal to the trainers' first step at the new size. A reclaim
reads as what sent it (``drain``, ``eviction``, ``spot reclaim`` ...), in the words
``regroup trace-report`` and the demo's report use (``regroup.reform_causes``). A re-form in
which waiting nodes took every leaving node's position changed no size, and says who took
whose place instead: ``n3 replaced by n5 at step 812, 0 steps lost, 0.9 s``
(``NodeReplaced``), ``n2 migrated to n5 at step 812, 0 steps lost, 0.8 s`` (``NodeMigrated``).
Workers that exited during the re-form instead of re-forming in place are told apart, with
the likely cause their agents recorded (``WorkerExitedInReform``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from regroup.records import MemberRecord, ReformCause, ReformOutcome, ReformPlan, ReformStrategy
from regroup.reform_causes import cause_label

_CAUSES = {
    ReformCause.NODE_LOST: "loss of",
    ReformCause.RESTART_STORM: "restart storm on",
    ReformCause.GROW: "grow with",
}
"""How each cause reads before the nodes it concerns (``ReformPlan.cause``); a reclaim reads
as what sent it (``cause_label``: ``drain of n2``, ``spot reclaim of n2``); any other cause
(``manual``) reads ``manual: n5 left``."""


def reform_end(plan: ReformPlan) -> float:
    """When the re-form ended: the trainer's resume, or the moment the plan was given up."""
    return plan.resumed_at if plan.outcome == ReformOutcome.COMPLETED and plan.resumed_at else plan.finished_at


def reform_seconds(plan: ReformPlan) -> float:
    """Detection to resume (or to the end of an abandoned plan)."""
    return max(0.0, reform_end(plan) - plan.detected_at)


def resize_message(plan: ReformPlan, cordoned: Collection[str] = ()) -> str:
    """``4 → 3 nodes: spot reclaim of n3, 0 steps lost, 1.2 s`` for a finished ``plan``;
    ``cordoned``: the nodes the cluster has cordoned (an eviction of one is a drain)."""
    before, after = plan.nodes_before, plan.nodes_after
    left = sorted(set(before) - set(after))
    joined = sorted(set(after) - set(before))
    if plan.cause == ReformCause.RECLAIM:
        what: str | None = f"{cause_label(plan.cause, plan.reason, cordoned)} of"
    else:
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
    return f"{len(before)} → {len(after)} nodes: {cause}, {_tail(plan)}"


_SWAPS: dict[str, tuple[str, str]] = {
    ReformStrategy.REPLACE: ("NodeReplaced", "replaced by"),
    ReformStrategy.MIGRATE: ("NodeMigrated", "migrated to"),
}
"""The Event reason of a completed re-form of each strategy that keeps the world's size,
and how its message says who took whose place."""


def completion_event(plan: ReformPlan, cordoned: Collection[str] = ()) -> tuple[str, str]:
    """(reason, message) of the Normal Event that tells the completed ``plan``:
    ``NodeReplaced`` or ``NodeMigrated`` when waiting nodes took the leaving nodes'
    positions, ``Resized`` otherwise (``resize_message``, ``cordoned`` the nodes cordoned)."""
    swap = _SWAPS.get(plan.strategy) if plan.replaced else None
    if swap is None:
        return "Resized", resize_message(plan, cordoned)
    reason, verb = swap
    moves = ", ".join(f"{old} {verb} {new}" for old, new in sorted(plan.replaced.items()))
    return reason, f"{moves} at step {plan.resumed_from_step}, {_tail(plan)}"


WORKER_EXITED = "WorkerExitedInReform"
"""The Warning Event of a re-form during which workers exited instead of re-forming in place."""


def worker_exit_text(members: Mapping[str, MemberRecord], plan: ReformPlan) -> str:
    """``n2: the worker exited during an in-place re-form (exit 1): ...``: the nodes whose
    workers exited during ``plan``'s re-form, by the line their agents recorded
    (``MemberRecord.worker_exit``, of the world the re-form ended or a later one); "" if none."""
    nodes: dict[str, list[str]] = {}
    for node in sorted(set(plan.nodes_before) | set(plan.nodes_after)):
        member = members.get(node)
        if member is not None and member.worker_exit and member.worker_exit_round >= plan.round_before:
            nodes.setdefault(member.worker_exit, []).append(node)
    return "; ".join(f"{', '.join(names)}: {note}" for note, names in nodes.items())


def replaced_text(replaced: Mapping[str, str]) -> str:
    """``n3->n5,n4->n6``: who took whose position (the span attribute ``regroup.replaced``)."""
    return ",".join(f"{old}->{new}" for old, new in sorted(replaced.items()))


def _tail(plan: ReformPlan) -> str:
    """``0 steps lost, 1.2 s`` and, for a planned re-form that fell back, why."""
    if plan.lost_steps < 0:
        lost = "steps lost unknown"
    else:
        lost = f"{plan.lost_steps} step{'' if plan.lost_steps == 1 else 's'} lost"
    fallback = f", unplanned: {plan.fallback}" if plan.fallback else ""
    return f"{lost}, {reform_seconds(plan):.1f} s{fallback}"
