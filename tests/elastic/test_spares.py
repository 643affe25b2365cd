"""Warm spares: a job keeps its world size through a loss or a reclaim, at the same step.

Real etcd, real ``regroup-run --standby`` agents (one per node), the real trainer on gloo,
real checkpoints. A spare is an agent beyond ``--nnodes``' max whose workers have started
and wait outside the world. A node SIGKILLed mid-run is replaced by a spare in its
position (its ranks): the world keeps its size, the survivors keep their processes and
their shards, the spare receives only the lost position's shards from the buddy copies,
and the run follows the trajectory of a run that never lost a node. A planned leave hands
its shards over and the spare takes its place with no step lost. With no spare left, a
loss shrinks the job as before.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from regroup.controller.decide.phases import lost_steps
from regroup.demo.etcd_server import EtcdServer
from regroup.exit_codes import LEFT_JOB
from regroup.records import Progress
from tests.rendezvous.inplace_job import InPlaceJob
from tests.elastic.test_snapshot_recovery import StraightRun, finish_and_compare, straight_run

pytestmark = pytest.mark.slow

STEPS = 40
GLOBAL_BATCH = 12
ACTIVE = ["a", "b"]
COMMON: dict[str, Any] = {
    "batch": {"global_batch_size": GLOBAL_BATCH},
    "optim": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
    "max_steps": STEPS,
    "log_every": 1,
    "step_time_floor": "150ms",
}


@pytest.fixture(scope="module")
def straight(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StraightRun]:
    """The run at two ranks that never lost a node, started with the first test that
    compares with it: it trains while that test's job starts and waits on its re-forms."""
    with straight_run(request, tmp_path_factory, len(ACTIVE), COMMON) as run:
        yield run


@pytest.fixture
def job(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[InPlaceJob]:
    trainer = {
        **COMMON,
        "snapshot": {"every": 1},
        "checkpoint": {"dir": str(tmp_path / "job" / "ckpt"), "every_steps": 5},
        "data": {"sample_log": str(tmp_path / "job" / "samples")},
    }
    running = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env, trainer=trainer)
    running.nnodes = "1:2"
    try:
        yield running
    finally:
        running.close()


def _start(job: InPlaceJob, spares: list[str]) -> None:
    """Two active nodes train; then each spare's agent starts, its worker warm, and asks to
    join: the job is at its max, so it waits outside the world. The world holds at a step
    boundary (a checkpoint request with hold) until the spares are up, however long their
    start takes on a busy machine, and goes on through a re-form of the same two nodes."""
    job.claim_control()
    job.expect(1, ACTIVE, "start")
    conf = f"spare_nodes={len(spares)}"
    for node in ACTIVE:
        job.start(node, conf=conf)
    job.await_progress("2 ranks training", lambda p: p.world_size == 2 and p.step >= 2)
    held = job.checkpoint(2, timeout=300)
    for node in spares:  # one after the other: the first to ask is the first to take a place
        job.start(node, conf=conf)
        job.await_joiner(node, after=0)
    for node in spares:
        assert len(job.workers(node)) == 1, f"spare {node} keeps its worker warm"
    before = job.progress()
    assert before is not None
    job.reform(3, ACTIVE, cause="manual")
    resumed = _replaced(job, before, "the two training on past the hold")
    assert resumed.resumed_from_step == held.step


def _ranks(job: InPlaceJob, node: str) -> list[int]:
    """The rank ``node``'s worker formed each of its worlds with (from its log)."""
    return [e["rank"] for e in job.events(node, "world formed")]


def _replaced(job: InPlaceJob, before: Progress, what: str) -> Progress:
    """The first progress of the world after ``before``'s, at the same size, past its first step."""
    return job.await_progress(
        what,
        lambda p: p.round > before.round and p.world_size == before.world_size and p.step > p.resumed_from_step,
        timeout=120,
    )


def _lost(job: InPlaceJob, after: Progress) -> int:
    """Steps the new world trains again: from the newest step any rank of the worlds before
    completed (their sample logs) back to the step it resumed from. The trainers' own account
    (``last_step``), and the controller's count from it, say the same."""
    rows = [json.loads(line) for path in (job.root / "samples").glob("samples-*.jsonl")
            for line in path.read_text().splitlines()]  # fmt: skip
    reached = max(row["step"] for row in rows if row["round"] < after.round)
    assert after.last_step == reached, f"the trainers say {after.last_step}, their sample logs {reached}"
    lost = reached - after.resumed_from_step
    assert lost_steps(after) == lost
    return lost


