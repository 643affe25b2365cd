"""When each resize of a recorded run was decided, re-formed and trained again.

Pure functions over a loaded run (``regroup.demo.analysis.RunData``): the scripted resizes, the
controller's re-form plans, the worlds the trainer's progress shows, and the latency from
a resize's cause to the first step of the world after it."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from regroup.demo.analysis import ProgressSample, RunData, ScriptedEvent, event_impacts, scripted_events, step_interval
from regroup.records import SCHEMA_VERSION, ReformCause, ReformPlan


@dataclass(frozen=True)
class ScriptedResize:
    """A scripted event with the job's size, in ranks, that the script implies around it."""

    event: ScriptedEvent
    ranks_before: int
    ranks_after: int


def scripted_resizes(run: RunData) -> list[ScriptedResize]:
    """Each scripted event with the world size the script implies before and after it.

    The job trains on as many live nodes as its max allows: a reclaimed, drained or lost
    node leaves, a restored or uncordoned one comes back; an evicted pod leaves and its
    replacement comes back on the same node before the next event. A flaky node stays until the controller cordons
    it, which the script does not decide, so it changes nothing here.
    """
    nodes = set(run.meta.get("nodes", ()))
    cap = int(run.meta.get("max_nodes", len(nodes)))
    per_node = int(run.meta.get("nproc_per_node", 1))
    resizes = []
    for event in scripted_events(run):
        before = min(len(nodes), cap) * per_node
        if event.reason == "evict":
            # The pod goes; its replacement comes back on the same node for the next event.
            after = min(len(nodes - set(event.nodes)), cap) * per_node
            resizes.append(ScriptedResize(event, before, after))
            continue
        if event.reason in ("reclaim", "drain", "lose", "vanish"):
            nodes -= set(event.nodes)
        elif event.reason in ("restore", "uncordon"):
            nodes |= set(event.nodes)
        resizes.append(ScriptedResize(event, before, min(len(nodes), cap) * per_node))
    return resizes


def world_segments(progress: list[ProgressSample]) -> list[list[ProgressSample]]:
    """Progress split by the world the trainer trained in.

    A new world begins when the rendezvous round changes (when the trainer reports it),
    the world size changes, or training resumed from a checkpoint (a new incarnation).
    """
    segments: list[list[ProgressSample]] = []
    for sample in progress:
        previous = segments[-1][-1] if segments else None
        if (
            previous is None
            or (sample.round and previous.round and sample.round != previous.round)
            or sample.world_size != previous.world_size
            or sample.resumed_from_step != previous.resumed_from_step
            or sample.step < previous.step
        ):
            segments.append([sample])
        else:
            segments[-1].append(sample)
    return segments


def world_starts(progress: list[ProgressSample]) -> list[ProgressSample]:
    """The first progress record of each world (``world_segments``). The trainer publishes
    a world's progress once its first step there completed: training was back then."""
    return [segment[0] for segment in world_segments(progress)]


def first_progress_at(
    run: RunData, after: float, world_size: int, before: float | None = None
) -> ProgressSample | None:
    """The first training step of a world of ``world_size`` ranks that began after
    ``after`` (and before ``before``); None if there was none.

    A world of that size already training at ``after`` does not count: it was not
    formed in answer to what happened then.
    """
    for start in world_starts(run.progress):
        if start.time <= after or start.world_size != world_size:
            continue
        if before is not None and start.time >= before:
            return None
        return start
    return None


def reform_plans(run: RunData) -> list[ReformPlan]:
    """The controller's re-form plans, each as last recorded, in the order they were decided."""
    last: dict[int, dict[str, Any]] = {}
    for body in run.plans:
        last[int(body["generation"])] = body
    plans = [ReformPlan.from_json(json.dumps({**body, "v": SCHEMA_VERSION})) for body in last.values()]
    return sorted(plans, key=lambda p: p.decided_at)


@dataclass(frozen=True)
class ResizeLatency:
    """From a scripted resize to the first training step at the size it implies."""

    event: ScriptedEvent
    ranks_before: int
    ranks_after: int
    start: float
    """The moment measured from (unix seconds)."""
    start_from: str
    """What ``start`` is: ``taint``, ``eviction``, ``drain``, ``kill``, ``grow plan decided`` or
    ``restore + join window``."""
    reached: ProgressSample | None
    """The first progress at ``ranks_after``; None when none came before the next scripted
    event (or the end of the run)."""
    lost_steps: int
    """Steps lost to the event (``EventImpact.lost_steps``)."""

    @property
    def seconds(self) -> float | None:
        return None if self.reached is None else self.reached.time - self.start


