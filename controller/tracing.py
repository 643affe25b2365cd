"""One trace per re-form, exported when it finishes, with ids fixed by its plan.

The spans' start and end times are the plan's recorded moments (first evidence of the
signal, decision, checkpoint request, ack, reform request, round formed, trainers resumed),
each taken from whoever knew it, by their own clock where they say it (``decide.phases``,
``decide.health``), so the trace is the same whichever leader finishes the re-form, and a
leader that takes a plan over does not stretch it to when it first looked. The resume span
is split further by the seconds the trainer's rank 0 reported per resume phase (startup,
process group, reshard or load, first step).
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import SpanContext, Status, StatusCode, TraceFlags

from regroup.controller.reform_summary import reform_end, replaced_text
from regroup.controller.trace_ids import span_id
from regroup.records import DETECT_PHASE, Progress, ReformOutcome, ReformPhase, ReformPlan


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
    """(start, end) unix times of each phase the re-form went through, by its name in
    ``TRACED_PHASES`` (a plain string: it names spans and labels metrics)."""
    end = plan.finished_at
    phases: dict[str, tuple[float, float]] = {DETECT_PHASE: (plan.detected_at, plan.decided_at)}
    if plan.checkpoint_requested_at:
        checkpoint_end = plan.acked_at or plan.reform_requested_at or end
        phases[ReformPhase.CHECKPOINT.value] = (plan.checkpoint_requested_at, checkpoint_end)
    if plan.reform_requested_at:
        phases[ReformPhase.RENDEZVOUS.value] = (plan.reform_requested_at, plan.rendezvous_done_at or end)
    if plan.rendezvous_done_at:
        phases[ReformPhase.RESUME.value] = (plan.rendezvous_done_at, plan.resumed_at or end)
    return phases


def resume_phase_times(plan: ReformPlan) -> dict[str, tuple[float, float]]:
    """(start, end) of each resume sub-phase rank 0 reported, in ``Progress.RESUME_PHASES`` order.

    The trainer reports durations, not moments: they are laid back to back from the resume
    span's start and clipped to its end, the trainers' first step at the new size.
    """
    window = phase_times(plan).get(ReformPhase.RESUME.value)
    if window is None:
        return {}
    start, end = window[0], max(window)
    known = [p for p in Progress.RESUME_PHASES if p in plan.resume_phases]
    # A newer trainer may report phases this controller does not know: keep them, last.
    names = known + sorted(set(plan.resume_phases) - set(known))
    times: dict[str, tuple[float, float]] = {}
    at = start
    for name in names:
        seconds = plan.resume_phases[name]
        if not isinstance(seconds, int | float):  # the record is JSON from another process
            continue
        times[name] = (min(at, end), min(at + max(0.0, seconds), end))
        at += max(0.0, seconds)
    return times


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
        "regroup.cause": plan.cause.value,
        "regroup.node_count.before": len(plan.nodes_before),
        "regroup.node_count.after": len(plan.nodes_after),
        "regroup.planned": plan.planned,
        "regroup.lost_steps": plan.lost_steps,
        "regroup.generation": plan.generation,
        "regroup.outcome": plan.outcome.value,
        "regroup.reason": plan.reason,
        "regroup.strategy": plan.strategy,
    }
    if plan.replaced:
        attributes["regroup.replaced"] = replaced_text(plan.replaced)
    if plan.fallback:
        attributes["regroup.fallback"] = plan.fallback
    if plan.why:
        attributes["regroup.why"] = plan.why
    if plan.mode:
        attributes["regroup.reform.mode"] = plan.mode
    if plan.worker_exit:
        attributes["regroup.worker_exit"] = plan.worker_exit
    root = tracer.start_span("regroup.reform", context=trace.set_span_in_context(trace.INVALID_SPAN),
                             attributes=attributes, start_time=_ns(plan.detected_at))
    parent = trace.set_span_in_context(
        trace.NonRecordingSpan(SpanContext(trace_id, root_id, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED)))
    )
    for phase, (start, end) in phase_times(plan).items():
        ids.span_id = int(span_id(plan.trace_id, phase), 16)
        child = tracer.start_span(f"regroup.{phase}", context=parent, start_time=_ns(start),
                                  attributes={"regroup.job": job, "regroup.generation": plan.generation})
        if phase == ReformPhase.CHECKPOINT and plan.fallback:
            child.set_status(Status(StatusCode.ERROR, plan.fallback))
        if phase == ReformPhase.RESUME:
            _resume_children(tracer, ids, plan, child, job)
        child.end(end_time=_ns(max(start, end)))
    if plan.outcome != ReformOutcome.COMPLETED:
        outcome = plan.outcome.value
        root.set_status(Status(StatusCode.ERROR, f"{outcome}: {plan.why}" if plan.why else outcome))
    root.end(end_time=_ns(max(plan.detected_at, reform_end(plan))))


def _resume_children(tracer: Any, ids: _FixedIds, plan: ReformPlan, resume: Any, job: str) -> None:
    """``regroup.resume.<phase>`` spans under ``resume``, and each phase's reported seconds on it."""
    parent = trace.set_span_in_context(resume)
    for phase, (start, end) in resume_phase_times(plan).items():
        # The reported value, unclipped: the span shows the layout, the attribute the measurement.
        resume.set_attribute(f"regroup.resume.{phase}_s", float(plan.resume_phases[phase]))
        ids.span_id = int(span_id(plan.trace_id, f"resume.{phase}"), 16)
        tracer.start_span(f"regroup.resume.{phase}", context=parent, start_time=_ns(start),
                          attributes={"regroup.job": job, "regroup.generation": plan.generation}).end(end_time=_ns(end))