def _resharded(job: InPlaceJob, node: str) -> dict[str, Any]:
    found = job.events(node, "resharded in memory")
    assert found, job.log(node)[-3000:]
    return found[-1]


def test_two_nodes_killed_are_replaced_by_two_spares_in_their_positions_then_the_job_shrinks(
    job: InPlaceJob, straight: StraightRun, tmp_path: Path
) -> None:
    """a and b train at two ranks with spares c and d. b is SIGKILLed: c takes rank 1 at
    the same world size, losing at most one step; a keeps its process and its shards. Then a
    is SIGKILLed: d takes rank 0. Then c: no spare is left, and d trains on alone (the
    elastic shrink). Every step's loss and the final state match the straight run."""
    rng = random.Random(2707)
    first, second, third = rng.randint(5, 8), rng.randint(4, 6), rng.randint(4, 6)
    _start(job, ["c", "d"])
    warm = {node: job.workers(node) for node in ("a", "c", "d")}

    before = job.await_progress(f"past step {first}", lambda p: p.world_size == 2 and p.step >= first)
    job.kill_node("b")
    after = _replaced(job, before, "training at 2 ranks again, c in b's place")
    assert after.reform_mode == "in-place"
    assert "reshard" in after.resume_phases and "load" not in after.resume_phases, after.resume_phases
    assert _lost(job, after) <= 1
    assert job.workers("a") == warm["a"] and job.workers("c") == warm["c"], "no process restarted"
    assert _ranks(job, "c")[-1] == 1 and _ranks(job, "a")[-1] == 0, "c took b's position"
    mine, theirs = _resharded(job, "a"), _resharded(job, "c")
    assert mine["layout"] == theirs["layout"] == "same"
    assert mine["received_bytes"] == 0, "the survivor keeps its shards"
    assert theirs["received_bytes"] > 0 and theirs["sent_bytes"] == 0
    assert job.workers("d") == warm["d"], "d is still a spare"

    before = job.await_progress(f"{second} steps on", lambda p: p.round == after.round and p.step >= after.step + second)
    job.kill_node("a")
    again = _replaced(job, before, "training at 2 ranks again, d in a's place")
    assert _lost(job, again) <= 1
    # Rank 0 is now the spare's worker: it waited warm, no process was started for this world.
    assert again.reform_mode == "in-place" and "startup" not in again.resume_phases, again
    assert job.workers("d") == warm["d"] and job.workers("c") == warm["c"]
    assert _ranks(job, "d")[-1] == 0 and _ranks(job, "c")[-1] == 1, "d took a's position, c kept its own"

    before = job.await_progress(f"{third} steps on", lambda p: p.round == again.round and p.step >= again.step + third)
    job.kill_node("c")
    alone = job.await_progress(
        "d training alone", lambda p: p.world_size == 1 and p.step > p.resumed_from_step, timeout=120
    )
    assert "reshard" in alone.resume_phases, alone.resume_phases
    assert _resharded(job, "d")["layout"] == "changed"

    finish_and_compare(job, ["d"], straight, tmp_path, steps=STEPS, global_batch=GLOBAL_BATCH)


def test_a_planned_leave_migrates_to_the_spare_with_no_step_lost(job: InPlaceJob) -> None:
    """The controller's planned reclaim of b with spare c waiting: checkpoint request with
    hold (acked from memory), then the next round [a, c]. b hands its shards over at the
    agreed step and leaves (exit 75); c takes rank 1 and the world resumes at that step."""
    _start(job, ["c"])
    warm = {node: job.workers(node) for node in ("a", "c")}
    before = job.progress()
    assert before is not None
    ack = job.checkpoint(4)
    assert not ack.stored, "acked from memory: nothing written on the critical path"
    job.reform(4, ["a", "c"], cause="reclaim")
    after = _replaced(job, before, "training at 2 ranks, c in b's place")
    assert after.resumed_from_step == ack.step, "0 steps lost"
    assert _lost(job, after) == 0
    assert "reshard" in after.resume_phases and "load" not in after.resume_phases, after.resume_phases
    assert _ranks(job, "c")[-1] == 1 and _ranks(job, "a")[-1] == 0
    assert job.workers("a") == warm["a"] and job.workers("c") == warm["c"]
    assert _resharded(job, "a")["received_bytes"] == 0
    assert _resharded(job, "c")["layout"] == "same"
    job.terminate("b")  # left out, b's agent stays to be let back in; stop it
    assert job.procs["b"].wait(60) == LEFT_JOB, job.log("b")[-3000:]
