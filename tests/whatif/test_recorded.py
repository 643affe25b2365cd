"""The stalls of training a job's spans record: where each starts and ends, what kind it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from regroup.telemetry import read_spans
from regroup.trace_report import CRASH, all_reforms
from regroup.whatif.recorded import (
    StallKind,
    checkpoint_seconds,
    stalls_from_spans,
    step_seconds,
)
from tests.whatif.spans import RESTART, T0, RecordedJob


def churned_job(path: Path) -> Path:
    """Four nodes at 0.5 s a step: a reclaim, a loss, a crash the agents re-formed on their
    own, a grow, a restart storm superseded by a loss."""
    job = RecordedJob(path)
    reclaim = job.reform("reclaim", 4, 3, 10.0, planned=True, checkpoint=0.4, rendezvous=0.3, resume=0.8)
    job.checkpoint(reclaim, 10.1, 0.2, step=20, world=4)
    job.resume(reclaim, 10.7, 11.5, resumed_from=20, world=3)
    lost = job.reform("node-lost", 3, 2, 21.5, rendezvous=0.2, resume=0.6, lost_steps=1)
    job.resume(lost, 21.8, 22.3, resumed_from=40, world=2)
    # The agents re-form a crashed rank's world without the controller: the trainer's resume
    # joins the latest re-form's trace.
    job.resume(lost, 32.0, 32.6, resumed_from=60, world=1)
    grow = job.reform("grow", 1, 4, 39.0, planned=True, detect=3.0, checkpoint=0.2, rendezvous=0.3, resume=1.0)
    job.checkpoint(grow, 42.1, 0.1, step=80, world=1, stored=True)
    job.resume(grow, 42.6, 43.5, resumed_from=80, world=4)
    job.reform("restart-storm", 4, 3, 50.0, rendezvous=0.3, resume=0.2, outcome="superseded")
    last = job.reform("node-lost", 4, 3, 51.0, rendezvous=0.2, resume=0.8, lost_steps=0)
    job.resume(last, 51.5, 52.0, resumed_from=94, world=3)
    job.close()
    return path


def test_each_new_world_is_one_stall_from_training_stopped_to_its_first_step(tmp_path: Path) -> None:
    stalls = stalls_from_spans(read_spans(churned_job(tmp_path / "spans.jsonl")))
    seen = [(round(s.start - T0, 3), round(s.end - T0, 3), s.kind, s.cause) for s in stalls]
    assert seen == [
        # Planned: from the trainers' save at the agreed step (training went on until then).
        (10.1, 11.5, StallKind.PLANNED_SHRINK, "reclaim"),
        # Unplanned: from the first sign, the controller's detection.
        (21.5, 22.3, StallKind.UNPLANNED, "node-lost"),
        (32.0, 32.6, StallKind.UNPLANNED, CRASH),
        # A grow's join window is training time: the stall starts at the save.
        (42.1, 43.5, StallKind.GROW, "grow"),
        # The superseded storm re-form had no world of its own: its start is this stall's.
        (50.0, 52.0, StallKind.UNPLANNED, "node-lost"),
    ]
    assert [s.lost_steps for s in stalls] == [0, 1, -1, 0, 0]
    assert stalls[0].checkpoint == pytest.approx(0.2)
    assert stalls[1].resume_phases == pytest.approx({"process_group": 0.1, "reshard": 0.3, "first_step": 0.2})


def test_a_restarted_worker_stalls_from_before_its_span_began(tmp_path: Path) -> None:
    """On the restart path the trainer's span starts once the new process runs; the startup
    it reports came before, and the loss was seen before that."""
    job = RecordedJob(tmp_path / "spans.jsonl")
    lost = job.reform("node-lost", 3, 2, 10.0, rendezvous=0.5, resume=4.5, mode="restart")
    job.resume(lost, 14.5, 15.0, resumed_from=40, world=2, phases=RESTART, mode="restart")
    job.resume(lost, 30.0, 30.5, resumed_from=70, world=2, phases=RESTART, mode="restart")
    job.close()
    first, crash = stalls_from_spans(read_spans(tmp_path / "spans.jsonl"))
    assert (first.start - T0, first.end - T0, first.mode) == pytest.approx((10.0, 15.0, "restart"))
    # A crash nobody traced: its startup is the only sign of when it began.
    assert (crash.start - T0, crash.seconds, crash.cause) == pytest.approx((25.7, 4.8, CRASH))


def spare_job(path: Path) -> Path:
    """n1-n3 train; a grow at 30 s brings n4 in (round 2) while the spare n5 begins to wait in
    round 3; n1's rank crashes at 60 s and the survivors re-form round 3 on their own with n5
    in n1's position (rank 0). n5's resume, in the grow's trace, runs from its wait at
    30.08 s to its first step at 60.7 s: it began before the grow's own resume."""
    job = RecordedJob(path)
    job.join(1, ("n1", "n2", "n3"), -1.0, -0.5)
    grow = job.reform("grow", 3, 4, 30.0, planned=True, checkpoint=0.05, rendezvous=0.15, resume=0.4)
    job.checkpoint(grow, 30.02, 0.02, step=150, world=3)
    job.join(2, ("n1", "n2", "n3", "n4"), 30.1, 30.2)
    job.join(3, ("n5",), 30.1, 60.25)
    job.resume(grow, 30.08, 60.7, resumed_from=299, world=4)  # the spare's: the agents' crash re-form
    job.resume(grow, 30.2, 30.6, resumed_from=150, world=4)  # the grow's own
    job.join(3, ("n2", "n3", "n4"), 60.2, 60.25, first_rank=1)
    job.close()
    return path


