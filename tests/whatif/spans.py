"""Writes a job's spans as the controller and the trainers export them: the controller's
trace from a finished ``ReformPlan`` (``emit_reform_trace``), the trainers' spans under the
``traceparent`` the plan hands them, through regroup's OTLP JSON-lines exporter.

Times are seconds after ``T0``.
"""

from __future__ import annotations

from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from regroup.controller.trace_ids import new_trace_id, traceparent
from regroup.controller.tracing import emit_reform_trace
from regroup.records import ReformPlan
from regroup.telemetry import JsonLinesSpanExporter, context_from_traceparent

T0 = 1_700_000_000.0
IN_PLACE = {"process_group": 0.1, "reshard": 0.3, "first_step": 0.2}
RESTART = {"startup": 4.0, "process_group": 0.1, "load": 0.5, "first_step": 0.2}


def _ns(at: float) -> int:
    return int((T0 + at) * 1e9)


class RecordedJob:
    """One job's spans file, written as the re-forms happen."""

    def __init__(self, path: Path) -> None:
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
        self.trainer = self.provider.get_tracer("regroup.trainer")
        self.generation = 0

    def reform(self, cause: str, before: int, after: int, at: float, *, planned: bool = False, detect: float = 0.0,
               checkpoint: float = 0.0, rendezvous: float = 0.5, resume: float = 1.0, lost_steps: int = 0,
               mode: str = "in-place", outcome: str = "completed", reason: str = "") -> str:  # fmt: skip
        """The controller's trace of one re-form detected ``at`` (``reason``: its plan's, the
        cause by default); returns its trace id."""
        self.generation += 1
        decided = at + detect
        asked = decided + checkpoint
        formed = asked + rendezvous
        nodes = [f"n{i}" for i in range(max(before, after))]
        trace_id = new_trace_id("default", "job", self.generation, T0 + decided)
        plan = ReformPlan(
            generation=self.generation, cause=cause, planned=planned, phase="done", reason=reason or cause,
            nodes_before=nodes[:before], nodes_after=nodes[:after], trace_id=trace_id,
            detected_at=T0 + at, decided_at=T0 + decided,
            checkpoint_requested_at=T0 + decided if planned else 0.0, acked_at=T0 + asked if planned else 0.0,
            reform_requested_at=T0 + asked, rendezvous_done_at=T0 + formed, resumed_at=T0 + formed + resume,
            lost_steps=lost_steps, outcome=outcome, finished_at=T0 + formed + resume, mode=mode,
        )  # fmt: skip
        emit_reform_trace(self.provider, "default", "job", plan)
        return trace_id

    def checkpoint(self, trace_id: str, at: float, seconds: float, step: int, world: int, *,
                   stored: bool = False) -> None:  # fmt: skip
        """Rank 0's ``regroup.trainer.checkpoint`` for the re-form's request."""
        parent = context_from_traceparent(traceparent(trace_id, "checkpoint"))
        span = self.trainer.start_span("regroup.trainer.checkpoint", context=parent, start_time=_ns(at))
        span.set_attributes({"regroup.step": step, "regroup.checkpoint.duration_s": seconds,
                             "regroup.checkpoint.bytes": 1000 if stored else 0, "regroup.checkpoint.stored": stored,
                             "regroup.world_size": world})  # fmt: skip
        span.end(end_time=_ns(at + seconds))

    def resume(self, trace_id: str, at: float, end: float, resumed_from: int, world: int, *,
               phases: dict[str, float] = IN_PLACE, mode: str = "in-place") -> None:  # fmt: skip
        """Rank 0's ``regroup.trainer.resume`` after the first step in a new world."""
        attributes = {"regroup.resumed_from_step": resumed_from, "regroup.world_size": world,
                      "regroup.restart_count": 0, "regroup.reform.mode": mode}  # fmt: skip
        attributes.update({f"regroup.resume.{k}_s": v for k, v in phases.items()})
        parent = context_from_traceparent(traceparent(trace_id, "root"))
        span = self.trainer.start_span("regroup.trainer.resume", context=parent, start_time=_ns(at))
        span.set_attributes(attributes)
        span.end(end_time=_ns(end))

    def join(self, number: int, nodes: tuple[str, ...], at: float, formed: float, first_rank: int = 0) -> None:
        """Each agent's ``regroup.rendezvous.join`` of round ``number``, from ``at`` until it
        formed, in the positions from ``first_rank`` on."""
        agents = self.provider.get_tracer("regroup.rendezvous")
        for rank, node in enumerate(nodes, first_rank):
            attributes = {"regroup.job": "job", "regroup.node": node, "regroup.round": number, "regroup.rank": rank,
                          "regroup.node_count": len(nodes), "regroup.restart_count": 0}  # fmt: skip
            span = agents.start_span("regroup.rendezvous.join", start_time=_ns(at), attributes=attributes)
            span.end(end_time=_ns(formed))

    def close(self) -> None:
        self.provider.shutdown()
