"""A live mirror of one job's etcd keys, kept by a reflector that survives etcd restarts.

The handler decides from this mirror (``JobView``), so torchrun's monitor loop can call
``num_nodes_waiting()`` every 0.1 s without a request to etcd. When the watch breaks
(etcd restarted or compacted, network blip) the reflector lists the prefix again and the
mirror is rebuilt from that listing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog

from regroup import etcd
from regroup.keys import JobKey, JobKeys, KeyKind, decode
from regroup.records import (
    ControllerPresence,
    Exclusions,
    ExpectedMembership,
    FinishedJob,
    JoinRecord,
    MemberRecord,
    RecordError,
    ReformRequest,
    RoundState,
)
from regroup.rendezvous.decisions import JobView

log = structlog.get_logger("regroup.rendezvous.watch")

PUBLISH_INTERVAL_S = 0.005
WAKE_COST_S = 0.00003
"""About what one waiter costs when a publish wakes it (it re-plans from the new view)."""


class JobWatch:
    """Mirror of ``/regroup/jobs/<ns>/<job>/`` (members, rdzv state, control keys, round stores)
    and of the job's tombstone beside it (``JobKeys.tombstone``)."""

    def __init__(self, client: Any, keys: JobKeys) -> None:
        self._keys = keys
        self._reflector = etcd.Reflector(client, keys.root, self._on_event, name=f"rdzv-watch-{keys.job}")
        self._tombstone_reflector = etcd.Reflector(
            client, keys.tombstone, self._on_tombstone, prefix=False, name=f"rdzv-tombstone-{keys.job}"
        )
        self._finished: FinishedJob | None = None
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
        self._tasks: list[asyncio.Task[None]] = []
        self._listeners: list[Callable[[JobView], None]] = []
        self.view = JobView()
        """The latest view; replaced (never mutated) on every change, so any thread may read it."""
        self.version = 0
        """Bumped on every change of the mirror."""
        self._publish_pending = False
        self._view_stale = False
        self._last_publish = 0.0
        self._visible_revision = 0
        self._waiters = 0

    @property
    def restarts(self) -> int:
        """How many times the watch had to be re-established."""
        return self._reflector.restarts

    async def start(self) -> None:
        """List the job's tombstone and keys (what etcd raises is raised), then follow them
        in tasks. The tombstone first: once it exists the job's keys are gone for good."""
        await self._tombstone_reflector.list()
        await self._reflector.list()
        self._tasks = [
            asyncio.create_task(self._tombstone_reflector.run(), name=f"rdzv-tombstone-{self._keys.job}"),
            asyncio.create_task(self._reflector.run(), name=f"rdzv-watch-{self._keys.job}"),
        ]

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def changed(self, timeout: float | None, since: int | None = None) -> None:
        """Return when the mirror changes after ``version`` was ``since`` (default: now), or
        after ``timeout`` seconds. Pass ``since`` when awaiting something in between, so a
        change made meanwhile is not missed."""
        if since is not None and since != self.version:
            return
        event = self._changed
        self._waiters += 1
        try:
            async with asyncio.timeout(timeout):
                await event.wait()
        except TimeoutError:
            pass
        finally:
            self._waiters -= 1

    def listen(self, listener: Callable[[JobView], None]) -> Callable[[], None]:
        """Call ``listener`` with each new view, on the loop, as it is published (it must be
        quick and must not raise); returns the call that stops it."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def poke(self) -> None:
        """Wake every waiter now, with the view unchanged, so it re-decides (on the loop):
        for a decision that depends on more than the view (the agent was told to stop). What
        the view shows as caught up stays as it was: a publish may be pending."""
        self.version += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def caught_up(self, revision: int, timeout: float) -> None:
        """Wait until the mirror has seen ``revision`` (a write of ours), at most ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._visible_revision < revision and loop.time() < deadline:
            await self.changed(deadline - loop.time())

    # -- applying ----------------------------------------------------------------

    def _on_event(self, event: etcd.ReflectorEvent) -> None:
        if isinstance(event, etcd.Listed):
            self._state, self._members, self._joins, self._store_kv = (None, 0), {}, {}, {}
            self._expected = self._reform = None
            self._controller = False
            self._excluded = {}
            for item in event.items:
                self._put(item.key, item.value, item.revision)
            self._revision = max(self._revision, event.revision)
            self._publish_view()
            self._notify()
            return
        self._revision = max(self._revision, event.revision)
        if isinstance(event, etcd.Put):
            found = self._put(event.key, event.value, event.revision)
        else:
            found = self._delete(event.key)
        # Round-store traffic wakes waiters, but the rendezvous view is unchanged.
        if found is None or found.kind is not KeyKind.ROUND_STORE:
            self._view_stale = True
        self._schedule_publish()

    def _on_tombstone(self, event: etcd.ReflectorEvent) -> None:
        if isinstance(event, etcd.Listed):
            put = event.items[0] if event.items else None
        else:
            put = event if isinstance(event, etcd.Put) else None
        finished = None
        if put is not None:
            try:
                finished = FinishedJob.from_json(put.value)
            except RecordError as exc:
                log.warning("ignoring unreadable tombstone", key=put.key, error=str(exc))
        if finished is None and self._finished is None:
            return
        self._finished = finished
        self._view_stale = True
        if isinstance(event, etcd.Listed):
            self._publish_view()
            self._notify()
        else:
            self._schedule_publish()

    def store_value(self, key: str) -> bytes | None:
        """A key of a round store (``rdzv/rounds/...``), as mirrored."""
        return self._store_kv.get(key)

    def store_keys(self, prefix: str) -> list[str]:
        return [k for k in self._store_kv if k.startswith(prefix)]

    def _schedule_publish(self) -> None:
        # Publish once per burst of events and at most every PUBLISH_INTERVAL_S: each
        # publish wakes every waiter of this process, which may be many agents (a process
        # hosting a thousand agents, as the benchmark does). The interval grows with them,
        # so waking them takes at most about half of the process' time, however fast
        # etcd's changes come: otherwise each change's wake-ups queue behind the last's.
        if self._publish_pending:
            return
        self._publish_pending = True
        loop = asyncio.get_running_loop()
        interval = max(PUBLISH_INTERVAL_S, 2 * WAKE_COST_S * self._waiters)
        delay = max(0.0, self._last_publish + interval - loop.time())
        loop.call_later(delay, self._publish)

    def _put(self, key: str, value: bytes, mod_revision: int) -> JobKey | None:
        try:
            found = decode(key, value, self._keys.prefix)
        except RecordError as exc:
            log.warning("ignoring unreadable record", key=key, error=str(exc))
            return None
        if found is None:
            return None
        kind, record = found.kind, found.record
        if kind is KeyKind.ROUND_STORE:
            self._store_kv[key] = value
        elif isinstance(record, RoundState):
            self._state = (record, mod_revision)
        elif isinstance(record, JoinRecord):
            self._joins[record.node] = record
        elif isinstance(record, MemberRecord):
            self._members[found.params["node"]] = record
        elif isinstance(record, ExpectedMembership):
            self._expected = record
        elif isinstance(record, ReformRequest):
            self._reform = record
        elif isinstance(record, ControllerPresence):
            self._controller = True
        elif isinstance(record, Exclusions):
            self._excluded = dict(record.nodes)
        return found

    def _delete(self, key: str) -> JobKey | None:
        found = decode(key, None, self._keys.prefix)
        kind = found.kind if found is not None else None
        if kind is KeyKind.ROUND_STORE:
            self._store_kv.pop(key, None)
        elif kind is KeyKind.ROUND_STATE:
            self._state = (None, 0)
        elif kind is KeyKind.JOIN:
            self._joins.pop(found.params["node"], None)
        elif kind is KeyKind.MEMBER:
            self._members.pop(found.params["node"], None)
        elif kind is KeyKind.EXPECTED:
            self._expected = None
        elif kind is KeyKind.REFORM:
            self._reform = None
        elif kind is KeyKind.CONTROLLER:
            self._controller = False
        elif kind is KeyKind.EXCLUDED:
            self._excluded = {}
        return found

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
            finished=self._finished,
        )
        for listener in list(self._listeners):
            listener(self.view)

    def _notify(self) -> None:
        self.version += 1
        self._visible_revision = self._revision
        event, self._changed = self._changed, asyncio.Event()
        event.set()
