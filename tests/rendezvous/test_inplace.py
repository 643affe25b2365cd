"""Workers survive re-forms in place under ``regroup-run``: same processes, new world.

Real etcd, real ``regroup-run`` agents, the real trainer on gloo, real checkpoints. The
test plays the controller where a scenario needs one, by writing its etcd records.
"""

from __future__ import annotations

import json
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from regroup.controller.decide.phases import lost_steps
from regroup.demo.etcd_server import EtcdServer
from tests.rendezvous.inplace_job import JOB, InPlaceJob, wait_for
from tests.elastic.harness import BackgroundTorchrun, flat_tensors, full_state, step_losses, write_config
from tests.elastic.test_resize import LOSS_RTOL, PARAM_ATOL, _samples
from regroup.elastic.checkpoint.folders import latest_committed

pytestmark = pytest.mark.slow


@pytest.fixture
def job(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[InPlaceJob]:
    running = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture
def job_without_snapshots(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[InPlaceJob]:
    """An unplanned loss then rolls back to the newest committed checkpoint (with snapshots
    it costs one step: tests/elastic/test_snapshot_recovery.py)."""
    running = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env, trainer={"snapshot": {"every": 0}})
    try:
        yield running
    finally:
        running.close()


def _start(job: InPlaceJob, nodes: list[str], **kwargs: object) -> dict[str, list[int]]:
    # The first round holds exactly these nodes, however far apart their agents start on a
    # busy machine (generation 0: the tests' own re-forms count from 1).
    job.expect(0, nodes, "start")
    for node in nodes:
        job.start(node, **kwargs)  # type: ignore[arg-type]
    job.await_progress(f"{len(nodes)} ranks training", lambda p: p.world_size == len(nodes) and p.step >= 3)
    pids = {node: job.workers(node) for node in nodes}
    assert all(len(p) == 1 for p in pids.values()), pids
    return pids


def test_survivors_keep_their_processes_across_an_unplanned_loss_and_a_grow(
    job_without_snapshots: InPlaceJob,
) -> None:
    job = job_without_snapshots
    pids = _start(job, ["a", "b", "c"])
    before = job.await_progress("a committed checkpoint", lambda p: (p.extra.get("last_committed_step") or 0) >= 5)

    job.kill_node("c")  # no notice: the agents learn it through c's lease
    shrunk = job.await_progress(
        "training at 2 ranks after the loss", lambda p: p.world_size == 2 and p.step > p.resumed_from_step
    )
    assert shrunk.reform_mode == "in-place"
    assert {"process_group", "load", "first_step"} <= set(shrunk.resume_phases)
    # Survivors roll back to the newest committed checkpoint: never a partial one, never ahead.
    assert before.extra["last_committed_step"] <= shrunk.resumed_from_step <= before.step + 5
    assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}
    # The survivors' failed collectives reached their member records, naming the peer's host:
    # the controller's first evidence of the loss (tests/controller/test_peer_failures.py).
    reports = {n: job.members()[n] for n in ("a", "b")}
    assert any(r.get("peer_failure_round") == before.round and r.get("failed_peer") for r in reports.values()), reports
    assert all(before.time - 60 < r.get("peer_failure_at", 0) <= shrunk.time for r in reports.values()
               if r.get("peer_failure_round")), reports

    job.start("c")  # c comes back; with no controller the agents grow the job themselves
    grown = job.await_progress("training at 3 ranks again", lambda p: p.world_size == 3 and p.round > shrunk.round)
    assert grown.reform_mode == "in-place"
    assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}
    for node in ("a", "b"):
        # The agents re-formed without restarting anything.
        assert not job.events(node, "worker group failed; restarting it"), job.log(node)[-3000:]


def test_a_survivor_blocked_on_a_frozen_peer_is_aborted_not_killed(job: InPlaceJob) -> None:
    """A node that freezes (SIGSTOP: its sockets stay open, nothing errors) leaves its peers
    blocked inside a collective. Once its lease expires and the re-form is announced, their
    blocked call is made to fail and they re-form in place, well inside gloo's timeout."""
    pids = _start(job, ["a", "b", "c"])
    job.await_progress("a committed checkpoint", lambda p: (p.extra.get("last_committed_step") or 0) >= 5)
    frozen = [job.procs["c"].pid, *job.workers("c")]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        shrunk = job.await_progress(
            "training at 2 ranks without the frozen node",
            lambda p: p.world_size == 2 and p.step > p.resumed_from_step,
            timeout=60,
        )
        assert shrunk.reform_mode == "in-place"
        assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}
        aborted = job.events("a", "re-form announced and this worker is still inside a collective; aborting it")
        aborted += job.events("b", "re-form announced and this worker is still inside a collective; aborting it")
        assert aborted, "a survivor was blocked on the frozen peer and had its collective aborted"
    finally:
        job.kill_node("c")


