"""A crashed rank's re-form that a spare answers, as the report and ``regroup trace-report``
read it from a recorded run.

The agents re-form on their own (no ``regroup.reform`` trace): the survivors' join spans,
the new rank 0's resume and the rank crash the run recorded tell it. The spare began to
join the next round long before (it waits there as a spare): its wait is not the re-form's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from regroup import trace_report
from regroup.demo.analysis import event_impacts, load_run, reform_rows, run_reforms
from regroup.demo.report import build_report, summarize, summary_text
from regroup.telemetry import read_spans
from tests.demo.recorded import T0, progress_rows, write_run
from tests.whatif.spans import RecordedJob

NODES = ("n1", "n2", "n3", "n4")
SPARES_META = {"nodes": [*NODES, "n5"], "min_nodes": 2, "max_nodes": 4}
EVENTS = [
    {"time": 1.5, "source": "scenario", "reason": "restore", "message": "n5 comes back", "nodes": ["n5"]},
    {"time": 30.0, "source": "scenario", "reason": "flaky", "message": "n1 starts crashing", "nodes": ["n1"]},
    {"time": 30.1, "source": "fault", "reason": "RankCrashed", "message": "n1: rank killed at step 60",
     "nodes": ["n1"]},
]  # fmt: skip
# 0.5 s a step: steps 1 to 60 on n1-n4 until 29.5 s; n5 in n1's place resumes from the
# survivors' memory of step 59 (1 step trained again) with its first step at 30.9 s.
WORLDS = [(0, 1, 60, 0.0, 4), (59, 60, 90, 30.9, 4)]


def join(job: RecordedJob, number: int, node: str, rank: int, at: float, formed: float) -> None:
    """One agent's ``regroup.rendezvous.join`` of round ``number`` in position ``rank``."""
    attributes = {"regroup.job": "job", "regroup.node": node, "regroup.round": number, "regroup.rank": rank,
                  "regroup.node_count": 4, "regroup.restart_count": 0}  # fmt: skip
    span = job.provider.get_tracer("regroup.rendezvous").start_span(
        "regroup.rendezvous.join", start_time=int((T0 + at) * 1e9), attributes=attributes
    )
    span.end(end_time=int((T0 + formed) * 1e9))


def spare_run(root: Path, events: list[dict] = EVENTS) -> Path:
    """n1-n4 train; the spare n5 begins to join round 2 at 2 s and waits; n1's rank crashes
    at 30.1 s; the survivors join at 30.3 s and the round forms at 30.4 s with n5 in n1's
    position (rank 0), whose resume span runs from its wait at 2 s to its first step."""
    write_run(root, "regroup", progress_rows(WORLDS), events, 46.0, meta=SPARES_META)
    job = RecordedJob(root / "spans.jsonl")
    for rank, node in enumerate(NODES):
        join(job, 1, node, rank, -1.0, -0.5)
    join(job, 2, "n5", 0, 2.0, 30.4)
    for rank, node in enumerate(NODES[1:], 1):
        join(job, 2, node, rank, 30.3, 30.4)
    job.resume("ab" * 16, 2.0, 30.9, resumed_from=59, world=4)
    job.close()
    return root


def test_a_spares_wait_is_not_the_reforms_and_it_starts_at_the_crash(tmp_path: Path) -> None:
    run = load_run(spare_run(tmp_path / "run"))
    [crash] = run_reforms(run)
    assert (crash.label, crash.world_before, crash.world_after, crash.reason) == ("crash", 4, 4, "n1 left; n5 joined")
    # From the crash the run recorded: detected when the survivors began to join, the round
    # formed 0.1 s later, the first step 0.5 s after that. Not the spare's 28 s in the round.
    assert crash.start == pytest.approx(T0 + 30.1)
    assert crash.phases == pytest.approx({"detect": 0.2, "rendezvous": 0.1, "resume": 0.5}, abs=1e-3)
    assert crash.duration == pytest.approx(0.8)
    # Filed under the event it followed (the flaky node), not the one before the spare's wait began.
    assert [(i.event.reason, [r.label for r in i.reforms]) for i in event_impacts(run)] == [
        ("restore", []), ("flaky", ["crash"]),
    ]  # fmt: skip
    # Spans alone (no recorded crash): it starts at the survivors' join.
    [alone] = [r for r in trace_report.all_reforms(read_spans(run.root / "spans.jsonl")) if not r.asked]
    assert alone.start == pytest.approx(T0 + 30.3)
    assert alone.phases == pytest.approx({"rendezvous": 0.1, "resume": 0.5}, abs=1e-3)


