"""Positions in the round: who takes a leaving node's place, and what the re-form is.

The expected membership the controller publishes is the next round's rank order: each
node's position is its ranks (with ``--nproc-per-node=k``, positions times k) and so its
coordinates in the trainers' device mesh. A re-form that keeps every surviving node in its
position and puts a waiting node in exactly the position a leaving one held moves no
survivor's shards: only the leaving position's state travels, to its replacement. A job
keeps that policy whether it asked for spares or not: a waiting node replaces a leaving
one before the job shrinks.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from regroup.controller.snapshot import JobSnapshot
from regroup.controller.decide.health import plan_of_round
from regroup.records import ReformPlan, ReformStrategy


def round_order(s: JobSnapshot, world: AbstractSet[str]) -> list[str]:
    """The nodes of ``world`` in the current round's rank order: the rendezvous' round record,
    else the completed plan that made the round (the rendezvous formed it in that order),
    else by name. Nodes the order does not name (seen in the round, never listed) come last,
    by name."""
    order: Sequence[str] = s.world_order
    if not order and (plan := plan_of_round(s)) is not None:
        order = plan.nodes_after
    ordered = list(filter(world.__contains__, order))  # in C: a round may hold hundreds
    if len(ordered) == len(world):
        return ordered
    listed = set(ordered)
    return ordered + sorted(n for n in world if n not in listed)


def fill_positions(
    order: Sequence[str], vacated: Collection[str], joiners: Sequence[str], max_nodes: int
) -> tuple[list[str], dict[str, str]]:
    """The next round's order and who replaces whom.

    Each node of ``order`` that is not ``vacated`` keeps its position; ``joiners`` (oldest
    first), as many as ``max_nodes`` leaves room for, fill the vacated positions in order,
    and the rest of them are appended; vacated positions left are dropped (the survivors
    keep their relative order). Survivors beyond ``max_nodes`` (the max was lowered) are
    dropped from the end. Returns (target, vacated node -> the joiner in its position)."""
    survivors = len(order) - sum(1 for n in order if n in vacated)
    coming = iter(joiners[: max(0, max_nodes - survivors)])
    target: list[str] = []
    replaced: dict[str, str] = {}
    for node in order:
        if node not in vacated:
            target.append(node)
            continue
        joiner = next(coming, None)
        if joiner is not None:
            target.append(joiner)
            replaced[node] = joiner
    target.extend(coming)
    if len(target) > max_nodes:
        kept = target[:max_nodes]
        return kept, {old: new for old, new in replaced.items() if new in kept}
    return target, replaced


def narrowed(plan: ReformPlan, nodes_after: Sequence[str], planned: bool) -> dict[str, Any]:
    """The plan's ``nodes_after``, ``strategy`` and ``replaced`` once it goes ahead with
    ``nodes_after`` (its targets less the lost ones), ``planned`` or not: a replacement lost
    before the re-form fills nothing, and a ``migrate`` that falls back to the unplanned path
    is a ``replace``."""
    kept = set(nodes_after)
    replaced = {old: new for old, new in plan.replaced.items() if new in kept}
    vacated = [n for n in plan.nodes_before if n not in kept]
    strategy = strategy_of(planned, plan.nodes_before, nodes_after, vacated, replaced)
    return {"nodes_after": list(nodes_after), "strategy": strategy.value, "replaced": replaced}


def strategy_of(planned: bool, before: Collection[str], target: Collection[str], vacated: Collection[str],
                replaced: Mapping[str, str]) -> ReformStrategy:
    """``migrate`` (planned) or ``replace`` (unplanned) when waiting nodes take every
    vacated position and the world keeps its size; ``elastic`` otherwise (no replacement,
    or some positions filled while the size still changes)."""
    if vacated and len(replaced) == len(vacated) and len(target) == len(before):
        return ReformStrategy.MIGRATE if planned else ReformStrategy.REPLACE
    return ReformStrategy.ELASTIC


def spares_of(joiners: Sequence[str], live: int, max_nodes: int, targets: AbstractSet[str]) -> list[str]:
    """The job's spares: the waiting ``joiners`` (healthy, not excluded, not on probation,
    oldest first) while the job trains at its max, less the ones the re-form in flight brings
    in. ``live``: the job's nodes now; ``targets``: the nodes of the re-form in flight (empty
    when none is), whose size is the one that counts while it is. Below max a waiting node
    grows the job: it is no spare."""
    if (len(targets) if targets else live) < max_nodes:
        return []
    return [n for n in joiners if n not in targets] if targets else list(joiners)