def test_a_spares_wait_is_not_a_stall_and_each_world_resumes_in_its_order(tmp_path: Path) -> None:
    """The stalls are the re-forms ``regroup trace-report`` shows, ended at each new world's
    first step in the order the worlds trained it."""
    spans = read_spans(spare_job(tmp_path / "spans.jsonl"))
    grow, crash = stalls_from_spans(spans)
    # The grow: from the trainers' save to its own world's first step, not the spare's.
    assert (grow.kind, grow.start - T0, grow.end - T0, grow.resumed_from_step) == pytest.approx(
        (StallKind.GROW, 30.02, 30.6, 150)
    )
    # The crash: from the first survivor's join (n5's 30 s in the round are not the re-form's)
    # to the new world's first step; from the crash where the run recorded it.
    assert (crash.cause, crash.kind, crash.start - T0, crash.seconds) == pytest.approx(
        (CRASH, StallKind.UNPLANNED, 60.2, 0.5)
    )
    [at_crash] = [s for s in stalls_from_spans(spans, faults=[T0 + 60.0]) if s.cause == CRASH]
    assert (at_crash.start - T0, at_crash.seconds) == pytest.approx((60.0, 0.7))
    # trace-report's rows: the crash's is the stall; the grow's ends where its stall does.
    rows = all_reforms(spans, [T0 + 60.0])
    assert [r.cause for r in rows] == ["grow", CRASH]
    assert [r.duration for r in rows] == pytest.approx([0.6, at_crash.seconds])
    assert (rows[0].resumed_at, rows[1].start) == pytest.approx((grow.end, at_crash.start))


def test_a_reform_begun_before_the_last_worlds_first_step_stalls_from_its_own_resume(tmp_path: Path) -> None:
    """A restart storm's cordon decided while the world the crash re-formed was resuming: that
    world trained on until the cordon's own world formed; the time between is training."""
    job = RecordedJob(tmp_path / "spans.jsonl")
    lost = job.reform("node-lost", 4, 3, 10.0, rendezvous=0.1, resume=0.4)
    job.resume(lost, 10.2, 10.8, resumed_from=50, world=3)
    storm = job.reform("restart-storm", 3, 3, 10.5, rendezvous=0.1, resume=0.2)
    job.resume(storm, 15.0, 15.8, resumed_from=75, world=3)
    job.close()
    first, cordon = stalls_from_spans(read_spans(tmp_path / "spans.jsonl"))
    assert (first.start - T0, first.seconds) == pytest.approx((10.0, 0.8))
    assert (cordon.cause, cordon.start - T0, cordon.seconds) == pytest.approx(("restart-storm", 15.0, 0.8))


def test_without_trainer_spans_each_reform_is_a_stall(tmp_path: Path) -> None:
    job = RecordedJob(tmp_path / "spans.jsonl")
    job.reform("grow", 2, 3, 5.0, planned=True, detect=3.0, checkpoint=0.5, rendezvous=0.5, resume=1.0)
    job.reform("node-lost", 3, 2, 20.0, rendezvous=0.5, resume=1.5, lost_steps=4)
    job.close()
    grow, lost = stalls_from_spans(read_spans(tmp_path / "spans.jsonl"))
    assert (grow.start - T0, grow.seconds, grow.kind) == pytest.approx((8.0, 2.0, StallKind.GROW))
    assert (lost.start - T0, lost.seconds, lost.kind) == pytest.approx((20.0, 2.0, StallKind.UNPLANNED))
    assert lost.lost_steps == 4


def test_the_first_formation_is_not_churn(tmp_path: Path) -> None:
    job = RecordedJob(tmp_path / "spans.jsonl")
    job.reform("grow", 0, 3, 0.0, planned=True)
    job.close()
    assert stalls_from_spans(read_spans(tmp_path / "spans.jsonl")) == []


def test_the_step_time_comes_from_the_steps_trained_between_reforms(tmp_path: Path) -> None:
    spans = read_spans(churned_job(tmp_path / "spans.jsonl"))
    # 20 steps in 10 s before the loss, 19 in 9.5 s before the grow's save, 13 in 6.5 s
    # before the storm; the world before the crash does not say where it stopped.
    assert step_seconds(spans, stalls_from_spans(spans)) == pytest.approx(0.5)
    assert step_seconds([], []) is None


def test_the_checkpoint_cost_counts_only_saves_to_storage(tmp_path: Path) -> None:
    spans = read_spans(churned_job(tmp_path / "spans.jsonl"))
    # The reclaim acked from memory (0.2 s, nothing written); the grow's save wrote.
    assert checkpoint_seconds(spans) == pytest.approx(0.1)
    job = RecordedJob(tmp_path / "memory.jsonl")
    reclaim = job.reform("reclaim", 3, 2, 1.0, planned=True)
    job.checkpoint(reclaim, 1.0, 0.2, step=5, world=3)
    job.close()
    assert checkpoint_seconds(read_spans(tmp_path / "memory.jsonl")) is None
