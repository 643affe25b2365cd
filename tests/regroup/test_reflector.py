"""The reflector against a real etcd: listing, changes in order, relists, cancellation."""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request
from datetime import timedelta
from typing import Any

import pytest

from regroup.etcd import (
    Backoff,
    Listed,
    Put,
    Reflector,
    ReflectorEvent,
    ReflectorState,
    RevisionCompactedError,
)
from tests.changes import WAIT, Changes
from tests.etcd_helpers import put_retrying

class Mirror(Changes):
    """What a reflector's user keeps: the keys as its events say they are."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[ReflectorEvent] = []
        self.keys: dict[str, bytes] = {}
        self.lost: list[BaseException | None] = []

    def __call__(self, event: ReflectorEvent) -> None:
        self.events.append(event)
        if isinstance(event, Listed):
            self.keys = {item.key: item.value for item in event.items}
        elif isinstance(event, Put):
            self.keys[event.key] = event.value
        else:
            self.keys.pop(event.key, None)
        self.changed()


def fast_backoff() -> Backoff:
    return Backoff(timedelta(milliseconds=20), timedelta(milliseconds=200), rng=random.Random(7))


def reflector(client: Any, mirror: Mirror, key: str = "/jobs/", **kwargs: Any) -> Reflector:
    return Reflector(client, key, mirror, backoff=fast_backoff(), on_lost=mirror.lost.append, **kwargs)




def server_watchers(url: str) -> int:
    """Watchers open on the etcd server, from its own metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(r"^etcd_debugging_mvcc_watcher_total (\S+)$", text, re.MULTILINE)
    assert match, "etcd no longer exports etcd_debugging_mvcc_watcher_total"
    return int(float(match.group(1)))


async def until_watchers(url: str, count: int) -> None:
    async with asyncio.timeout(WAIT):
        while (await asyncio.to_thread(server_watchers, url)) != count:
            await asyncio.sleep(0.05)  # polling the server's gauge: nothing to await on


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_lists_then_hands_over_puts_and_deletes_in_order(etcd_client) -> None:
    await etcd_client.put(b"/jobs/a", b"1")
    await etcd_client.put(b"/jobs/b", b"2")
    await etcd_client.put(b"/other", b"not under the prefix")
    mirror = Mirror()
    reflecting = reflector(etcd_client, mirror)
    assert reflecting.state is ReflectorState.LISTING
    task = asyncio.create_task(reflecting.run())
    try:
        async with asyncio.timeout(WAIT):
            await reflecting.synced()
        listed = mirror.events[0]
        assert isinstance(listed, Listed)
        assert [(i.key, i.value) for i in listed.items] == [("/jobs/a", b"1"), ("/jobs/b", b"2")]
        assert reflecting.state is ReflectorState.SYNCED and reflecting.revision == listed.revision

        await etcd_client.put(b"/jobs/c", b"3")
        await etcd_client.delete(b"/jobs/a")
        await etcd_client.put(b"/jobs/b", b"2'")
        await etcd_client.put(b"/other", b"still not")
        await etcd_client.delete(b"/jobs/c")
        await mirror.until(lambda: len(mirror.events) == 5)
        changes = mirror.events[1:]
        assert [type(e).__name__ for e in changes] == ["Put", "Deleted", "Put", "Deleted"]
        assert [e.key for e in changes] == ["/jobs/c", "/jobs/a", "/jobs/b", "/jobs/c"]
        revisions = [e.revision for e in changes]
        assert revisions == sorted(revisions) and revisions[0] > listed.revision
        assert mirror.keys == {"/jobs/b": b"2'"}
        assert reflecting.revision == revisions[-1] and not mirror.lost
    finally:
        await stop(task)


async def test_one_key_without_prefix_sees_only_that_key(etcd_client) -> None:
    await etcd_client.put(b"/jobs/request", b"1")
    await etcd_client.put(b"/jobs/requests", b"a sibling with the same start")
    mirror = Mirror()
    reflecting = reflector(etcd_client, mirror, "/jobs/request", prefix=False)
    await reflecting.list()
    assert mirror.keys == {"/jobs/request": b"1"}
    task = asyncio.create_task(reflecting.run())
    try:
        await etcd_client.put(b"/jobs/requests", b"ignored")
        await etcd_client.put(b"/jobs/request", b"2")
        await mirror.until(lambda: mirror.keys.get("/jobs/request") == b"2")
        assert [e.key for e in mirror.events[1:]] == ["/jobs/request"]
    finally:
        await stop(task)


