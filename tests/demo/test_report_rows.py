"""The report's re-form table, Events table and latency chart, on recorded runs.

The re-form table has a row for every re-form the job went through, the shrinks a crashing
rank causes too (the agents re-form around it without the controller: no ``regroup.reform``
trace, only the trainers' resume and the agents' join spans), and its lost steps add up to
the summary's. A job-level Event the controller tells on each of the job's pods is one row
of the Events table. The chart's labels do not overlap, and no table is cut at the right.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from regroup.demo.analysis import STOPPED, event_rows, load_run, reform_label, reform_rows, run_interruptions
from regroup.demo.report import (
    MAX_X_LABELS,
    build_report,
    reform_latency_figure,
    summarize,
    summary_text,
)
from tests.demo.recorded import T0, progress_rows, write_run
from tests.whatif.spans import RecordedJob

NODES = ("n1", "n2", "n3", "n4")
SPOT = "reclaim notice on n4 (aws-node-termination-handler/spot-itn, AWS node-termination-handler)"

# (resumed_from, first step, last step, start s, ranks), 0.5 s a step: a reclaim of n4 at
# 10 s; n1's rank crashes after step 60 and the survivors resume from their snapshot of step
# 59 (1 step trained again); the controller grows n1 back at 41.5 s; it crashes again after
# step 100 (1 more); grown back once more at 59.5 s.
WORLDS = [(0, 1, 20, 0.0, 4), (20, 21, 60, 11.1, 3), (59, 60, 80, 31.5, 2), (80, 81, 100, 43.0, 3),
          (99, 100, 110, 54.0, 2), (110, 111, 140, 61.0, 3)]  # fmt: skip
EVENTS = [
    {"time": 10.0, "source": "scenario", "reason": "reclaim", "message": "reclaim notice on n4", "nodes": ["n4"]},
    {"time": 29.0, "source": "scenario", "reason": "flaky", "message": "n1 starts crashing", "nodes": ["n1"]},
    {"time": 30.7, "source": "fault", "reason": "RankCrashed", "message": "n1: rank killed (crash #1)", "nodes": ["n1"]},
    {"time": 52.7, "source": "fault", "reason": "RankCrashed", "message": "n1: rank killed (crash #2)", "nodes": ["n1"]},
]  # fmt: skip


def crashing_run(root: Path, duration: float = 76.0) -> Path:
    """The newcomer's run in small: a grow back after each of two crashes, 2 steps lost."""
    write_run(root, "regroup", progress_rows(WORLDS), EVENTS, duration,
              meta={"nodes": list(NODES), "min_nodes": 2, "max_nodes": 4})  # fmt: skip
    job = RecordedJob(root / "spans.jsonl")
    job.join(1, NODES, -1.0, -0.5)
    reclaim = job.reform("reclaim", 4, 3, 10.0, planned=True, checkpoint=0.3, rendezvous=0.2, resume=0.6, reason=SPOT)
    job.checkpoint(reclaim, 10.0, 0.01, step=20, world=4)
    job.join(2, NODES[:3], 10.3, 10.5)
    job.resume(reclaim, 10.5, 11.1, resumed_from=20, world=3)
    job.join(3, ("n2", "n3"), 30.9, 31.1)
    job.resume(reclaim, 30.8, 31.5, resumed_from=59, world=2)  # the agents' own: a second resume in the trace
    for at, round_, resumed_from in ((41.5, 4, 80), (59.5, 6, 110)):
        grow = job.reform("grow", 2, 3, at, planned=True, checkpoint=0.5, rendezvous=0.5, resume=0.5,
                          reason="nodes joining: n1")  # fmt: skip
        job.join(round_, NODES[:3], at + 0.5, at + 1.0)
        job.resume(grow, at + 1.0, at + 1.5, resumed_from=resumed_from, world=3)
        if round_ == 4:
            job.join(5, ("n2", "n3"), 53.2, 53.4)
            job.resume(grow, 53.0, 54.0, resumed_from=99, world=2)
    job.close()
    return root


