"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection.

A candidate takes the Lease when it is free or its holder has not renewed it for
``lease_duration`` (measured on this replica's clock, from when it last saw the record
change, so clock skew between replicas does not matter). The leader renews every
``retry_period`` and steps down when it could not renew for ``renew_deadline``: its work is
cancelled before another replica can take over.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import aiohttp
import structlog

from regroup.controller.kube.api import KubeError, RawKube
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.settings import KubeSettings

log = structlog.get_logger("regroup.controller.leader")


def micro_time(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Campaigns for one Lease; runs ``lead()`` while holding it."""

    def __init__(
        self,
        raw: RawKube,
        namespace: str,
        name: str,
        identity: str,
        settings: KubeSettings,
        metrics: ControllerMetrics,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._raw = raw
        self._path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._namespace = namespace
        self._name = name
        self.identity = identity
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._wall = wall
        self._observed: tuple[str, str] | None = None
        """(holder, renewTime) last seen, and when (``_observed_at``) it was first seen so."""
        self._observed_at = 0.0
        self.leading = False

    async def run(self, lead: Callable[[], Awaitable[None]]) -> None:
        """Campaign until cancelled; each time leadership is won, run ``lead()`` until it is lost."""
        while True:
            while not await self._try():
                await asyncio.sleep(self._settings.retry_period.total_seconds())
            log.info("leading", lease=self._name, identity=self.identity)
            self.leading = True
            self._metrics.leader.set(1)
            work = asyncio.create_task(lead(), name="leader-work")
            try:
                await self._renew(work)
            finally:
                self.leading = False
                self._metrics.leader.set(0)
                work.cancel()
                results = await asyncio.gather(work, return_exceptions=True)
                await self._release()
            if isinstance(results[0], BaseException) and not isinstance(results[0], asyncio.CancelledError):
                raise results[0]
            if work.done() and not work.cancelled() and results[0] is None:
                return
            log.warning("leadership lost", lease=self._name, identity=self.identity)

    async def _renew(self, work: asyncio.Task[None]) -> None:
        last_ok = self._clock()
        while not work.done():
            done, _ = await asyncio.wait({work}, timeout=self._settings.retry_period.total_seconds())
            if done:
                return
            if await self._try():
                last_ok = self._clock()
            elif self._clock() - last_ok >= self._settings.renew_deadline.total_seconds():
                return

    async def _try(self) -> bool:
        """Acquire or renew the Lease once; False if another replica holds it or the API failed."""
        try:
            return await self._try_once()
        except (TimeoutError, KubeError, aiohttp.ClientError, OSError) as exc:
            log.warning("lease request failed", lease=self._name, error=str(exc))
            return False

    async def _try_once(self) -> bool:
        now = self._wall()
        duration = int(self._settings.lease_duration.total_seconds())
        try:
            lease = await self._raw.request("GET", f"{self._path}/{self._name}")
        except KubeError as exc:
            if exc.status != 404:
                raise
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self._name, "namespace": self._namespace},
                "spec": {
                    "holderIdentity": self.identity,
                    "leaseDurationSeconds": duration,
                    "acquireTime": micro_time(now),
                    "renewTime": micro_time(now),
                    "leaseTransitions": 0,
                },
            }
            try:
                await self._raw.request("POST", self._path, body=body)
            except KubeError as create_exc:
                if create_exc.status == 409:
                    return False
                raise
            return True
        spec: dict[str, Any] = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime") or "")
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()
        held_by_other = holder and holder != self.identity
        seconds = float(spec.get("leaseDurationSeconds") or duration)
        if held_by_other and self._clock() - self._observed_at < seconds:
            return False
        new_holder = holder != self.identity
        spec = {
            **spec,
            "holderIdentity": self.identity,
            "leaseDurationSeconds": duration,
            "renewTime": micro_time(now),
        }
        if new_holder:
            spec["acquireTime"] = micro_time(now)
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if holder else 0)
        lease["spec"] = spec
        try:
            await self._raw.request("PUT", f"{self._path}/{self._name}", body=lease)
        except KubeError as exc:
            if exc.status == 409:
                return False
            raise
        return True

    async def _release(self) -> None:
        """Hand the Lease back so a standby takes over at once (best effort)."""
        try:
            lease = await self._raw.request("GET", f"{self._path}/{self._name}")
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            spec["holderIdentity"] = ""
            spec["leaseDurationSeconds"] = 1
            lease["spec"] = spec
            await self._raw.request("PUT", f"{self._path}/{self._name}", body=lease)
        except (TimeoutError, KubeError, aiohttp.ClientError, OSError) as exc:
            log.warning("could not release the lease", lease=self._name, error=str(exc))
