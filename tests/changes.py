"""``Changes``: state another task changes, and a test that awaits a condition on it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

WAIT = 60.0
"""Upper bound for a condition awaited here; a loaded machine passes well within it."""


class Changes:
    """Call ``changed()`` after each change; ``until(predicate)`` returns once it holds,
    checking it again after each change, never on a timer."""

    def __init__(self) -> None:
        self._changed = asyncio.Event()

    def changed(self) -> None:
        self._changed.set()

    async def until(self, predicate: Callable[[], Any], timeout: float = WAIT) -> None:
        async with asyncio.timeout(timeout):
            while not predicate():
                self._changed.clear()
                await self._changed.wait()
