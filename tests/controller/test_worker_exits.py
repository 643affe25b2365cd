"""A re-form during which workers exited instead of re-forming in place says so, in one
line naming the likely cause: the agents' member records carry it
(tests/rendezvous/test_reform_exits.py), the controller tells it in a Warning Event and on
the re-form's trace, and the demo's report shows it under the re-form's row."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from regroup.controller.reform_summary import WORKER_EXITED, worker_exit_text
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import PostPodEvents, WritePlan
from regroup.controller.tracing import emit_reform_trace
from regroup.demo.report import worker_exit_lines
from regroup.records import Progress, ReformPlan
from regroup.rendezvous.inplace.exits import LIKELY_CAUSE, REFORM_EXIT
from regroup.telemetry import JsonLinesSpanExporter, read_spans
from regroup.trace_report import reforms_from_spans

from .builders import JOB, NS, T0, applied, decide, job, member, of

S = ControllerSettings()
NOTE = f"{REFORM_EXIT} (exit 1): {LIKELY_CAUSE}"


def _loss_of_n3_resumed(exits: dict[str, int]) -> tuple[ReformPlan, list[PostPodEvents]]:
    """n3 lost; n1 and n2 re-form in round 2, their members carrying ``exits`` (node -> the
    round its worker exited in); the trainer resumes. The finished plan and its Events."""
    s = job(step=230).without_member("n3")
    s = applied(s, decide(s, T0, S).actions, T0)
    members = [member(n, 2) for n in ("n1", "n2")]
    s = s.with_members(
        dataclasses.replace(m, worker_exit=NOTE, worker_exit_round=exits[m.node]) if m.node in exits else m
        for m in members
    )
    s = applied(s, decide(s, T0 + 1, S).actions, T0 + 1)
    assert s.plan.phase == "resume"
    progress = Progress(step=229, loss=1.0, samples_seen=0, world_size=4, time=T0 + 2.5, resumed_from_step=228)
    d = decide(s.at(T0 + 2.5).with_progress(progress, 50), T0 + 2.5, S)
    [written] = of(d.actions, WritePlan)
    return written.plan, of(d.actions, PostPodEvents)


def test_a_worker_exit_in_the_reform_is_a_warning_event_and_on_the_plan() -> None:
    plan, events = _loss_of_n3_resumed({"n2": 1})  # exited in round 1, the world the re-form ended
    assert plan.outcome == "completed" and plan.worker_exit == f"n2: {NOTE}"
    [warning] = [e for e in events if e.reason == WORKER_EXITED]
    assert warning.type_ == "Warning" and {p.name for p in warning.pods} == {f"{JOB}-{n}" for n in ("n1", "n2", "n3")}
    assert warning.message == (
        f"re-form {plan.generation}: n2: the worker exited during an in-place re-form (exit 1): a wrapper or "
        "`except` in the script likely caught the re-form; put @elastic.in_place outermost or let "
        "regroup.elastic.Reform through"
    )
    assert "\n" not in warning.message
    assert [e.reason for e in events if e.reason != WORKER_EXITED] == ["Resized"]


def test_an_exit_of_an_earlier_world_is_not_this_reforms() -> None:
    plan, events = _loss_of_n3_resumed({"n2": 0})
    assert plan.worker_exit == "" and not [e for e in events if e.reason == WORKER_EXITED]


def test_nodes_with_the_same_cause_share_one_line() -> None:
    plan = ReformPlan(
        generation=2, cause="manual", planned=True, phase="done", reason="", nodes_before=["n1", "n2", "n3"],
        nodes_after=["n1", "n2", "n3"], trace_id="0" * 32, detected_at=T0, decided_at=T0, round_before=4,
    )  # fmt: skip
    noted = {n: dataclasses.replace(member(n, 5), worker_exit=NOTE, worker_exit_round=4) for n in ("n1", "n3")}
    other = dataclasses.replace(member("n2", 5), worker_exit=NOTE.replace("exit 1", "exit 3"), worker_exit_round=4)
    text = worker_exit_text({**noted, "n2": other}, plan)
    assert text == f"n1, n3: {NOTE}; n2: {other.worker_exit}"


def test_the_trace_carries_it_and_the_demo_report_shows_it_under_the_reform(tmp_path: Path) -> None:
    plan, _ = _loss_of_n3_resumed({"n2": 1})
    spans = tmp_path / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(spans)))
    emit_reform_trace(provider, NS, JOB, plan)
    provider.shutdown()
    [reform] = reforms_from_spans(read_spans(spans))
    assert reform.attributes["regroup.worker_exit"] == reform.worker_exit == f"n2: {NOTE}"
    assert worker_exit_lines([reform]) == [f"#1 n2: {NOTE}"]