def test_every_reform_is_a_row_and_the_lost_steps_add_up_to_the_summarys(tmp_path: Path) -> None:
    run = load_run(crashing_run(tmp_path / "run"))
    summary = summarize(run)
    rows = reform_rows(run)
    # The shrinks the crashes caused are rows: no "grow 2->3" without the shrink before it.
    assert [(reform_label(run, r), r.world_before, r.world_after) for r in rows] == [
        ("spot reclaim", 4, 3), ("crash", 3, 2), ("grow", 2, 3), ("crash", 3, 2), ("grow", 2, 3),
    ]  # fmt: skip
    assert [r.lost_steps for r in rows] == [0, 1, 0, 1, 0]
    assert summary.lost_steps == 2 and sum(r.lost_steps for r in rows) == summary.lost_steps
    assert summary.reforms == 5
    # The printed table says the same, with its sum.
    text = summary_text([run], tmp_path / "report.html")
    table = text[text.index("re-forms (regroup):") :].splitlines()
    assert [line.split()[2] for line in table[4:9]] == ["spot", "crash", "grow", "crash", "grow"]
    [total] = [line for line in table if line.split()[:1] == ["sum"]]
    assert total.split()[1] == "2"
    # The crashes' re-forms are not the controller's: no plan's strategy is lent to them; each
    # takes the one its worlds show (a shrink: elastic), so the counts add up to the re-forms.
    assert summary.strategies == {"elastic": 5}


def test_a_stop_no_reform_accounts_for_is_a_row_too(tmp_path: Path) -> None:
    # Training stopped for good at 75.5 s and the run ended at 90 s, 5 steps past the last
    # committed checkpoint: the summary counts them, so does the table.
    root = crashing_run(tmp_path / "run", duration=90.0)
    meta = json.loads((root / "run.json").read_text())
    (root / "run.json").write_text(json.dumps({**meta, "latest_checkpoint_step": 135}))
    run = load_run(root)
    stops = run_interruptions(run)
    assert not stops[-1].resumed and stops[-1].lost_steps == 5
    rows = reform_rows(run)
    assert rows[-1].cause == STOPPED and rows[-1].lost_steps == 5
    assert sum(r.lost_steps for r in rows) == summarize(run).lost_steps == 7


def write_events(root: Path, events: list[dict]) -> None:
    (root / "events.jsonl").write_text("".join(json.dumps({"type": "Normal", **e}) + "\n" for e in events))


def test_an_event_told_on_each_pod_is_one_row_and_a_repeat_is_counted(tmp_path: Path) -> None:
    root = crashing_run(tmp_path / "run")
    resized = "4 → 3 nodes: reclaim of n4, 0 steps lost, 1.1 s"
    events = [{"time": T0 - 5 + i * 0.001, "source": "cluster", "reason": "NodeReady", "message": "node joined",
               "nodes": [n]} for i, n in enumerate(NODES)]  # fmt: skip
    # The controller tells a job-level Event on each of the job's pods, one post after the other.
    events += [{"time": T0 + 11.1 + i * 0.002, "source": "controller", "reason": "Resized", "message": resized,
                "nodes": [n]} for i, n in enumerate(NODES)]  # fmt: skip
    # The same Event on the same objects again: Kubernetes counts it (its series).
    events += [{"time": T0 + 70.0 + i * 0.002, "source": "controller", "reason": "Resized", "message": resized,
                "nodes": [n]} for i, n in enumerate(NODES)]  # fmt: skip
    events += [{"time": T0 + 30.7, "source": "fault", "reason": "RankCrashed", "message": "n1: rank killed",
                "nodes": ["n1"], "type": "Warning"}]  # fmt: skip
    write_events(root, events)
    run = load_run(root)
    rows = event_rows(run)
    assert [(r.reason, r.nodes, r.count) for r in rows] == [
        ("NodeReady", NODES, 1), ("Resized", NODES, 2), ("RankCrashed", ("n1",), 1),
    ]  # fmt: skip
    assert rows[1].time == pytest.approx(T0 + 11.1) and rows[1].last == pytest.approx(T0 + 70.0)
    assert rows[2].type == "Warning"
    page = build_report([run], tmp_path / "report.html").read_text()
    events_table = page[page.index("<h2>Events (regroup)</h2>") :]
    assert events_table.count("Resized") == 1
    assert "<td>n1, n2, n3, n4</td><td>2 (last at 70.0)</td>" in events_table


