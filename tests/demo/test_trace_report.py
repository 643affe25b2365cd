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
    assert header == ["#", "at_s", "cause", "world", "planned", "lost", "detect_s", "checkpoint_s",
                      "rendezvous_s", "resume_s", "total_s"]  # fmt: skip
    rows = [line.split() for line in lines[2:5]]
    assert [r[2] for r in rows] == ["reclaim", "node-lost", "grow"]
    assert rows[0][3:6] == ["3->2", "yes", "0"]
    assert rows[0][6:] == ["0.10", "0.80", "1.50", "2.00", "4.40"]
    # The unplanned re-form has no checkpoint phase.
    assert rows[1][5:] == ["7", "0.40", "-", "1.20", "2.50", "4.10"]
    assert rows[1][1] == "19.7"
    assert "p50" in out and lines[-1].split()[-1] == "6.50"


def test_json_output_and_run_folder_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_reform_spans(tmp_path / "spans.jsonl", REFORMS[:1])
    code, out, _ = run_cli(capsys, str(tmp_path), "--json")
    assert code == 0
    [reform] = json.loads(out)
    assert reform["cause"] == "reclaim" and reform["planned"] is True and reform["lost_steps"] == 0
    assert reform["phases"] == pytest.approx({"detect": 0.1, "checkpoint": 0.8, "rendezvous": 1.5, "resume": 2.0})
    assert reform["duration"] == pytest.approx(4.4)


def test_spans_other_than_reforms_are_ignored(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    write_reform_spans(spans, REFORMS)
    assert len(read_spans(spans)) == 3 + 11
    assert len(trace_report.reforms_from_spans(read_spans(spans))) == 3
    assert trace_report.format_table([]) == "no regroup.reform spans found"


def test_missing_or_bad_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, str(tmp_path / "nope.jsonl"))
    assert code == 2 and "no spans file" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    code, _, err = run_cli(capsys, str(bad))
    assert code == 2 and "not an OTLP JSON-lines spans file" in err
