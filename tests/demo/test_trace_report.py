"""``regroup trace-report``: the re-form latency table from an OTLP JSON-lines file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from regroup import trace_report
from regroup.telemetry import read_spans
from tests.demo.recorded import REFORMS, write_reform_spans


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
    lines = out.splitlines()
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
    lines = out.splitlines()
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
