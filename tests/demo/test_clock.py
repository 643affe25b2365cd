"""When a demo run's scenario clock starts: once the job trains settled (every node it starts
with in its world, its spares waiting), so the events land at their scripted times and the
report places them there. A spare node starts only once the job trains, and its start-up
used to push every event of the spares scenario back (15 s on two busy cores)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from regroup.demo.analysis import goodput, load_run, world_size_timeline
from regroup.demo.runner import start_clock
from tests.demo.recorded import T0, progress_rows, write_run
from tests.demo.test_settle import join, spares_run

NODES = ["node-1", "node-2", "node-3", "node-4"]


async def test_the_clock_starts_once_the_spare_waits(tmp_path: Path) -> None:
    run, _ = spares_run(tmp_path, NODES)
    run.trained_at = time.time()
    clock = asyncio.create_task(start_clock(run))
    await asyncio.sleep(0)  # its first look: the job trains at 4, node-5 is still starting
    assert not clock.done() and run.started_at == 0.0
    assert run.snapshot().next_event.startswith("waiting for the job to settle")
    waiting_since = time.time()
    run.recorder.view.joins["node-5"] = join("node-5")
    await clock
    assert run.started_at >= waiting_since and run.delay == 0.0
    # The first event is due at its scripted time from here, nothing pushed back.
    upcoming = run.snapshot().next_event
    countdown, _, what = upcoming.removeprefix("in ").partition("s: ")
    assert 19 <= float(countdown) <= 20 and what.startswith("reclaim notice on node-2"), upcoming


async def test_a_job_that_never_settles_starts_the_clock_anyway_and_says_so(tmp_path: Path) -> None:
    run, _ = spares_run(tmp_path, NODES)
    await start_clock(run, timeout=0.3)
    assert run.started_at > 0.0 and run.delay == 0.0
    [event] = [json.loads(line) for line in run.layout.events.read_text().splitlines()]
    assert event["reason"] == "NotSettled" and event["message"].startswith("gave up after 0s")


async def test_the_baseline_starts_the_clock_at_the_first_step(tmp_path: Path) -> None:
    run, _ = spares_run(tmp_path, NODES)
    run.mode = "torchrun-c10d"
    before = time.time()
    await start_clock(run)
    assert before <= run.started_at <= time.time()


def test_training_before_the_clock_started_is_not_churn_time(tmp_path: Path) -> None:
    # The job trained 20 s at 4 ranks while its spare started; the clock starts at T0 + 20.
    rows = progress_rows([(0, 1, 100, 0.0, 4)])
    root = write_run(tmp_path / "run", "regroup", rows, [], 30.0, meta={"started_at": T0 + 20, "ended_at": T0 + 50})
    run = load_run(root)
    points = world_size_timeline(run)
    assert points[0] == (0.0, 4) and all(t >= 0.0 for t, _ in points)
    assert [t for t, _ in points] == sorted(t for t, _ in points)
    # Trained until T0 + 49.5 of a 30 s run: 29.5 s of it counts, none of the 20 s before.
    assert goodput(run) == pytest.approx(29.5 / 30.0)