async def test_a_watch_compacted_away_is_replaced_by_a_fresh_listing(etcd_client) -> None:
    await etcd_client.put(b"/jobs/kept", b"1")
    await etcd_client.put(b"/jobs/gone", b"1")
    mirror = Mirror()
    reflecting = reflector(etcd_client, mirror)
    await reflecting.list()
    listed_at = reflecting.revision
    # Changes nobody watched yet, then history compacted past the revision the watch resumes from.
    await etcd_client.delete(b"/jobs/gone")
    await etcd_client.put(b"/jobs/new", b"2")
    head = await etcd_client.put(b"/jobs/kept", b"3")
    await etcd_client.compact(head.header.revision)
    task = asyncio.create_task(reflecting.run())
    try:
        await mirror.until(lambda: reflecting.state is ReflectorState.SYNCED and reflecting.restarts == 1)
        assert [type(e) for e in mirror.lost] == [RevisionCompactedError]
        relisted = mirror.events[-1]
        assert isinstance(relisted, Listed) and relisted.revision >= head.header.revision > listed_at
        assert mirror.keys == {"/jobs/kept": b"3", "/jobs/new": b"2"}
        # Watching again from past the new listing.
        await etcd_client.put(b"/jobs/after", b"4")
        await mirror.until(lambda: "/jobs/after" in mirror.keys)
    finally:
        await stop(task)


async def test_an_etcd_restart_is_ridden_out_with_nothing_missed(etcd, etcd_client) -> None:
    await etcd_client.put(b"/jobs/a", b"1")
    await etcd_client.put(b"/jobs/b", b"1")
    mirror = Mirror()
    reflecting = reflector(etcd_client, mirror)
    task = asyncio.create_task(reflecting.run())
    try:
        async with asyncio.timeout(WAIT):
            await reflecting.synced()
        await asyncio.to_thread(etcd.restart)
        # Written while the reflector may still be down or relisting: it must end up with them.
        await put_retrying(etcd_client, "/jobs/c", b"2")
        await etcd_client.delete(b"/jobs/a")
        await mirror.until(lambda: mirror.keys == {"/jobs/b": b"1", "/jobs/c": b"2"})
        assert reflecting.restarts >= 1 and mirror.lost
        await mirror.until(lambda: reflecting.state is ReflectorState.SYNCED)
        await etcd_client.put(b"/jobs/d", b"3")
        await mirror.until(lambda: "/jobs/d" in mirror.keys)
    finally:
        await stop(task)


async def test_cancelling_closes_the_watch_on_the_server(etcd, etcd_client) -> None:
    mirror = Mirror()
    reflecting = reflector(etcd_client, mirror)
    before = server_watchers(etcd.url)
    task = asyncio.create_task(reflecting.run())
    await until_watchers(etcd.url, before + 1)
    # A change delivered through it: the watch is open on this side too, not only on the
    # server (a watch cancelled while aetcd still creates it is another case).
    await etcd_client.put(b"/jobs/live", b"1")
    await mirror.until(lambda: mirror.keys.get("/jobs/live") == b"1")
    await stop(task)
    await until_watchers(etcd.url, before)


async def test_what_the_handler_raises_ends_the_reflector_instead_of_a_relist(etcd_client) -> None:
    def refuse(event: ReflectorEvent) -> None:
        if isinstance(event, Put):
            raise OSError("a disk full while recording")

    reflecting = Reflector(etcd_client, "/jobs/", refuse, backoff=fast_backoff())
    task = asyncio.create_task(reflecting.run())
    async with asyncio.timeout(WAIT):
        await reflecting.synced()
    await etcd_client.put(b"/jobs/a", b"1")
    with pytest.raises(OSError, match="disk full"):
        async with asyncio.timeout(WAIT):
            await task
    assert reflecting.restarts == 0


def test_backoff_doubles_to_its_cap_with_jitter_below_each_step() -> None:
    backoff = Backoff(timedelta(seconds=1), timedelta(seconds=4), jitter=0.5, rng=random.Random(3))
    delays = [backoff.delay() for _ in range(5)]
    for delay, step in zip(delays, [1, 2, 4, 4, 4], strict=True):
        assert step * 0.5 <= delay <= step
    assert len(set(delays)) == 5, "jitter spreads the delays"
    backoff.reset()
    assert backoff.delay() <= 1
    with pytest.raises(ValueError, match="jitter"):
        Backoff(jitter=1.0)
