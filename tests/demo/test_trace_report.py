"""``regroup trace-report``: the re-form latency table from an OTLP JSON-lines file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from regroup import trace_report
from regroup.telemetry import read_spans
from tests.demo.recorded import EVENTS, INCARNATIONS, REFORMS, T0, progress_rows, write_reform_spans, write_run
from tests.whatif import spans as tspans
from tests.whatif.spans import RecordedJob


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    trace_report.add_arguments(parser)
    code = trace_report.run(parser.parse_args(list(argv)))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_one_row_per_reform_with_its_phases(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = tmp_path / "spans.jsonl"
    write_reform_spans(spans, REFORMS)
    code, out, _ = run_cli(capsys, str(spans))
    assert code == 0
    # Spans alone, without a job start in them: the table says what at_s counts from.
    note, *lines = out.splitlines()
    assert note == "at_s: seconds since the first re-form's start"
    header = lines[0].split()
    assert header == ["#", "at_s", "cause", "world", "planned", "mode", "lost", "detect_s", "checkpoint_s",
                      "rendezvous_s", "resume_s", "total_s"]  # fmt: skip
    rows = [line.split() for line in lines[2:5]]
    assert [r[2] for r in rows] == ["reclaim", "node-lost", "grow"]
    assert rows[0][3:7] == ["3->2", "yes", "in-place", "0"]
    assert rows[0][7:] == ["0.10", "0.80", "1.50", "2.00", "4.40"]
    # The unplanned re-form has no checkpoint phase; its workers were restarted.
    assert rows[1][5:] == ["restart", "7", "0.40", "-", "1.20", "2.50", "4.10"]
    assert rows[1][1] == "19.7"
    # A trace without the mode (an older trainer) says it does not know.
    assert rows[2][5] == "?"
    assert "p50" in out and lines[-1].split()[-1] == "6.50"


def test_the_resume_split_follows_the_resume_column(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = tmp_path / "spans.jsonl"
    write_reform_spans(spans, REFORMS)
    code, out, _ = run_cli(capsys, str(spans), "--resume-split")
    assert code == 0
    lines = out.splitlines()[1:]
    # Only the sub-phases some re-form reported, in the order they happen.
    assert lines[0].split()[10:] == ["resume_s", "startup_s", "process_group_s", "reshard_s", "load_s", "first_step_s", "total_s"]
    rows = [line.split() for line in lines[2:5]]
    assert rows[0][10:] == ["2.00", "-", "0.30", "0.90", "-", "0.60", "4.40"]
    assert rows[1][10:] == ["2.50", "1.20", "0.30", "-", "0.60", "0.30", "4.10"]
    assert rows[2][10:] == ["2.00", "-", "-", "-", "-", "-", "6.50"]
    assert lines[-1].split()[-1] == "6.50"


def test_json_output_and_run_folder_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_reform_spans(tmp_path / "spans.jsonl", REFORMS[:1])
    code, out, _ = run_cli(capsys, str(tmp_path), "--json")
    assert code == 0
    [reform] = json.loads(out)
    assert reform["cause"] == "reclaim" and reform["planned"] is True and reform["lost_steps"] == 0
    assert reform["phases"] == pytest.approx({"detect": 0.1, "checkpoint": 0.8, "rendezvous": 1.5, "resume": 2.0})
    assert reform["mode"] == "in-place"
    assert reform["resume_phases"] == pytest.approx({"process_group": 0.3, "reshard": 0.9, "first_step": 0.6})
    assert reform["duration"] == pytest.approx(4.4)


def test_spans_other_than_reforms_are_ignored(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    write_reform_spans(spans, REFORMS)
    # Three roots, eleven phases, seven resume sub-phases: only the roots are rows.
    assert len(read_spans(spans)) == 3 + 11 + 7
    assert len(trace_report.reforms_from_spans(read_spans(spans))) == 3
    assert trace_report.format_table([]) == "no regroup.reform spans found"


def test_missing_or_bad_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, str(tmp_path / "nope.jsonl"))
    assert code == 2 and "no spans file" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    code, _, err = run_cli(capsys, str(bad))
    assert code == 2 and "not an OTLP JSON-lines spans file" in err


def test_the_report_reads_what_the_controller_writes(tmp_path: Path) -> None:
    """The controller's trace, through the JSON-lines exporter, gives back the plan's mode and split."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    from regroup.controller.tracing import emit_reform_trace
    from regroup.records import ReformPlan
    from regroup.telemetry import JsonLinesSpanExporter

    phases = {"startup": 2.5, "process_group": 0.5, "load": 1.25, "first_step": 0.75}
    plan = ReformPlan(
        generation=2, cause="node-lost", planned=False, phase="done", reason="", nodes_before=["a", "b"], nodes_after=["a"],
        trace_id="ab" * 16, detected_at=100.0, decided_at=101.0, reform_requested_at=101.0, rendezvous_done_at=104.0,
        resumed_at=110.0, lost_steps=3, outcome="completed", finished_at=110.0, mode="restart", resume_phases=phases,
    )  # fmt: skip
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(tmp_path / "spans.jsonl")))
    emit_reform_trace(provider, "team", "llama", plan)
    provider.shutdown()
    [reform] = trace_report.reforms_from_spans(read_spans(tmp_path / "spans.jsonl"))
    assert (reform.mode, reform.resume_phases) == ("restart", phases)
    assert list(reform.resume_phases) == ["startup", "process_group", "load", "first_step"]
    assert reform.phases["resume"] == pytest.approx(6.0)


