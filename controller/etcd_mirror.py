"""Keeps the model's etcd half current through one reflector over every job's keys.

Its listings (the first, and one after each lost watch: etcd restarted or compacted) go
to ``etcd_resynced``, where everything absent is gone; its changes to ``etcd_put`` and
``etcd_delete``, waking no job for the controller's own writes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from regroup.controller.metrics import ControllerMetrics
from regroup.controller.model import ClusterModel
from regroup import etcd as etcd_layer


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
) -> None:
    """List and watch ``prefix`` into ``model`` until cancelled."""

    def apply(event: etcd_layer.ReflectorEvent) -> None:
        if isinstance(event, etcd_layer.Listed):
            model.etcd_resynced([(item.key, item.value, item.revision) for item in event.items])
        elif isinstance(event, etcd_layer.Put):
            model.etcd_put(event.key, event.value, event.revision, wake=not own.claim(event.revision))
        else:
            model.etcd_delete(event.key, event.revision, wake=not own.claim(event.revision))

    reflector = etcd_layer.Reflector(
        client,
        prefix.rstrip("/") + "/",
        apply,
        backoff=etcd_layer.Backoff(retry, retry_max),
        on_lost=lambda _: metrics.watch_restarts.labels("etcd").inc(),
        name="controller-etcd-mirror",
    )
    await reflector.run()
