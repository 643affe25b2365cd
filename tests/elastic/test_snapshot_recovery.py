"""A node lost without notice costs at most ``snapshot.max_every`` steps (one by default):
in-memory snapshots with buddy copies.

Real etcd, real ``regroup-run`` agents (one per node), the real trainer on gloo, real
checkpoints. A node is SIGKILLed at a seeded random step; the survivors rebuild the state
from their snapshots and the copies their buddies kept, and the run then follows the
trajectory of a run that never lost a node. The bound holds with every core kept busy,
where ``every: auto`` measures snapshots as costly. Losing a node and its buddy together
leaves a rank's shards nowhere in memory: the survivors then load the last committed
checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from regroup.controller.decide.phases import lost_steps
from regroup.demo.etcd_server import EtcdServer
from regroup.records import Progress
from tests.conftest import REPO
from tests.rendezvous.inplace_job import InPlaceJob
from tests.elastic.harness import BackgroundTorchrun, flat_tensors, full_state, run_all, step_losses, write_config
from tests.elastic.test_resize import LOSS_RTOL, PARAM_ATOL
from tests.scratch import scratch

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


class StraightRun:
    """A run of ``ranks`` that never loses a node, started in the background: it trains
    while the job under test starts its agents and waits on its re-forms. ``result()``
    waits for its end: its checkpoint root and its loss per step."""

    def __init__(self, root: Path, ranks: int, common: dict[str, Any]) -> None:
        self.root = root
        # No step-time floor: it paces the job for the test to act, and changes no number.
        config = write_config(
            root / "train.yaml", **{**common, "step_time_floor": "0s"}, checkpoint={"dir": str(root / "ckpt")}
        )
        env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.run = BackgroundTorchrun(ranks, config, env, root, timeout=300)
        self._losses: dict[int, float] | None = None

    def result(self) -> tuple[Path, dict[int, float]]:
        if self._losses is None:
            self._losses = step_losses(self.run.stderr())
        return self.root / "ckpt", self._losses

    def close(self) -> None:
        self.run.close()


@contextlib.contextmanager
def straight_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, ranks: int, common: dict[str, Any]
) -> Iterator[StraightRun]:
    """A module's straight run, in a folder that goes with it (``tests.scratch``)."""
    with scratch(request, tmp_path_factory, "straight") as root:
        run = StraightRun(root, ranks, common)
        try:
            yield run
        finally:
            run.close()


@pytest.fixture(scope="module")
def straight(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StraightRun]:
    """The run that never lost a node, started with the first test that compares with it."""
    with straight_run(request, tmp_path_factory, len(NODES), COMMON) as run:
        yield run


def _steps_done(folder: Path, world: int) -> list[int]:
    """Steps some rank completed (its optimizer step) in a world of ``world`` ranks."""
    steps = []
    for path in folder.glob(f"samples-w{world}-r*.jsonl"):
        steps += [json.loads(line)["step"] for line in path.read_text().splitlines()]
    return steps


