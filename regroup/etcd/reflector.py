"""``Reflector``: one key or prefix of etcd, listed and then watched, kept whole through
anything etcd does.

It lists, hands the listing over as ``Listed(items, revision)``, then watches from the
listing's revision + 1 and hands over each change as ``Put`` or ``Deleted``, in etcd's
order. When the watch is lost (etcd restarted or compacted past it, the stream broke), it
lists again after a back-off with jitter: a ``Listed`` always holds everything there is,
so a user rebuilds from it and never misses a change. Every watch it opens is closed when
it stops, cancelled included.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import aetcd.utils
import structlog

from regroup.etcd.client import TRANSIENT_ERRORS
from regroup.etcd.watch import EventKind, close_watch, open_watch

log = structlog.get_logger("regroup.etcd")


@dataclass(frozen=True)
class Put:
    """``key`` holds ``value``, written at ``revision`` (its mod_revision)."""

    key: str
    value: bytes
    revision: int


@dataclass(frozen=True)
class Deleted:
    """``key`` was deleted at ``revision``."""

    key: str
    revision: int


@dataclass(frozen=True)
class Listed:
    """Every key there is at ``revision``: a key known before and absent here is gone."""

    items: tuple[Put, ...]
    revision: int


ReflectorEvent = Listed | Put | Deleted


class ReflectorState(enum.StrEnum):
    LISTING = "listing"
    """Not listed yet."""
    SYNCED = "synced"
    """Listed; every change since is handed over as it arrives."""
    RELISTING = "relisting"
    """The watch was lost; changes wait for the next listing."""


@dataclass
class Backoff:
    """Delays between attempts: ``first``, doubling up to ``most``, each shortened by up to
    ``jitter`` of itself at random, so clients that lost etcd together do not return together."""

    first: timedelta = timedelta(seconds=0.05)
    most: timedelta = timedelta(seconds=1)
    jitter: float = 0.5
    rng: random.Random = field(default_factory=random.Random)
    _next: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.first <= timedelta(0) or self.most < self.first:
            raise ValueError("Backoff: need 0 < first <= most")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError("Backoff.jitter must be in [0, 1)")
        self.reset()

    def reset(self) -> None:
        self._next = self.first.total_seconds()

    def delay(self) -> float:
        """Seconds to wait before the next attempt."""
        base = self._next
        self._next = min(base * 2, self.most.total_seconds())
        return base * (1.0 - self.jitter * self.rng.random())


class Reflector:
    """Lists ``key`` (every key under it, with ``prefix``) and watches it, handing each
    ``ReflectorEvent`` to ``handle`` (called on the loop, in order; what it raises ends
    ``run``). ``on_lost`` is told each time the watch or a listing failed."""

    def __init__(
        self,
        client: Any,
        key: str,
        handle: Callable[[ReflectorEvent], None],
        *,
        prefix: bool = True,
        backoff: Backoff | None = None,
        on_lost: Callable[[BaseException | None], None] | None = None,
        name: str = "",
    ) -> None:
        self._client = client
        self._key = key.encode()
        self._range_end = aetcd.utils.prefix_range_end(self._key) if prefix else self._key + b"\0"
        self._prefix = prefix
        self._handle = handle
        self._backoff = backoff or Backoff()
        self._on_lost = on_lost
        self.name = name or key
        self.state = ReflectorState.LISTING
        self.revision = 0
        """The revision everything handed over so far is current at."""
        self.restarts = 0
        """How many times the watch was lost or a listing failed."""
        self._synced = asyncio.Event()

    async def synced(self) -> None:
        """Return once the state is ``SYNCED`` (at once if it is)."""
        await self._synced.wait()

    async def list(self) -> None:
        """List once and hand the listing over; what etcd raises is raised (a caller that
        must fail at once on bad credentials or no etcd calls this before ``run``)."""
        self._listed(await self._fetch())

    async def run(self) -> None:
        """List (unless listed already), then watch, listing again whenever the watch is
        lost, until cancelled."""
        while True:
            if self.state is not ReflectorState.SYNCED:
                try:
                    found = await self._fetch()
                except TRANSIENT_ERRORS as exc:
                    await self._retry(exc)
                    continue
                self._listed(found)
                if self.restarts:
                    log.info("etcd watch re-established", name=self.name, revision=self.revision)
            await self._retry(await self._follow())

    async def _fetch(self) -> Any:
        return await self._client.get_range(self._key, self._range_end)

    def _listed(self, found: Any) -> None:
        revision = int(found.header.revision)
        self._handle(Listed(tuple(Put(kv.key.decode(), kv.value, int(kv.mod_revision)) for kv in found), revision))
        self.revision = revision
        self.state = ReflectorState.SYNCED
        self._synced.set()

    async def _follow(self) -> BaseException | None:
        """Watch from past the listing until the watch is lost: why (None: it just ended).
        Only etcd's errors are caught; what ``handle`` raises ends ``run``."""
        try:
            watch = await open_watch(self._client, self._key, start_revision=self.revision + 1, prefix=self._prefix)
        except TRANSIENT_ERRORS as exc:
            return exc
        try:
            self._backoff.reset()
            events = aiter(watch)
            while True:
                try:
                    event = await anext(events)
                except StopAsyncIteration:
                    return None
                except TRANSIENT_ERRORS as exc:
                    return exc
                key, revision = event.kv.key.decode(), int(event.kv.mod_revision)
                if event.kind == EventKind.PUT:
                    self._handle(Put(key, event.kv.value, revision))
                else:
                    self._handle(Deleted(key, revision))
                self.revision = revision
        finally:
            await close_watch(watch)

    async def _retry(self, error: BaseException | None) -> None:
        """Count and report the loss, then wait out the back-off before listing again."""
        self.restarts += 1
        if self.state is ReflectorState.SYNCED:
            self.state = ReflectorState.RELISTING
            self._synced.clear()
        delay = self._backoff.delay()
        what = f"{type(error).__name__}: {error}" if error is not None else "the watch ended"
        log.warning("etcd watch lost; listing again", name=self.name, error=what, retry_in=round(delay, 3))
        if self._on_lost is not None:
            self._on_lost(error)
        await asyncio.sleep(delay)
