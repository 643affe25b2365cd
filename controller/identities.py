"""Each job's own etcd identity (``--etcd-job-identities``; ``regroup.etcd.auth``).

A job has an etcd user and role ``regroup:job:<namespace>:<job>`` for as long as the
controller tracks it: from the moment its pods (label ``regroup.dev/job``) or its keys are
seen, until nothing of it is left: its keys removed and, for a finished job, its tombstone
too (a pod restarted while the tombstone stands must still read it). The model says which
jobs it tracks (``ClusterModel.jobs``, and tells each change through ``on_tracking``);
``plan_identities`` decides, purely, which identities to make and which to remove;
``JobIdentities`` applies that through the auth adapters, backs a failing job off and tells
it: a log line, and a Warning Event ``EtcdIdentityFailed`` on the job's pods (the workers are
refused by etcd until their identity exists).

Level-triggered like the reconciler: a restarted controller lists the identities etcd holds,
makes (and corrects) those of the jobs it tracks, and removes those of the jobs it does not,
never before the pods and etcd are listed in full (until then every job looks gone); every
``resync`` it lists them again, so one deleted by hand is made again. A job's workers that
start before their identity exists are refused (``regroup.etcd.PermissionDenied``) and retry
until it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import structlog

from regroup.controller.events import EventRecorder
from regroup.controller.fleet import JobId
from regroup.controller.model import ClusterModel
from regroup.controller.settings import ControllerSettings
from regroup.etcd.auth import auth_enabled, ensure_job_identity, job_identities, job_user, remove_job_identity
from regroup.keys import JobKeys

log = structlog.get_logger("regroup.controller")

FAILED = "EtcdIdentityFailed"
"""Reason of the Warning Event on a job's pods when its etcd identity cannot be made."""
CONCURRENT = 8
"""Jobs whose identities are changed at once (a restarted controller checks every job's)."""


@dataclass(frozen=True)
class IdentityPlan:
    """What to do about the jobs' etcd identities now, and when to look again."""

    ensure: tuple[JobId, ...] = ()
    """Jobs whose identity is to be made (or checked and corrected)."""
    remove: tuple[JobId, ...] = ()
    """Jobs whose identity is to be removed."""
    later: tuple[JobId, ...] = ()
    """Jobs to look at again at ``wake_at`` (backing off after a failure)."""
    wake_at: float | None = None


def plan_identities(
    touched: Iterable[JobId],
    tracked: Collection[JobId],
    made: AbstractSet[JobId],
    present: AbstractSet[JobId],
    *,
    synced: bool,
    backoff: Mapping[JobId, float],
    now: float,
    gone_since: Mapping[JobId, float] | None = None,
    grace: float = 0.0,
) -> IdentityPlan:
    """For each ``touched`` job: a ``tracked`` one needs its identity, unless this controller
    ``made`` (or checked) it already; one no longer tracked loses its identity if there is
    one (``made`` here, or ``present`` in etcd's listing), but only once the model is
    ``synced`` and the job has been gone ``grace`` seconds (since ``gone_since[job]``). A job
    ``backoff`` holds until after ``now`` waits until then."""
    ensure, remove, later = [], [], []
    wake_at: float | None = None
    for job in touched:
        until = backoff.get(job)
        if job in tracked:
            if job in made:
                continue
            todo = ensure
        elif synced and (job in made or job in present):
            todo = remove
            gone_until = (gone_since or {}).get(job, now) + grace
            if gone_until > now:
                until = gone_until if until is None else max(until, gone_until)
        else:
            continue
        if until is not None and until > now:
            later.append(job)
            wake_at = until if wake_at is None else min(wake_at, until)
        else:
            todo.append(job)
    return IdentityPlan(tuple(ensure), tuple(remove), tuple(later), wake_at)


