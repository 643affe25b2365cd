"""The instruction count of the storm (``--instructions``) rests on a replay that decides
the same way however fast it runs, and on reading callgrind's totals right."""

from __future__ import annotations

import time

import pytest

from bench.controller.direct import direct_harness
from bench.controller.instructions import VIRTUAL_START, VirtualClock, replay_window, summary
from bench.controller.storm import Layout
from regroup.controller.cluster import NodeInfo

# A tenth of the benchmark's cluster: 200 nodes, 20 jobs of 50, each node hosting 5 jobs.
SMALL = Layout(nodes=200, jobs=20, per_job=50)

# The head and tail of a real callgrind dump (``--cache-sim=yes``), numbers shortened.
DUMP = """\
version: 1
creator: callgrind-3.19.0
pid: 11307
cmd:  .venv/bin/python /tmp/replay.py 1000
part: 1
desc: I1 cache: 32768 B, 64 B, 8-way associative
events: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
fl=(1)
fn=(1) 0x0000000000000000
0 3
summary: 990855452 288045633 165348247 19680955 12383854 4115168 33 3 7527
totals: 990855452 288045633 165348247 19680955 12383854 4115168 33 3 7527
"""


def test_the_summary_is_read_by_the_names_of_the_events_line() -> None:
    totals = summary(DUMP)
    assert totals["Ir"] == 990_855_452
    assert (totals["I1mr"], totals["D1mr"], totals["D1mw"]) == (19_680_955, 12_383_854, 4_115_168)
    with pytest.raises(ValueError):
        summary("events: Ir\n")


def test_the_virtual_clock_moves_only_when_told() -> None:
    clock = VirtualClock(start=100.0, step=0.25)
    assert clock() == clock() == 100.0
    clock.tick()
    clock.tick()
    assert clock() == 100.5


async def test_the_counted_window_decides_the_same_way_however_slowly_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    first = await replay_window(SMALL, 400, 200, seed=8, rate=5000.0)
    assert first["events"] == 400 and first["cpu_s"] > 0
    # Node events wake each of the node's five jobs; pod and rank restarts mostly wake none.
    assert 400 < first["decisions"] < 2000
    # Under callgrind the replay runs a hundred times slower. If any decision read the wall
    # clock, a wall clock a year past the virtual one (every rendezvous and resume timeout
    # firing) would change what it decides. (The virtual clock starts in 2027: a jump of an
    # hour from today would still be behind it and fire nothing.)
    assert time.time() < VIRTUAL_START
    year = 365 * 24 * 3600.0
    monkeypatch.setattr(time, "time", lambda: VIRTUAL_START + year)
    slow = await replay_window(SMALL, 400, 200, seed=8, rate=5000.0)
    assert slow["decisions"] == first["decisions"]
    # The virtual clock is what decisions run on: other gaps between events, other decisions.
    other_rate = await replay_window(SMALL, 400, 200, seed=8, rate=0.001)
    assert other_rate["decisions"] != first["decisions"]


async def test_the_harness_stamps_and_decides_on_the_clock_it_is_given() -> None:
    # The virtual clock only helps if both the model's sightings and the decisions' ``now``
    # come from it: a default bound to time.time would escape the monkeypatch above.
    clock = VirtualClock(start=VIRTUAL_START, step=1.0)
    h = await direct_harness(SMALL, 0, clock)
    try:
        clock.tick()
        h.model.node_changed(NodeInfo(SMALL.node(0), ready=False))
        assert h.model.fleet.signals[SMALL.node(0)]["notready"] == VIRTUAL_START + 1.0
        statuses = [state.status for state in h.model.jobs.values()]
        assert statuses and all(s is not None and s.updated_at == VIRTUAL_START for s in statuses)
    finally:
        await h.stop()
