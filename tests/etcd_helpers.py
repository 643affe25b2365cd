"""Helpers for tests that restart etcd under a running client."""

from __future__ import annotations

import asyncio
from typing import Any

from regroup.etcd import TRANSIENT_ERRORS


async def put_retrying(client: Any, key: str, value: bytes, timeout: float = 60.0) -> None:
    """Put once the client's channel is back after an etcd restart (its first calls may
    fail); a failure is retried after a pause, since no event says the channel is back."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                await client.put(key.encode(), value)
                return
            except TRANSIENT_ERRORS:
                await asyncio.sleep(0.1)


async def lease_count(client: Any) -> int:
    """How many leases etcd holds (``LeaseLeases``, which aetcd's client does not wrap)."""
    from aetcd import rpc

    response = await client.leasestub.LeaseLeases(rpc.LeaseLeasesRequest(), timeout=10)
    return len(response.leases)