def crashing_job(path: Path) -> Path:
    """A job of four nodes (seconds after ``tests.whatif.spans.T0``): a spot reclaim with
    notice, then n1's rank crashes and the agents re-form without it on their own (the
    trainers' resume joins the reclaim's trace, a second resume in it), and the controller
    grows the job back with n1."""
    job = RecordedJob(path)
    job.join(1, ("n1", "n2", "n3", "n4"), 0.0, 1.0)
    spot = "reclaim notice on n4 (aws-node-termination-handler/spot-itn, AWS node-termination-handler)"
    reclaim = job.reform("reclaim", 4, 3, 10.0, planned=True, checkpoint=0.3, rendezvous=0.2, resume=0.6, reason=spot)
    job.join(2, ("n1", "n2", "n3"), 10.3, 10.5)
    job.resume(reclaim, 10.5, 11.1, resumed_from=20, world=3)
    job.join(3, ("n2", "n3"), 30.1, 30.4)
    job.resume(reclaim, 30.0, 30.9, resumed_from=59, world=2)
    grow = job.reform("grow", 2, 3, 40.0, planned=True, checkpoint=0.2, rendezvous=0.3, resume=0.5)
    job.join(4, ("n1", "n2", "n3"), 40.2, 40.5)
    job.resume(grow, 40.5, 41.0, resumed_from=80, world=3)
    job.close()
    return path


def test_a_world_the_agents_formed_on_their_own_is_a_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A crashed rank's world, re-formed by the agents without the controller, has no
    ``regroup.reform`` trace: the trainers' resume and the agents' join spans tell it."""
    spans = crashing_job(tmp_path / "spans.jsonl")
    reforms = trace_report.all_reforms(read_spans(spans))
    assert [(r.label, r.world_before, r.world_after, r.planned, r.asked) for r in reforms] == [
        ("spot reclaim", 4, 3, True, True), ("crash", 3, 2, False, False), ("grow", 2, 3, True, True),
    ]  # fmt: skip
    crash = reforms[1]
    assert crash.reason == "n1 left" and crash.lost_steps == -1 and crash.mode == "in-place"
    # From the trainers' stop (their resume's start) to their first step in the new world.
    assert crash.start == pytest.approx(tspans.T0 + 30.0) and crash.end == pytest.approx(tspans.T0 + 30.9)
    assert crash.phases == pytest.approx({"rendezvous": 0.4, "resume": 0.5})
    # The controller's re-forms alone are still what reforms_from_spans reads (whatif's input).
    assert [r.cause for r in trace_report.reforms_from_spans(read_spans(spans))] == ["reclaim", "grow"]
    code, out, _ = run_cli(capsys, str(spans))
    assert code == 0
    rows = [line.split() for line in out.splitlines()[3:6]]
    assert [r[2:7] for r in rows] == [
        ["spot", "reclaim", "4->3", "yes", "in-place"], ["crash", "3->2", "no", "in-place", "?"],
        ["grow", "2->3", "yes", "in-place", "0"],
    ]  # fmt: skip


def test_the_cause_is_what_sent_the_reform_as_its_plan_says() -> None:
    label = trace_report.cause_label
    notice = "reclaim notice on node-2 ({}, {})"
    cases = {
        notice.format("spec.unschedulable", "Kubernetes"): "drain",
        notice.format("node.kubernetes.io/unschedulable", "Kubernetes"): "drain",
        notice.format("pod node-2-worker DisruptionTarget (EvictionByEvictionAPI)", "Kubernetes"): "eviction",
        notice.format("pod node-2-worker DisruptionTarget (PreemptionByScheduler)", "Kubernetes"): "preemption",
        notice.format("pod node-2-worker deleted (30 s grace)", "Kubernetes"): "pod deletion",
        notice.format("agent on node-2 leaving", "regroup agent"): "agent leaving",
        notice.format("aws-node-termination-handler/spot-itn", "AWS node-termination-handler"): "spot reclaim",
        notice.format("aws-node-termination-handler/asg-lifecycle-termination", "AWS node-termination-handler"): "scale-in",
        notice.format("ToBeDeletedByClusterAutoscaler", "cluster-autoscaler"): "scale-down",
        notice.format("karpenter.sh/disrupted", "Karpenter"): "karpenter disruption",
        notice.format("cloud.google.com/impending-node-termination", "GKE node termination handler"): "preemption",
        notice.format("example.com/going", "regroup.dev/reclaim-taints"): "reclaim",
    }
    for reason, expected in cases.items():
        assert label("reclaim", reason) == expected, reason
    two = "reclaim notice on n2 (spec.unschedulable, Kubernetes), n3 (ToBeDeletedByClusterAutoscaler, cluster-autoscaler)"
    assert label("reclaim", two) == "drain+scale-down"
    assert label("manual", "5 nodes exceed max 4") == "scale"
    assert [label(c, "x") for c in ("grow", "node-lost", "restart-storm", "crash")] == [
        "grow", "node-lost", "restart-storm", "crash"]  # fmt: skip


def test_a_drain_reads_as_one_in_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The controller's trace carries its plan's reason (``regroup.reason``); the table's
    cause is read from it, the JSON keeps ``regroup.cause`` beside it."""
    job = RecordedJob(tmp_path / "spans.jsonl")
    job.reform("reclaim", 3, 2, 1.0, planned=True, checkpoint=0.2,
               reason="reclaim notice on node-2 (spec.unschedulable, Kubernetes)")  # fmt: skip
    job.close()
    code, out, _ = run_cli(capsys, str(tmp_path), "--json")
    assert code == 0
    [reform] = json.loads(out)
    assert (reform["cause"], reform["label"]) == ("reclaim", "drain")
    code, out, _ = run_cli(capsys, str(tmp_path))
    assert out.splitlines()[3].split()[2] == "drain"


