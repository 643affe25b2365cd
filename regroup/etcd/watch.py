"""Watches, opened and closed so a cancellation is never lost.

Only the reflector (``regroup.etcd.reflector``) opens watches; a test fails on any other
caller of ``open_watch`` or of aetcd's own ``watch``/``watch_prefix``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta

import aetcd
import structlog

from regroup.etcd.client import TRANSIENT_ERRORS, PermissionDenied, describe_keys

log = structlog.get_logger("regroup.etcd")

EventKind = aetcd.rtypes.EventKind
Watch = aetcd.rtypes.Watch

REFUSED = -1
"""The watch id etcd answers a refused watch creation with (``clientv3.InvalidWatchID``)."""


async def open_watch(client: aetcd.Client, key: bytes, *, start_revision: int, prefix: bool = True) -> Watch:
    """A watch on ``key`` (with ``prefix``, on every key under it) from ``start_revision``.

    aetcd creates a watch under ``asyncio.wait_for``, which on Python 3.11 drops a
    cancellation that lands in the loop turn the watch is created in (CPython gh-86296):
    the caller would then wait on its new watch, cancelled but never told, and whatever
    awaits its end (a ``TaskGroup``, a shutdown) would hang. The cancellation is honoured
    here: the watch is closed and ``CancelledError`` raised.

    A watch etcd refuses (the client's identity may not read the range) is answered as
    created and cancelled at once, with watch id -1, which aetcd hands back as a watch that
    never delivers anything: ``PermissionDenied`` is raised instead.
    """
    opener = client.watch_prefix if prefix else client.watch
    watch = await opener(key, start_revision=start_revision)
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        await close_watch(watch)
        raise asyncio.CancelledError(f"cancelled while the watch on {key.decode(errors='replace')} was created")
    if watch.watch_id == REFUSED:
        await close_watch(watch)
        what = describe_keys([key]) + (" (prefix)" if prefix else "")
        denied = PermissionDenied(
            "etcd cancelled the watch as it created it", operation="watch", key=what,
            identity=getattr(client, "identity", "anonymous"),
        )  # fmt: skip
        report = getattr(client, "report", None)
        if report is not None:
            report(denied)
        raise denied
    return watch



async def close_watch(watch: Watch, timeout: timedelta = timedelta(seconds=1)) -> bool:
    """Cancel ``watch`` on the server, waiting at most ``timeout``; False when it could not
    be (etcd gone, the stream already broken): the stream's end drops it all the same."""
    try:
        async with asyncio.timeout(timeout.total_seconds()):
            await watch.cancel()
        return True
    except TRANSIENT_ERRORS as exc:
        log.debug("watch not cancelled on the server", error=str(exc))
        return False
