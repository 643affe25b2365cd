"""GET ...?watch=true: a chunked stream of JSON event lines, as the API server writes it."""

from __future__ import annotations

import asyncio
import json
import traceback
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

from aiohttp import web

from kubeapi.errors import ApiError
from kubeapi.params import parse_bool, parse_int
from kubeapi.resources import Resource
from kubeapi.store import Filter, Store, Watcher

LINES_PER_WRITE = 256
"""Watch events already queued go out together, up to this many per chunk."""


async def serve_watch(
    request: web.Request,
    store: Store,
    selected: Filter,
    query: dict[str, str],
    *,
    bookmark_interval: timedelta,
    await_revision: Callable[[int], Awaitable[None]],
    notify: Callable[[], None],
    internal_errors: list[str],
) -> web.StreamResponse:
    """Streams the watch until it times out, is closed through its Watcher, or the client goes.

    Errors in the parameters raise ApiError before anything is sent; a version older than
    the history is an ERROR event in a 200 stream, as the real server reports it."""
    resource = selected.resource
    bookmarks = parse_bool(query.get("allowWatchBookmarks"), "allowWatchBookmarks")
    initial_events = parse_bool(query.get("sendInitialEvents"), "sendInitialEvents")
    timeout = parse_int(query["timeoutSeconds"], "timeoutSeconds") if query.get("timeoutSeconds") else None
    match = query.get("resourceVersionMatch")
    if initial_events and (not bookmarks or match != "NotOlderThan"):
        raise ApiError(
            422,
            "sendInitialEvents: requires allowWatchBookmarks=true and resourceVersionMatch=NotOlderThan",
            reason="Invalid",
        )
    if match and not initial_events:
        raise ApiError(
            422, "resourceVersionMatch: forbidden for watch unless sendInitialEvents is set", reason="Invalid"
        )
    rv_text = query.get("resourceVersion") or ""
    backlog: list[tuple[str, dict[str, Any]]] = []
    gone: ApiError | None = None
    if rv_text in ("", "0") or initial_events:
        # No version (or "any"): the current state as synthetic ADDED events, then changes.
        backlog = [("ADDED", o) for _, o in sorted(store.items(resource.storage).items()) if selected.accepts(o)]
        if initial_events:
            backlog.append(("BOOKMARK", bookmark(resource, store.revision, initial_events_end=True)))
    else:
        await await_revision(parse_int(rv_text, "resourceVersion"))
        try:
            backlog = [event for change in store.changes_since(int(rv_text)) if (event := selected.view(change))]
        except ApiError as e:
            gone = e
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    if gone is not None:
        try:
            await response.prepare(request)
            await response.write(line("ERROR", gone.status()))
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client went away
        return response
    watcher = Watcher(selected)
    # Registered before the first await, so no change between snapshot and stream is missed.
    store.watchers.add(watcher)
    notify()
    try:
        await response.prepare(request)
        lines = [line(kind, obj if kind == "BOOKMARK" else resource.wire(obj)) for kind, obj in backlog]
        for first in range(0, len(lines), LINES_PER_WRITE):
            await response.write(b"".join(lines[first : first + LINES_PER_WRITE]))
        ending = await _stream(response, store, watcher, bookmark_interval if bookmarks else None, timeout)
    except ConnectionResetError:
        return response  # the client went away
    except Exception:
        # Headers are sent, so no error status can follow: record the bug and cut the stream.
        internal_errors.append(f"watch {request.path}: {traceback.format_exc()}")
        ending = "drop"
    finally:
        store.watchers.discard(watcher)
        notify()
    if ending == "drop" and request.transport is not None:
        request.transport.abort()
    elif ending == "end":
        try:
            await response.write_eof()
        except ConnectionResetError:
            pass
    return response


async def _stream(
    response: web.StreamResponse, store: Store, watcher: Watcher, bookmarks: timedelta | None, timeout: int | None
) -> str:
    """Writes queued events until the watch times out ("end") or is closed ("drop"/"end")."""
    loop = asyncio.get_running_loop()
    resource = watcher.filter.resource
    deadline = loop.time() + timeout if timeout else None
    interval = bookmarks.total_seconds() if bookmarks else None
    next_bookmark = loop.time() + interval if interval else None
    while True:
        waits = [t - loop.time() for t in (deadline, next_bookmark) if t is not None]
        try:
            async with asyncio.timeout(max(0.0, min(waits)) if waits else None):
                item = await watcher.queue.get()
        except TimeoutError:
            now = loop.time()
            if deadline is not None and now >= deadline:
                return "end"
            if interval and next_bookmark is not None and now >= next_bookmark:
                # The queue is empty, so every change up to the current revision was sent.
                await response.write(line("BOOKMARK", bookmark(resource, store.revision)))
                next_bookmark = now + interval
            continue
        # Whatever else is already queued goes out in the same chunk, as a storm would.
        lines: list[bytes] = []
        while True:
            if isinstance(item, str):
                if lines:
                    await response.write(b"".join(lines))
                return item
            kind, obj = item
            lines.append(line(kind, resource.wire(obj)))
            if watcher.queue.empty() or len(lines) >= LINES_PER_WRITE:
                break
            item = watcher.queue.get_nowait()
        await response.write(b"".join(lines))


def bookmark(resource: Resource, revision: int, *, initial_events_end: bool = False) -> dict[str, Any]:
    """A BOOKMARK object: the resource's kind with only metadata.resourceVersion."""
    metadata: dict[str, Any] = {"resourceVersion": str(revision)}
    if initial_events_end:
        metadata["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"kind": resource.kind, "apiVersion": resource.api_version, "metadata": metadata}


def line(kind: str, obj: dict[str, Any]) -> bytes:
    return json.dumps({"type": kind, "object": obj}).encode() + b"\n"
