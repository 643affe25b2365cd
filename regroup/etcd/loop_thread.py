"""``LoopThread``: an asyncio loop in a daemon thread, for synchronous callers (the
torchrun rendezvous handler, the training loop); ``loop_threads`` lists the open ones and
what went wrong on them (the test suite fails a test that leaks either)."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import threading
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import structlog

log = structlog.get_logger("regroup.etcd")

T = TypeVar("T")


@dataclass(frozen=True)
class LoopProblem:
    """Something that went wrong on a ``LoopThread``'s loop that no caller was told about:
    a task that crashed or did not stop, an exception in a callback."""

    serial: int
    """Order of recording, process-wide (see ``LoopThreads.mark``)."""
    loop: str
    """The loop thread's name and serial, e.g. ``rdzv-job#3``."""
    text: str

    def __str__(self) -> str:
        return f"{self.loop}: {self.text}"


@dataclass(frozen=True)
class LoopMark:
    """A point in time of ``loop_threads``: the serials the next loop and problem will get."""

    loop: int
    problem: int


class LoopThreads:
    """Every ``LoopThread`` of this process that is still open, and the problems they recorded.

    The open ones are held strongly until ``close()``: a dropped ``LoopThread`` keeps its
    thread and loop running, and it is exactly such a leak that must stay findable. Problems
    are kept in a bounded window (the newest ``PROBLEMS_KEPT``); each is logged when recorded.
    """

    PROBLEMS_KEPT = 1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop_serials = itertools.count(1)
        self._problem_serials = itertools.count(1)
        self._next_loop = 1
        self._next_problem = 1
        self._open: dict[int, LoopThread] = {}
        self._problems: collections.deque[LoopProblem] = collections.deque(maxlen=self.PROBLEMS_KEPT)

    def mark(self) -> LoopMark:
        with self._lock:
            return LoopMark(self._next_loop, self._next_problem)

    def open(self, since: LoopMark | None = None) -> list[LoopThread]:
        """The loop threads not closed yet (created at or after ``since``, if given)."""
        first = since.loop if since is not None else 0
        with self._lock:
            return [t for serial, t in sorted(self._open.items()) if serial >= first]

    def problems(self, since: LoopMark | None = None) -> list[LoopProblem]:
        """The problems recorded (at or after ``since``, if given), oldest first."""
        first = since.problem if since is not None else 0
        with self._lock:
            return [p for p in self._problems if p.serial >= first]

    def _opened(self, thread: LoopThread) -> int:
        with self._lock:
            serial = next(self._loop_serials)
            self._next_loop = serial + 1
            self._open[serial] = thread
            return serial

    def _closed(self, thread: LoopThread) -> None:
        with self._lock:
            self._open.pop(thread.serial, None)

    def _record(self, thread: LoopThread, text: str) -> LoopProblem:
        with self._lock:
            serial = next(self._problem_serials)
            self._next_problem = serial + 1
            problem = LoopProblem(serial, f"{thread.name}#{thread.serial}", text)
            self._problems.append(problem)
        return problem


loop_threads = LoopThreads()
"""The process's registry of loop threads (read by the test suite's leak check)."""


def _describe_task(task: asyncio.Future[Any]) -> str:
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        where = getattr(coro, "__qualname__", None) or repr(coro)
        return f"task {task.get_name()!r} ({where})"
    return repr(task)