def test_the_spare_in_the_crashed_ranks_place_is_a_replace_and_the_strategies_add_up(tmp_path: Path) -> None:
    run = load_run(spare_run(tmp_path / "run"))
    summary = summarize(run)
    assert summary.strategies == {"replace": 1} and sum(summary.strategies.values()) == summary.reforms == 1
    page = build_report([run], tmp_path / "report.html").read_text()
    per_event = page[page.index("<h2>Per scripted event</h2>") :]
    assert "crash (in-place; replace n1-&gt;n5) 0.8" in per_event
    assert "re-form strategies" in summary_text([run], tmp_path / "report.html")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    trace_report.add_arguments(parser)
    code = trace_report.run(parser.parse_args(list(argv)))
    return code, capsys.readouterr().out


def test_trace_report_on_the_run_says_what_the_report_says(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a demo run's folder the crash's lost steps come from the progress records, as the
    report's do: 1, and the sum adds up (no ``?``)."""
    root = spare_run(tmp_path / "run")
    run = load_run(root)
    [row] = reform_rows(run)
    assert row.lost_steps == 1 and summarize(run).lost_steps == 1
    code, out = run_cli(capsys, str(root))
    assert code == 0
    lines = out.splitlines()
    crash = lines[3].split()
    assert crash[1:7] == ["30.1", "crash", "4->4", "no", "in-place", "1"]
    [total] = [line.split() for line in lines if line.split()[:1] == ["sum"]]
    assert total[1] == "1"
    printed = summary_text([run], tmp_path / "report.html")
    assert lines[3] in printed.splitlines()
    code, out = run_cli(capsys, str(root), "--json")
    [reform] = json.loads(out)
    assert (reform["label"], reform["lost_steps"], round(reform["at_s"], 1)) == ("crash", 1, 30.1)


def test_a_spare_that_began_its_resume_before_the_grow_it_waited_through(tmp_path: Path) -> None:
    """The spare becomes rank 0 of the crash's world: its resume span began when it began to
    wait, before the grow's own resume in the same trace. The grow's resume is still the
    grow's (the worlds' first steps order them), and the crash's row is the crash's."""
    job = RecordedJob(tmp_path / "spans.jsonl")
    for rank, node in enumerate(NODES[:3]):
        join(job, 1, node, rank, -1.0, -0.5)
    grow = job.reform("grow", 3, 4, 10.0, planned=True, checkpoint=0.1, rendezvous=0.1, resume=0.5)
    for rank, node in enumerate(NODES):
        join(job, 2, node, rank, 10.1, 10.2)
    join(job, 3, "n5", 0, 10.15, 30.4)
    job.resume(grow, 10.15, 30.9, resumed_from=59, world=4)  # the spare's: waits from 10.15 s
    job.resume(grow, 10.2, 10.7, resumed_from=20, world=4)  # the grow's own
    for rank, node in enumerate(NODES[1:], 1):
        join(job, 3, node, rank, 30.3, 30.4)
    job.close()
    reforms = trace_report.all_reforms(read_spans(tmp_path / "spans.jsonl"), faults=[T0 + 30.1])
    assert [(r.label, r.world_before, r.world_after) for r in reforms] == [("grow", 3, 4), ("crash", 4, 4)]
    grown, crash = reforms
    assert grown.resumed_at == pytest.approx(T0 + 10.7)
    assert crash.start == pytest.approx(T0 + 30.1) and crash.duration == pytest.approx(0.8)
    assert crash.attributes["regroup.strategy"] == "replace" and crash.attributes["regroup.replaced"] == "n1->n5"
