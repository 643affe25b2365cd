"""A live mirror of one job's etcd keys, kept by a watch that survives etcd restarts.

The handler decides from this mirror (``JobView``), so torchrun's monitor loop can call
``num_nodes_waiting()`` every 0.1 s without a request to etcd. When the watch breaks
(etcd restarted, network blip) it resumes from the last revision it saw; if that
revision was compacted away it reloads the whole prefix.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from regroup import etcd
from regroup.keys import JobKeys
from regroup.records import ControllerPresence, Exclusions, ExpectedMembership, MemberRecord, RecordError, ReformRequest
from rendezvous.decisions import JobView
from rendezvous.records import JoinRecord, RoundState

log = structlog.get_logger("rendezvous.watch")

PUBLISH_INTERVAL_S = 0.005

WATCH_ERRORS = (etcd.ClientError, ConnectionError, OSError, asyncio.TimeoutError, RecordError)


class JobWatch:
    """Mirror of ``/regroup/jobs/<ns>/<job>/`` (members, rdzv state, control keys, round stores)."""

    def __init__(self, client: Any, keys: JobKeys) -> None:
        self._client = client
        self._keys = keys
        self._rounds = keys.rdzv + "rounds/"
        self._revision = 0
        self._state: tuple[RoundState | None, int] = (None, 0)
        self._members: dict[str, MemberRecord] = {}
        self._joins: dict[str, JoinRecord] = {}
        self._expected: ExpectedMembership | None = None
        self._reform: ReformRequest | None = None
        self._controller = False
        self._excluded: dict[str, str] = {}
        self._store_kv: dict[str, bytes] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.view = JobView()
        """The latest view; replaced (never mutated) on every change, so any thread may read it."""
        self.restarts = 0
        """How many times the watch had to be re-established."""
        self.version = 0
        """Bumped on every change of the mirror."""
        self._publish_pending = False
        self._view_stale = False
        self._last_publish = 0.0
        self._visible_revision = 0

    async def start(self) -> None:
        await self._load()
        self._task = asyncio.create_task(self._run(), name=f"rdzv-watch-{self._keys.job}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def changed(self, timeout: float | None, since: int | None = None) -> None:
        """Return when the mirror changes after ``version`` was ``since`` (default: now), or
        after ``timeout`` seconds. Pass ``since`` when awaiting something in between, so a
        change made meanwhile is not missed."""
        if since is not None and since != self.version:
            return
        event = self._changed
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            pass

    async def caught_up(self, revision: int, timeout: float) -> None:
        """Wait until the mirror has seen ``revision`` (a write of ours), at most ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._visible_revision < revision and loop.time() < deadline:
            await self.changed(deadline - loop.time())

    # -- loading and applying -------------------------------------------------------

    async def _load(self) -> None:
        response = await self._client.get_prefix(self._keys.root.encode())
        self._state, self._members, self._joins, self._store_kv = (None, 0), {}, {}, {}
        self._expected = self._reform = None
        self._controller = False
        self._excluded = {}
        for kv in response:
            self._put(kv.key.decode(), kv.value, kv.mod_revision)
        self._revision = max(self._revision, response.header.revision)
        self._publish_view()
        self._notify()

    async def _run(self) -> None:
        backoff = 0.05
        reload = False
        while True:
            try:
                if reload:
                    await self._load()
                    reload = False
                watch = await etcd.open_watch(self._client, self._keys.root.encode(), start_revision=self._revision + 1)
                backoff = 0.05
                try:
                    async for event in watch:
                        self._apply(event)
                finally:
                    await etcd.close_watch(watch)
            except etcd.RevisionCompactedError:
                reload = True
            except WATCH_ERRORS as exc:
                log.info(
                    "rendezvous watch broken; resuming", job=self._keys.job, revision=self._revision, error=str(exc)
                )
            self.restarts += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    def store_value(self, key: str) -> bytes | None:
        """A key of a round store (``rdzv/rounds/...``), as mirrored."""
        return self._store_kv.get(key)

    def store_keys(self, prefix: str) -> list[str]:
        return [k for k in self._store_kv if k.startswith(prefix)]

    def _apply(self, event: Any) -> None:
        key = event.kv.key.decode()
        self._revision = max(self._revision, event.kv.mod_revision)
        if key.startswith(self._rounds):
            # Round-store traffic: wake waiters, but the rendezvous view is unchanged.
            if event.kind == etcd.EventKind.PUT:
                self._store_kv[key] = event.kv.value
            else:
                self._store_kv.pop(key, None)
        else:
            if event.kind == etcd.EventKind.PUT:
                self._put(key, event.kv.value, event.kv.mod_revision)
            else:
                self._delete(key)
            self._view_stale = True
        self._schedule_publish()

    def _schedule_publish(self) -> None:
        # Publish once per burst of events and at most every PUBLISH_INTERVAL_S: each
        # publish wakes every waiter of this process, which may be many agents (benchmarks).
        if self._publish_pending:
            return
        self._publish_pending = True
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last_publish + PUBLISH_INTERVAL_S - loop.time())
        loop.call_later(delay, self._publish)

    def _put(self, key: str, value: bytes, mod_revision: int) -> None:
        k = self._keys
        try:
            if key == k.rdzv + "state":
                self._state = (RoundState.from_json(value), mod_revision)
            elif key.startswith(k.rdzv + "joins/"):
                join = JoinRecord.from_json(value)
                self._joins[join.node] = join
            elif key.startswith(self._rounds):
                self._store_kv[key] = value
            elif key.startswith(k.members):
                self._members[key[len(k.members) :]] = MemberRecord.from_json(value)
            elif key == k.expected:
                self._expected = ExpectedMembership.from_json(value)
            elif key == k.reform:
                self._reform = ReformRequest.from_json(value)
            elif key == k.controller:
                ControllerPresence.from_json(value)
                self._controller = True
            elif key == k.excluded:
                self._excluded = dict(Exclusions.from_json(value).nodes)
        except RecordError as exc:
            log.warning("ignoring unreadable record", key=key, error=str(exc))

    def _delete(self, key: str) -> None:
        k = self._keys
        if key == k.rdzv + "state":
            self._state = (None, 0)
        elif key.startswith(k.rdzv + "joins/"):
            self._joins.pop(key[len(k.rdzv + "joins/") :], None)
        elif key.startswith(k.members):
            self._members.pop(key[len(k.members) :], None)
        elif key == k.expected:
            self._expected = None
        elif key == k.reform:
            self._reform = None
        elif key == k.controller:
            self._controller = False
        elif key == k.excluded:
            self._excluded = {}

    def _publish(self) -> None:
        self._publish_pending = False
        self._last_publish = asyncio.get_running_loop().time()
        if self._view_stale:
            self._publish_view()
        self._notify()

    def _publish_view(self) -> None:
        self._view_stale = False
        state, state_revision = self._state
        self.view = JobView(
            revision=self._revision,
            state=state,
            state_revision=state_revision,
            members=dict(self._members),
            joins=dict(self._joins),
            expected=self._expected,
            reform=self._reform,
            controller=self._controller,
            excluded=self._excluded,
        )

    def _notify(self) -> None:
        self.version += 1
        self._visible_revision = self._revision
        event, self._changed = self._changed, asyncio.Event()
        event.set()