@contextlib.contextmanager
def busy_cores(env: dict[str, str]) -> Iterator[int]:
    """Every core kept busy while the block runs: one process per core spinning at normal
    priority (``tests/busy.py``'s ``spin``). Only these processes are ended after it."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "from tests.busy import spin; spin()"], env=env, cwd=REPO)
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield len(spinners)
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait()


def _lost_steps(job: InPlaceJob, resumed: Progress, worlds: tuple[int, ...] = (4,)) -> int:
    """Steps the new world trains again, from the sample logs: the newest step any rank of
    the worlds before (of ``worlds`` ranks) completed, back to the step it resumed from. The
    trainers' own account (``last_step``), and the controller's count from it, say the same."""
    reached = max(step for world in worlds for step in _steps_done(job.root / "samples", world))
    assert resumed.last_step == reached, f"the trainers say {resumed.last_step}, their sample logs {reached}"
    lost = reached - resumed.resumed_from_step
    assert lost_steps(resumed) == lost
    return lost


def finish_and_compare(
    job: InPlaceJob,
    survivors: list[str],
    straight: StraightRun,
    scratch: Path,
    steps: int = STEPS,
    global_batch: int = GLOBAL_BATCH,
) -> None:
    """The survivors train to the end; every step's loss and the final state match the run
    that never lost a node, and the sample log shows no sample skipped."""
    for node in survivors:
        assert job.procs[node].wait(240) == 0, job.log(node)[-3000:]
    got: dict[int, float] = {}
    for node in sorted(job.procs, key=lambda n: n in survivors):
        got.update(step_losses(job.log(node)))  # a step trained again after a loss: its last loss wins
    ckpt, expected = straight.result()
    assert sorted(got) == sorted(expected) == list(range(1, steps + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_RTOL), f"loss differs at step {step}"
    a = flat_tensors(full_state(ckpt, steps, scratch))
    b = flat_tensors(full_state(job.root / "ckpt", steps, scratch))
    assert sorted(a) == sorted(b)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
    assert worst < PARAM_ATOL, f"largest parameter/optimizer-state difference {worst}"
    trained: Counter[int] = Counter()
    for path in (job.root / "samples").glob("samples-*.jsonl"):
        for line in path.read_text().splitlines():
            trained.update(json.loads(line)["ids"])
    assert sorted(trained) == list(range(steps * global_batch)), "no sample skipped"


@contextlib.contextmanager
def four_nodes(etcd: EtcdServer, tmp_path: Path, env: dict[str, str], checkpoint_every: int) -> Iterator[InPlaceJob]:
    """The four nodes training with a snapshot every step and a checkpoint every
    ``checkpoint_every`` steps (0: at the end), sample logs on; ended after the block."""
    trainer = {
        **COMMON,
        "snapshot": {"every": 1},
        "checkpoint": {"dir": str(tmp_path / "job" / "ckpt"), "every_steps": checkpoint_every},
        "data": {"sample_log": str(tmp_path / "job" / "samples")},
    }
    job = InPlaceJob(etcd.endpoint, tmp_path / "job", env, trainer=trainer)
    try:
        job.expect(1, NODES, "start")  # the first world holds all four, like the run compared with
        for node in NODES:
            job.start(node, nnodes=f"1:{len(NODES)}")
        yield job
    finally:
        job.close()


def lose_one(job: InPlaceJob, rng: random.Random) -> tuple[str, Progress]:
    """A node picked by ``rng`` SIGKILLed at a step it picks too; (that node, the first
    progress of the three once they counted a step)."""
    lost, kill_at = rng.choice(NODES), rng.randint(6, 10)
    job.await_progress(f"4 ranks past step {kill_at}", lambda p: p.world_size == 4 and p.step >= kill_at)
    job.kill_node(lost)
    shrunk = job.await_progress(
        "training at 3 ranks", lambda p: p.world_size == 3 and p.step > p.resumed_from_step, timeout=120
    )
    return lost, shrunk


def test_a_node_lost_without_notice_costs_at_most_one_step_and_its_buddy_too_falls_back(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str], straight: StraightRun
) -> None:
    """Four nodes. One, picked at random, is SIGKILLed at a random step: the survivors
    rebuild from memory and lose at most one step. Then a node and its buddy die together:
    one rank's shards are nowhere in memory, and the last survivor loads the last commit.
    The run ends where the run that never lost a node ends."""
    rng = random.Random(1307)
    with four_nodes(etcd, tmp_path, worker_env, checkpoint_every=4) as job:
        lost, shrunk = lose_one(job, rng)
        assert shrunk.reform_mode == "in-place"
        assert "reshard" in shrunk.resume_phases and "load" not in shrunk.resume_phases, shrunk.resume_phases
        lost_steps = _lost_steps(job, shrunk)
        assert lost_steps <= 1, f"{lost_steps} steps lost: resumed from {shrunk.resumed_from_step}"
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
        # Loaded from the checkpoint: every step past it that a rank of the three (or of the
        # four) completed is trained again.
        assert _lost_steps(job, fallen, worlds=(4, 3)) >= 0
        finish_and_compare(job, [left[0]], straight, tmp_path)


def test_a_node_lost_in_a_re_formed_worlds_first_step_costs_at_most_one_step(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """A world that restored its state snapshots that state at once. Four nodes; one is
    SIGKILLed, the three re-form from memory; a second is SIGKILLed as soon as the three
    have counted their first step. The two left rebuild from the three's first snapshot
    (of the state they resumed from) and lose at most one step, where the first snapshot
    used to wait for the host buffers and a boundary, and such a loss went back to the last
    checkpoint (here: none since the start)."""
    rng = random.Random(4111)
    with four_nodes(etcd, tmp_path, worker_env, checkpoint_every=0) as job:
        first, shrunk = lose_one(job, rng)
        left = [n for n in NODES if n != first]
        second = rng.choice(left)
        job.kill_node(second)
        fallen = job.await_progress(
            "training at 2 ranks", lambda p: p.world_size == 2 and p.step > p.resumed_from_step, timeout=120
        )
        assert "reshard" in fallen.resume_phases and "load" not in fallen.resume_phases, fallen.resume_phases
        assert fallen.resumed_from_step >= shrunk.resumed_from_step
        lost_steps = _lost_steps(job, fallen, worlds=(4, 3))
        assert lost_steps <= 1, f"{lost_steps} steps lost: resumed from {fallen.resumed_from_step}"
        restored = [e for n in left for e in job.events(n, "snapshot of the restored state")]
        assert {e["step"] for e in restored if e["world_size"] == 3} == {shrunk.resumed_from_step}, restored


def test_a_node_lost_after_a_planned_shrinks_ack_costs_no_step(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """A planned shrink leaves d out; its checkpoint request names d, and the trainers ack
    from memory. Then c is SIGKILLed before the re-form: c's shards were on c and, as its
    buddy's copy, on d, which leaves. Before the ack d sent its snapshots (its own and c's
    copy) to staying ranks, so a and b rebuild the acked step from memory and lose no step,
    where they used to find c's shards nowhere and start over from storage (here: nothing)."""
    with four_nodes(etcd, tmp_path, worker_env, checkpoint_every=0) as job:
        job.await_progress("4 ranks past step 5", lambda p: p.world_size == 4 and p.step >= 5)
        ack = job.checkpoint(2, leaving=["d"])
        assert not ack.stored, ack  # answered from memory: nothing on storage to fall back to
        (secured,) = [e for n in NODES for e in job.events(n, "leaving ranks secured their state")]
        assert secured["step"] == ack.step and secured["ranks"] == [NODES.index("d")], secured
        job.kill_node("c")
        job.reform(3, ["a", "b"], cause="node-lost")
        shrunk = job.await_progress(
            "training at 2 ranks", lambda p: p.world_size == 2 and p.step > p.resumed_from_step, timeout=120
        )
        assert shrunk.reform_mode == "in-place"
        assert "reshard" in shrunk.resume_phases and "load" not in shrunk.resume_phases, shrunk.resume_phases
        assert shrunk.resumed_from_step == ack.step
        assert _lost_steps(job, shrunk) == 0
        assert job.procs["d"].wait(60) == 0, job.log("d")[-3000:]  # d left the job, as planned


