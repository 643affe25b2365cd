"""A node's record of the newest step its agent's workers completed: what a restarted
world's workers read when no process of the world before survived (the restart path)."""

from __future__ import annotations

import os
from pathlib import Path

from regroup.elastic.world.reached import NodeSteps

ENV = {"TORCHELASTIC_RUN_ID": "llm", "LOCAL_RANK": "1"}


def test_the_workers_an_agent_starts_next_read_the_newest_step_any_of_its_workers_completed(tmp_path: Path) -> None:
    first = [NodeSteps.for_agent({**ENV, "LOCAL_RANK": str(rank)}, root=tmp_path) for rank in (0, 1)]
    assert all(steps is not None and steps.read() == -1 for steps in first)
    for step in range(1, 36):
        first[0].record(step)  # type: ignore[union-attr]
    first[1].record(34)  # type: ignore[union-attr]
    for steps in first:
        steps.close()  # type: ignore[union-attr]
    restarted = NodeSteps.for_agent(ENV, root=tmp_path)
    assert restarted is not None and restarted.read() == 35
    # Resumed from step 20, the new world trains 21..30 and is lost in its turn: the record
    # keeps 35, the newest step any worker of this agent completed.
    for step in range(21, 31):
        restarted.record(step)
    assert NodeSteps.for_agent(ENV, root=tmp_path).read() == 35  # type: ignore[union-attr]
    restarted.record(36)
    assert NodeSteps.for_agent(ENV, root=tmp_path).read() == 36  # type: ignore[union-attr]


def test_the_record_is_the_agents_own_and_goes_when_the_run_finished(tmp_path: Path) -> None:
    mine = NodeSteps.for_agent(ENV, root=tmp_path)
    assert mine is not None and mine.folder.name.startswith(f"llm-{os.getppid()}-")
    mine.record(12)
    # Another agent (another job's, or this node's after a restart of its container) has its own.
    other = NodeSteps(tmp_path / "llm-1-1", 1)
    assert other.read() == -1
    mine.forget()
    assert NodeSteps.for_agent(ENV, root=tmp_path).read() == -1  # type: ignore[union-attr]
    assert not mine.folder.exists()


def test_a_process_outside_an_agent_keeps_no_record(tmp_path: Path) -> None:
    assert NodeSteps.for_agent({"LOCAL_RANK": "0"}, root=tmp_path) is None
