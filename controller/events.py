"""``EventRecorder``: the controller's Kubernetes Events, posted in the background.

A decision hands its Events over and goes on; one task posts them, as client-go's
recorder does. Three filters keep a storm from turning into an Event flood:

- the same Event (object, reason, message) is posted once in ``EVENT_MEMORY``;
- each subject has a token bucket (client-go's spam filter: a burst of 25, then one
  every five minutes). The subject of a job-level Event told on each of the job's pods
  (``record_on_pods``) is the job, so a job whose re-forms are superseded many times a
  second posts 25 rounds of them, not 25 per pod per second;
- the queue is bounded: when the API server cannot keep up, the newest Events are dropped.

Dropped Events are counted (``regroup_events_dropped_total{cause}``); a failed post is
logged and dropped, never retried in the decision path.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from datetime import timedelta
from operator import itemgetter
from typing import Any, Literal

import structlog

from regroup.controller.cluster import ClusterActuator, ObjectRef, PodInfo
from regroup.controller.metrics import ControllerMetrics

log = structlog.get_logger("regroup.controller")

EventType = Literal["Normal", "Warning"]

EVENT_MEMORY = timedelta(minutes=15)
"""The same Event (object, reason, message) is posted at most once in this long."""

SPAM_BURST = 25
"""Events a subject may post at once (client-go's ``defaultSpamBurst``)."""

SPAM_REFILL = timedelta(minutes=5)
"""One more Event per subject each this long (client-go's ``defaultSpamQPS``, 1/300)."""

QUEUE_CAPACITY = 1000
"""Events waiting to be posted (client-go's ``maxQueuedEvents``)."""


def _forget_before(ordered: OrderedDict[Any, Any], cutoff: float, when: Callable[[Any], float]) -> None:
    """Drop the entries of ``ordered`` last counted at or before ``cutoff`` (``when`` reads
    that time off a value). A counted key moves to the end, so the oldest come first and
    forgetting stops at the first one kept: nothing still remembered is rescanned."""
    while ordered:
        oldest = next(iter(ordered))
        if when(ordered[oldest]) > cutoff:
            break
        del ordered[oldest]


class SpamFilter:
    """A token bucket per subject (client-go's spam filter): ``burst`` at once, then one
    more each ``refill``. Subjects whose bucket is full again are forgotten."""

    def __init__(self, burst: int = SPAM_BURST, refill: timedelta = SPAM_REFILL) -> None:
        self.burst = float(burst)
        self.refill = refill.total_seconds()
        self._buckets: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()
        """Subject -> (tokens left, when counted), least recently counted first."""

    def allow(self, subject: Hashable, now: float) -> bool:
        """Spend one of ``subject``'s tokens if it has one."""
        buckets, refill, burst = self._buckets, self.refill, self.burst
        tokens, since = buckets.get(subject, (burst, now))
        tokens = min(burst, tokens + (now - since) / refill)
        _forget_before(buckets, now - burst * refill, itemgetter(1))  # full again: forgotten
        allowed = tokens >= 1.0
        buckets[subject] = (tokens - 1.0 if allowed else tokens, now)
        buckets.move_to_end(subject)
        return allowed


class EventRecorder:
    """Deduplicates, rate-limits and queues Events; ``run`` posts them through ``actuator``."""

    def __init__(
        self,
        actuator: ClusterActuator,
        metrics: ControllerMetrics,
        capacity: int = QUEUE_CAPACITY,
    ) -> None:
        self.actuator = actuator
        self.metrics = metrics
        self.capacity = capacity
        self._queue: deque[tuple[Sequence[ObjectRef | PodInfo], EventType, str, str]] = deque()
        """Events to post: their subjects (pods' Event references are taken when posted),
        type, reason and message."""
        self._queued = 0
        """Events in the queue (an entry for a job's pods holds one per pod)."""
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._seen: OrderedDict[tuple[str, ...], float] = OrderedDict()
        """Event key -> when it was last posted, oldest first."""
        self._spam = SpamFilter()
        self._drop_counters: dict[str, Any] = {}

    def record(self, ref: ObjectRef, type_: EventType, reason: str, message: str, now: float) -> None:
        """Post an Event about ``ref`` (unless a filter drops it)."""
        if self._admit((ref.kind, ref.namespace, ref.name), reason, message, now):
            self._enqueue((ref,), type_, reason, message)

    def record_on_pods(
        self, job: tuple[str, str], pods: Sequence[PodInfo], type_: EventType, reason: str, message: str, now: float
    ) -> None:
        """Tell a job-level Event on each of ``pods`` (the job is the filters' subject)."""
        if pods and self._admit(("Job", *job), reason, message, now):
            self._enqueue(pods, type_, reason, message)

    def _admit(self, subject: tuple[str, ...], reason: str, message: str, now: float) -> bool:
        key = (*subject, reason, message)
        if not self._due(key, now):
            return False
        if not self._spam.allow(subject, now):
            self._dropped("rate-limited")
            return False
        self._seen[key] = now
        self._seen.move_to_end(key)
        return True

    def _due(self, key: tuple[str, ...], now: float) -> bool:
        """Whether the Event ``key`` names was not posted within ``EVENT_MEMORY``."""
        memory = EVENT_MEMORY.total_seconds()
        seen = self._seen
        last = seen.get(key)
        if last is not None and now - last < memory:
            return False
        _forget_before(seen, now - memory, float)
        return True

    def _enqueue(self, refs: Sequence[ObjectRef | PodInfo], type_: EventType, reason: str, message: str) -> None:
        if self._queued + len(refs) > self.capacity:
            self._dropped("queue-full", len(refs))
            return
        self._queue.append((refs, type_, reason, message))
        self._queued += len(refs)
        self._idle.clear()
        self._wake.set()

    def _dropped(self, cause: str, count: int = 1) -> None:
        counter = self._drop_counters.get(cause)
        if counter is None:
            counter = self._drop_counters[cause] = self.metrics.events_dropped.labels(cause)
        counter.inc(count)

    async def run(self) -> None:
        """Post queued Events, oldest first, until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                subjects, type_, reason, message = self._queue.popleft()
                for subject in subjects:
                    ref = subject.ref if isinstance(subject, PodInfo) else subject
                    try:
                        await self.actuator.post_event(ref, type_, reason, message)
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:  # noqa: BLE001 - an Event is never worth a retry loop
                        self._dropped("error")
                        log.warning("cannot post event", kind=ref.kind, name=ref.name, reason=reason,
                                    error=f"{type(exc).__name__}: {exc}")
                    finally:
                        self._queued -= 1
                # Decisions go first: an API server that answers at once (or a recorder
                # that only drops) never holds the loop for a whole queue.
                await asyncio.sleep(0)
            self._idle.set()

    async def posted(self) -> None:
        """Wait until every Event queued so far is posted (or dropped)."""
        await self._idle.wait()
