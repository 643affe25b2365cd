"""Clean-up: a job that is over leaves nothing in etcd, and a live one does not pile up acks.

A job is over ``retention`` after it finished (its rendezvous closed), or after its pods and
members were all gone. Both moments are kept in etcd (``JobStatus.since`` of the
``finished`` state, ``JobStatus.vacant_since``), so a new leader or a restarted controller
counts on from them instead of starting the wait again. Then one delete removes the job's
root (``RemoveJob``). A finished job leaves its tombstone (``FinishedJob``) in the same
transaction: an agent that starts under the job reads it as a closed rendezvous, so a pod
restarted after the clean-up writes nothing and trains nothing. The tombstone goes once the
job has had no pod and no member for ``retention`` (``RemoveTombstone``): nothing of that run
can restart then, and a new run under the name starts afresh. A job whose pods went away
without finishing leaves no tombstone (created again, it resumes from its checkpoints).

Nothing is removed while an agent of the job is registered, nor before the pods and etcd
have been listed in full (a job not listed yet would look empty).
"""

from __future__ import annotations

from regroup.controller.decide.out import Out
from regroup.controller.settings import CleanupSettings
from regroup.controller.snapshot import (
    Alerts,
    Decision,
    JobSnapshot,
    PruneAcks,
    RemoveJob,
    RemoveTombstone,
    WriteTombstone,
)
from regroup.records import FinishedJob, evolve

FINISHED = "finished"
"""The ``JobStatus.state`` of a job whose rendezvous is closed."""

ACK_DELETES = 64
"""Most ack keys one decision deletes (one transaction, well under etcd's 128 operations):
a job that piled up thousands before this version is pruned over several decisions."""


def vacant_since(s: JobSnapshot, now: float) -> float:
    """Since when the job has had no pod and no registered member (0: it has one). Until the
    pods and etcd are listed, what the status record says (the job may only look empty)."""
    recorded = s.status.vacant_since if s.status is not None else 0.0
    if not (s.pods_synced and s.etcd_synced):
        return recorded
    if s.pods or s.members:
        return 0.0
    return recorded or now


def removal(s: JobSnapshot, now: float, settings: CleanupSettings, out: Out) -> Decision | None:
    """The decision to remove the job's keys once it is over for ``retention``; None while it
    is not (asking to look again when it will be)."""
    if not (s.pods_synced and s.etcd_synced) or s.members:
        return None
    status = s.status
    if s.finished and (status is None or status.state != FINISHED or not status.since):
        # This decision's status write starts the clock; its own write does not wake the
        # controller, and nothing else may follow, so a timer must: the retention, from now.
        out.again_in(settings.retention.total_seconds())
        return None
    if status is None:
        return None
    if s.finished:
        since, reason, what = status.since, "finished", "finished"
    elif not s.pods and status.vacant_since:
        since, reason, what = status.vacant_since, "gone", "without pods or members"
    else:
        return None
    retention = settings.retention.total_seconds()
    due = since + retention
    if now < due:
        out.again_in(due - now)
        return None
    why = f"{what} for {now - since:.0f}s (retention {retention:g}s): its keys are removed"
    tombstone = None
    if reason == "finished":
        tombstone = FinishedJob(finished_at=since, removed_at=now, vacant_since=vacant_since(s, now))
        if tombstone.vacant_since:
            out.again_in(tombstone.vacant_since + retention - now)  # the tombstone's own wait
    out.actions.append(RemoveJob(reason, why, tombstone))
    return out.decision(why, 0, None, Alerts())


def tombstoned(s: JobSnapshot, now: float, settings: CleanupSettings, out: Out) -> Decision:
    """A finished job whose keys were removed: its tombstone notes since when the job has had
    no pod and no member, and goes ``retention`` after that."""
    tombstone = s.tombstone
    assert tombstone is not None
    reason = "finished; its keys were removed"
    if not (s.pods_synced and s.etcd_synced):
        return out.decision(reason, 0, None, Alerts())
    vacant = not s.pods and not s.members
    retention = settings.retention.total_seconds()
    if not vacant:
        if tombstone.vacant_since:
            out.actions.append(WriteTombstone(evolve(tombstone, vacant_since=0.0), s.tombstone_revision))
    elif not tombstone.vacant_since:
        out.actions.append(WriteTombstone(evolve(tombstone, vacant_since=now), s.tombstone_revision))
        out.again_in(retention)
    elif now >= tombstone.vacant_since + retention:
        reason = f"finished, without pods or members for {now - tombstone.vacant_since:.0f}s: its tombstone is removed"
        out.actions.append(RemoveTombstone(s.tombstone_revision, reason))
    else:
        out.again_in(tombstone.vacant_since + retention - now)
    return out.decision(reason, 0, None, Alerts())


def prune_acks(s: JobSnapshot, out: Out) -> None:
    """Delete the acks no one reads any more: those of generations before the plan's
    previous one. The controller reads the ack of its plan's generation; a trainer reads
    the newest generation acked on start, and ignores any request not newer than the last
    re-form, which the plan's generation bounds."""
    plan = s.plan
    if plan is None or not s.ack_generations:
        return
    keep_from = plan.generation - 1
    stale = [g for g in s.ack_generations if g < keep_from]
    if not stale:
        return
    stale.sort()
    out.actions.append(PruneAcks(tuple(stale[:ACK_DELETES])))
    if len(stale) > ACK_DELETES:
        out.again_in(0)
