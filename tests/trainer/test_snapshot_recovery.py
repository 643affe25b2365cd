"""A node lost without notice costs at most one step: in-memory snapshots with buddy copies.

Real etcd, real ``regroup-run`` agents (one per node), the real trainer on gloo, real
checkpoints. A node is SIGKILLed at a seeded random step; the survivors rebuild the state
from their snapshots and the copies their buddies kept, and the run then follows the
trajectory of a run that never lost a node. Losing a node and its buddy together leaves a
rank's shards nowhere in memory: the survivors then load the last committed checkpoint.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from regroup.demo.etcd_server import EtcdServer
from tests.conftest import REPO
from tests.rendezvous.inplace_job import InPlaceJob
from tests.trainer.harness import check, flat_tensors, full_state, step_losses, torchrun, write_config
from tests.trainer.test_resize import LOSS_RTOL, PARAM_ATOL

pytestmark = pytest.mark.slow

STEPS = 30
GLOBAL_BATCH = 12  # splits over 4, 3 and 1 ranks
NODES = ["a", "b", "c", "d"]
"""Buddies follow the node order: a -> b -> c -> d -> a."""
COMMON: dict[str, Any] = {
    "batch": {"global_batch_size": GLOBAL_BATCH},
    "optim": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": STEPS},
    "max_steps": STEPS,
    "log_every": 1,
    "step_time_floor": "100ms",
}


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, float]]:
    """The run that never lost a node: its checkpoint root and its loss per step."""
    root = tmp_path_factory.mktemp("straight")
    # No step-time floor: it paces the job for the test to act, and changes no number.
    config = write_config(
        root / "train.yaml", **{**COMMON, "step_time_floor": "0s"}, checkpoint={"dir": str(root / "ckpt")}
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    done = check(torchrun(len(NODES), config, env, timeout=300))
    return root / "ckpt", step_losses(done.stderr)


def _steps_done(folder: Path, world: int) -> list[int]:
    """Steps some rank completed (its optimizer step) in a world of ``world`` ranks."""
    steps = []
    for path in folder.glob(f"samples-w{world}-r*.jsonl"):
        steps += [json.loads(line)["step"] for line in path.read_text().splitlines()]
    return steps


def _finish_and_compare(
    job: InPlaceJob, survivors: list[str], straight: tuple[Path, dict[int, float]], scratch: Path
) -> None:
    """The survivors train to the end; every step's loss and the final state match the run
    that never lost a node, and the sample log shows no sample skipped."""
    for node in survivors:
        assert job.procs[node].wait(240) == 0, job.log(node)[-3000:]
    got: dict[int, float] = {}
    for node in sorted(job.procs, key=lambda n: n in survivors):
        got.update(step_losses(job.log(node)))  # a step trained again after a loss: its last loss wins
    ckpt, expected = straight
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_RTOL), f"loss differs at step {step}"
    a = flat_tensors(full_state(ckpt, STEPS, scratch))
    b = flat_tensors(full_state(job.root / "ckpt", STEPS, scratch))
    assert sorted(a) == sorted(b)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
    assert worst < PARAM_ATOL, f"largest parameter/optimizer-state difference {worst}"
    trained: Counter[int] = Counter()
    for path in (job.root / "samples").glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            trained.update(json.loads(line)["ids"])
    assert sorted(trained) == list(range(STEPS * GLOBAL_BATCH)), "no sample skipped"


def test_a_node_lost_without_notice_costs_at_most_one_step_and_its_buddy_too_falls_back(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str], straight: tuple[Path, dict[int, float]]
) -> None:
    """Four nodes. One, picked at random, is SIGKILLed at a random step: the survivors
    rebuild from memory and lose at most one step. Then a node and its buddy die together:
    one rank's shards are nowhere in memory, and the last survivor loads the last commit.
    The run ends where the run that never lost a node ends."""
    rng = random.Random(1307)
    lost, kill_at = rng.choice(NODES), rng.randint(6, 10)
    trainer = {
        **COMMON,
        "snapshot": {"every": 1},
        "checkpoint": {"dir": str(tmp_path / "job" / "ckpt"), "every_steps": 4},
        "data": {"sample_log": str(tmp_path / "job" / "samples")},
    }
    job = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env, trainer=trainer)
    try:
        job.expect(1, NODES, "start")  # the first world holds all four, like the run compared with
        for node in NODES:
            job.start(node, nnodes=f"1:{len(NODES)}")
        job.await_progress(f"4 ranks past step {kill_at}", lambda p: p.world_size == 4 and p.step >= kill_at)
        job.kill_node(lost)
        shrunk = job.await_progress(
            "training at 3 ranks", lambda p: p.world_size == 3 and p.step > p.resumed_from_step, timeout=120
        )
        assert shrunk.reform_mode == "in-place"
        assert "reshard" in shrunk.resume_phases and "load" not in shrunk.resume_phases, shrunk.resume_phases
        reached = max(_steps_done(job.root / "samples", 4))
        assert reached - shrunk.resumed_from_step <= 1, f"reached {reached}, resumed from {shrunk.resumed_from_step}"
        assert shrunk.extra.get("snapshot_every") == 1

        left = [n for n in NODES if n != lost]  # buddies now follow the three: left[1]'s copy is on left[2]
        before = job.await_progress(
            "a checkpoint committed at 3 ranks",
            lambda p: p.world_size == 3 and (p.extra.get("last_committed_step") or 0) > shrunk.step,
        )
        job.kill_node(left[1])
        job.kill_node(left[2])
        fallen = job.await_progress(
            "training at 1 rank", lambda p: p.world_size == 1 and p.step > p.resumed_from_step, timeout=120
        )
        assert "load" in fallen.resume_phases and "reshard" not in fallen.resume_phases, fallen.resume_phases
        assert fallen.resumed_from_step % 4 == 0 and fallen.resumed_from_step >= before.extra["last_committed_step"]
        _finish_and_compare(job, [left[0]], straight, tmp_path)
    finally:
        job.close()
