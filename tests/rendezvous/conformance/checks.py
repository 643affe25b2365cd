"""What the scenarios assert over time: that a condition holds for a while, that a call raises."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.rendezvous.conformance.scenario_run import Run


def holds_for(predicate: Callable[[], Any], seconds: float, interval: float = 0.05) -> bool:
    """Whether ``predicate`` stays truthy for ``seconds`` (checked every ``interval``):
    the event it guards against is awaited with that deadline."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(interval)
    return bool(predicate())


def raises(run: Run, fn: Any, timeout: float, what: str) -> BaseException:
    """The exception ``fn()`` raised; fails if it returned."""
    try:
        value = run.call(fn, timeout, what)
    except AssertionError:
        raise
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError(f"{what} returned {value!r} instead of raising")
