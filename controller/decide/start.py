"""Starting a re-form when no plan is in flight: replace lost nodes, shrink ahead of a
reclaim, shrink to max, grow with joiners, or report the job stalled below min (a job
whose first round has not formed yet first gets the rendezvous' time to gather its nodes)."""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from typing import Any, NamedTuple

from regroup.controller.cluster import PodInfo
from regroup.controller.decide.health import joiner_seen
from regroup.controller.decide.out import Out
from regroup.controller.decide.positions import fill_positions, round_order, strategy_of
from regroup.controller.decide.situation import Situation
from regroup.controller.decide.writes import checkpoint_request, reform_request_fields, reform_writes
from regroup.controller.signals import ReclaimNotice
from regroup.controller.snapshot import JobSnapshot, PostEvent, WriteCheckpointRequest, WritePlan
from regroup.controller.trace_ids import new_trace_id
from regroup.records import ReformCause, ReformPhase, ReformPlan, ReformStrategy


def start(sit: Situation, world: AbstractSet[str], joiners: list[str], newest: PodInfo | None) -> tuple[str, bool]:
    """Begin a re-form if the job needs one. Returns (reason, stalled)."""
    config, health = sit.config, sit.health
    lost = {n: r for n, r in health.lost.items() if n in world}
    leaving = {n: notice for n, notice in health.notices.items() if n in world}
    if lost or leaving:
        before = sorted(world)
        # Replace before shrinking: waiting nodes take the lost and leaving nodes' positions
        # in the round's rank order, every survivor keeps its own.
        vacated = lost.keys() | leaving.keys()
        target, replaced = fill_positions(round_order(sit.s, world), vacated, joiners, config.max_nodes)
        swap = Swap(vacated, replaced)
        if lost:
            return _replace_lost(sit, before, target, lost, newest, swap)
        return _shrink_for_reclaim(sit, before, target, leaving, newest, swap)
    if len(world) > config.max_nodes:
        return _shrink_to_max(sit, sorted(world))
    live = len(world)
    if joiners and live < config.max_nodes:
        return _grow(sit, world, joiners, newest)
    if world and live < config.min_nodes:
        if not sit.s.world_round:
            return _first_round(sit, world, newest)
        return _stall(sit.s, sit.out, newest, f"{live} nodes, below min {config.min_nodes}")
    if joiners:
        return f"{len(joiners)} nodes waiting, job at max {config.max_nodes}", False
    return f"steady at {live} nodes", False


class Swap(NamedTuple):
    """The positions a loss or a reclaim vacates, and the waiting nodes that fill them."""

    vacated: AbstractSet[str]
    replaced: dict[str, str]
    """Vacated node -> the waiting node in its position."""


def _replace_lost(
    sit: Situation, before: list[str], target: list[str], lost: Mapping[str, str], newest: PodInfo | None, swap: Swap
) -> tuple[str, bool]:
    """Unplanned: the lost nodes' ranks are gone already, so re-form at once without them
    (waiting nodes in their positions)."""
    storm_only = all(n in sit.health.storm for n in lost)
    cause = ReformCause.RESTART_STORM if storm_only else ReformCause.NODE_LOST
    what = ", ".join(f"{n} ({r})" for n, r in sorted(lost.items()))
    if len(target) < sit.config.min_nodes:
        return _stall(sit.s, sit.out, newest, f"lost {what}: {len(target)} nodes left, below min {sit.config.min_nodes}")
    detected = min(sit.health.lost_since[n] for n in lost)
    strategy = _begin(sit, cause, False, f"lost {what}", before, target, detected, swap=swap)
    how = cause.value if strategy == ReformStrategy.ELASTIC else f"{cause.value}, {strategy.value}"
    return f"unplanned re-form ({how}): lost {what}{_by(swap)}", False


