"""The live view: what a moment of the run looks like on a terminal and in a log."""

from __future__ import annotations

import io
import dataclasses

from regroup.demo.live import LiveSnapshot, LiveView, phase_of, render, render_line, stale_after
from regroup.demo.recorder import JobView
from regroup.records import JobStatus, Progress, ReformPlan

SNAP = LiveSnapshot(
    title="regroup demo · default",
    elapsed=42.0,
    duration=195.0,
    step=180,
    loss=1.2345,
    world_size=3,
    phase="re-forming (reclaim, planned): checkpoint",
    next_event="in  13s: abrupt loss of node-3",
    nodes=(("node-1", "training"), ("node-2", "training, reclaim in 8s")),
    recent=(" 20.0s  scenario   reclaim: reclaim notice on node-2",),
)


def _plan(phase: str) -> ReformPlan:
    return ReformPlan(
        generation=3, cause="reclaim", planned=True, phase=phase, reason="", nodes_before=["a", "b"],
        nodes_after=["a"], trace_id="0" * 32, detected_at=1.0, decided_at=1.0,
    )  # fmt: skip


def test_the_screen_shows_step_loss_world_phase_and_next_event() -> None:
    text = "\n".join(render(SNAP))
    for expected in ("step       180", "loss 1.2345", "world size 3", "reclaim, planned): checkpoint",
                     "in  13s: abrupt loss of node-3", "node-2: training, reclaim in 8s", "42s / 195s"):  # fmt: skip
        assert expected in text, expected
    line = render_line(SNAP)
    assert line.startswith("[   42s] step 180 loss 1.2345 world 3 |") and "\n" not in line


def test_the_phase_follows_the_plan_then_progress() -> None:
    view = JobView()
    assert phase_of(view, now=100.0) == "starting"
    view.progress = Progress(step=5, loss=2.0, samples_seen=60, world_size=2, time=99.0)
    view.progress_seen_at = 99.5
    assert phase_of(view, now=100.0) == "training"
    assert phase_of(view, now=110.0) == "training stopped, waiting to resume"
    view.progress = Progress(step=9, loss=1.9, samples_seen=90, world_size=2, time=99.0, round=2,
                             reform_mode="in-place", resume_phases={"process_group": 0.5, "reshard": 0.8})
    assert phase_of(view, now=100.0) == "training (last re-form in-place, resumed in 1.3s)"
    view.plan = _plan("rendezvous")
    assert phase_of(view, now=100.0) == "re-forming (reclaim, planned): rendezvous"
    view.plan = _plan("done")
    view.status = JobStatus(state="stalled", reason="1 nodes, below min 2", node_count=1)
    assert phase_of(view, now=100.0) == "stalled: 1 nodes, below min 2"


def test_a_terminal_gets_redraws_and_a_pipe_gets_lines() -> None:
    tty, pipe = io.StringIO(), io.StringIO()
    LiveView(lambda: SNAP, stream=tty, tty=True).draw()
    LiveView(lambda: SNAP, stream=pipe, tty=False).draw()
    assert tty.getvalue().startswith("\x1b[H\x1b[J") and tty.getvalue().count("\n") == len(render(SNAP))
    assert pipe.getvalue() == render_line(SNAP) + "\n"


def test_the_phase_says_how_the_world_is_kept_where_the_plan_says() -> None:
    view = JobView()
    view.plan = dataclasses.replace(_plan("checkpoint"), strategy="migrate", replaced={"node-2": "node-5"})
    assert phase_of(view, now=100.0) == "re-forming (reclaim, planned, migrate node-2->node-5): checkpoint"


def _published(every: float, count: int, announced: float | None = None, last: float = 100.0) -> JobView:
    """A job whose rank 0 published ``count`` progress records ``every`` seconds, the last at ``last``."""
    view = JobView()
    extra = {} if announced is None else {"progress_interval_s": announced}
    view.progress = Progress(step=count, loss=1.0, samples_seen=12 * count, world_size=2, time=last, extra=extra)
    for i in range(count):
        view.progress_arrivals.append(last - (count - 1 - i) * every)
    view.progress_seen_at = last
    return view


def test_a_script_that_publishes_every_5s_is_training_all_the_way_between_its_records() -> None:
    # A user's script publishes every 5 s by default (etcd.progress_interval), from its first record on.
    first = _published(5.0, 1, announced=5.0)
    steady = _published(5.0, 12, announced=5.0)
    for view in (first, steady):
        for waited in (0.5, 2.5, 3.5, 4.9, 6.0):
            assert phase_of(view, now=100.0 + waited) == "training", waited
        assert phase_of(view, now=100.0 + 16.0) == "training stopped, waiting to resume"
    # Without the announcement, the gaps seen between its records give the pace.
    unannounced = _published(5.0, 4)
    assert phase_of(unannounced, now=104.9) == "training"
    assert phase_of(unannounced, now=116.0) == "training stopped, waiting to resume"


def test_a_job_that_publishes_often_is_stopped_after_a_couple_of_seconds() -> None:
    builtin = _published(0.25, 20, announced=0.25)
    assert stale_after(builtin) == 2.0
    assert phase_of(builtin, now=101.5) == "training"
    assert phase_of(builtin, now=102.5) == "training stopped, waiting to resume"


def test_steps_slower_than_the_interval_set_the_pace() -> None:
    # Progress is published at step boundaries: 8 s steps publish every 8 s whatever the interval.
    slow = _published(8.0, 6, announced=5.0)
    assert stale_after(slow) == 24.0
    assert phase_of(slow, now=100.0 + 7.9) == "training"
