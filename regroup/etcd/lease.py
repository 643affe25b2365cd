"""``LeaseKeeper``: aetcd has no background keep-alive; this is the owned task that
refreshes a lease until cancelled, over one long-lived ``LeaseKeepAlive`` stream.

aetcd's ``Lease.refresh`` opens a new gRPC stream for every refresh (a request, a reply,
the stream's end): at 50 jobs of 16 agents that was about 40% of etcd's CPU. etcd's own
clients keep one stream per lease holder open and send each refresh as one message on it;
so does this keeper, and it opens a new stream only after an error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import aetcd
import grpc
import structlog
from aetcd import rpc

from regroup.etcd.client import TRANSIENT_ERRORS

log = structlog.get_logger("regroup.etcd")


class LeaseKeeper:
    """Keeps one etcd lease alive from an owned background task.

    ``on_lost`` is called (once) if the lease expired or could not be refreshed
    before its TTL ran out, so the owner can re-register. The lease is refreshed every
    ``ttl``/3; ``hurry`` refreshes it at once and then every ``every`` for a while, so that
    anyone reading its TTL meanwhile (``renewed_within``) sees it renewed within the last
    second for as long as its holder lives.
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
        self._wake = asyncio.Event()
        self._fast: tuple[float, float] = (0.0, 0.0)
        """(period, until: loop time) of a ``hurry``."""
        self._revoked = False
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

    def hurry(self, every: timedelta, for_: timedelta) -> None:
        """Refresh now, then every ``every`` (at most ``ttl``/3) for ``for_``. On the lease's loop."""
        until = asyncio.get_running_loop().time() + for_.total_seconds()
        self._fast = (min(every, self._ttl / 3).total_seconds(), max(until, self._fast[1]))
        self._wake.set()

    def _period(self, now: float) -> float:
        every, until = self._fast
        return every if now < until else self._ttl.total_seconds() / 3

    async def _keep_alive(self) -> None:
        ttl = self._ttl.total_seconds()
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        stream = _Stream(self._client, int(self.lease.id), timeout=ttl / 3)
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self._period(loop.time())):
                        await self._wake.wait()
                self._wake.clear()
                try:
                    if await stream.refresh() > 0:
                        last_ok = loop.time()
                        continue
                except TRANSIENT_ERRORS as exc:
                    stream.close()  # the next refresh opens a new one
                    log.warning("lease refresh failed", lease=self.lease.id, error=str(exc) or type(exc).__name__)
                    if loop.time() - last_ok < ttl:
                        continue
                log.warning("lease lost", lease=self.lease.id)
                if self._on_lost is not None:
                    result = self._on_lost()
                    if asyncio.iscoroutine(result):
                        await result
                return
        finally:
            stream.close()

    async def stop(self, revoke: bool = True) -> bool:
        """Stop renewing; with ``revoke``, end the lease now (its keys go at once). False when
        etcd could not be told: the lease then expires on its own within its TTL. Once
        revoked, a second stop does nothing."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None
        if revoke and self.lease is not None and not self._revoked:
            try:
                await self.lease.revoke()
            except TRANSIENT_ERRORS as exc:
                log.info("lease not revoked; it expires on its own", lease=self.id, error=str(exc))
                return False
            self._revoked = True
        return True


async def renewed_within(client: aetcd.Client, lease_id: int) -> bool:
    """Whether the lease's holder renewed it within about the last second, from the TTL
    left that etcd reports (whole seconds, rounded down: a lease renewed less than a second
    ago shows its granted TTL less at most 1). False for a lease that is gone. Meaningful for
    holders that refresh more often than every second (``LeaseKeeper.hurry``)."""
    info = await client.get_lease_info(lease_id, keys=False)
    return int(info.TTL) > 0 and int(info.TTL) >= int(info.grantedTTL) - 1


class _Stream:
    """One lease's ``LeaseKeepAlive`` stream, opened on first use and kept: a refresh is a
    request and its reply on it. Any error closes it (``close``); the next refresh opens
    another on the client's current channel."""

    def __init__(self, client: aetcd.Client, lease_id: int, timeout: float) -> None:
        self._client = client
        self._request = rpc.LeaseKeepAliveRequest(ID=lease_id)
        self._timeout = timeout
        self._call: Any = None

    async def refresh(self) -> int:
        """Renew the lease; its TTL left as etcd answers (<= 0: it expired). Raises one of
        ``TRANSIENT_ERRORS`` when etcd does not answer within the timeout or the stream broke."""
        if self._call is None or self._call.done():
            if self._client.leasestub is None:
                await self._client.connect()
            self._call = self._client.leasestub.LeaseKeepAlive(metadata=self._client.metadata)
        try:
            async with asyncio.timeout(self._timeout):
                await self._call.write(self._request)
                reply = await self._call.read()
        except asyncio.InvalidStateError as exc:  # the stream ended between the check and the write
            raise ConnectionError(f"the keep-alive stream ended ({exc})") from exc
        if reply is grpc.aio.EOF:
            raise ConnectionError("etcd ended the keep-alive stream")
        return int(reply.TTL)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
