"""Reconcile one job: fresh snapshot -> ``decide`` -> apply the actions.

The etcd writes go through ``EtcdWriter`` (the plan by compare-and-set on its revision:
the fencing token that stops a stale replica from overwriting a newer plan; a checkpoint
request's withdrawal by a delete fenced on its own revision and the plan's; a job's removal
by one delete of its root, fenced on no agent of it being registered); cluster
actions go to the ``ClusterActuator``, Events to the ``EventRecorder``, which posts them
in the background. A failed write ends the cycle and the job is looked at again after a
back-off; nothing is retried blindly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple, Protocol

import structlog

from regroup.controller.cluster import ClusterActuator
from regroup.controller.decide import decide, summarize
from regroup.controller.events import EventRecorder, SpamFilter
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.model import ClusterModel, JobId
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import (
    AFTER_PREVIOUS_PLAN,
    Action,
    Cordon,
    Decision,
    DeletePod,
    PostEvent,
    PostPodEvents,
    PruneAcks,
    RemoveJob,
    RemoveTombstone,
    WithdrawCheckpointRequest,
    WriteCheckpointRequest,
    WriteExclusions,
    WriteExpected,
    WritePlan,
    WritePresence,
    WriteReform,
    WriteStatus,
    WriteTombstone,
)
from regroup.controller.tracing import emit_reform_trace, phase_times, reform_end
from regroup.keys import JobKeys, KeyKind
from regroup.records import Record, ReformCause, ReformOutcome, ReformPhase, ReformPlan, ReformStrategy

log = structlog.get_logger("regroup.controller")

RECORD_WRITES: dict[type[Action], tuple[KeyKind, str, bool]] = {
    WriteCheckpointRequest: (KeyKind.CHECKPOINT, "request", False),
    WriteExpected: (KeyKind.EXPECTED, "expected", False),
    WriteReform: (KeyKind.REFORM, "request", False),
    WritePresence: (KeyKind.CONTROLLER, "presence", True),
    WriteStatus: (KeyKind.STATUS, "status", False),
    WriteExclusions: (KeyKind.EXCLUDED, "exclusions", False),
}
"""Each action that writes one of the job's control records: (its key, the action's field
holding the record, whether the write is bound to the controller's lease)."""


_NO_GAUGES = (None,) * 9
"""What a job's gauges held before its first decision (every value is set then)."""


_UNTRACKED = Decision((), "the job is not tracked: nothing of it is left")


class PlanConflict(Exception):
    """A fenced write found etcd changed under it (``control/plan`` moved, an agent
    registered in a job being removed): the snapshot was stale."""


class EtcdWriter(Protocol):
    """Where the controller's etcd writes go."""

    async def put(self, key: str, value: bytes, *, leased: bool = False) -> int:
        """Write ``key``; bound to the controller's lease when ``leased``. Returns the revision."""
        ...

    async def compare_and_put(self, key: str, value: bytes, expected_revision: int) -> int:
        """Write ``key`` only if its mod_revision is ``expected_revision`` (0: absent).

        Returns the new revision; raises ``PlanConflict`` otherwise."""
        ...

    async def compare_and_delete(self, key: str, expected_revision: int, fence: tuple[str, int]) -> None:
        """Delete ``key`` only if its mod_revision is ``expected_revision`` and that of
        ``fence[0]`` is ``fence[1]``; raises ``PlanConflict`` otherwise."""
        ...

    async def remove_prefix(
        self, prefix: str, unless_under: tuple[str, ...], put: tuple[str, bytes] | None = None,
        delete: tuple[str, int] | None = None,
    ) -> int:
        """In one transaction: delete every key under ``prefix``, write ``put`` (key, value)
        and delete ``delete`` (a key, only if its mod_revision is the one given), only if no
        key exists under any of ``unless_under``; raises ``PlanConflict`` otherwise. Returns
        the revision."""
        ...

    async def delete_keys(self, keys: tuple[str, ...]) -> int:
        """Delete ``keys`` in one transaction; returns the revision."""
        ...


class Outcome(NamedTuple):
    """What one reconcile did: look again after ``requeue_after`` (None: on the next event)."""

    decision: Decision
    requeue_after: timedelta | None
    error: str | None = None


