"""The records that carry a plan to the agents and trainers, and the plan's end.

A planned re-form asks for a checkpoint first (``control/checkpoint``); every re-form
then publishes the next round (``control/expected``) and asks for it (``control/reform``).
A checkpoint request lives no longer than its plan waits or holds on it
(``withdraw_stale_checkpoint``): a trainer must never hold for a re-form nobody will ask for.
"""

from __future__ import annotations

from collections.abc import Iterable
from operator import attrgetter
from typing import Any

from regroup.controller.decide.out import Out
from regroup.controller.reform_summary import WORKER_EXITED, completion_event, worker_exit_text
from regroup.controller.snapshot import (
    AFTER_PREVIOUS_PLAN,
    JobSnapshot,
    PostPodEvents,
    WithdrawCheckpointRequest,
    WriteCheckpointRequest,
    WriteExpected,
    WritePlan,
    WriteReform,
)
from regroup.controller.trace_ids import traceparent
from regroup.records import (
    CheckpointRequest,
    ExpectedMembership,
    ReformOutcome,
    ReformPhase,
    ReformPlan,
    ReformRequest,
    evolve,
)


_LOCAL_WORLD_SIZE = attrgetter("local_world_size")


def checkpoint_request(plan: ReformPlan) -> CheckpointRequest:
    """The checkpoint request of a planned re-form, under its checkpoint span."""
    return CheckpointRequest(
        generation=plan.generation,
        deadline=plan.checkpoint_deadline,
        hold=True,
        reason=plan.reason,
        traceparent=traceparent(plan.trace_id, ReformPhase.CHECKPOINT.value),
        requested_at=plan.checkpoint_requested_at,
        leaving=sorted(set(plan.nodes_before) - set(plan.nodes_after)),
    )


def request_reform(s: JobSnapshot, plan: ReformPlan, now: float) -> ReformPlan:
    """The plan as it stands when ``control/expected`` and ``control/reform`` go out."""
    return evolve(plan, **reform_request_fields(s, plan.generation, plan.nodes_after, now))


def reform_request_fields(s: JobSnapshot, generation: int, nodes_after: Iterable[str], now: float) -> dict[str, Any]:
    """What a plan records when its ``control/expected`` and ``control/reform`` go out."""
    step = s.progress.step if s.progress is not None else -1
    ack = s.acks.get(generation)
    if ack is not None:
        step = max(step, ack.step)
    # In C: the planned members' local world sizes (a member record is never falsy).
    ranks = sum(map(_LOCAL_WORLD_SIZE, filter(None, map(s.members.get, nodes_after))))
    return {
        "phase": ReformPhase.RENDEZVOUS,
        "reform_requested_at": now,
        "step_before": step,
        "progress_revision": s.progress_revision,
        "world_size_target": ranks,
    }


def reform_writes(plan: ReformPlan, out: Out, s: JobSnapshot | None = None) -> None:
    """Write the plan's expected membership and reform request, each unless ``s`` shows it already."""
    expected = s is None or s.expected is None or s.expected.generation != plan.generation
    reform = s is None or s.reform is None or s.reform.generation != plan.generation
    if not (expected or reform):
        return
    rdzv = traceparent(plan.trace_id, ReformPhase.RENDEZVOUS.value)
    if expected:
        out.actions.append(
            WriteExpected(ExpectedMembership(plan.generation, list(plan.nodes_after), plan.reason, rdzv))
        )
    if reform:
        out.actions.append(
            WriteReform(ReformRequest(plan.generation, plan.cause.value, plan.reason, rdzv, plan.reform_requested_at))
        )


def finish(s: JobSnapshot, plan: ReformPlan, now: float, outcome: ReformOutcome, out: Out, why: str) -> str:
    """End the plan. A completed one is told on each of the job's pods (a Normal Event
    ``Resized``, or ``NodeReplaced``/``NodeMigrated`` when waiting nodes took the leaving
    nodes' positions: ``reform_summary.completion_event``); one that did not complete is
    abandoned loudly (a Warning Event on each of the job's pods; the trace and the metric
    carry ``why``), and the decision goes on to start what the job needs now
    (``out.abandoned``). Workers that exited during it instead of re-forming in place are
    told by a Warning Event of their own, with the cause their agents recorded."""
    exits = worker_exit_text(s.members, plan)
    done = evolve(plan, phase=ReformPhase.DONE, outcome=outcome, finished_at=now, why=why, worker_exit=exits)
    out.actions.append(WritePlan(done, s.plan_revision, finished=True))
    if exits:
        out.actions.append(PostPodEvents(s.pods, "Warning", WORKER_EXITED, f"re-form {plan.generation}: {exits}"))
    if outcome == ReformOutcome.COMPLETED:
        reason, message = completion_event(done, cordoned=[n for n, info in s.nodes.items() if info.unschedulable])
        out.actions.append(PostPodEvents(s.pods, "Normal", reason, message))
    else:
        what = f"re-form {plan.generation} ({plan.cause.value}, phase {plan.phase.value})"
        out.actions.append(PostPodEvents(s.pods, "Warning", "ReformAbandoned", f"{what} abandoned, {outcome.value}: {why}"))
        out.abandoned = True
    return f"re-form {plan.generation} {outcome.value}: {why}"


def withdraw_stale_checkpoint(s: JobSnapshot, out: Out) -> None:
    """Withdraw ``control/checkpoint`` once its plan no longer waits or holds on it: the plan
    (as this decision leaves it) ended, fell back to the unplanned path without the ack, or
    is another generation's. Trainers hold at a boundary on a request with ``hold``; left in
    place, a dropped plan's request would stop the survivors of the re-form that replaced it
    until its deadline. A request of a newer generation than the plan is not this
    controller's to judge. Fenced: the delete applies only while the request and the plan
    are still what this decision saw (``WithdrawCheckpointRequest``)."""
    request = s.checkpoint
    if request is None:
        return
    plan, plan_revision = s.plan, s.plan_revision
    for action in reversed(out.actions):
        if type(action) is WriteCheckpointRequest:
            return  # this decision writes the request of its own plan over it
        if type(action) is WritePlan:
            plan, plan_revision = action.plan, AFTER_PREVIOUS_PLAN
            break
    if plan is None or request.generation > plan.generation:
        return
    if request.generation == plan.generation and plan.planned and plan.phase != ReformPhase.DONE:
        return  # its plan waits for the ack, or holds the trainers on it until the re-form
    out.actions.append(WithdrawCheckpointRequest(request.generation, s.checkpoint_revision, plan_revision))
