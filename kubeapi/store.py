"""Object storage with one global, increasing resourceVersion, a change history and watchers.

Plays the part of etcd plus the API server's watch cache: every write gets the next
revision, the history lets a watch resume from a revision, and compaction (or the
history window filling up) makes older revisions answer 410 Gone.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubeapi.errors import expired
from kubeapi.resources import Resource
from kubeapi.selectors import FieldSelector, LabelSelector

Key = tuple[str, str]
"""(namespace, name); namespace is "" for cluster-scoped objects."""


def key_of(obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return meta.get("namespace", ""), meta["name"]


@dataclass(frozen=True)
class Change:
    """One committed write. For DELETED, `obj` is the last state stamped with the delete's revision."""

    rv: int
    storage: str
    type: str
    obj: dict[str, Any]
    prev: dict[str, Any] | None


@dataclass(frozen=True)
class Filter:
    """What a list or watch selects: a namespace (or all), labels and fields."""

    resource: Resource
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector

    def accepts(self, stored: dict[str, Any]) -> bool:
        """Whether a stored object passes the namespace, label and field filters."""
        meta = stored["metadata"]
        if self.namespace is not None and meta.get("namespace", "") != self.namespace:
            return False
        if not self.labels.matches(meta.get("labels")):
            return False
        return not self.fields.terms or self.fields.matches(self.resource.wire(stored))

    def view(self, change: Change) -> tuple[str, dict[str, Any]] | None:
        """The event a watch with this filter sees, following the watch cache: an object
        entering the filter is ADDED, leaving it is DELETED (previous state, new revision)."""
        if change.storage != self.resource.storage:
            return None
        now_in = change.type != "DELETED" and self.accepts(change.obj)
        was_in = change.prev is not None and self.accepts(change.prev)
        if now_in:
            return ("MODIFIED" if was_in else "ADDED"), change.obj
        if was_in:
            assert change.prev is not None
            return "DELETED", _at_revision(change.prev, change.rv)
        return None


@dataclass(eq=False)
class Watcher:
    """An open watch: its filter and the queue of events not yet written to the client."""

    filter: Filter
    queue: asyncio.Queue[tuple[str, dict[str, Any]] | str] = field(default_factory=asyncio.Queue)

    def close(self, how: str) -> None:
        """Ends the stream: "drop" cuts the connection, "end" finishes it cleanly."""
        self.queue.put_nowait(how)


def _at_revision(obj: dict[str, Any], rv: int) -> dict[str, Any]:
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(rv)}}


class Store:
    """Objects by storage and key, the revision counter, the retained history and the watchers."""

    def __init__(self, *, history_limit: int, on_change: Callable[[], None]) -> None:
        if history_limit < 1:
            raise ValueError(f"history_limit: must be at least 1, got {history_limit}")
        self._objects: dict[str, dict[Key, dict[str, Any]]] = {}
        self._history: deque[Change] = deque()
        self._history_limit = history_limit
        self._on_change = on_change
        self.revision = 1
        self.compacted = 0
        """Watches and exact reads from a revision below this answer 410 Gone."""
        self.watchers: set[Watcher] = set()

    def get(self, storage: str, key: Key) -> dict[str, Any] | None:
        return self._objects.get(storage, {}).get(key)

    def items(self, storage: str) -> dict[Key, dict[str, Any]]:
        return self._objects.setdefault(storage, {})

    def state_at(self, storage: str, rv: int) -> dict[Key, dict[str, Any]]:
        """The objects as they were at revision `rv`, rebuilt by undoing newer changes."""
        if rv < self.compacted:
            raise expired(f"too old resource version: {rv} ({self.compacted})")
        state = dict(self.items(storage))
        for change in reversed(self._history):
            if change.rv <= rv:
                break
            if change.storage != storage:
                continue
            key = key_of(change.obj)
            if change.prev is None:
                state.pop(key, None)
            else:
                state[key] = change.prev
        return state

    def changes_since(self, rv: int) -> Iterator[Change]:
        """Retained changes newer than `rv`; 410 if some of them were forgotten."""
        if rv < self.compacted:
            raise expired(f"too old resource version: {rv} ({self.compacted})")
        return (c for c in list(self._history) if c.rv > rv)

    def put(self, storage: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Writes a new or changed object at the next revision and returns it as stored.

        The store takes `obj` over: neither it nor what it returns may be changed in place
        afterwards (subtrees may be shared with other stored objects)."""
        self.revision += 1
        stored = _at_revision(obj, self.revision)
        key = key_of(stored)
        prev = self.items(storage).get(key)
        self.items(storage)[key] = stored
        self._commit(Change(self.revision, storage, "MODIFIED" if prev else "ADDED", stored, prev))
        return stored

    def remove(self, storage: str, key: Key) -> dict[str, Any]:
        """Deletes at the next revision; returns the last state stamped with that revision."""
        prev = self.items(storage).pop(key)
        self.revision += 1
        gone = _at_revision(prev, self.revision)
        self._commit(Change(self.revision, storage, "DELETED", gone, prev))
        return gone

    def compact(self) -> None:
        """Forgets all history: any revision older than the current one is now too old."""
        self._history.clear()
        self.compacted = self.revision

    def _commit(self, change: Change) -> None:
        self._history.append(change)
        while len(self._history) > self._history_limit:
            self.compacted = self._history.popleft().rv
        for watcher in self.watchers:
            if event := watcher.filter.view(change):
                watcher.queue.put_nowait(event)
        self._on_change()
