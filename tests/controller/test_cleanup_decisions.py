"""Clean-up decisions, pure: when a job that is over loses its keys and its tombstone, and
which acks a live job keeps. Scenes at any moment, no I/O."""

from __future__ import annotations

from datetime import timedelta

import pytest

from regroup.controller.decide.cleanup import ACK_DELETES
from regroup.controller.settings import CleanupSettings, ControllerSettings
from regroup.controller.snapshot import (
    PruneAcks,
    RemoveJob,
    RemoveTombstone,
    WritePresence,
    WriteStatus,
    WriteTombstone,
)
from regroup.records import FinishedJob, JobStatus, ReformCause, ReformOutcome, ReformPhase, ReformPlan

from .builders import JOB, KEYS, NS, T0, Scene, acked, decide, job, of
from .builders import step as reconcile

RETENTION = 600.0
S = ControllerSettings(cleanup=CleanupSettings(retention=timedelta(seconds=RETENTION)))


def step(s: Scene, now: float) -> Scene:
    """One reconcile at ``now``, its writes landed, the clean-up's included."""
    s, d = reconcile(s, now, S)
    for a in d.actions:
        if isinstance(a, RemoveJob):
            s = s.then(lambda m, a=a: m.job_removed((NS, JOB), a.tombstone, 50))
        elif isinstance(a, WriteTombstone):
            s = s.then(lambda m, a=a: m.tombstone_put(KEYS.tombstone, a.tombstone.to_json(), a.expected_revision + 1))
        elif isinstance(a, RemoveTombstone):
            s = s.then(lambda m: m.job_removed((NS, JOB)))
    return s


def finished(s: Scene, at: float = T0) -> Scene:
    """The agents closed the rendezvous and left: members gone, pods still there."""
    return s.closed().without_member(*s.members).at(at)


def without_pods(s: Scene) -> Scene:
    for pod in list(s.pods):
        s = s.without_pod(pod.name)
    return s


def test_a_finished_job_keeps_its_keys_for_the_retention_then_loses_them_for_a_tombstone() -> None:
    s = step(finished(job()), T0)
    assert s.status.state == "finished" and s.status.since == T0
    d = decide(s, T0 + RETENTION - 1, S)
    assert not of(d.actions, RemoveJob) and d.requeue_after == timedelta(seconds=1)
    d = decide(s, T0 + RETENTION, S)
    [remove] = of(d.actions, RemoveJob)
    assert remove.reason == "finished" and remove.tombstone == FinishedJob(finished_at=T0, removed_at=T0 + RETENTION)
    # Nothing else: no presence or status written into a root that is going.
    assert d.actions == (remove,)


def test_the_decision_that_finds_the_job_finished_looks_again_at_the_retention_by_itself() -> None:
    # Its own status write starts the clock and wakes nobody: the members and pods may have
    # gone before it, so no other event need follow.
    d = decide(finished(job()), T0, S)
    assert [w.status.since for w in of(d.actions, WriteStatus)] == [T0]
    assert d.requeue_after == timedelta(seconds=RETENTION)


def test_the_retention_counts_from_the_status_record_so_a_new_controller_does_not_wait_again() -> None:
    # A previous controller recorded the job finished 590 s ago; this one starts now.
    earlier = JobStatus(state="finished", reason="finished", node_count=0, updated_at=T0 - 590, since=T0 - 590)
    s = finished(job()).with_record(KEYS.status, earlier)
    d = decide(s, T0, S)
    assert [w.status.since for w in of(d.actions, WriteStatus)] == [T0 - 590], "the moment is kept, not restarted"
    assert d.requeue_after == timedelta(seconds=10)
    assert of(decide(s, T0 + 10, S).actions, RemoveJob)


def test_a_status_from_a_writer_without_the_moment_starts_the_clock_once() -> None:
    older = JobStatus(state="finished", reason="finished", node_count=0)
    s = step(finished(job()).with_record(KEYS.status, older), T0)
    assert s.status.since == T0
    assert not of(decide(s, T0 + RETENTION - 1, S).actions, RemoveJob)


def test_nothing_is_removed_while_an_agent_is_registered_or_before_the_pods_are_listed() -> None:
    lingering = step(job().closed(), T0)  # closed, but the agents are still registered
    assert not of(decide(lingering, T0 + 10 * RETENTION, S).actions, RemoveJob)
    # A controller that has not listed the pods yet sees a job without pods: not gone.
    unlisted = Scene().then(lambda m: m.etcd_resynced([])).with_member(job().members["n1"])
    unlisted = unlisted.without_member("n1")
    s = step(unlisted, T0)
    assert not s.pods_synced and s.status.vacant_since == 0.0
    assert not of(decide(s, T0 + 10 * RETENTION, S).actions, RemoveJob)


def test_a_job_whose_pods_and_members_are_gone_is_removed_after_the_retention_without_a_tombstone() -> None:
    s = step(without_pods(job()), T0)
    assert s.status.vacant_since == 0.0, "members are still registered"
    s = step(s.without_member("n1", "n2", "n3"), T0 + 5)
    assert s.status.state == "waiting" and s.status.vacant_since == T0 + 5
    assert not of(decide(s, T0 + 5 + RETENTION - 1, S).actions, RemoveJob)
    [remove] = of(decide(s, T0 + 5 + RETENTION, S).actions, RemoveJob)
    assert remove.reason == "gone" and remove.tombstone is None