@pytest.mark.parametrize(
    "snapshot",
    [{}, {"max_every": 3}],
    ids=["default-auto-max_every-1", "auto-max_every-3"],
)
def test_on_a_busy_machine_a_node_lost_without_notice_costs_at_most_max_every_steps(
    etcd: EtcdServer,
    tmp_path: Path,
    worker_env: dict[str, str],
    straight: StraightRun,
    snapshot: dict[str, Any],
) -> None:
    """Every core busy, as on the node where ``every: auto`` once widened to 18 steps and a
    kill cost 12: with the default settings (``auto``, ``max_every`` 1) and with a raised
    bound, a node SIGKILLed at a random step costs at most ``max_every`` steps, the survivors
    rebuild from memory, and the run ends where the run that never lost a node ends."""
    straight.result()  # the load on the cores is the spinners' and the job's alone
    max_every = snapshot.get("max_every", 1)
    rng = random.Random(2029 + max_every)
    lost, kill_at = rng.choice(NODES), rng.randint(8, 12)  # past auto's first measurements
    trainer = {
        **COMMON,
        # Unpaced: each snapshot's exchange overlaps the next step's compute, as in a real job,
        # instead of running in a pause after the boundary, where the kill would mostly land.
        "step_time_floor": "0s",
        "snapshot": snapshot,
        # Saved only at the end: no checkpoint newer than the snapshots stands in for them.
        "checkpoint": {"dir": str(tmp_path / "job" / "ckpt"), "every_steps": 0},
        "data": {"sample_log": str(tmp_path / "job" / "samples")},
    }
    job = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env, trainer=trainer)
    try:
        with busy_cores(worker_env):
            job.expect(1, NODES, "start")
            for node in NODES:
                job.start(node, nnodes=f"1:{len(NODES)}")
            job.await_progress(
                f"4 ranks past step {kill_at}", lambda p: p.world_size == 4 and p.step >= kill_at, timeout=180
            )
            job.kill_node(lost)
            shrunk = job.await_progress(
                "training at 3 ranks", lambda p: p.world_size == 3 and p.step > p.resumed_from_step, timeout=180
            )
        lost_steps = _lost_steps(job, shrunk)
        assert lost_steps <= max_every, f"{lost_steps} steps lost with max_every {max_every}"
        assert shrunk.reform_mode == "in-place"
        assert "reshard" in shrunk.resume_phases and "load" not in shrunk.resume_phases, shrunk.resume_phases
        assert shrunk.extra.get("snapshot_max_every") == max_every
        assert 1 <= shrunk.extra["snapshot_every"] <= max_every
        widest = max(e["every"] for node in NODES for e in job.events(node, "snapshot interval"))
        assert widest <= max_every, f"auto chose every {widest} with max_every {max_every}"
        finish_and_compare(job, [n for n in NODES if n != lost], straight, tmp_path)
    finally:
        job.close()


