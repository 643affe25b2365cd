"""The live view: what a moment of the run looks like on a terminal and in a log."""

from __future__ import annotations

import io
import dataclasses

from regroup.demo.live import LiveSnapshot, LiveView, phase_of, render, render_line
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
