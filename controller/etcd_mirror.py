"""Keeps the model's etcd half current through two reflectors: one over every job's keys,
one over the finished jobs' tombstones beside them.

Their listings (the first, and one after each lost watch: etcd restarted or compacted) go
to ``etcd_resynced`` and ``tombstones_listed``, where everything absent is gone; their
changes to ``etcd_put``, ``etcd_delete``, ``tombstone_put`` and ``tombstone_delete``,
waking no job for the controller's own writes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from regroup.controller.metrics import ControllerMetrics
from regroup.controller.model import ClusterModel
from regroup import etcd as etcd_layer
from regroup.keys import finished_root


class OwnWrites:
    """Revisions of this controller's own writes: their watch events must not wake it again."""

    def __init__(self) -> None:
        self._revisions: set[int] = set()
        self._many: set[int] = set()
        """Revisions of writes that make several watch events (deletes of several keys)."""

    def add(self, revision: int, many: bool = False) -> None:
        """A write of ours at ``revision``; ``many``: it makes a watch event per key it deleted."""
        revisions = self._many if many else self._revisions
        revisions.add(revision)
        if len(revisions) > 4096:
            revisions.intersection_update(sorted(revisions)[-2048:])

    def claim(self, revision: int) -> bool:
        """True if ``revision`` was one of ours (once, unless it made ``many`` events)."""
        if revision in self._revisions:
            self._revisions.discard(revision)
            return True
        return revision in self._many


async def mirror_etcd(
    client: Any,
    prefix: str,
    model: ClusterModel,
    metrics: ControllerMetrics,
    own: OwnWrites,
    retry: timedelta,
    retry_max: timedelta,
) -> None:
    """List and watch ``prefix`` and the tombstones beside it (``finished_root``) into
    ``model`` until cancelled. The tombstones are listed first, so once the jobs are
    (``etcd_synced``) a removed job's tombstone is known: a decision without it would write
    the job's keys again."""

    def apply(event: etcd_layer.ReflectorEvent) -> None:
        if isinstance(event, etcd_layer.Listed):
            model.etcd_resynced([(item.key, item.value, item.revision) for item in event.items])
        elif isinstance(event, etcd_layer.Put):
            model.etcd_put(event.key, event.value, event.revision, wake=not own.claim(event.revision))
        else:
            model.etcd_delete(event.key, event.revision, wake=not own.claim(event.revision))

    def apply_tombstone(event: etcd_layer.ReflectorEvent) -> None:
        if isinstance(event, etcd_layer.Listed):
            model.tombstones_listed([(item.key, item.value, item.revision) for item in event.items])
        elif isinstance(event, etcd_layer.Put):
            model.tombstone_put(event.key, event.value, event.revision, wake=not own.claim(event.revision))
        else:
            model.tombstone_delete(event.key, wake=not own.claim(event.revision))

    def reflector(key: str, handle: Callable[[etcd_layer.ReflectorEvent], None], name: str) -> etcd_layer.Reflector:
        return etcd_layer.Reflector(
            client, key, handle, backoff=etcd_layer.Backoff(retry, retry_max),
            on_lost=lambda _: metrics.watch_restarts.labels("etcd").inc(), name=name,
        )  # fmt: skip

    tombstones = reflector(finished_root(prefix), apply_tombstone, "controller-etcd-tombstones")
    jobs = reflector(prefix.rstrip("/") + "/", apply, "controller-etcd-mirror")
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(tombstones.run(), name="etcd-tombstones")
        await tombstones.synced()
        tasks.create_task(jobs.run(), name="etcd-jobs")
