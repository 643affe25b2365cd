"""Shared fixtures: a real etcd on a free loopback port, and the no-leaked-task check."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from regroup.etcd import EtcdSettings, connect
from regroup.etcd_server import EtcdServer

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
    leaked = [t for t in leaked if "_AioCall" not in repr(t.get_coro())]
    assert not leaked, f"test leaked tasks: {leaked}"