def test_a_step_counts_only_once_every_buddy_holds_the_snapshot_before_it(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """Four ranks on gloo (``snapshot_bound_worker``); one runs the exchange of the snapshot
    of step 1 late, as a loaded node does. Every rank, even one whose own exchange neither
    sends to nor receives from the late one, lets step 2 count only after that exchange:
    had it counted earlier, losing the late node then (its copy of step 1 on no buddy yet)
    would cost two steps with ``max_every`` 1."""
    world_size, slow, delay_s = 4, 3, 1.5
    # The test hosts the store on a port the kernel picked: no port is guessed.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    spec = json.dumps(
        {"port": store.port, "world_size": world_size, "slow_rank": slow, "delay_s": delay_s, "out": str(tmp_path)}
    )
    env = {**worker_env, "GLOO_SOCKET_IFNAME": "lo"}
    argv = [sys.executable, "-m", "tests.elastic.snapshot_bound_worker", spec]
    logs = [tmp_path / f"rank-{rank}.log" for rank in range(world_size)]
    run_all([[*argv, str(rank)] for rank in range(world_size)], logs, env, REPO, 120)
    records = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(world_size)]
    buddy = records[0]["buddy"]
    sender = {b: r for r, b in enumerate(buddy)}
    apart = [r for r in range(world_size) if slow not in (r, buddy[r], sender[r])]
    assert apart, f"every rank exchanges with the late one ({buddy}): the test shows nothing"
    began = records[slow]["exchange_began"]
    for record in records:
        assert record["counted_at"] >= began, f"rank {record['rank']} counted step 2 before the late exchange began"
        assert record["held_sender_copy"], record
    for rank in apart:
        assert records[rank]["waited_s"] > 0, f"rank {rank} had nothing to wait for: {records[rank]}"