def _shrink_for_reclaim(
    sit: Situation,
    before: list[str],
    target: list[str],
    leaving: Mapping[str, ReclaimNotice],
    newest: PodInfo | None,
    swap: Swap,
) -> tuple[str, bool]:
    """Planned when the checkpoint fits inside every notice (less the margin) and the trainer
    has reported; else unplanned at once. Waiting nodes take the leaving nodes' positions."""
    s, now, config = sit.s, sit.now, sit.config
    what = ", ".join(f"{n} ({notice.signal}, {notice.source})" for n, notice in sorted(leaving.items()))
    if len(target) < config.min_nodes:
        return _stall(s, sit.out, newest, f"reclaim of {what} leaves {len(target)} nodes, below min {config.min_nodes}")
    detected = min(sit.health.seen[n] for n in leaving)
    deadline = now + config.checkpoint_timeout.total_seconds()
    margin = sit.settings.reform.notice_margin.total_seconds()
    for notice in leaving.values():
        if notice.ends_at is not None:
            # A short notice (a 5 s grace) keeps half of itself for the re-form, not the margin.
            deadline = min(deadline, notice.ends_at - min(margin, (notice.ends_at - notice.since) / 2))
    planned = deadline > now and trainer_answers(s)
    strategy = _begin(sit, ReformCause.RECLAIM, planned, f"reclaim notice on {what}", before, target, detected,
                      deadline, swap)
    kind = "shrink" if strategy == ReformStrategy.ELASTIC else strategy.value
    return f"{'planned' if planned else 'unplanned'} {kind} (reclaim): {what}{_by(swap)}", False


def _shrink_to_max(sit: Situation, before: list[str]) -> tuple[str, bool]:
    """More nodes than the job's max (the max was lowered): keep the first ``max`` by name."""
    config, now = sit.config, sit.now
    target = before[: config.max_nodes]
    deadline = now + config.checkpoint_timeout.total_seconds()
    why = f"{len(before)} nodes exceed max {config.max_nodes}"
    _begin(sit, ReformCause.MANUAL, trainer_answers(sit.s), why, before, target, now, deadline)
    return f"shrink to max: {why}", False


def _grow(sit: Situation, world: AbstractSet[str], joiners: list[str], newest: PodInfo | None) -> tuple[str, bool]:
    """Gather joiners for the join window (or until max), then re-form with them."""
    s, now, config = sit.s, sit.now, sit.config
    live = len(world)
    capacity = config.max_nodes - live
    # A joiner can only be added once the current round exists: the wait starts then.
    opened = max(joiner_seen(s, joiners[0]), s.round_times[-1] if s.round_times else 0.0)
    closes = opened + config.join_window.total_seconds()
    if now < closes and len(joiners) < capacity:
        sit.out.again_in(closes - now)
        return f"gathering {len(joiners)} joining nodes until the join window closes", live < config.min_nodes
    before = sorted(world)
    # Joiners are appended: every node of the round keeps its position.
    target = _clamp(round_order(s, world), joiners, config.max_nodes)
    if len(target) < config.min_nodes:
        return _stall(s, sit.out, newest, f"{len(target)} nodes available, below min {config.min_nodes}")
    added = ", ".join(target[live:])
    planned = live >= config.min_nodes and trainer_answers(s)
    deadline = now + config.checkpoint_timeout.total_seconds()
    _begin(sit, ReformCause.GROW, planned, f"nodes joining: {added}", before, target, min(opened, now), deadline)
    return f"grow to {len(target)} nodes: {added} joining", False