def test_a_demo_runs_times_count_from_the_jobs_start_as_the_demo_defines_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``regroup trace-report`` on a demo run counts from the run's ``started_at`` (the
    scenario clock's start, once the job trained and settled), as the demo's report does,
    and both say so; the run's folder or its spans file alike."""
    from regroup.demo.analysis import load_run
    from regroup.demo.report import build_report, summary_text

    root = write_run(tmp_path / "run", "regroup", progress_rows(INCARNATIONS), EVENTS, 75.0, REFORMS,
                     meta={"started_at": T0 + 4.0, "ended_at": T0 + 79.0})  # fmt: skip
    for path in (root, root / "spans.jsonl"):
        code, out, _ = run_cli(capsys, str(path))
        assert code == 0
        note, _, _, *rows = out.splitlines()
        assert note == f"at_s: seconds since {trace_report.DEMO_START}"
        assert note.startswith("at_s: seconds since the job's start (the demo's scenario clock")
        # The reclaim's trace started at T0 + 10.5: 6.5 s after the job's start.
        assert [row.split()[1] for row in rows[:3]] == ["6.5", "26.2", "41.0"]
        code, out, _ = run_cli(capsys, str(path), "--json")
        # The run's table, as its report shows it: the stop at its end (no re-form) is a row.
        assert [(round(r["at_s"], 1), r["label"]) for r in json.loads(out)] == [
            (6.5, "reclaim"), (26.2, "node-lost"), (41.0, "grow"), (57.5, "stopped")]  # fmt: skip
    run = load_run(root)
    text = summary_text([run], tmp_path / "report.html")
    assert f"at_s: seconds since {trace_report.DEMO_START}" in text
    assert [line.split()[1] for line in text.splitlines() if line.split()[:1] == ["1"]] == ["6.5"]
    page = build_report([run], tmp_path / "report.html").read_text()
    assert f"at_s: seconds since {trace_report.DEMO_START}".replace("'", "&#x27;") in page
    assert "<td>6.5</td>" in page


def test_spans_alone_count_from_the_jobs_first_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spans = crashing_job(tmp_path / "spans.jsonl")
    code, out, _ = run_cli(capsys, str(spans))
    assert code == 0
    note, _, _, first, *_ = out.splitlines()
    assert note == "at_s: seconds since the job's first rendezvous round formed (round 1)"
    assert first.split()[1] == "9.0"  # round 1 formed at 1.0, the reclaim began at 10.0
