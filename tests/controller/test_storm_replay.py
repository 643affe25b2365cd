"""The controller benchmark's storm replay (``--costs``) makes the same decisions every run.

Its CPU per event (and its instruction count under ``--instructions``, which
docs/benchmarks.md compares code changes by) stands in for the paced runs' p99, which at a
saturating rate moves by a third from run to run. That only holds if the replay itself
never depends on timing: same storm, same decisions.
"""

from __future__ import annotations

from bench.controller.costs import storm_replay
from bench.controller.storm import Layout

# A tenth of the benchmark's cluster: 200 nodes, 20 jobs of 50, each node hosting 5 jobs.
SMALL = Layout(nodes=200, jobs=20, per_job=50)


async def test_the_storm_replay_decides_the_same_way_every_run() -> None:
    first = await storm_replay(SMALL, 2000, seed=8)
    second = await storm_replay(SMALL, 2000, seed=8)
    assert first["storm_decisions_per_event"] == second["storm_decisions_per_event"]
    # Node events wake each of the node's five jobs; pod and rank restarts mostly wake none.
    assert 1.0 < first["storm_decisions_per_event"] < 5.0
    assert first["storm_us_per_decision"] > 0 and first["storm_intake_us_per_event"] > 0
    other = await storm_replay(SMALL, 2000, seed=9)
    assert other["storm_decisions_per_event"] != first["storm_decisions_per_event"]
