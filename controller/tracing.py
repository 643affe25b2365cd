"""One trace per re-form, exported when it finishes, with ids fixed by its plan.

The spans' start and end times are the plan's recorded moments (signal seen, decision,
checkpoint request, ack, reform request, round formed, trainer resumed), so the trace
is the same whichever leader finishes the re-form.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

from controller.trace_ids import span_id
from regroup.records import ReformPlan


class _FixedIds(IdGenerator):
    """Hands out the ids the plan fixed, one span at a time."""

    def __init__(self) -> None:
        self.trace_id = 0
        self.span_id = 0

    def generate_trace_id(self) -> int:
        return self.trace_id

    def generate_span_id(self) -> int:
        return self.span_id


def _ns(t: float) -> int:
    return int(t * 1e9)


def phase_times(plan: ReformPlan) -> dict[str, tuple[float, float]]:
    """(start, end) unix times of each phase the re-form went through."""
    end = plan.finished_at
    phases: dict[str, tuple[float, float]] = {"detect": (plan.detected_at, plan.decided_at)}
    if plan.checkpoint_requested_at:
        phases["checkpoint"] = (plan.checkpoint_requested_at, plan.acked_at or plan.reform_requested_at or end)
    if plan.reform_requested_at:
        phases["rendezvous"] = (plan.reform_requested_at, plan.rendezvous_done_at or end)
    if plan.rendezvous_done_at:
        phases["resume"] = (plan.rendezvous_done_at, plan.resumed_at or end)
    return phases


def reform_end(plan: ReformPlan) -> float:
    return plan.resumed_at if plan.outcome == "completed" and plan.resumed_at else plan.finished_at


def emit_reform_trace(provider: Any, namespace: str, job: str, plan: ReformPlan) -> None:
    """Export the finished re-form ``plan`` as one trace (no-op without an SDK provider)."""
    if not isinstance(provider, TracerProvider):
        return
    ids = _FixedIds()
    tracer = provider.get_tracer("regroup.controller")
    tracer.id_generator = ids  # type: ignore[attr-defined]
    trace_id = int(plan.trace_id, 16)
    root_id = int(span_id(plan.trace_id, "root"), 16)
    ids.trace_id, ids.span_id = trace_id, root_id
    attributes = {
        "regroup.job": job,
        "regroup.namespace": namespace,
        "regroup.cause": plan.cause,
        "regroup.world_size.before": len(plan.nodes_before),
        "regroup.world_size.after": len(plan.nodes_after),
        "regroup.planned": plan.planned,
        "regroup.lost_steps": plan.lost_steps,
        "regroup.generation": plan.generation,
        "regroup.outcome": plan.outcome,
        "regroup.reason": plan.reason,
    }
    if plan.fallback:
        attributes["regroup.fallback"] = plan.fallback
    root = tracer.start_span("regroup.reform", context=trace.set_span_in_context(trace.INVALID_SPAN),
                             attributes=attributes, start_time=_ns(plan.detected_at))
    parent = trace.set_span_in_context(
        trace.NonRecordingSpan(SpanContext(trace_id, root_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    )
    for phase, (start, end) in phase_times(plan).items():
        ids.span_id = int(span_id(plan.trace_id, phase), 16)
        child = tracer.start_span(f"regroup.{phase}", context=parent, start_time=_ns(start),
                                  attributes={"regroup.job": job, "regroup.generation": plan.generation})
        if phase == "checkpoint" and plan.fallback:
            child.set_status(Status(StatusCode.ERROR, plan.fallback))
        child.end(end_time=_ns(max(start, end)))
    if plan.outcome != "completed":
        root.set_status(Status(StatusCode.ERROR, plan.outcome))
    root.end(end_time=_ns(max(plan.detected_at, reform_end(plan))))
