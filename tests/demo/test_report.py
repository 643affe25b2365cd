"""Analysis of a recorded run and the HTML report built from it."""

from __future__ import annotations

import html
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
from regroup.demo.strategy import reform_strategies, round_strategies
from regroup.demo.throughput import throughput_around_events
from tests.demo.recorded import EVENTS, INCARNATIONS, REFORMS, T0, progress_rows, spares_run, write_run


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
    # An HTML table (its cells wrap where the page is narrow), as trace-report prints it.
    [table] = re.findall(r'<table class="reforms">(.*?)</table>', text, re.S)
    header, reclaim, lost, grow, *_ = ([html.unescape(c) for c in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
                                   for row in re.findall(r"<tr>(.*?)</tr>", table))  # fmt: skip
    assert header[5] == "mode" and "reshard_s" in header and "startup_s" in header
    assert (reclaim[5], lost[5], grow[5]) == ("in-place", "restart", "?")
    assert reclaim[header.index("reshard_s")] == "0.90" and lost[header.index("load_s")] == "0.60"
    # The per-event table says how the workers got through each re-form.
    assert "reclaim (in-place) 4.4" in text and "node-lost (restart) 4.1" in text
    # The terminal summary keeps one line per re-form narrow: the mode, not the split.
    summary = summary_text([run], regroup_run / "report.html")
    assert " in-place " in summary and " restart " in summary and "reshard_s" not in summary


def test_each_reform_has_the_strategy_its_trace_or_else_its_plan_recorded(tmp_path: Path) -> None:
    run = load_run(spares_run(tmp_path / "run"))
    described = [s.describe() if s else None for s in reform_strategies(run)]
    assert described == ["migrate node-2->node-5", "elastic", "elastic", "replace node-1->node-3"]
    assert {r: s.name for r, s in round_strategies(run).items()} == {3: "elastic"}
    # A run whose controller records no strategy shows none (it is never guessed).
    assert reform_strategies(load_run(write_run(tmp_path / "old", "regroup", progress_rows(INCARNATIONS),
                                                EVENTS, 75.0, REFORMS))) == [None, None, None]  # fmt: skip


def test_throughput_after_a_replacement_equals_before_and_a_shrink_loses_the_lost_share(tmp_path: Path) -> None:
    around = throughput_around_events(load_run(spares_run(tmp_path / "run")))
    assert [t.event.reason for t in around] == ["reclaim", "lose", "restore", "flaky"]
    assert [t.unit for t in around] == ["samples/s"] * 4
    # 12 samples a step: 0.5 s a step at 4 ranks, 2/3 s at 3.
    assert [(t.before.per_s, t.after.per_s) for t in around] == [
        (pytest.approx(24.0), pytest.approx(24.0)), (pytest.approx(24.0), pytest.approx(18.0)),
        (pytest.approx(18.0), pytest.approx(24.0)), (pytest.approx(24.0), pytest.approx(24.0)),
    ]  # fmt: skip
    assert [(t.before.ranks, t.after.ranks) for t in around] == [(4, 4), (4, 3), (3, 4), (4, 4)]
    assert [round(t.ratio, 2) for t in around] == [1.0, 0.75, 1.33, 1.0]
    # The windows stay inside one world: the re-form's pause and its first step are not in them.
    migrate = around[0]
    assert migrate.before.until - T0 <= 10.0 and migrate.after.since - T0 == pytest.approx(11.7)


def test_throughput_without_a_world_formed_after_the_event_is_the_same_worlds(tmp_path: Path) -> None:
    """An event that needed no re-form (here a reclaim of the node waiting as the spare):
    after it, the world that trained on."""
    rows = progress_rows([(0, 1, 60, 0.0, 4)])
    run = load_run(write_run(tmp_path / "run", "regroup", rows, EVENTS[:1], 30.0))
    [item] = throughput_around_events(run, window=5.0)
    assert item.after is not None and item.after.since - T0 >= 10.0 and item.after.until - T0 <= 15.0
    assert item.ratio == pytest.approx(1.0)


def test_the_report_shows_each_reforms_strategy_and_the_throughput_around_each_event(tmp_path: Path) -> None:
    run = load_run(spares_run(tmp_path / "run"))
    text = build_report([run], tmp_path / "run" / "report.html").read_text()
    assert "reclaim (in-place; migrate node-2-&gt;node-5) 1.5" in text
    assert "node-lost (in-place; replace node-1-&gt;node-3) 1.5" in text
    assert "<td>re-form strategies</td><td>replace 1, migrate 1, elastic 2</td>" in text
    [table] = re.findall(r"<h2>Throughput before and after.*?(<table>.*?</table>)", text, re.S)
    rows = re.findall(r"<tr>(.*?)</tr>", table)
    assert "<th>samples/s before</th><th>samples/s after</th><th>after / before</th>" in rows[0]
    cells = [re.findall(r"<td>(.*?)</td>", row) for row in rows[1:]]
    assert [(c[2], c[3], c[4], c[5], c[6]) for c in cells] == [
        ("migrate node-2-&gt;node-5", "4 -&gt; 4", "24.0", "24.0", "1.00"),
        ("elastic", "4 -&gt; 3", "24.0", "18.0", "0.75"),
        ("elastic", "3 -&gt; 4", "18.0", "24.0", "1.33"),
        ("replace node-1-&gt;node-3", "4 -&gt; 4", "24.0", "24.0", "1.00"),
    ]
    summary = summary_text([run], tmp_path / "run" / "report.html")
    assert "replace 1, migrate 1, elastic 2" in summary
    assert "throughput after/before each event (regroup): reclaim 1.00, lose 0.75, restore 1.33, flaky 1.00" in summary


def test_a_run_without_strategies_says_so(regroup_run: Path) -> None:
    run = load_run(regroup_run)
    assert summarize(run).strategies == {}
    assert "<td>re-form strategies</td><td>not recorded</td>" in build_report([run], regroup_run / "report.html").read_text()
