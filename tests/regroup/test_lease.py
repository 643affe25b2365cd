"""``LeaseKeeper`` against a real etcd: one keep-alive stream per lease, kept open across
refreshes (etcd's own gRPC counters say how many it served), reopened after etcd restarts,
and a lease that is gone reported once."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest

from regroup.demo.etcd_server import EtcdServer
from regroup.etcd import EtcdSettings, LeaseKeeper, connect

TTL = timedelta(seconds=2)
"""The shortest TTL etcd grants with its default election timeout: a refresh every 0.67 s."""


def keep_alive_counts(etcd: EtcdServer) -> tuple[int, int]:
    """(streams started, refresh messages received) of etcd's ``LeaseKeepAlive``, from its metrics."""
    with urllib.request.urlopen(f"{etcd.url}/metrics", timeout=10) as response:
        text = response.read().decode()

    def count(name: str) -> int:
        pattern = rf'^{name}{{grpc_method="LeaseKeepAlive",grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"}} (\S+)$'
        match = re.search(pattern, text, re.MULTILINE)
        assert match, f"etcd no longer exports {name} for LeaseKeepAlive"
        return int(float(match.group(1)))

    return count("grpc_server_started_total"), count("grpc_server_msg_received_total")


async def refreshes(etcd: EtcdServer, at_least: int) -> tuple[int, int]:
    """Await etcd having received ``at_least`` keep-alive messages; the counts then."""
    async with asyncio.timeout(30):
        while (counts := await asyncio.to_thread(keep_alive_counts, etcd))[1] < at_least:
            await asyncio.sleep(0.1)  # polling the server's counter: nothing to await on
    return counts


@pytest.fixture
async def kept(etcd_client: Any) -> AsyncIterator[tuple[LeaseKeeper, list[bool]]]:
    """A kept lease with the key ``/k`` on it, and the calls of its ``on_lost``."""
    lost: list[bool] = []
    keeper = LeaseKeeper(etcd_client, TTL, on_lost=lambda: lost.append(True))
    await keeper.start()
    try:
        await etcd_client.put(b"/k", b"v", lease=keeper.lease)
        yield keeper, lost
    finally:
        await keeper.stop()


async def test_refreshes_share_one_long_lived_stream_and_keep_the_lease(
    etcd: EtcdServer, etcd_client: Any, kept: tuple[LeaseKeeper, list[bool]]
) -> None:
    keeper, lost = kept
    streams, messages = await refreshes(etcd, at_least=6)  # 4 s: twice the TTL
    assert streams == 1, f"{messages} refreshes opened {streams} streams"
    assert await etcd_client.get(b"/k") is not None and not lost
    await keeper.stop()
    assert await etcd_client.get(b"/k") is None, "stop revokes the lease: its keys go at once"


async def test_a_restarted_etcd_gets_a_new_stream_and_the_lease_lives_on(
    etcd: EtcdServer, etcd_client: Any, kept: tuple[LeaseKeeper, list[bool]]
) -> None:
    _, lost = kept
    await refreshes(etcd, at_least=2)
    await asyncio.to_thread(etcd.restart)  # a leader's start renews every lease by its TTL
    streams, _ = await refreshes(etcd, at_least=4)  # the counters start over with the process
    assert streams == 1 and not lost
    assert await etcd_client.get(b"/k") is not None


async def test_a_lease_revoked_elsewhere_is_reported_lost_once(etcd: EtcdServer, etcd_client: Any) -> None:
    lost = asyncio.Event()
    calls: list[int] = []

    def on_lost() -> None:
        calls.append(1)
        lost.set()

    keeper = LeaseKeeper(etcd_client, TTL, on_lost=on_lost)
    await keeper.start()
    other = await connect(EtcdSettings.from_endpoint_string(etcd.endpoint))
    try:
        await other.revoke_lease(keeper.id)
        async with asyncio.timeout(10):
            await lost.wait()  # the next refresh's answer: TTL 0
    finally:
        await other.close()
        await keeper.stop(revoke=False)
    assert calls == [1]
