"""Keeps the model's etcd half current: list the job prefix, then watch it.

One watch covers every job under the prefix; it breaks when etcd restarts or compacts,
and then the prefix is listed again (everything absent is gone) and watched from the
listed revision, with back-off between failures.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import grpc
import structlog

from controller.metrics import ControllerMetrics
from controller.model import ClusterModel
from regroup import etcd as etcd_layer

log = structlog.get_logger("regroup.controller.etcd")

ETCD_ERRORS = (etcd_layer.ClientError, grpc.RpcError, OSError, asyncio.TimeoutError)


class OwnWrites:
    """Revisions of this controller's own writes: their watch events must not wake it again."""

    def __init__(self) -> None:
        self._revisions: set[int] = set()

    def add(self, revision: int) -> None:
        self._revisions.add(revision)
        if len(self._revisions) > 4096:
            self._revisions = set(sorted(self._revisions)[-2048:])

    def claim(self, revision: int) -> bool:
        """True (once) if ``revision`` was one of ours."""
        if revision in self._revisions:
            self._revisions.discard(revision)
            return True
        return False


async def mirror_etcd(
    client: Any,
    prefix: str,
    model: ClusterModel,
    metrics: ControllerMetrics,
    own: OwnWrites,
    retry: timedelta,
    retry_max: timedelta,
    on_synced: Callable[[], None],
) -> None:
    """List and watch ``prefix`` into ``model`` until cancelled."""
    delay = retry.total_seconds()
    head = prefix.rstrip("/") + "/"
    first = True
    while True:
        try:
            listing = await client.get_prefix(head.encode())
            items = [(kv.key.decode(), kv.value, kv.mod_revision) for kv in listing.kvs]
            model.etcd_resynced(items)
            on_synced()
            watch = await etcd_layer.open_watch(client, head.encode(), start_revision=listing.header.revision + 1)
            if not first:
                log.info("etcd watch re-established", revision=listing.header.revision)
            first = False
            try:
                async for event in watch:
                    key = event.kv.key.decode()
                    revision = event.kv.mod_revision
                    wake = not own.claim(revision)
                    if event.kind == etcd_layer.EventKind.PUT:
                        model.etcd_put(key, event.kv.value, revision, wake=wake)
                    else:
                        model.etcd_delete(key, revision, wake=wake)
                    delay = retry.total_seconds()
            finally:
                await etcd_layer.close_watch(watch)
        except asyncio.CancelledError:
            raise
        except ETCD_ERRORS as exc:
            metrics.watch_restarts.labels("etcd").inc()
            log.warning("etcd watch broken; listing again", error=f"{type(exc).__name__}: {exc}", retry_in=delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, retry_max.total_seconds())