def _labels_overlap(fig: matplotlib.figure.Figure) -> list[tuple[str, str]]:
    """Neighbouring x tick labels that overlap once drawn: side by side when level; when
    slanted, their text lines (parallel strips) closer than a line's height."""
    fig.canvas.draw()
    ax = fig.axes[0]
    labels = [t for t in ax.get_xticklabels() if t.get_text()]
    renderer = fig.canvas.get_renderer()
    clashes = []
    for a, b in zip(labels, labels[1:]):
        angle = math.radians(a.get_rotation())
        if angle == 0:
            if a.get_window_extent(renderer).overlaps(b.get_window_extent(renderer)):
                clashes.append((a.get_text(), b.get_text()))
            continue
        (xa, _), (xb, _) = ax.transData.transform([(a.get_position()[0], 0), (b.get_position()[0], 0)])
        lines = max(a.get_text().count("\n"), b.get_text().count("\n")) + 1
        height = a.get_fontsize() * fig.dpi / 72 * 1.2 * lines
        if abs(xb - xa) * math.sin(angle) < height:
            clashes.append((a.get_text(), b.get_text()))
    return clashes


@pytest.mark.parametrize("crashes", [2, 12])
def test_the_latency_charts_labels_do_not_overlap(tmp_path: Path, crashes: int) -> None:
    root = crashing_run(tmp_path / "run")
    if crashes > 2:
        # A long run: many more re-forms than the chart can name side by side.
        job = RecordedJob(root / "spans.jsonl")
        for i in range(crashes):
            at = 62.0 + i
            lost = job.reform("node-lost", 3, 2, at, rendezvous=0.2, resume=0.3,
                              reason=f"lost n{i % 3 + 1} (pod deleted)")  # fmt: skip
            job.resume(lost, at + 0.2, at + 0.5, resumed_from=111 + i, world=2)
            grow = job.reform("grow", 2, 3, at + 0.5, planned=True, checkpoint=0.1, rendezvous=0.1, resume=0.2)
            job.resume(grow, at + 0.7, at + 0.9, resumed_from=112 + i, world=3)
        job.close()
    run = load_run(root)
    fig = reform_latency_figure(run)
    assert fig is not None
    named = [t.get_text() for t in fig.axes[0].get_xticklabels() if t.get_text()]
    assert 0 < len(named) <= MAX_X_LABELS
    assert named[0].startswith("#1 spot reclaim 4->3 @10s")
    assert _labels_overlap(fig) == []


def test_no_table_of_the_report_is_cut_at_the_right(tmp_path: Path) -> None:
    run = load_run(crashing_run(tmp_path / "run"))
    page = build_report([run], tmp_path / "report.html").read_text()
    # The re-form table is a table whose cells wrap, in a box that scrolls when still too wide.
    assert '<div class="wide"><table class="reforms">' in page and ".wide{overflow-x:auto" in page
    assert "<pre>#" not in page
    # Pre-formatted text wraps instead of running past the page's edge.
    style = page[page.index("<style>") : page.index("</style>")]
    pre = style[style.index("pre{") :]
    assert "white-space:pre-wrap" in pre[: pre.index("}")]


