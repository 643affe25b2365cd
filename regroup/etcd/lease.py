"""``LeaseKeeper``: aetcd has no background keep-alive; this is the owned task that
refreshes a lease until cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import aetcd
import structlog

from regroup.etcd.client import TRANSIENT_ERRORS

log = structlog.get_logger("regroup.etcd")


class LeaseKeeper:
    """Keeps one etcd lease alive from an owned background task.

    ``on_lost`` is called (once) if the lease expired or could not be refreshed
    before its TTL ran out, so the owner can re-register.
    """

    def __init__(
        self,
        client: aetcd.Client,
        ttl: timedelta,
        on_lost: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        if ttl < timedelta(seconds=2):
            raise ValueError("LeaseKeeper ttl must be at least 2s")
        self._client = client
        self._ttl = ttl
        self._on_lost = on_lost
        self._task: asyncio.Task[None] | None = None
        self.lease: Any = None

    @property
    def id(self) -> int:
        if self.lease is None:
            raise RuntimeError("lease not granted yet")
        return int(self.lease.id)

    async def start(self) -> Any:
        self.lease = await self._client.lease(int(self._ttl.total_seconds()))
        self._task = asyncio.create_task(self._keep_alive(), name=f"lease-keeper-{self.lease.id}")
        return self.lease

    async def _keep_alive(self) -> None:
        period = self._ttl.total_seconds() / 3
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while True:
            await asyncio.sleep(period)
            try:
                response = await self.lease.refresh()
                alive = int(getattr(response, "TTL", 1)) > 0
                if alive:
                    last_ok = loop.time()
                    continue
            except TRANSIENT_ERRORS as exc:
                log.warning("lease refresh failed", lease=self.lease.id, error=str(exc))
                if loop.time() - last_ok < self._ttl.total_seconds():
                    continue
            log.warning("lease lost", lease=self.lease.id)
            if self._on_lost is not None:
                result = self._on_lost()
                if asyncio.iscoroutine(result):
                    await result
            return

    async def stop(self, revoke: bool = True) -> bool:
        """Stop renewing; with ``revoke``, end the lease now (its keys go at once). False when
        etcd could not be told: the lease then expires on its own within its TTL."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None
        if revoke and self.lease is not None:
            try:
                await self.lease.revoke()
            except TRANSIENT_ERRORS as exc:
                log.info("lease not revoked; it expires on its own", lease=self.id, error=str(exc))
                return False
        return True
