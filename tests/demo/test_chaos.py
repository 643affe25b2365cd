"""A seeded chaos campaign of three faults on a three-node job: a node SIGKILLed mid-step,
etcd restarted, the controller cancelled mid re-form and replaced. Real etcd, agents,
trainers and controller (``bench.chaos``); every wait in it is on an observed event.
Each fault must be recovered from within the bound and no invariant may break."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.chaos.campaign import CampaignSettings, run_campaign
from bench.chaos.invariants import (
    RECOVERY_PROMISE,
    kept_history,
    read_samples,
    recovery_point,
    slow_recovery_finding,
    steps_lost_finding,
)
from bench.chaos.job import JobShape
from bench.chaos.plan import CONTROLLER_KILL, ETCD_RESTART, MID_STEP, NODE_KILL
from bench.chaos.report import render
from regroup.records import Progress

KINDS = (f"{NODE_KILL}/{MID_STEP}", ETCD_RESTART, CONTROLLER_KILL)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_three_seeded_faults_break_no_invariant(tmp_path: Path) -> None:
    shape = JobShape(nodes=3, min_nodes=2, max_nodes=3)
    settings = CampaignSettings(seed=0, faults=len(KINDS), root=tmp_path / "chaos", kinds=KINDS, shape=shape)
    result = await run_campaign(settings)
    table = render(result, (0.0, 0.0))
    assert sorted(f.fault.kind for f in result.faults) == sorted(KINDS), table
    # Invariant 7 (trains again within 10 s) is a speed: the benchmark measures it, on a
    # loaded machine a test must not depend on it. Every other invariant holds.
    assert not [v for v in result.violations() if v[1].invariant != 7], table
    assert all(f.recovered_at is not None for f in result.faults), table
    takeover = next(f for f in result.faults if f.fault.kind == CONTROLLER_KILL)
    assert takeover.injection is not None and takeover.injection.moment_seen, table
    assert takeover.injection.plan_generation is not None, "the controller was not killed mid re-form"
    assert result.controllers == 2
    assert result.shutdown is not None and not result.shutdown.processes_left and not result.shutdown.leaked_keys
    assert result.last_step > 0


# The checks themselves, on made-up records (no processes).


def _log(folder: Path, world_size: int, round_: int, steps: range, t0: float, skip_rank: int | None = None) -> None:
    """Sample-log lines of one world, as the trainer writes them (global batch 12)."""
    folder.mkdir(parents=True, exist_ok=True)
    share = 12 // world_size
    for rank in range(world_size):
        with open(folder / f"samples-w{world_size}-r{rank}.jsonl", "a") as out:
            for i, step in enumerate(steps):
                if rank == skip_rank and step == steps[-1]:
                    continue
                ids = list(range((step - 1) * 12 + rank * share, (step - 1) * 12 + (rank + 1) * share))
                out.write(json.dumps({"step": step, "ids": ids, "restart": 0, "round": round_, "t": t0 + i}) + "\n")


def test_a_resumed_world_replaces_the_steps_it_redoes(tmp_path: Path) -> None:
    _log(tmp_path, 4, 1, range(1, 7), 100.0, skip_rank=3)  # killed inside step 6
    _log(tmp_path, 3, 2, range(5, 9), 200.0)  # resumed from step 4: 5 and 6 again
    history = kept_history(read_samples(tmp_path), 12)
    assert history.findings == [] and history.last_step == 8
    assert history.redone == [(100.0, 0), (200.0, 1)], "step 5 was complete, the cut step 6 was not"
    assert {s: w.round for s, w in history.kept.items()} == {1: 1, 2: 1, 3: 1, 4: 1, 5: 2, 6: 2, 7: 2, 8: 2}


def test_a_step_resumed_past_is_skipped_samples(tmp_path: Path) -> None:
    _log(tmp_path, 4, 1, range(1, 5), 100.0)
    _log(tmp_path, 2, 3, range(6, 8), 200.0)  # resumed from step 5, which nobody trained
    messages = [f.message for f in kept_history(read_samples(tmp_path), 12).findings]
    assert any("step 5 is in no world's log" in m for m in messages)
    assert any("12 sample ids skipped, first 48" in m for m in messages)


def _progress(step: int, t: float, world_size: int = 3, round_: int = 1, resumed: int = 0) -> Progress:
    return Progress(
        step=step, loss=1.0, samples_seen=0, world_size=world_size, time=t, resumed_from_step=resumed, round=round_
    )


def test_recovery_needs_a_whole_step_after_the_fault() -> None:
    legal = range(2, 5)
    # The old world's record written just after the kill is of a step that ended before it.
    old = [_progress(10, 99.0), _progress(11, 100.1)]
    assert recovery_point(old, 100.0, legal) is None
    new = [*old, _progress(9, 103.0, 2, 2, 8), _progress(10, 103.4, 2, 2, 8)]
    assert recovery_point(new, 100.0, legal) == new[2]
    assert recovery_point([*old, _progress(9, 103.0, 1, 2, 8), _progress(10, 103.4, 1, 2, 8)], 100.0, legal) is None


def test_a_fault_that_takes_a_member_may_cost_max_every_steps_and_any_other_none() -> None:
    assert steps_lost_finding(1.0, "node-kill/mid-step", True, 1, 1) is None
    lost = steps_lost_finding(1.0, "rank-kill/save", True, 5, 1)
    assert lost is not None and lost.invariant == 6 and "lost 5 steps, more than 1" in lost.message
    assert steps_lost_finding(1.0, "node-kill/save", True, 3, 4) is None
    planned = steps_lost_finding(1.0, "etcd-restart", False, 1, 4)
    assert planned is not None and "more than 0" in planned.message


def test_a_fault_trained_again_after_the_promise_is_a_violation() -> None:
    assert slow_recovery_finding(1.0, "rank-kill/mid-step", RECOVERY_PROMISE) is None
    assert slow_recovery_finding(1.0, "rank-kill/mid-step", None) is None  # invariant 1's to report
    slow = slow_recovery_finding(1.0, "rank-kill/after-ack", 13.2)
    assert slow is not None and slow.invariant == 7 and "after 13.20 s" in slow.message
