"""The summary a run ends with, on the console and at the top of the HTML report: the nodes
cordoned for restart storms (a drain's cordon is not one), a run that gave up waiting for
its job to settle (``NotSettled``) said before the numbers, and the re-forms' strategies
counted so they add up to the re-forms."""

from __future__ import annotations

import html
from pathlib import Path

from regroup.demo.analysis import load_run
from regroup.demo.report import build_report, summarize, summary_text
from regroup.demo.strategy import strategy_counts
from tests.demo.recorded import progress_rows, spares_run, write_run

GAVE_UP = "gave up after 180s waiting for the job to settle: flaky node-1 not cordoned"
EVENTS = [
    {"time": 10.0, "source": "scenario", "reason": "drain", "message": "drain of node-2", "nodes": ["node-2"]},
    {"time": 10.0, "source": "cluster", "reason": "NodeNotSchedulable", "message": "drained", "nodes": ["node-2"]},
    {"time": 30.0, "source": "scenario", "reason": "flaky", "message": "node-1 starts crashing", "nodes": ["node-1"]},
    {"time": 44.5, "source": "demo", "reason": "NotSettled", "message": GAVE_UP, "type": "Warning"},
]  # fmt: skip


def drained_run(root: Path, events: list[dict] = EVENTS) -> Path:
    return write_run(root, "regroup", progress_rows([(0, 1, 20, 0.0, 3), (20, 21, 80, 11.0, 2)]), events, 45.0)


def _row(text: str, name: str) -> list[str]:
    [line] = [line for line in text.splitlines() if line.strip().startswith(name)]
    return line.removeprefix(f"  {name}").split()


def test_the_cordoned_nodes_are_those_cordoned_for_restart_storms(tmp_path: Path) -> None:
    run = load_run(drained_run(tmp_path / "run"))
    assert summarize(run).cordoned == ()
    text = summary_text([run], tmp_path / "report.html")
    assert _row(text, "cordoned for restart storms") == ["none"]
    assert not any(line.split()[:2] == ["cordoned", "none"] for line in text.splitlines())
    page = build_report([run], tmp_path / "report.html").read_text()
    assert "<tr><td>cordoned for restart storms</td><td>none</td></tr>" in page
    cordoned = [*EVENTS, {"time": 40.0, "source": "cluster", "reason": "Cordoned", "message": "restart storm",
                          "nodes": ["node-1"]}]  # fmt: skip
    storm = load_run(drained_run(tmp_path / "storm", cordoned))
    assert _row(summary_text([storm], tmp_path / "report.html"), "cordoned for restart storms") == ["node-1"]


def test_a_run_that_gave_up_waiting_says_so_before_the_numbers(tmp_path: Path) -> None:
    run = load_run(drained_run(tmp_path / "run"))
    assert summarize(run).not_settled == (f"at 44 s: {GAVE_UP}",)
    text = summary_text([run], tmp_path / "report.html")
    lines = text.splitlines()
    warning = lines.index(f"NOT SETTLED (regroup) at 44 s: {GAVE_UP}")
    assert warning < next(i for i, line in enumerate(lines) if line.strip().startswith("wall time"))
    assert _row(text, "job settled at every wait") == ["NO"]
    page = build_report([run], tmp_path / "report.html").read_text()
    summary = page[page.index("<h2>Summary</h2>") : page.index("<h2>World size")]
    assert '<div class="warning">' in summary and html.escape(GAVE_UP) in summary
    assert summary.index('<div class="warning">') < summary.index("<table>")
    # A run that settled every time says so, and shows no warning.
    settled = load_run(drained_run(tmp_path / "settled", EVENTS[:3]))
    assert _row(summary_text([settled], tmp_path / "report.html"), "job settled at every wait") == ["yes"]
    assert '<div class="warning">' not in build_report([settled], tmp_path / "settled.html").read_text()


def test_the_strategies_add_up_to_the_reforms_those_not_recorded_counted_too(tmp_path: Path) -> None:
    """Each re-form's strategy is its trace's, else its plan's; one that recorded neither is
    counted as not recorded, never guessed."""
    run = load_run(spares_run(tmp_path / "run"))
    assert summarize(run).strategies == strategy_counts(run) == {"replace": 1, "migrate": 1, "elastic": 2}
    root = spares_run(tmp_path / "no-plans")
    (root / "plans.jsonl").unlink()  # the loss recorded its strategy in its plan only
    summary = summarize(load_run(root))
    assert summary.strategies == {"replace": 1, "migrate": 1, "elastic": 1, "not recorded": 1}
    assert sum(summary.strategies.values()) == summary.reforms == 4
    text = summary_text([load_run(root)], tmp_path / "report.html")
    assert _row(text, "re-form strategies") == "replace 1, migrate 1, elastic 1, not recorded 1".split()
