"""The controller as the benchmark runs it, and how it is fed and timed.

The same ``ClusterModel``, ``WorkQueue``, ``Reconciler`` and ``decide`` as in production;
etcd writes land in the model and cluster actions cost nothing. Signal->decision latency
runs from the moment a signal entered the system (``Harness.origin``: when it was offered
to the controller, or written into the API stand-in) to the end of the first decision
of each job it dirtied that started after it: a decision that covers several signals
counts from the first of them.
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench._stats import percentile
from regroup.controller.cluster import ObjectRef
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.model import ClusterModel, JobId
from regroup.controller.reconciler import Outcome, Reconciler
from regroup.controller.runtime import ReconcileLoop, freeze_listed_heap
from regroup.controller.settings import ControllerSettings
from regroup.controller.workqueue import WorkQueue
from regroup.keys import JobKeys
from regroup.records import Progress

from .storm import NAMESPACE, Event, Layout, member


class NullActuator:
    """Cluster actions cost nothing here: the bench measures observing and deciding."""

    async def cordon(self, node: str, reason: str, taint_key: str, now: float) -> None:
        return None

    async def delete_pod(self, namespace: str, name: str, reason: str) -> None:
        return None

    async def post_event(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        return None


class TimedReconciler(Reconciler):
    """Records, per decision, how long the oldest signal it covers waited for it."""

    def __init__(self, harness: Harness, *args: Any) -> None:
        super().__init__(*args)
        self.harness = harness

    async def reconcile(self, job: JobId) -> Outcome:
        since = self.harness.pending.pop(job, None)
        outcome = await super().reconcile(job)
        self.harness.decisions += 1
        if since is not None:
            self.harness.latencies.append(time.perf_counter() - since)
        return outcome


class Harness:
    """Model, queue, reconciler and workers, with latencies recorded per decision."""

    def __init__(self, workers: int, clock: Callable[[], float] = time.time) -> None:
        """``clock``: the unix time the model stamps and decisions run at (a replay may
        pass a virtual one, so no decision depends on how fast it runs)."""
        self.settings = ControllerSettings()
        self.clock = clock
        self.queue: WorkQueue[JobId] = WorkQueue(time.perf_counter)
        self.model = ClusterModel(clock, self._dirty, prefix=self.settings.etcd_prefix, job_defaults=self.settings.jobs)
        self.reconciler = TimedReconciler(
            self, self.model, self.settings, None, NullActuator(), ControllerMetrics(), None, clock
        )
        self.loop = ReconcileLoop(self.reconciler, self.queue)
        self.workers = workers
        self.tasks: list[asyncio.Task[None]] = []
        self.origin: float | None = None
        """When the signal being delivered entered the system (None: now)."""
        self.pending: dict[JobId, float] = {}
        """Job -> the oldest signal that dirtied it since its last decision started."""
        self.latencies: list[float] = []
        self.decisions = 0

    def _dirty(self, job: JobId) -> None:
        if job not in self.pending:
            self.pending[job] = self.origin if self.origin is not None else time.perf_counter()
        self.queue.add(job)

    def reset(self) -> None:
        self.latencies.clear()
        self.decisions = 0

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.loop.worker()) for _ in range(self.workers)]
        self.tasks.append(asyncio.create_task(self.reconciler.events.run()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.queue.close()

    async def settled(self) -> None:
        """The initial lists decided: the heap frozen as the controller freezes it once
        synced, and the counters zeroed."""
        await self.drained()
        freeze_listed_heap()
        self.reset()

    async def drained(self) -> None:
        """Until every queued job is decided: by the workers, or here when there are none."""
        if not self.workers:
            await self.decide_queued()
            return
        while len(self.queue) or self.queue._active:
            await asyncio.sleep(0.001)

    async def decide_queued(self) -> None:
        """Decide every queued job once, in queue order, as a worker would (requeue timers aside)."""
        while len(self.queue):
            job, _ = await self.queue.get()
            try:
                await self.reconciler.reconcile(job)
            finally:
                self.queue.done(job)

    def seed_etcd(self, layout: Layout) -> None:
        items = []
        for j in range(layout.jobs):
            keys = JobKeys(NAMESPACE, layout.job(j), self.settings.etcd_prefix)
            for n in layout.job_nodes(j):
                items.append((keys.member(n), member(layout, j, n), 1))
            progress = Progress(step=100, loss=1.0, samples_seen=0, world_size=400, time=self.clock())
            items.append((keys.progress, progress.to_json(), 1))
        self.model.etcd_resynced(items)


async def offer(
    events: Sequence[Event], rate: float, deliver: Callable[[Event, float], None], start: float | None = None
) -> None:
    """Offer ``events`` at ``rate`` per second: event i arrives ``i / rate`` after ``start``
    (a ``time.perf_counter`` value, now by default; two processes given the same one keep
    the same schedule). Each turn hands over every event that has arrived by then, as a
    watch read returns all that is buffered, so a controller that falls behind gets bigger
    batches, and each event is stamped with its arrival (``deliver(event, arrived)``)."""
    if start is None:
        start = time.perf_counter()
    elif start > time.perf_counter():
        await asyncio.sleep(start - time.perf_counter())
    done = 0
    while done < len(events):
        arrived = min(len(events), int((time.perf_counter() - start) * rate) + 1)
        for i in range(done, arrived):
            deliver(events[i], start + i / rate)
        done = arrived
        # Until the next arrival, at least a millisecond (a watch read's granularity); at
        # once when it has arrived already.
        wait = start + done / rate - time.perf_counter()
        await asyncio.sleep(max(0.001, wait) if wait > 0 else 0)


def latency_summary(latencies: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": round((percentile(latencies, 0.50) or 0.0) * 1e3, 3),
        "p99_ms": round((percentile(latencies, 0.99) or 0.0) * 1e3, 3),
        "mean_ms": round(statistics.fmean(latencies) * 1e3, 3) if latencies else 0.0,
    }


def peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