def test_scenario_events_are_placed_at_their_scripted_times(tmp_path: Path) -> None:
    """The scenario clock starts once the job trained and settled (``runner.start_clock``),
    so its events play at their YAML times and the report places them there; one the run
    had to push back (it waits for the job to settle before each event) is still placed at
    its YAML time, and says when it played."""
    root = crashing_run(tmp_path / "run")
    played = [
        {"time": T0 + 10.0, "source": "scenario", "reason": "reclaim", "message": "reclaim notice on n4",
         "nodes": ["n4"], "at": 10.0},
        {"time": T0 + 44.0, "source": "scenario", "reason": "flaky", "message": "n1 starts crashing",
         "nodes": ["n1"], "at": 29.0},
    ]  # fmt: skip
    write_events(root, played)
    run = load_run(root)
    assert [(e.reason, e.at) for e in run.events] == [("reclaim", 10.0), ("flaky", 29.0)]
    page = build_report([run], tmp_path / "report.html").read_text()
    per_event = page[page.index("<h2>Per scripted event</h2>") :]
    assert "<tr><td>10</td><td>reclaim notice on n4</td>" in per_event
    assert "<tr><td>29 (played at 44: the job settled first)</td><td>n1 starts crashing</td>" in per_event
    events = page[page.index("<h2>Events (regroup)</h2>") :]
    assert "<td>10.0</td><td>scenario</td>" in events and "<td>44.0 (scripted at 29)</td>" in events


async def test_the_runner_records_each_scenario_events_scripted_time(tmp_path: Path) -> None:
    from regroup.demo.runner import _play
    from tests.demo.test_settle import join
    from tests.demo.test_settle import spares_run as settled_spares_run

    run, _ = settled_spares_run(tmp_path, ["node-1", "node-2", "node-3", "node-4"])
    run.recorder.view.joins["node-5"] = join("node-5")  # settled: the spare waits
    flaky = run.scenario.events[-1]
    run.started_at = time.time() - flaky.at.total_seconds()  # it is due now
    await _play(run, (flaky,))
    [event] = [json.loads(line) for line in run.layout.events.read_text().splitlines()]
    assert (event["source"], event["reason"], event["at"]) == ("scenario", "flaky", 130.0)


def test_a_drain_is_labelled_a_drain_and_an_eviction_an_eviction(tmp_path: Path) -> None:
    """A drain cordons the node, then evicts its pod: the controller's plan names the notice
    that ends first, the eviction's; the cordon the cluster reported makes it the drain it is."""
    evicted = "reclaim notice on n2 (pod demo-n2 DisruptionTarget (EvictionByEvictionAPI), Kubernetes)"
    cordon = {"time": 9.9, "source": "cluster", "reason": "NodeNotSchedulable", "message": "drained", "nodes": ["n2"]}
    uncordon = {"time": 9.95, "source": "cluster", "reason": "NodeSchedulable", "message": "uncordoned",
                "nodes": ["n2"]}  # fmt: skip
    labels = {}
    for name, events in (("drain", [cordon]), ("evict", []), ("uncordoned", [cordon, uncordon])):
        root = write_run(tmp_path / name, "regroup", progress_rows([(0, 1, 20, 0.0, 3), (20, 21, 40, 11.0, 2)]),
                         events, 21.0)  # fmt: skip
        job = RecordedJob(root / "spans.jsonl")
        reclaim = job.reform("reclaim", 3, 2, 10.0, planned=True, checkpoint=0.3, rendezvous=0.2, resume=0.5,
                             reason=evicted)  # fmt: skip
        job.resume(reclaim, 10.5, 11.0, resumed_from=20, world=2)
        job.close()
        run = load_run(root)
        [row] = reform_rows(run)
        labels[name] = reform_label(run, row)
        if name == "drain":
            text = summary_text([run], tmp_path / "report.html")
            assert text.splitlines()[[line.split()[:1] for line in text.splitlines()].index(["1"])].split()[2] == "drain"
    assert labels == {"drain": "drain", "evict": "eviction", "uncordoned": "eviction"}