class LoopThread:
    """An asyncio loop in a daemon thread, for synchronous code that needs etcd.

    Nothing that goes wrong on the loop is dropped silently: an error the loop reports (a
    task's exception nobody retrieved, an exception in a callback), a ``spawn``/``supervise``
    task that crashed, and at ``close()`` a task that crashed while being cancelled or did
    not finish cancelling, are logged and recorded in ``problems`` (and in ``loop_threads``).
    """

    def __init__(self, name: str = "regroup-etcd") -> None:
        self.name = name
        self._problems: list[str] = []
        self._stuck: set[int] = set()
        """``id()`` of the tasks recorded as not finishing their cancellation, so that being
        destroyed pending is not recorded again (a weak reference is dead by then)."""
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._on_loop_error)
        self.serial = loop_threads._opened(self)
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<LoopThread {self.name}#{self.serial} {state}>"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def problems(self) -> tuple[str, ...]:
        """What went wrong on this loop that no caller was told about, oldest first."""
        return tuple(self._problems)

    def run(self, coro: Coroutine[Any, Any, T], timeout: timedelta | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout``)."""
        future = self.submit(coro)
        try:
            return future.result(None if timeout is None else timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"etcd call did not finish within {timeout}") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting; the caller owns the result (use
        ``spawn`` when nobody will look at it). ``RuntimeError`` once closed."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self!r}: closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start ``coro`` on the loop with nobody waiting for it: if it ends with an exception
        (other than being cancelled), that is logged and recorded in ``problems``."""
        name = getattr(coro, "__qualname__", repr(coro))
        self.submit(coro).add_done_callback(lambda future: self._check_ended(future, f"spawned {name!r}"))

    def supervise(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        """For a background task on this loop that nobody awaits for a result (a watch, a
        keep-alive): if it ends with an exception other than cancellation, that is logged and
        recorded in ``problems`` at once, not found (or not) at shutdown. Returns ``task``."""
        task.add_done_callback(lambda done: self._check_ended(done, _describe_task(done)))
        return task

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Cancel every task still on the loop, stop the loop and close it. Idempotent.

        A task that ends its cancellation with an exception (not ``CancelledError``) or is
        still running ``timeout`` after being cancelled, a loop that does not answer within
        ``timeout``, a thread that does not stop: each is logged and recorded in ``problems``;
        the loop is then left to its (daemon) thread rather than closed under a running task.
        """
        if self._closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{self!r}: close() called from its own loop")
        self._closed = True
        seconds = timeout.total_seconds()

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=seconds)
                for task in tasks:
                    if task in pending:
                        self._stuck.add(id(task))
                        self._record(f"{_describe_task(task)} still running {seconds:g}s after being cancelled")
                    elif not task.cancelled() and task.exception() is not None:
                        self._record(f"{_describe_task(task)} ended with {task.exception()!r} when cancelled")
            await self._loop.shutdown_asyncgens()

        try:
            # The outer limit only matters when the loop itself is blocked (cancel_all has its own).
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(seconds + 5)
        except concurrent.futures.TimeoutError:
            self._record(f"the loop did not answer close() within {seconds + 5:g}s (blocked by synchronous code?)")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(seconds)
        loop_threads._closed(self)
        if self._thread.is_alive():
            self._record(f"thread still running {seconds:g}s after the loop was asked to stop")
            return
        self._loop.close()

    # -- problems ------------------------------------------------------------------------

    def _record(self, text: str) -> None:
        self._problems.append(text)
        problem = loop_threads._record(self, text)
        log.error("loop thread problem", loop=problem.loop, problem=text)

    def _check_ended(self, future: asyncio.Future[Any] | concurrent.futures.Future[Any], what: str) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self._record(f"{what} crashed: {exc!r}")

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if _late_grpc_completion(context):
            log.info("a gRPC completion reached an event loop already closed", loop=f"{self.name}#{self.serial}")
            return
        loop.default_exception_handler(context)  # logs it, with the traceback
        if id(context.get("task")) in self._stuck:
            self._stuck.discard(id(context["task"]))
            return  # "destroyed but pending": already recorded at close()
        parts = [str(context.get("message") or "unhandled error")]
        for key in ("task", "future", "handle"):
            if context.get(key) is not None:
                parts.append(_describe_task(context[key]) if key != "handle" else repr(context[key]))
                break
        if context.get("exception") is not None:
            parts.append(repr(context["exception"]))
        self._record(": ".join(parts))


def _late_grpc_completion(context: dict[str, Any]) -> bool:
    """gRPC's aio poller (one per process, run by the loop that first used gRPC) hands each
    completion of a call made on another loop to that loop with ``call_soon_threadsafe``.
    A completion that arrives after its own loop was closed (a call finishing its
    cancellation as a ``LoopThread`` closed) raises "Event loop is closed" here, on the
    poller's loop. The closed loop's call is gone with it, and nothing is lost on this loop:
    every queued completion has its own wake-up, so the next ones are handled on the next.
    """
    exc = context.get("exception")
    return (
        isinstance(exc, RuntimeError)
        and str(exc) == "Event loop is closed"
        and "PollerCompletionQueue._handle_events" in repr(context.get("handle"))
    )

