"""Analysis of a recorded run and the HTML report built from it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from regroup.demo.analysis import ProgressSample as P
from regroup.demo.analysis import (
    continuity_errors,
    event_impacts,
    goodput,
    incarnations,
    interruptions,
    load_run,
    run_interruptions,
    useful_training_time,
    world_size_timeline,
)
from regroup.demo.report import build_report, summarize, summary_text
from tests.demo.recorded import EVENTS, INCARNATIONS, REFORMS, progress_rows, write_run


@pytest.fixture
def regroup_run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "run", "regroup", progress_rows(INCARNATIONS), EVENTS, 75.0, REFORMS)


@pytest.fixture
def baseline_run(tmp_path: Path) -> Path:
    # Loses 20 steps on the reclaim (no checkpoint before the node dies) and stalls longer.
    rows = progress_rows([(0, 1, 30, 0.0, 3), (10, 11, 40, 30.0, 2), (40, 41, 50, 55.0, 1)])
    # Training stops for good at 59.5 s, 10 steps past its last checkpoint.
    return write_run(tmp_path / "run" / "torchrun-c10d", "torchrun-c10d", rows, EVENTS[:4], 75.0, latest_checkpoint_step=40)


def test_lost_steps_come_from_the_resume_points(regroup_run: Path) -> None:
    run = load_run(regroup_run)
    stops = interruptions(run.progress)
    assert [(s.last_step, s.resumed_from_step, s.lost_steps) for s in stops] == [(20, 20, 0), (47, 40, 7), (60, 60, 0)]
    assert [len(i.samples) for i in incarnations(run.progress)] == [20, 27, 20, 20]
    impacts = event_impacts(run)
    assert [(i.event.reason, i.lost_steps, len(i.reforms)) for i in impacts] == [
        ("reclaim", 0, 1), ("lose", 7, 1), ("restore", 0, 1), ("flaky", 0, 0),
    ]  # fmt: skip
    assert continuity_errors(run.progress) == []


def test_lost_steps_take_the_trainers_own_last_step_when_the_recorder_missed_it() -> None:
    """Rank 0 publishes progress every interval: the recorder's newest step before a re-form
    may be one behind the step the survivors completed; their own count (``last_step``) wins."""
    seen = [P(0, 1, 1.0, 3, 0), P(1, 104, 1.0, 3, 0), P(2, 105, 1.0, 2, 104, last_step_before=105)]
    [stop] = interruptions(seen)
    assert (stop.last_step, stop.resumed_from_step, stop.lost_steps) == (105, 104, 1)


def test_a_stop_that_never_resumed_counts_until_the_end(baseline_run: Path) -> None:
    run = load_run(baseline_run)
    *_, last = run_interruptions(run)
    assert (last.resumed, last.last_step, last.resumed_from_step, last.lost_steps) == (False, 50, 40, 10)
    assert last.downtime == pytest.approx(75.0 - 59.5)
    flaky = event_impacts(run)[-1]
    assert flaky.event.reason == "flaky" and flaky.interruptions == (last,)
    assert len(interruptions(run.progress)) == 2


def test_continuity_catches_skipped_and_backward_steps() -> None:
    skipped = [P(0, 1, 1.0, 2, 0), P(1, 2, 1.0, 2, 0), P(3, 6, 1.0, 2, 5)]
    assert "steps skipped" in continuity_errors(skipped)[0]
    backwards = [P(0, 1, 1.0, 2, 0), P(1, 5, 1.0, 2, 0), P(2, 9, 1.0, 2, 4), P(3, 3, 1.0, 2, 4)]
    assert continuity_errors(backwards), "a step going back without a new resume point is an error"
    regress = [P(0, 9, 1.0, 2, 5), P(1, 12, 1.0, 2, 5), P(2, 4, 1.0, 2, 2)]
    assert "older than the previous resume" in continuity_errors(regress)[-1]


def test_a_resume_from_memory_may_start_past_the_last_record_of_a_dead_rank_0() -> None:
    # Rank 0 recorded step 2 and died after training step 3 with the others; they resume
    # from their memory at step 3. From a checkpoint, the same resume would skip steps.
    before = [P(0, 1, 1.0, 3, 0), P(1, 2, 1.0, 3, 0)]
    from_memory = P(2, 4, 1.0, 2, 3, resume_phases={"process_group": 0.5, "reshard": 1.0})
    assert continuity_errors([*before, from_memory]) == []
    loaded = P(2, 4, 1.0, 2, 3, resume_phases={"process_group": 0.5, "load": 1.0})
    assert "steps skipped" in continuity_errors([*before, loaded])[0]


def test_goodput_counts_only_steps_that_were_kept(regroup_run: Path) -> None:
    run = load_run(regroup_run)
    # Step time 0.5 s. Kept: 19 + (40-21=19) + 19 + 19 intervals; 7 of the second
    # incarnation's 26 intervals were redone.
    assert useful_training_time(run.progress) == pytest.approx(0.5 * (19 + 19 + 19 + 19))
    assert goodput(run) == pytest.approx(0.5 * 76 / 75.0)


def test_world_size_drops_to_zero_while_training_is_stopped(regroup_run: Path) -> None:
    points = world_size_timeline(load_run(regroup_run))
    sizes = [w for _, w in points]
    assert sizes[0] == 0 and 3 in sizes and 1 in sizes
    # Training stopped between incarnations, and after the last progress (13.5 s before the end).
    stops = [round(t, 2) for t, w in points if w == 0 and t > 0]
    assert stops == [9.51, 28.01, 44.51, 61.51, 75.0]


def test_report_is_self_contained_and_shows_both_runs(regroup_run: Path, baseline_run: Path) -> None:
    runs = [load_run(regroup_run), load_run(baseline_run)]
    path = build_report(runs, regroup_run / "report.html")
    text = path.read_text()
    images = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', text)
    # world size, loss, regroup's re-form latency, downtime per event, lost steps per event, goodput
    assert len(images) == 6 and all(len(i) > 1000 for i in images)
    assert not re.search(r'(src|href)="(https?:)?//', text), "the report must open offline"
    for heading in ("World size over time", "Loss vs step", "Re-form latency", "Lost steps per", "Goodput"):
        assert heading in text
    assert "<th>regroup</th><th>torchrun-c10d</th>" in text
    regroup, baseline = summarize(runs[0]), summarize(runs[1])
    assert (regroup.reclaim_lost_steps, regroup.lost_steps, regroup.cordoned) == (0, 7, ("node-1",))
    # The baseline resumed from step 10 after reaching 30 when the reclaimed node died.
    assert (baseline.reclaim_lost_steps, baseline.lost_steps, baseline.reforms) == (20, 30, 0)
    summary = summary_text(runs, path)
    assert f"report: {path}" in summary and "node-lost" in summary
    assert len(summary.splitlines()) < 40


def test_the_reform_table_shows_the_mode_and_the_html_the_resume_split(regroup_run: Path) -> None:
    run = load_run(regroup_run)
    text = build_report([run], regroup_run / "report.html").read_text()
    [table] = re.findall(r"<pre>(.*?)</pre>", text, re.S)
    header, _, reclaim, lost, grow = (line.split() for line in table.splitlines()[:5])
    assert header[5] == "mode" and "reshard_s" in header and "startup_s" in header
    assert (reclaim[5], lost[5], grow[5]) == ("in-place", "restart", "?")
    assert reclaim[header.index("reshard_s")] == "0.90" and lost[header.index("load_s")] == "0.60"
    # The per-event table says how the workers got through each re-form.
    assert "reclaim (in-place) 4.4" in text and "node-lost (restart) 4.1" in text
    # The terminal summary keeps one line per re-form narrow: the mode, not the split.
    summary = summary_text([run], regroup_run / "report.html")
    assert " in-place " in summary and " restart " in summary and "reshard_s" not in summary