def grow_decided_at(run: RunData, after: float, before: float | None = None) -> float | None:
    """When the controller closed the join window of the first grow it decided in
    [``after``, ``before``): the grow plan's ``decided_at``; None without one."""
    for plan in reform_plans(run):
        if plan.cause == ReformCause.GROW and plan.decided_at >= after and (before is None or plan.decided_at < before):
            return plan.decided_at
    return None


def reform_latencies(run: RunData, join_window: float) -> list[ResizeLatency]:
    """For each scripted reclaim, eviction, drain, loss (abrupt or silent), restore and uncordon: seconds until
    training at the new size.

    Measured from the reclaim taint, the eviction (or the drain's cordon), the kill, and for
    a restore (or an uncordon) the moment the join
    window closed: the grow plan's ``decided_at``, or, where no controller decided a grow
    (plain torchrun), the restore plus ``join_window`` seconds. The search for the new
    size ends at the next scripted event.
    """
    resizes = scripted_resizes(run)
    impacts = event_impacts(run)
    latencies = []
    for i, (resize, impact) in enumerate(zip(resizes, impacts)):
        event = resize.event
        if event.reason not in ("reclaim", "evict", "drain", "lose", "vanish", "restore", "uncordon"):
            continue
        until = resizes[i + 1].event.time if i + 1 < len(resizes) else None
        if event.reason == "reclaim":
            start, start_from = event.time, "taint"
        elif event.reason in ("evict", "drain"):
            start, start_from = event.time, "eviction" if event.reason == "evict" else "drain"
        elif event.reason in ("lose", "vanish"):
            start, start_from = event.time, "kill"
        else:
            decided = grow_decided_at(run, event.time, until)
            if decided is not None:
                start, start_from = decided, "grow plan decided"
            else:
                start, start_from = event.time + join_window, f"{event.reason} + join window"
        reached = first_progress_at(run, event.time, resize.ranks_after, until)
        latencies.append(
            ResizeLatency(event, resize.ranks_before, resize.ranks_after, start, start_from, reached, impact.lost_steps)
        )
    return latencies


def training_at(run: RunData, moment: float) -> bool:
    """Whether the job was training at ``moment`` or trained at any time after it."""
    gap = max(3.0, 4 * step_interval(run.progress))
    return any(p.time >= moment - gap for p in run.progress)


@dataclass(frozen=True)
class WorldChange:
    """The job trained in a new world: one re-form as the trainer lived it."""

    at: float
    """Time of the first step in the new world."""
    round: int
    """Rendezvous round of the new world (0: not reported)."""
    ranks_before: int
    ranks_after: int
    mode: str
    """``in-place`` or ``restart``, as the trainer reported it ("" not reported)."""
    resume_phases: dict[str, float]
    """Seconds of the resume by phase, as the trainer's rank 0 reported it."""
    cause: str
    """Cause of the controller's plan that led to this round ("" no plan names it)."""
    planned: bool = False
    plan_mode: str = ""
    """The ``mode`` that plan recorded ("" none), to compare with the trainer's."""


def world_changes(run: RunData) -> list[WorldChange]:
    """Every new world after the first, with how the workers reached it and what the
    resume cost, from the trainer's own progress records; the cause comes from the plan
    whose ``round_after`` is the new round.

    The trainer's word is preferred over the plan's ``mode`` and ``resume_phases``: a
    plan may finish on progress of the old world and copy its values.
    """
    plans = {p.round_after: p for p in reform_plans(run) if p.round_after}
    changes = []
    for before, world in itertools.pairwise(world_segments(run.progress)):
        start = world[0]
        plan = plans.get(start.round) if start.round else None
        changes.append(
            WorldChange(
                at=start.time,
                round=start.round,
                ranks_before=before[0].world_size,
                ranks_after=start.world_size,
                mode=next((p.reform_mode for p in world if p.reform_mode), ""),
                resume_phases=dict(next((p.resume_phases for p in world if p.resume_phases), {})),
                cause=plan.cause.value if plan is not None else "",
                planned=plan.planned if plan is not None else False,
                plan_mode=plan.mode if plan is not None else "",
            )
        )
    return changes