def _first_round(sit: Situation, world: AbstractSet[str], newest: PodInfo | None) -> tuple[str, bool]:
    """No round has formed yet and fewer than min nodes have registered for the first: the
    agents of a starting job register one by one, so this is how every job starts, not a
    stall. It is one once the nodes have had the rendezvous' time to gather
    (``rendezvous_timeout`` since the first of them registered) and are still too few."""
    s, now, config = sit.s, sit.now, sit.config
    first = min((joiner_seen(s, n) for n in world if n in s.members), default=now)
    gave_up_at = first + sit.settings.reform.rendezvous_timeout.total_seconds()
    if now < gave_up_at:
        sit.out.again_in(gave_up_at - now)
        return f"starting: {len(world)} of min {config.min_nodes} nodes registered for the first round", False
    why = f"{len(world)} nodes, below min {config.min_nodes}, {now - first:.0f}s after the first registered"
    return _stall(s, sit.out, newest, why)


def trainer_answers(s: JobSnapshot) -> bool:
    """Whether a checkpoint request can be answered: the trainer reports progress from the
    job's current round (or reports no round). A round whose trainer has not resumed (it is
    still forming, or was superseded while forming) acks nothing: a plan that asked it would
    wait out its deadline for nothing, so the re-form goes ahead unplanned (in place, the
    live state is handed over at the agreed boundary all the same)."""
    progress = s.progress
    return progress is not None and progress.round in (0, s.world_round)


def _stall(s: JobSnapshot, out: Out, newest: PodInfo | None, why: str) -> tuple[str, bool]:
    if newest is not None:
        ref = newest.ref
        out.actions.append(PostEvent(ref, "Warning", "JobStalled", f"job {s.job} stalled: {why}"))
    return f"stalled: {why}", True


def _clamp(survivors: list[str], joiners: list[str], max_nodes: int) -> list[str]:
    """The first ``max_nodes`` of ``survivors``, then joiners up to the max."""
    keep = survivors[:max_nodes]
    return keep + joiners[: max(0, max_nodes - len(keep))]


def _by(swap: Swap) -> str:
    """``; n5 takes n3's position`` for each replacement, for the decision's reason."""
    if not swap.replaced:
        return ""
    return "; " + ", ".join(f"{new} takes {old}'s position" for old, new in sorted(swap.replaced.items()))


def _next_generation(s: JobSnapshot) -> int:
    gens = [0]
    for record in (s.plan, s.checkpoint, s.expected, s.reform):
        if record is not None:
            gens.append(record.generation)
    gens.extend(s.acks)
    return max(gens) + 1


def _begin(
    sit: Situation,
    cause: ReformCause,
    planned: bool,
    reason: str,
    before: list[str],
    target: list[str],
    detected: float,
    deadline: float = 0.0,
    swap: Swap | None = None,
) -> ReformStrategy:
    """Write the new plan and its first request: the checkpoint when planned, else the re-form.
    Returns the plan's strategy."""
    s, now, out = sit.s, sit.now, sit.out
    generation = _next_generation(s)
    replaced = dict(swap.replaced) if swap is not None else {}
    strategy = strategy_of(planned, before, target, swap.vacated if swap is not None else (), replaced)
    common: dict[str, Any] = {
        "generation": generation,
        "cause": cause,
        "planned": planned,
        "reason": reason,
        "nodes_before": before,
        "nodes_after": list(target),
        "trace_id": new_trace_id(s.namespace, s.job, generation, now),
        "detected_at": min(detected, now),
        "decided_at": now,
        "round_before": s.world_round,
        "strategy": strategy.value,
        "replaced": replaced,
    }
    if planned:
        plan = ReformPlan(**common, phase=ReformPhase.CHECKPOINT, checkpoint_requested_at=now,
                          checkpoint_deadline=deadline)
        out.actions.append(WritePlan(plan, sit.plan_revision))
        out.actions.append(WriteCheckpointRequest(checkpoint_request(plan)))
        out.again_in(deadline - now)
    else:
        # Built whole: the plan as it stands once the re-form is requested.
        plan = ReformPlan(**common, **reform_request_fields(s, generation, target, now))
        out.actions.append(WritePlan(plan, sit.plan_revision))
        reform_writes(plan, out)
        out.again_in(sit.settings.reform.rendezvous_timeout.total_seconds())
    return strategy
