"""The re-form trace built from a finished plan: names, attributes, ids and times."""

from __future__ import annotations

import dataclasses

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from regroup.controller.cluster import ContainerRestarts
from regroup.controller.reform_summary import resize_message
from regroup.controller.settings import ControllerSettings
from regroup.controller.trace_ids import new_trace_id, span_id
from regroup.controller.tracing import emit_reform_trace
from regroup.records import Progress, ReformPlan

from .builders import JOB, NS, T0, job, member, registered, step

TRACE = new_trace_id(NS, JOB, 4, T0)
# The resume phase runs 2 s, from the round forming (T0 + 10) to the new progress (T0 + 12).
PLAN = ReformPlan(
    generation=4, cause="node-lost", planned=False, phase="done", reason="n3 lost", nodes_before=["n1", "n2", "n3"],
    nodes_after=["n1", "n2"], trace_id=TRACE, detected_at=T0, decided_at=T0 + 1, reform_requested_at=T0 + 1,
    rendezvous_done_at=T0 + 10, resumed_at=T0 + 12, lost_steps=0, outcome="completed", finished_at=T0 + 12,
    mode="in-place", resume_phases={"first_step": 0.75, "reshard": 1.0, "process_group": 0.5},
)  # fmt: skip


def spans_of(plan: ReformPlan) -> dict[str, object]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    emit_reform_trace(provider, NS, JOB, plan)
    return {s.name: s for s in exporter.get_finished_spans()}


def test_the_root_names_the_mode_and_the_resume_span_carries_each_phase() -> None:
    spans = spans_of(PLAN)
    assert spans["regroup.reform"].attributes["regroup.reform.mode"] == "in-place"
    resume = spans["regroup.resume"]
    # As the trainer measured them, even where the span had to be clipped.
    assert {k: v for k, v in resume.attributes.items() if k.startswith("regroup.resume.")} == {
        "regroup.resume.process_group_s": 0.5, "regroup.resume.reshard_s": 1.0, "regroup.resume.first_step_s": 0.75,
    }  # fmt: skip


def test_resume_phases_are_children_back_to_back_clipped_to_the_resume_span() -> None:
    spans = spans_of(PLAN)
    resume = spans["regroup.resume"]
    children = sorted((s for s in spans.values() if s.parent and s.parent.span_id == resume.context.span_id),
                      key=lambda s: s.start_time)  # fmt: skip
    assert [c.name for c in children] == ["regroup.resume.process_group", "regroup.resume.reshard", "regroup.resume.first_step"]
    ns = 1e9
    assert [(round(c.start_time / ns - T0, 3), round(c.end_time / ns - T0, 3)) for c in children] == [
        (10.0, 10.5), (10.5, 11.5), (11.5, 12.0),  # first_step reported 0.75 s: clipped at the resume's end
    ]  # fmt: skip
    for child in children:
        name = child.name.removeprefix("regroup.")
        assert child.context.span_id == int(span_id(TRACE, name), 16)
        assert child.context.trace_id == resume.context.trace_id
    assert spans_of(PLAN)["regroup.resume.reshard"].context.span_id == spans["regroup.resume.reshard"].context.span_id


def test_a_phase_past_the_resume_end_is_an_empty_span_at_the_end() -> None:
    spans = spans_of(dataclasses.replace(PLAN, resume_phases={"startup": 3.0, "process_group": 0.5}))
    ns = 1e9
    assert round(spans["regroup.resume.startup"].end_time / ns - T0, 3) == 12.0
    pg = spans["regroup.resume.process_group"]
    assert pg.start_time == pg.end_time == spans["regroup.resume"].end_time


def test_an_older_trainer_gives_the_trace_of_before() -> None:
    spans = spans_of(dataclasses.replace(PLAN, mode="", resume_phases={}))
    assert set(spans) == {"regroup.reform", "regroup.detect", "regroup.rendezvous", "regroup.resume"}
    assert "regroup.reform.mode" not in spans["regroup.reform"].attributes
    assert not [k for k in spans["regroup.resume"].attributes if k.startswith("regroup.resume.")]


def test_the_cause_and_outcome_attributes_are_the_plain_stored_strings() -> None:
    """Exporters and the spans file see the values ``regroup.cause``/``regroup.outcome`` always had."""
    abandoned = dataclasses.replace(PLAN, outcome="timeout", why="the trainer reported no progress")
    root = spans_of(abandoned)["regroup.reform"]
    cause, outcome = root.attributes["regroup.cause"], root.attributes["regroup.outcome"]
    assert (cause, outcome) == ("node-lost", "timeout")
    assert type(cause) is str and type(outcome) is str
    assert root.status.description == "timeout: the trainer reported no progress"


def test_a_taken_over_loss_is_traced_from_the_container_exit_to_the_trainers_resume() -> None:
    """The facts, each by whoever knew it: n3's agent container was SIGKILLed (the kubelet's
    ``finishedAt``: T0 + 1); the leader saw it at T0 + 1.4, asked for the re-form and went
    away; the rendezvous formed the round at T0 + 2.2 and the trainers completed their first
    step at the new size at T0 + 3.1; the next leader first looked at T0 + 20."""
    settings = ControllerSettings()
    s = registered(job(), T0 - 600)
    killed = ContainerRestarts("worker", 1, True, running_since=T0 + 1.5, exited_at=T0 + 1, exit_code=137,
                               exit_reason="Error")
    s = s.changed_pod("n3", at=T0 + 1.4, restart_count=1, containers=(killed,), agent_container="worker")
    s, _ = step(s, T0 + 1.4, settings)
    later = T0 + 20
    s = s.round_formed(2, ("n1", "n2"), at=later, formed_at=T0 + 2.2)
    first = Progress(step=101, loss=1.0, samples_seen=0, world_size=4, time=T0 + 3.1, resumed_from_step=100,
                     last_step=100, reform_mode="in-place", resume_phases={"process_group": 0.5, "reshard": 0.25, "first_step": 0.5})
    s = s.at(later).with_members(member(n, 2, joined_at=T0 - 600) for n in ("n1", "n2")).with_progress(first, 50)
    s, _ = step(s, later, settings)
    s, _ = step(s, later, settings)
    plan = s.plan
    assert plan.outcome == "completed" and plan.reason == "lost n3 (pod llama-n3 container exited (code 137))"
    spans = spans_of(plan)
    times = {name.removeprefix("regroup."): (round(sp.start_time / 1e9 - T0, 3), round(sp.end_time / 1e9 - T0, 3))
             for name, sp in spans.items()}  # fmt: skip
    assert times == {
        "reform": (1.0, 3.1), "detect": (1.0, 1.4), "rendezvous": (1.4, 2.2), "resume": (2.2, 3.1),
        "resume.process_group": (2.2, 2.7), "resume.reshard": (2.7, 2.95), "resume.first_step": (2.95, 3.1),
    }  # fmt: skip
    # The Event, the metric and `regroup status` say the same: 2.1 s, not the new leader's 19 s.
    assert resize_message(plan) == "3 → 2 nodes: loss of n3, 0 steps lost, 2.1 s"
