"""Shared fixtures: a real etcd on a free loopback port, and the no-leaked-task checks."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from regroup.etcd import EtcdSettings, LoopThread, connect, loop_threads
from regroup.demo.etcd_server import EtcdServer

REPO = Path(__file__).resolve().parent.parent

pytest_plugins = ["tests.kubeapi.fixtures"]


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh etcd v3 server (data in a temp dir), stopped after the test."""
    server = EtcdServer(data_dir=tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def etcd_settings(etcd: EtcdServer) -> EtcdSettings:
    return EtcdSettings.from_endpoint_string(etcd.endpoint)


@pytest.fixture
async def etcd_client(etcd_settings: EtcdSettings) -> AsyncIterator[object]:
    client = await connect(etcd_settings)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
def worker_env() -> dict[str, str]:
    """Environment for child processes (torchrun, trainers): the repo importable, output unbuffered."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture
def python() -> str:
    return sys.executable


@pytest.fixture(autouse=True)
async def _no_leaked_tasks() -> AsyncIterator[None]:
    """Every async test must leave no task of its own running (STYLE: no orphan tasks)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        yield
        return
    before = set(asyncio.all_tasks())
    yield
    leaked = [t for t in asyncio.all_tasks() - before if not t.done() and t is not asyncio.current_task()]
    # gRPC's aio channel (under aetcd) finishes a closed call's status in a task of its own,
    # a few loop turns later; that task is the library's, not the test's.
    for _ in range(10):
        if not leaked:
            break
        await asyncio.sleep(0)
        leaked = [t for t in leaked if not t.done()]
    # The task's repr names its coroutine by qualified name; a Cython coroutine's own repr does not.
    leaked = [t for t in leaked if "_AioCall." not in repr(t)]
    assert not leaked, f"test leaked tasks: {leaked}"


class _LoopThreadCheck:
    """Where the loop-thread checks have looked up to, so each problem is reported once."""

    checked = loop_threads.mark()

    @classmethod
    def unchecked(cls) -> list[str]:
        """Problems recorded since the last look, as text; moves the mark on."""
        problems = loop_threads.problems(since=cls.checked)
        cls.checked = loop_threads.mark()
        return [str(p) for p in problems]

    @staticmethod
    def close(threads: list[LoopThread]) -> list[str]:
        """Close what was left open, so the next test is not blamed for (or slowed by) it;
        their names, as they were (open)."""
        names = [repr(thread) for thread in threads]
        for thread in threads:
            thread.close()
        return names


@pytest.fixture(autouse=True)
def _no_leaked_loop_threads() -> Iterator[None]:
    """Every test must close the ``LoopThread``s it opened, and nothing may go wrong on a
    loop thread unnoticed (``regroup.etcd.loop_threads``): a task that crashed with no caller
    told, a task that did not finish cancelling at ``close()``, an exception in a callback.
    Those loops run in threads of their own, out of ``_no_leaked_tasks``' sight.

    Loop threads that legitimately outlive a test (opened by a module- or session-scoped
    fixture) are not the test's: only the loop threads created during the test (by its
    function-scoped fixtures too: autouse, this fixture is set up before them and torn down
    after them) must be closed by its end. A leaked one is closed here once reported. A
    problem recorded during the test fails it, whatever loop it happened on. One recorded
    between tests (e.g. in a module-scoped fixture's teardown) fails the next test's setup,
    and one after the last test fails ``_no_loop_thread_left_at_exit``.
    """
    between = _LoopThreadCheck.unchecked()
    assert not between, f"problems on loop threads before this test, outside any test: {between}"
    mark = loop_threads.mark()
    yield
    leaked = _LoopThreadCheck.close(loop_threads.open(since=mark))
    problems = _LoopThreadCheck.unchecked()
    assert not leaked and not problems, f"loop threads left open: {leaked}; problems on loop threads: {problems}"


@pytest.fixture(autouse=True, scope="session")
def _no_loop_thread_left_at_exit() -> Iterator[None]:
    """At the end of the session no loop thread may be open (a module- or session-scoped
    fixture's included), and none may have recorded a problem since the last test's check.
    Reported as an error in the teardown of the session's last test."""
    yield
    leaked = _LoopThreadCheck.close(loop_threads.open())
    problems = _LoopThreadCheck.unchecked()
    assert not leaked and not problems, (
        f"loop threads open at the end of the session: {leaked}; problems on loop threads: {problems}"
    )


@pytest.fixture
def take_loop_thread_problems() -> Callable[[], list[str]]:
    """For tests of the loop-thread check itself: returns the problems recorded since the
    check last looked, which are then the test's to assert on (not reported again)."""
    return _LoopThreadCheck.unchecked