def test_a_pod_coming_back_stops_the_clock() -> None:
    s = step(without_pods(job()).without_member("n1", "n2", "n3"), T0)
    assert s.status.vacant_since == T0
    back = step(s.with_pod(job().pods[0]), T0 + 100)
    assert back.status.vacant_since == 0.0
    assert not of(decide(back, T0 + 10 * RETENTION, S).actions, RemoveJob)
    again = step(back.without_pod(job().pods[0].name), T0 + 200)
    assert again.status.vacant_since == T0 + 200


def test_a_removed_job_keeps_its_tombstone_until_its_pods_are_gone_for_the_retention() -> None:
    s = step(step(finished(job()), T0), T0 + RETENTION)
    assert s.tombstone == FinishedJob(finished_at=T0, removed_at=T0 + RETENTION)
    assert s.status is None and s.plan is None and not s.finished, "the model forgot the job's keys"
    # Its pods (say, Succeeded and kept by their Job) hold the tombstone; nothing is written
    # under the job's root, not even the controller's presence.
    d = decide(s, T0 + 5 * RETENTION, S)
    assert d.actions == () and d.requeue_after is None
    s = step(without_pods(s), T0 + 5 * RETENTION)
    assert s.tombstone.vacant_since == T0 + 5 * RETENTION
    d = decide(s, T0 + 6 * RETENTION - 1, S)
    assert not of(d.actions, RemoveTombstone) and d.requeue_after == timedelta(seconds=1)
    [remove] = decide(s, T0 + 6 * RETENTION, S).actions
    assert isinstance(remove, RemoveTombstone) and remove.revision == s.tombstone_revision
    assert not of(decide(s, T0 + 6 * RETENTION, S).actions, WritePresence)


def test_a_pod_back_under_a_tombstone_resets_its_clock() -> None:
    s = step(without_pods(step(step(finished(job()), T0), T0 + RETENTION)), T0 + RETENTION + 1)
    assert s.tombstone.vacant_since == T0 + RETENTION + 1
    [reset] = decide(s.with_pod(job().pods[0]), T0 + RETENTION + 2, S).actions
    assert isinstance(reset, WriteTombstone) and reset.tombstone.vacant_since == 0.0


def test_a_finished_job_without_pods_leaves_a_tombstone_that_counts_from_when_they_went() -> None:
    s = step(without_pods(finished(job())), T0)
    [remove] = of(decide(s, T0 + RETENTION, S).actions, RemoveJob)
    assert remove.tombstone.vacant_since == T0
    s = step(s, T0 + RETENTION)
    assert isinstance(decide(s, T0 + RETENTION, S).actions[0], RemoveTombstone)


def test_only_the_acks_of_the_plan_and_the_one_before_are_kept() -> None:
    s = job()
    for generation in range(1, 11):
        s = acked(s, generation, 10 * generation)
    s = s.with_record(KEYS.plan, _done_plan(10))
    [prune] = of(decide(s, T0, S).actions, PruneAcks)
    assert prune.generations == tuple(range(1, 9))
    s = s.then(lambda m: m.own_acks_deleted((NS, JOB), prune.generations))
    assert s.ack_generations == {9, 10} and not of(decide(s, T0, S).actions, PruneAcks)


def test_thousands_of_old_acks_go_a_bounded_batch_per_decision() -> None:
    s = job()
    for generation in range(1, 151):
        s = acked(s, generation, generation)
    s = s.with_record(KEYS.plan, _done_plan(150))
    assert s.acks.keys() == set(range(143, 151)), "the model keeps the newest records only"
    d = decide(s, T0, S)
    [prune] = of(d.actions, PruneAcks)
    assert prune.generations == tuple(range(1, ACK_DELETES + 1)) and d.requeue_after == timedelta(0)
    s = s.then(lambda m: m.own_acks_deleted((NS, JOB), prune.generations))
    [second] = of(decide(s, T0, S).actions, PruneAcks)
    s = s.then(lambda m: m.own_acks_deleted((NS, JOB), second.generations))
    d = decide(s, T0, S)
    [last] = of(d.actions, PruneAcks)
    assert last.generations == tuple(range(2 * ACK_DELETES + 1, 149)) and d.requeue_after is None


def _done_plan(generation: int) -> ReformPlan:
    return ReformPlan(generation=generation, cause=ReformCause.NODE_LOST, planned=False, reason="lost n4",
                      nodes_before=["n1", "n2", "n3", "n4"], nodes_after=["n1", "n2", "n3"], trace_id="1" * 32,
                      detected_at=T0 - 10, decided_at=T0 - 10, phase=ReformPhase.DONE, round_after=1,
                      outcome=ReformOutcome.COMPLETED, finished_at=T0 - 5)


def test_retention_is_validated_naming_the_field() -> None:
    with pytest.raises(ValueError, match="CleanupSettings.retention must be positive"):
        CleanupSettings(retention=timedelta(0))
    with pytest.raises(ValueError, match="etcd_prefix"):
        ControllerSettings(etcd_prefix="/regroup/finished")
    assert CleanupSettings().retention == timedelta(minutes=10)
