"""``run_controller``: the controller's one asyncio loop.

Owned tasks: the cluster source and the etcd mirror (feeding the model), the reconcile
workers (started once both have listed everything), the Event recorder, the periodic resync,
the presence lease and, with ``etcd_job_identities``, the keeper of the jobs' etcd identities
(``identities``, started with the workers). All are
cancelled together when the caller cancels ``run_controller``; the lease is revoked on
the way out, so agents see the controller gone at once and handle joins themselves again.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import structlog
from opentelemetry import trace

from regroup.controller.cluster import ClusterActuator, ClusterSource
from regroup.controller.etcd_mirror import OwnWrites, mirror_etcd
from regroup.controller.identities import JobIdentities
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.model import ClusterModel, JobId
from regroup.controller.reconciler import Outcome, PlanConflict, Reconciler
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import Decision
from regroup.controller.workqueue import WorkQueue
from regroup import etcd as etcd_layer
from regroup.etcd import EtcdSettings, LeaseKeeper

log = structlog.get_logger("regroup.controller")

DecisionObserver = Callable[[JobId, Decision, float], None]
"""Called after each reconcile with the job, the decision and the seconds since the
job was first queued for it (signal-to-decision latency)."""


class EtcdLeaseWriter:
    """The controller's etcd writes: presence keys bound to its lease, the plan by CAS, a
    checkpoint request's withdrawal fenced on its revision and the plan's, a job's removal
    fenced on no agent of it being registered."""

    def __init__(self, client: Any, own: OwnWrites) -> None:
        self.client = client
        self.own = own
        self.lease: Any = None

    async def put(self, key: str, value: bytes, *, leased: bool = False) -> int:
        response = await self.client.put(key.encode(), value, lease=self.lease if leased else None)
        revision = int(response.header.revision)
        self.own.add(revision)
        return revision

    async def compare_and_put(self, key: str, value: bytes, expected_revision: int) -> int:
        txn = self.client.transactions
        ok, responses = await self.client.transaction(
            compare=[txn.mod(key.encode()) == expected_revision],
            success=[txn.put(key.encode(), value)],
            failure=[],
        )
        if not ok:
            raise PlanConflict(key)
        revision = int(responses[0].response_put.header.revision)
        self.own.add(revision)
        return revision

    async def compare_and_delete(self, key: str, expected_revision: int, fence: tuple[str, int]) -> None:
        txn = self.client.transactions
        fence_key, fence_revision = fence
        ok, responses = await self.client.transaction(
            compare=[txn.mod(key.encode()) == expected_revision, txn.mod(fence_key.encode()) == fence_revision],
            success=[txn.delete(key.encode())],
            failure=[],
        )
        if not ok:
            raise PlanConflict(key)
        self.own.add(int(responses[0].response_delete_range.header.revision))

    async def remove_prefix(
        self, prefix: str, unless_under: tuple[str, ...], put: tuple[str, bytes] | None = None,
        delete: tuple[str, int] | None = None,
    ) -> int:
        txn = self.client.transactions
        # A range compare holds for every key in the range, and an empty range compares as a
        # key of version 0: "no key under it".
        compare = [txn.version(p.encode(), range_end=prefix_end(p.encode())) == 0 for p in unless_under]
        success = [txn.delete(prefix.encode(), range_end=prefix_end(prefix.encode()))]
        if put is not None:
            success.append(txn.put(put[0].encode(), put[1]))
        if delete is not None:
            compare.append(txn.mod(delete[0].encode()) == delete[1])
            success.append(txn.delete(delete[0].encode()))
        ok, responses = await self.client.transaction(compare=compare, success=success, failure=[])
        if not ok:
            raise PlanConflict(prefix)
        revision = int(responses[0].response_delete_range.header.revision)
        self.own.add(revision, many=True)  # a watch event per key deleted, all of this revision
        return revision

    async def delete_keys(self, keys: tuple[str, ...]) -> int:
        txn = self.client.transactions
        _, responses = await self.client.transaction(
            compare=[], success=[txn.delete(key.encode()) for key in keys], failure=[]
        )
        revision = int(responses[0].response_delete_range.header.revision)
        self.own.add(revision, many=True)
        return revision


def prefix_end(prefix: bytes) -> bytes:
    """The end of the key range of everything under ``prefix`` (etcd's ``range_end``)."""
    end = bytearray(prefix.rstrip(b"\xff"))
    end[-1] += 1
    return bytes(end)


class ReconcileLoop:
    """The work queue and its workers around one ``Reconciler``."""

    def __init__(self, reconciler: Reconciler, queue: WorkQueue[JobId], observer: DecisionObserver | None = None) -> None:
        self.reconciler = reconciler
        self.queue = queue
        self.observer = observer

    async def worker(self) -> None:
        while True:
            job, added = await self.queue.get()
            try:
                outcome = await self.reconciler.reconcile(job)
            except asyncio.CancelledError:
                self.queue.done(job)
                raise
            except Exception as exc:
                log.exception("reconcile failed", namespace=job[0], job=job[1], error=str(exc))
                outcome = None
            self.queue.done(job)
            if self.observer is not None and outcome is not None:
                self.observer(job, outcome.decision, self.queue.clock() - added)
            self._requeue(job, outcome)
            # A decision whose writes all returned at once never gave the loop back: let the
            # watches deliver what arrived meanwhile, so a signal for a job still queued is
            # folded into that job's coming decision instead of waiting for the whole queue.
            await asyncio.sleep(0)

    def _requeue(self, job: JobId, outcome: Outcome | None) -> None:
        delay = outcome.requeue_after if outcome is not None else timedelta(seconds=1)
        if delay is None:
            return
        if delay <= timedelta(0):
            self.queue.add(job)
        else:
            self.queue.add_after(job, delay.total_seconds())

    async def resync(self, period: timedelta) -> None:
        """Queue every job every ``period``, events or not (level-triggered safety net)."""
        while True:
            await asyncio.sleep(period.total_seconds())
            for job in list(self.reconciler.model.jobs):
                self.queue.add(job)


async def _connect(etcd: EtcdSettings, settings: ControllerSettings) -> Any:
    delay = settings.runtime.etcd_retry.total_seconds()
    while True:
        try:
            return await etcd_layer.connect(etcd)
        except etcd_layer.EtcdUnavailable as exc:
            log.warning("etcd unavailable; retrying", error=str(exc), retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, settings.runtime.etcd_retry_max.total_seconds())


async def _keep_presence_lease(
    client: Any, writer: EtcdLeaseWriter, model: ClusterModel, queue: WorkQueue[JobId], settings: ControllerSettings,
    granted: asyncio.Event,
) -> None:
    """Hold the lease the presence keys are bound to; when it is lost, take a new one and
    let every job write its presence again."""
    while True:
        lost = asyncio.Event()
        keeper = LeaseKeeper(client, settings.runtime.lease_ttl, on_lost=lost.set)
        try:
            try:
                writer.lease = await keeper.start()
            except etcd_layer.TRANSIENT_ERRORS as exc:
                log.warning("cannot grant the controller lease; retrying", error=str(exc))
                await asyncio.sleep(settings.runtime.etcd_retry.total_seconds())
                continue
            granted.set()
            for state in model.jobs.values():
                state.presence = None
            for job in list(model.jobs):
                queue.add(job)
            await lost.wait()
            log.warning("controller lease lost; taking a new one")
        finally:
            await keeper.stop(revoke=True)


def freeze_listed_heap() -> None:
    """Move everything allocated so far out of the cyclic garbage collector's sight.

    Once the initial lists are in, the heap is mostly the fleet's nodes, pods and records,
    which live as long as the process; every full collection would walk them all again,
    stalling each decision queued behind it (tens of milliseconds at 10,000 pods). What is
    frozen is still freed by reference counting when the model drops it."""
    gc.freeze()


async def run_controller(
    settings: ControllerSettings,
    source: ClusterSource,
    actuator: ClusterActuator,
    etcd: EtcdSettings,
    *,
    ready: asyncio.Event | None = None,
    tracer_provider: Any = None,
    metrics: ControllerMetrics | None = None,
    observer: DecisionObserver | None = None,
    clock: Callable[[], float] = time.time,
) -> None:
    """Run the controller until cancelled. ``ready`` is set once Kubernetes (or the local
    cluster) and etcd have each been listed in full and the presence lease is held."""
    metrics = metrics or ControllerMetrics()
    provider = tracer_provider if tracer_provider is not None else trace.get_tracer_provider()
    client = await _connect(etcd, settings)
    queue: WorkQueue[JobId] = WorkQueue(clock)
    synced = asyncio.Event()
    identities = JobIdentities(client, settings, clock) if settings.runtime.etcd_job_identities else None
    model = ClusterModel(
        clock,
        queue.add,
        prefix=settings.etcd_prefix,
        cordon_taint=settings.cordon.taint_key,
        identity=settings.runtime.identity,
        on_synced=synced.set,
        job_defaults=settings.jobs,
        on_tracking=identities.touch if identities is not None else None,
    )
    own = OwnWrites()
    writer = EtcdLeaseWriter(client, own)
    reconciler = Reconciler(model, settings, writer, actuator, metrics, provider, clock)
    loop = ReconcileLoop(reconciler, queue, observer)
    granted = asyncio.Event()
    metrics.jobs_tracked.set_function(lambda: len(model.jobs))
    http = None
    try:
        if settings.runtime.http_port is not None:
            from regroup.controller.http import HealthServer

            http = HealthServer(metrics, settings.runtime.http_host, settings.runtime.http_port,
                                healthy=lambda: True, ready=synced.is_set)
            await http.start()
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_keep_presence_lease(client, writer, model, queue, settings, granted), name="presence-lease")
            await granted.wait()
            tasks.create_task(source.run(model), name="cluster-source")
            tasks.create_task(
                mirror_etcd(client, settings.etcd_prefix, model, metrics, own, settings.runtime.etcd_retry,
                            settings.runtime.etcd_retry_max),
                name="etcd-mirror",
            )
            tasks.create_task(reconciler.events.run(), name="event-recorder")
            # No decision on half a view: a job whose pods are not listed yet looks gone, and
            # one whose etcd keys (or tombstone) are not looks new, so its keys would be
            # written again. The queue gathers the jobs meanwhile.
            await synced.wait()
            if identities is not None:
                # Removals need the whole view as much as decisions do (an unlisted job looks gone).
                tasks.create_task(identities.run(model, reconciler.events), name="etcd-identities")
            for i in range(settings.runtime.workers):
                tasks.create_task(loop.worker(), name=f"reconcile-{i}")
            tasks.create_task(loop.resync(settings.runtime.resync), name="resync")
            freeze_listed_heap()
            log.info("controller ready", jobs=len(model.jobs), nodes=len(model.nodes), identity=settings.runtime.identity)
            if ready is not None:
                ready.set()
    finally:
        queue.close()
        metrics.jobs_tracked.set_function(lambda: 0)  # a standby holds no job (nor this model)
        if http is not None:
            await http.stop()
        await client.close()