def test_a_planned_shrink_and_grow_in_place_lose_no_step_and_keep_the_survivors(job: InPlaceJob) -> None:
    job.claim_control()
    pids = _start(job, ["a", "b", "c"])

    ack = job.checkpoint(1)
    before = job.members()["c"]["joined_at"]
    job.reform(1, ["a", "b"], cause="reclaim")
    shrunk = job.await_progress("training at 2 ranks", lambda p: p.world_size == 2 and p.step > ack.step)
    assert (shrunk.resumed_from_step, shrunk.reform_mode) == (ack.step, "in-place")  # 0 steps lost
    # c handed its shards to a survivor before it left: nothing was read back from disk.
    assert "reshard" in shrunk.resume_phases and "load" not in shrunk.resume_phases, shrunk.resume_phases
    assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}

    # c's agent stays (never exit 0 for a job that goes on) and asks to be let back in.
    job.await_joiner("c", after=before)
    ack = job.checkpoint(2)
    job.reform(2, ["a", "b", "c"], cause="grow")
    grown = job.await_progress("training at 3 ranks", lambda p: p.world_size == 3 and p.step > ack.step)
    assert (grown.resumed_from_step, grown.reform_mode) == (ack.step, "in-place")
    assert "reshard" in grown.resume_phases and "load" not in grown.resume_phases, grown.resume_phases
    assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}


def test_a_planned_shrink_writes_no_checkpoint_on_its_critical_path(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """In place, the ack of a planned shrink comes from memory: nothing is written before
    it (no periodic saves here, so the only writes are the request's), the survivors
    reshard the handed-over state (0 steps lost) and store it in the background at their
    first boundary. (A world with a rank that does not outlive the re-form commits first:
    ``test_in_place_and_restart_reforms_follow_the_uninterrupted_trajectory``.)"""
    trainer = {"checkpoint": {"dir": str(tmp_path / "job" / "ckpt"), "every_steps": 0, "every": "0s", "at_end": False}}
    job = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env, trainer=trainer)
    try:
        job.claim_control()
        _start(job, ["a", "b", "c"])
        ack = job.checkpoint(1)
        ckpt = job.root / "ckpt"
        assert not ack.stored and latest_committed(ckpt) is None
        job.reform(1, ["a", "b"], cause="reclaim")
        shrunk = job.await_progress("training at 2 ranks", lambda p: p.world_size == 2 and p.step > ack.step + 1)
        assert (shrunk.resumed_from_step, shrunk.reform_mode) == (ack.step, "in-place")  # 0 steps lost
        assert "reshard" in shrunk.resume_phases and "load" not in shrunk.resume_phases, shrunk.resume_phases
        # Written down after the resume (the first boundary of the new world), then no more.
        stored = job.await_progress("the resumed step stored", lambda p: latest_committed(ckpt) is not None)
        assert latest_committed(ckpt) == ack.step + 1, stored
    finally:
        job.close()


def test_a_worker_that_cannot_reform_in_place_falls_back_to_a_restart(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # Rank 1 fails its first in-place re-form: its agent restarts it the usual way, and the
    # job still re-forms around it.
    faults = [{"kind": "refuse_reform", "rank": 1, "step": 1}]
    job = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env, trainer={"faults": faults})
    try:
        pids = _start(job, ["a", "b", "c"])
        by_rank = {job.events(n, "world formed")[0]["rank"]: n for n in ("a", "b", "c")}
        keeper, refuser, lost = by_rank[0], by_rank[1], by_rank[2]
        job.kill_node(lost)
        job.await_progress(
            "training at 2 ranks after the fallback", lambda p: p.world_size == 2 and p.step > p.resumed_from_step + 2
        )
        assert job.workers(keeper) == pids[keeper], f"{keeper} re-formed in place"
        assert job.workers(refuser) and job.workers(refuser) != pids[refuser], f"{refuser}'s worker was restarted"
        refused = job.events(refuser, "in-place re-form failed; falling back to a restart")
        assert refused and "injected" in refused[0]["error"]
        # The fallback is not charged to the node as a fault of its own (no restart storm from it).
        assert job.members()[refuser]["restart_count"] == 0
    finally:
        job.close()


def _steps(samples: Path, world: int) -> list[int]:
    """Steps some rank of a world of ``world`` ranks completed (their sample logs)."""
    return [json.loads(line)["step"] for path in samples.glob(f"samples-w{world}-r*.jsonl")
            for line in path.read_text().splitlines()]  # fmt: skip


