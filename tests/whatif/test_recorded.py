"""The stalls of training a job's spans record: where each starts and ends, what kind it is."""

from __future__ import annotations

from pathlib import Path

import pytest

from regroup.telemetry import read_spans
from regroup.whatif.recorded import (
    CRASH,
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
