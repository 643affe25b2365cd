"""A work queue of job keys: deduplicated, one worker per key, delayed re-adds.

Keys, never events (STYLE 1): adding a key already waiting does nothing, and a key added
while it is being processed is processed once more afterwards.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    """FIFO of distinct keys; ``get`` hands a key to one worker until ``done``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        """Stamps when keys are added (signal-to-decision latency is measured on it)."""
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._waiting: dict[K, float] = {}
        """Key -> when it was first added since it was last handed out."""
        self._active: set[K] = set()
        self._again: dict[K, float] = {}
        self._timers: dict[K, asyncio.TimerHandle] = {}

    def add(self, key: K) -> None:
        now = self.clock()
        if key in self._active:
            self._again.setdefault(key, now)
            return
        if key in self._waiting:
            return
        self._waiting[key] = now
        self._queue.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        """Add ``key`` after ``delay`` seconds (an earlier pending add wins)."""
        loop = asyncio.get_running_loop()
        due = loop.time() + max(0.0, delay)
        timer = self._timers.get(key)
        if timer is not None:
            if timer.when() <= due:
                return
            timer.cancel()
        self._timers[key] = loop.call_at(due, self._fire, key)

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    async def get(self) -> tuple[K, float]:
        """The next key and when it was first added (for signal-to-decision latency)."""
        key = await self._queue.get()
        added = self._waiting.pop(key)
        self._active.add(key)
        return key, added

    def done(self, key: K) -> None:
        self._active.discard(key)
        if key in self._again:
            self._again.pop(key)
            self.add(key)

    def __len__(self) -> int:
        return len(self._waiting)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
