"""Nodes and regroup pods from the API server: list, then watch, as client-go's reflector.

Each kind: list (paged) and hand the full list to the model, then watch from the list's
resourceVersion with bookmarks. A watch that ends is resumed from the last version seen;
410 Gone (history compacted) means list again; other errors back off (doubling) and list
again. Everything is listed again every ``resync`` as a safety net.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp
import structlog

from regroup.controller.cluster import JOB_LABEL, ClusterSink
from regroup.controller.kube.api import KubeError, RawKube
from regroup.controller.kube.convert import node_info, pod_info
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.settings import KubeSettings

log = structlog.get_logger("regroup.controller.kube")

_TRANSIENT = (KubeError, aiohttp.ClientError, asyncio.TimeoutError, OSError, json.JSONDecodeError)


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class KubeSource:
    """A ``ClusterSource`` over the Kubernetes API."""

    def __init__(self, raw: RawKube, settings: KubeSettings, metrics: ControllerMetrics) -> None:
        self._raw = raw
        self._settings = settings
        self._metrics = metrics

    async def run(self, sink: ClusterSink) -> None:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(
                self._reflect("nodes", "/api/v1/nodes", {}, lambda objs: sink.nodes_listed([node_info(o) for o in objs]),
                              lambda o: sink.node_changed(node_info(o)),
                              lambda o: sink.node_deleted(o["metadata"]["name"])),
                name="watch-nodes",
            )
            tasks.create_task(
                self._reflect("pods", "/api/v1/pods", {"labelSelector": JOB_LABEL},
                              lambda objs: sink.pods_listed([pod_info(o) for o in objs]),
                              lambda o: sink.pod_changed(pod_info(o)),
                              lambda o: sink.pod_deleted(o["metadata"].get("namespace", "default"), o["metadata"]["name"])),
                name="watch-pods",
            )

    async def _list(self, path: str, query: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = await self._raw.request("GET", path, {**query, "limit": self._settings.page_size, "continue": token})
            items.extend(page.get("items") or ())
            meta = page.get("metadata") or {}
            token = meta.get("continue") or None
            if token is None:
                return items, meta.get("resourceVersion", "")

    async def _reflect(
        self,
        kind: str,
        path: str,
        query: dict[str, Any],
        listed: Callable[[list[dict[str, Any]]], None],
        changed: Callable[[dict[str, Any]], None],
        deleted: Callable[[dict[str, Any]], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        delay = self._settings.backoff.total_seconds()
        version: str | None = None
        listed_at = 0.0
        while True:
            try:
                if version is None or loop.time() - listed_at >= self._settings.resync.total_seconds():
                    items, version = await self._list(path, query)
                    listed_at = loop.time()
                    listed(items)
                remaining = self._settings.resync.total_seconds() - (loop.time() - listed_at)
                window = max(1, int(min(self._settings.watch_timeout.total_seconds(), remaining)))
                watch_query = {**query, "resourceVersion": version, "allowWatchBookmarks": True, "timeoutSeconds": window}
                async for events in self._raw.watch(path, watch_query, timeout=window + 30):
                    for event in events:
                        kind_of, obj = event.get("type"), event.get("object") or {}
                        if kind_of == "ERROR":
                            if obj.get("code") == 410:
                                raise _Gone(obj.get("message", "410 Gone"))
                            raise KubeError("WATCH", path, int(obj.get("code", 500)), obj.get("message", ""))
                        version = (obj.get("metadata") or {}).get("resourceVersion", version)
                        if kind_of in ("ADDED", "MODIFIED"):
                            changed(obj)
                        elif kind_of == "DELETED":
                            deleted(obj)
                delay = self._settings.backoff.total_seconds()
            except asyncio.CancelledError:
                raise
            except _Gone as exc:
                self._metrics.watch_restarts.labels(kind).inc()
                log.info("watch expired; listing again", kind=kind, reason=str(exc))
                version = None
            except _TRANSIENT as exc:
                self._metrics.watch_restarts.labels(kind).inc()
                if isinstance(exc, KubeError) and exc.status == 410:
                    version = None
                    continue
                log.warning("list/watch failed; backing off", kind=kind, error=f"{type(exc).__name__}: {exc}", retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._settings.backoff_max.total_seconds())
                version = None