def test_plain_torchrun_keeps_the_restart_path(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> None:
    """``--in-place=off`` is torchrun's way: every membership change restarts the workers.
    The node lost is rank 0's, whose progress record is published every interval and dies
    with it: the restarted workers still count every step past the checkpoint they load as
    lost, from the record their nodes kept of the steps their workers completed."""
    samples = tmp_path / "job" / "samples"
    trainer = {
        "data": {"sample_log": str(samples)},
        # A commit every 30 steps, the kill 12 past one: the next commit is 18 steps away, for
        # a loaded machine's slow look and kill.
        "checkpoint": {"dir": str(tmp_path / "job" / "ckpt"), "every_steps": 30},
        # Published every 2 s (production's default is 5 s), and before each commit.
        "etcd": {"endpoint": etcd.endpoint, "job": JOB, "progress_interval": "2s"},
    }
    job = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env, trainer=trainer)
    try:
        pids = _start(job, ["a", "b", "c"], in_place="off", standby=False)
        seen = job.await_progress("a committed checkpoint", lambda p: (p.extra.get("last_committed_step") or 0) >= 30)
        # Killed between two commits (progress is also published before each), a few steps
        # past the progress record seen.
        past = next(step for step in range(seen.step + 3, seen.step + 33) if step % 30 == 12)
        wait_for(lambda: max(_steps(samples, 3), default=0) >= past, 60, f"a rank at step {past}")
        [rank_zero] = [n for n in ("a", "b", "c") if job.events(n, "world formed")[0]["rank"] == 0]
        job.kill_node(rank_zero)
        shrunk = job.await_progress(
            "training at 2 ranks", lambda p: p.world_size == 2 and p.step > p.resumed_from_step > 0
        )
        assert shrunk.reform_mode == "restart"
        assert "startup" in shrunk.resume_phases and "load" in shrunk.resume_phases
        survivors = [n for n in ("a", "b", "c") if n != rank_zero]
        assert all(job.workers(n) != pids[n] for n in survivors)
        committed = latest_committed(job.root / "ckpt")
        assert committed is not None and committed >= shrunk.resumed_from_step
        reached = max(_steps(samples, 3))
        assert shrunk.last_step == reached, f"the trainers say {shrunk.last_step}, their sample logs {reached}"
        assert lost_steps(shrunk) == reached - shrunk.resumed_from_step > 1
    finally:
        job.close()



def test_in_place_and_restart_reforms_follow_the_uninterrupted_trajectory(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    """Shrink 3 -> 2 and grow back, planned, with a surviving in place and b restarted each
    time (``--in-place=off``): every step's loss and the final parameters match a run that
    never changed size, and every sample is trained exactly once."""
    steps = 40
    common = {
        "batch": {"global_batch_size": 12, "max_micro_batch_size": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 2, "decay_steps": steps},
        "max_steps": steps,
        "log_every": 1,
    }
    straight_cfg = write_config(
        tmp_path / "straight.yaml",
        **common,
        checkpoint={"dir": str(tmp_path / "straight" / "ckpt")},
        data={"sample_log": str(tmp_path / "straight" / "samples")},
    )
    # It trains while the job starts its agents and waits on its re-forms.
    straight = BackgroundTorchrun(3, straight_cfg, worker_env, tmp_path, timeout=300)

    trainer = {**common, "data": {"sample_log": str(tmp_path / "job" / "samples")}}
    job = InPlaceJob(etcd.endpoint, tmp_path / "job", worker_env, trainer=trainer)
    try:
        job.claim_control()
        job.expect(0, ["a", "b", "c"], "start")  # however far apart they start on a busy machine
        job.start("a")
        job.start("b", in_place="off", standby=False)
        job.start("c")
        job.await_progress("3 ranks training", lambda p: p.world_size == 3 and p.step >= 5)
        pid_a = job.workers("a")
        ack = job.checkpoint(1)
        # b's process does not outlive the re-form, so the state must be on storage first.
        assert ack.stored
        before = job.members()["c"]["joined_at"]
        job.reform(1, ["a", "b"], cause="reclaim")
        job.await_progress("2 ranks training", lambda p: p.world_size == 2 and p.step >= ack.step + 3)
        # Held at this boundary (checkpoint request with hold) until c is up: the steps left
        # to train at 3 ranks do not depend on how long c takes to start.
        ack = job.checkpoint(2, timeout=180)
        assert ack.step < steps - 5, "the run must still have steps to train at 3 ranks"
        job.await_joiner("c", after=before)  # left out, c's agent stays and asks to be let back in
        job.reform(2, ["a", "b", "c"], cause="grow")
        for node in ("a", "b", "c"):
            assert job.procs[node].wait(120) == 0, job.log(node)[-3000:]
        assert job.workers("a") == [] and job.events("a", "re-formed in place")
    except BaseException:
        straight.close()
        raise
    finally:
        job.close()
    assert pid_a, "a trained in the first world"

    expected = step_losses(straight.stderr())
    got: dict[int, float] = {}
    for node in ("a", "b", "c"):  # rank 0 logs each step; which node holds rank 0 may change
        got.update(step_losses(job.log(node)))
    assert sorted(got) == sorted(expected) == list(range(1, steps + 1))
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=LOSS_RTOL), f"loss differs at step {step}"
    a = flat_tensors(full_state(tmp_path / "straight" / "ckpt", steps, tmp_path))
    b = flat_tensors(full_state(job.root / "ckpt", steps, tmp_path))
    assert sorted(a) == sorted(b)
    worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].is_floating_point())
    assert worst < PARAM_ATOL, f"largest parameter/optimizer-state difference {worst}"
    for folder in (tmp_path / "straight" / "samples", tmp_path / "job" / "samples"):
        counts = Counter(_samples(folder))
        assert sorted(counts) == list(range(steps * 12)) and set(counts.values()) == {1}