class Reconciler:
    """Applies decisions for jobs of ``model``; shared by all workers."""

    def __init__(
        self,
        model: ClusterModel,
        settings: ControllerSettings,
        writer: EtcdWriter | None,
        actuator: ClusterActuator,
        metrics: ControllerMetrics,
        tracer_provider: Any = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model = model
        self.settings = settings
        self.writer = writer
        self.actuator = actuator
        self.metrics = metrics
        self.tracer_provider = tracer_provider
        self.clock = clock
        self.events = EventRecorder(actuator, metrics)
        """Where the decisions' Events go; its ``run`` posts them (a task beside the workers)."""
        self._abandon_logs = SpamFilter()
        self._unlogged: dict[JobId, int] = {}
        """Job -> its abandoned re-forms the spam filter kept out of the log since the last line."""
        self._reasons: dict[JobId, str] = {}
        self._rounds: dict[JobId, int] = {}
        self._cordon_lock = asyncio.Lock()
        self._backoff: dict[JobId, float] = {}
        self._gauges: dict[JobId, tuple[object, ...]] = {}
        self._gauge_children: dict[JobId, tuple[Any, ...]] = {}
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._job_keys: dict[JobId, JobKeys] = {}
        self._cordoned_gauge = -1

    async def reconcile(self, job: JobId) -> Outcome:
        now = self.clock()
        cordoned = len(self.model.cordoned)
        if cordoned != self._cordoned_gauge:
            # Gauge.set takes a lock: only when the count moved.
            self._cordoned_gauge = cordoned
            self.metrics.cordoned_nodes.set(cordoned)
        if job not in self.model.jobs:
            # Forgotten since it was queued (its keys removed, nothing of it left): a decision
            # on nothing would write its status and presence again.
            return Outcome(_UNTRACKED, None)
        snapshot = self.model.snapshot(job)
        decision = decide(snapshot, now, self.settings)
        if self._reasons.get(job) != decision.reason:
            self._reasons[job] = decision.reason
            if log.is_enabled_for(logging.INFO):  # the reason moves with most decisions of a storm
                log.info("decision", namespace=job[0], job=job[1], reason=decision.reason,
                         actions=dict(summarize(decision.actions)))
        if snapshot.tombstone is None:  # a removed job has no gauges
            self._export_gauges(job, decision)
        try:
            for action in decision.actions:
                await self._apply(job, action, now)
        except PlanConflict:
            # Another writer moved the plan: our view is stale until the watch catches up.
            delay = self._next_backoff(job, first=0.05)
            return Outcome(decision, timedelta(seconds=delay), "plan changed under this decision")
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failed write: log, back off, look again
            delay = self._next_backoff(job, first=self.settings.runtime.etcd_retry.total_seconds())
            log.warning("action failed", namespace=job[0], job=job[1], error=f"{type(exc).__name__}: {exc}",
                        retry_in=delay)
            return Outcome(decision, timedelta(seconds=delay), str(exc))
        self._backoff.pop(job, None)
        return Outcome(decision, decision.requeue_after)

    def _next_backoff(self, job: JobId, first: float) -> float:
        previous = self._backoff.get(job)
        delay = first if previous is None else min(previous * 2, self.settings.runtime.etcd_retry_max.total_seconds())
        self._backoff[job] = delay
        return delay

    # --- actions ---------------------------------------------------------------------

    async def _apply(self, job: JobId, action: Action, now: float) -> None:
        if type(action) is PostPodEvents:
            # The most frequent kind of action: a finished re-form tells each of the job's pods.
            self.events.record_on_pods(job, action.pods, action.type_, action.reason, action.message, now)
            return
        if type(action) is PostEvent:
            self.events.record(action.ref, action.type_, action.reason, action.message, now)
            return
        if type(action) is WritePlan:
            await self._write_plan(job, action, now)
            return
        record = RECORD_WRITES.get(type(action))
        if record is not None:
            kind, name, leased = record
            await self._put(job, kind, getattr(action, name), leased)
        elif isinstance(action, WithdrawCheckpointRequest):
            await self._withdraw_checkpoint(job, action)
        elif isinstance(action, Cordon):
            await self._cordon(action, now)
        elif isinstance(action, DeletePod):
            log.info("deleting pod", namespace=action.namespace, pod=action.name, reason=action.reason)
            await self.actuator.delete_pod(action.namespace, action.name, action.reason)
        elif isinstance(action, PruneAcks):
            await self._prune_acks(job, action)
        elif isinstance(action, RemoveJob):
            await self._remove_job(job, action)
        elif isinstance(action, WriteTombstone):
            await self._write_tombstone(job, action)
        elif isinstance(action, RemoveTombstone):
            await self._remove_tombstone(job, action)

    def _keys(self, job: JobId) -> JobKeys:
        keys = self._job_keys.get(job)
        if keys is None:
            keys = self._job_keys[job] = JobKeys(job[0], job[1], self.settings.etcd_prefix)
        return keys

    async def _put(self, job: JobId, kind: KeyKind, record: Record, leased: bool = False) -> None:
        # Our own writes go into the model by job and wake no one.
        if self.writer is None:
            revision = 0
        else:
            revision = await self.writer.put(self._keys(job).key(kind), record.to_json(), leased=leased)
        self.model.own_write(job, kind, record, revision)

    async def _withdraw_checkpoint(self, job: JobId, action: WithdrawCheckpointRequest) -> None:
        if self.writer is not None:
            plan_revision = action.plan_revision
            if plan_revision == AFTER_PREVIOUS_PLAN:
                plan_revision = self.model.jobs[job].plan_revision
            keys = self._keys(job)
            await self.writer.compare_and_delete(keys.checkpoint, action.revision, (keys.plan, plan_revision))
        self.model.own_delete(job, KeyKind.CHECKPOINT)
        log.info("checkpoint request withdrawn", namespace=job[0], job=job[1], generation=action.generation)

    # --- clean-up --------------------------------------------------------------------

    async def _prune_acks(self, job: JobId, action: PruneAcks) -> None:
        if self.writer is not None:
            keys = self._keys(job)
            await self.writer.delete_keys(tuple(keys.ack(g) for g in action.generations))
        self.model.own_acks_deleted(job, action.generations)
        log.debug("acks pruned", namespace=job[0], job=job[1], generations=len(action.generations))

    async def _remove_job(self, job: JobId, action: RemoveJob) -> None:
        revision = 0
        if self.writer is not None:
            keys = self._keys(job)
            tombstone = (keys.tombstone, action.tombstone.to_json()) if action.tombstone is not None else None
            revision = await self.writer.remove_prefix(keys.root, _agent_keys(keys), put=tombstone)
        self.model.job_removed(job, action.tombstone, revision)
        self.metrics.jobs_removed.labels(action.reason).inc()
        self._forget(job)
        log.info("job removed", namespace=job[0], job=job[1], reason=action.reason, why=action.why,
                 tombstone=action.tombstone is not None)

    async def _write_tombstone(self, job: JobId, action: WriteTombstone) -> None:
        if self.writer is None:
            revision = action.expected_revision + 1
        else:
            revision = await self.writer.compare_and_put(
                self._keys(job).tombstone, action.tombstone.to_json(), action.expected_revision
            )
        self.model.own_tombstone(job, action.tombstone, revision)

    async def _remove_tombstone(self, job: JobId, action: RemoveTombstone) -> None:
        if self.writer is not None:
            keys = self._keys(job)
            # Whatever an agent of an older version wrote under the root since goes with it.
            await self.writer.remove_prefix(keys.root, _agent_keys(keys), delete=(keys.tombstone, action.revision))
        self.model.job_removed(job)
        self._forget(job)
        log.info("tombstone removed", namespace=job[0], job=job[1], why=action.why)

    def _forget(self, job: JobId) -> None:
        """Drop what this reconciler and the metrics hold for a removed job: its series (a
        controller serving many short jobs would otherwise export every one it ever saw)
        and the caches beside them."""
        self.metrics.forget_job(*job)
        m = self.metrics
        per_job = (m.reform_duration, m.reforms, m.abandoned, m.lost_steps, m.replacements)
        for key in [k for k in self._children if k[0] in per_job and k[1][:2] == job]:
            metric, labels = key
            del self._children[key]
            metric.remove(*labels)
        for cache in (self._reasons, self._rounds, self._gauges, self._gauge_children, self._job_keys, self._unlogged):
            cache.pop(job, None)

    async def _write_plan(self, job: JobId, action: WritePlan, now: float) -> None:
        if self.writer is None:
            revision = self.model.jobs[job].plan_revision + 1 if job in self.model.jobs else 1
        else:
            expected = action.expected_revision
            if expected == AFTER_PREVIOUS_PLAN:
                # The plan written just before in this decision went into the model with its revision.
                expected = self.model.jobs[job].plan_revision
            revision = await self.writer.compare_and_put(self._keys(job).plan, action.plan.to_json(), expected)
        self.model.own_write(job, KeyKind.PLAN, action.plan, revision)
        plan = action.plan
        if log.is_enabled_for(logging.INFO):
            log.info("re-form " + plan.phase.value, namespace=job[0], job=job[1], generation=plan.generation,
                     cause=plan.cause.value, planned=plan.planned, strategy=plan.strategy, nodes=plan.nodes_after,
                     trace_id=plan.trace_id)
        if action.finished:
            self._finished(job, plan)

    def _finished(self, job: JobId, plan: ReformPlan) -> None:
        planned = str(plan.planned).lower()
        cause = plan.cause.value
        m, child = self.metrics, self._child
        if plan.outcome == ReformOutcome.COMPLETED:
            child(m.reform_duration, job[0], job[1], cause, planned, plan.mode or "unknown").observe(max(0.0, reform_end(plan) - plan.detected_at))
            if plan.lost_steps > 0:
                child(m.lost_steps, job[0], job[1], cause).inc(plan.lost_steps)
            if plan.replaced and plan.strategy != ReformStrategy.ELASTIC:
                child(m.replacements, job[0], job[1], plan.strategy).inc(len(plan.replaced))
        child(m.reforms, job[0], job[1], cause, planned).inc()
        if plan.outcome != ReformOutcome.COMPLETED:
            phase = _abandoned_in(plan).value
            child(m.abandoned, job[0], job[1], cause, phase, plan.outcome.value).inc()
            # Metrics and traces count every one; the log line follows a spam filter per
            # job (a storm can supersede a job's plans many times a second).
            if self._abandon_logs.allow(job, plan.finished_at):
                unlogged = self._unlogged.pop(job, 0)
                log.warning("re-form abandoned", namespace=job[0], job=job[1], generation=plan.generation,
                            phase=phase, outcome=plan.outcome.value, why=plan.why,
                            **({"unlogged_before": unlogged} if unlogged else {}))
            else:
                self._unlogged[job] = self._unlogged.get(job, 0) + 1
        for phase, (start, end) in phase_times(plan).items():
            child(m.phase_duration, cause, phase).observe(max(0.0, end - start))
        emit_reform_trace(self.tracer_provider, job[0], job[1], plan)

    def _child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, looked up once (a storm ends thousands of re-forms)."""
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    async def _cordon(self, action: Cordon, now: float) -> None:
        # Jobs decide concurrently: the budget is re-checked here, under one lock.
        async with self._cordon_lock:
            budget = self.settings.cordon.budget(self.model.fleet.hosting_nodes)
            if action.node in self.model.cordoned:
                return
            if len(self.model.cordoned) >= budget:
                log.warning("cordon budget exhausted", node=action.node, budget=budget)
                return
            log.warning("cordoning node", node=action.node, reason=action.reason)
            await self.actuator.cordon(action.node, action.reason, self.settings.cordon.taint_key, now)
            self.model.cordoned.add(action.node)
            self.metrics.cordons.labels(ReformCause.RESTART_STORM.value).inc()

    # --- metrics ---------------------------------------------------------------------

    def _export_gauges(self, job: JobId, decision: Decision) -> None:
        a = decision.alerts
        values = (decision.node_count, decision.min_nodes, decision.max_nodes, a.stalled, a.bad_config, a.flapping,
                  a.rendezvous_on_gpu, decision.spare_count, decision.spares_wanted)
        before = self._gauges.get(job)
        if before != values:
            # Label lookups cost more than the decision itself, and each set takes a lock:
            # look the children up once, and set only the values that moved.
            self._gauges[job] = values
            children = self._gauge_children.get(job)
            if children is None:
                m = self.metrics
                children = self._gauge_children[job] = tuple(
                    g.labels(*job)
                    for g in (m.job_nodes, m.min_nodes, m.max_nodes, m.stalled, m.bad_config, m.flapping,
                              m.rendezvous_on_gpu, m.spare_nodes, m.spare_nodes_wanted)
                )
            for child, was, value in zip(children, before or _NO_GAUGES, values, strict=True):
                if was != value:
                    child.set(int(value))
        state = self.model.jobs.get(job)
        rounds = state.round.advanced if state is not None else 0
        seen = self._rounds.get(job, 0)
        if rounds > seen:
            self.metrics.rounds.labels(*job).inc(rounds - seen)
        self._rounds[job] = rounds


def _agent_keys(keys: JobKeys) -> tuple[str, ...]:
    """Where a registered agent of the job has keys (its member key and join record, written
    together): a removal of the job goes ahead only while nothing is there."""
    return (keys.members, keys.joins)


def _abandoned_in(plan: ReformPlan) -> ReformPhase:
    """The phase a finished but not completed ``plan`` was in when it was given up."""
    if plan.rendezvous_done_at:
        return ReformPhase.RESUME
    return ReformPhase.RENDEZVOUS if plan.reform_requested_at else ReformPhase.CHECKPOINT