class JobIdentities:
    """Keeps one etcd identity per tracked job (the adapter around ``plan_identities``).
    ``touch`` is the model's ``on_tracking``; ``run`` is a task of the controller."""

    def __init__(self, client: Any, settings: ControllerSettings, clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self._settings = settings
        self._clock = clock
        self._prefix = settings.etcd_prefix
        self._pending: set[JobId] = set()
        self._wake = asyncio.Event()
        self.made: set[JobId] = set()
        """Jobs whose identity this controller made or checked (and has not removed since)."""
        self.present: set[JobId] = set()
        """Jobs with a user in etcd, as last listed (and changed by this controller since)."""
        self._backoff_until: dict[JobId, float] = {}
        self._backoff: dict[JobId, float] = {}
        self._gone_since: dict[JobId, float] = {}
        """When each job this controller saw go stopped being tracked."""

    def touch(self, job: JobId) -> None:
        """``job`` started or stopped being tracked: look at its identity."""
        self._pending.add(job)
        self._wake.set()

    async def run(self, model: ClusterModel, events: EventRecorder) -> None:
        """Until cancelled: keep each tracked job's identity, remove the others'. Start it once
        the model is synced (the reconcile workers' condition)."""
        await self._warn_if_auth_off()
        next_listing = 0.0
        while True:
            now = self._clock()
            if now >= next_listing:
                await self._list(model)
                next_listing = now + self._settings.runtime.resync.total_seconds()
            touched, self._pending = self._pending, set()
            for job in touched:
                if job in model.jobs:
                    self._gone_since.pop(job, None)
                else:
                    self._gone_since.setdefault(job, now)
            plan = plan_identities(touched, model.jobs, self.made, self.present, synced=model.synced,
                                   backoff=self._backoff_until, now=now, gone_since=self._gone_since,
                                   grace=self._settings.runtime.etcd_identity_grace.total_seconds())
            self._pending.update(plan.later)
            limit = asyncio.Semaphore(CONCURRENT)
            await asyncio.gather(*(self._ensure(job, model, events, limit) for job in plan.ensure),
                                 *(self._remove(job, model, limit) for job in plan.remove))
            if self._pending - set(plan.later):
                continue  # touched meanwhile
            wake_at = min(next_listing, plan.wake_at or next_listing)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):  # woken by the clock, not by a touch
                async with asyncio.timeout(max(0.0, wake_at - self._clock())):
                    await self._wake.wait()

    async def _warn_if_auth_off(self) -> None:
        try:
            enabled = await auth_enabled(self._client)
        except Exception as exc:  # noqa: BLE001 - any failure: logged, retried; never a crash
            log.warning("cannot tell whether etcd enforces authentication", error=f"{type(exc).__name__}: {exc}")
            return
        if not enabled:
            log.warning("etcd authentication is off: the jobs' etcd identities are made but not enforced "
                        "(run regroup etcd-auth bootstrap)")

    async def _list(self, model: ClusterModel) -> None:
        """List the identities etcd holds; look at every one and at every tracked job."""
        try:
            listed = {(keys.namespace, keys.job) for keys in await job_identities(self._client, self._prefix)}
        except Exception as exc:  # noqa: BLE001 - any failure: logged, retried; never a crash
            log.warning("cannot list the jobs' etcd identities; trying again at the next resync",
                        error=f"{type(exc).__name__}: {exc}")
            listed = set(self.present)
        self.made &= listed  # one removed by hand is made again
        self.present = listed
        self._pending.update(listed, model.jobs)

    async def _ensure(self, job: JobId, model: ClusterModel, events: EventRecorder, limit: asyncio.Semaphore) -> None:
        keys = JobKeys(job[0], job[1], self._prefix)
        async with limit:
            try:
                changes = await ensure_job_identity(self._client, keys)
            except Exception as exc:  # noqa: BLE001 - any failure: logged, retried; never a crash
                delay = self._failed(job)
                why = f"{type(exc).__name__}: {exc}"
                log.warning("cannot make the job's etcd identity; retrying", namespace=job[0], job=job[1],
                            user=job_user(keys), error=why, retry_in=delay)
                state = model.jobs.get(job)
                if state is not None:
                    message = (f"etcd user and role {job_user(keys)} could not be made: {why}. Until they are, "
                               "etcd refuses the job's workers; the controller keeps trying.")
                    events.record_on_pods(job, tuple(state.pods.values()), "Warning", FAILED, message, self._clock())
                return
        self._succeeded(job)
        self.made.add(job)
        self.present.add(job)
        if changes:
            log.info("job's etcd identity made", namespace=job[0], job=job[1], user=job_user(keys), changes=changes)

    async def _remove(self, job: JobId, model: ClusterModel, limit: asyncio.Semaphore) -> None:
        keys = JobKeys(job[0], job[1], self._prefix)
        async with limit:
            if job in model.jobs:
                return  # tracked again meanwhile (touched, so ensured next)
            try:
                removed = await remove_job_identity(self._client, keys)
            except Exception as exc:  # noqa: BLE001 - any failure: logged, retried; never a crash
                delay = self._failed(job)
                log.warning("cannot remove the job's etcd identity; retrying", namespace=job[0], job=job[1],
                            user=job_user(keys), error=f"{type(exc).__name__}: {exc}", retry_in=delay)
                return
        self._succeeded(job)
        self._gone_since.pop(job, None)
        self.made.discard(job)
        self.present.discard(job)
        if removed:
            log.info("job's etcd identity removed", namespace=job[0], job=job[1], user=job_user(keys))

    def _failed(self, job: JobId) -> float:
        """Back ``job`` off (the controller's etcd back-off, doubling); the delay."""
        runtime = self._settings.runtime
        previous = self._backoff.get(job)
        delay = runtime.etcd_retry.total_seconds() if previous is None else previous * 2
        delay = min(delay, runtime.etcd_retry_max.total_seconds())
        self._backoff[job] = delay
        self._backoff_until[job] = self._clock() + delay
        self._pending.add(job)
        return delay

    def _succeeded(self, job: JobId) -> None:
        self._backoff.pop(job, None)
        self._backoff_until.pop(job, None)
