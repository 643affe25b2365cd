"""The ``http`` path and its ``anchor``: the storm through the Kubernetes API stand-in.

``http``: events are written into the stand-in and reach the model through the real
list+watch adapter (``controller/kube/source.py``) over HTTP; rank restarts still come
from "etcd", i.e. straight into the model. ``anchor``: the stand-in alone, the same
storm read by a bare watch consumer that only decodes the lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .direct import paced_summary
from .harness import Harness, offer, peak_rss_mb
from .storm import ANNOTATIONS, NAMESPACE, Event, Layout, encoded, storm

NODE_EVENTS = ("taint", "untaint", "ready")


def _kube_objects(layout: Layout) -> list[dict[str, Any]]:
    from kubeapi import objects

    out = [objects.node(layout.node(i)) for i in range(layout.nodes)]
    for j, n in layout.placements():
        out.append(objects.pod(NAMESPACE, layout.pod(j, n), job=layout.job(j), node=n, annotations=ANNOTATIONS))
    return out


def write_event(api: Any, h: Harness | None, layout: Layout, event: Event) -> int:
    """Write one storm event into the stand-in; returns how many watch events it makes."""
    from kubeapi import objects

    kind = event[0]
    if kind == "taint":
        api.patch("Node", event[1], {"spec": {"taints": [objects.taint(event[2])]}})
    elif kind == "untaint":
        api.patch("Node", event[1], {"spec": {"taints": None}})
    elif kind == "ready":
        api.patch("Node", event[1], {"status": {"conditions": [{"type": "Ready", "status": "True" if event[2] else "False"}]}})
    elif kind == "pod-restart":
        _, j, n, count = event
        statuses = [{"name": "worker", "image": "regroup:test", "imageID": "", "ready": True, "restartCount": count,
                     "started": True, "state": {"running": {}}}]
        api.patch("Pod", layout.pod(j, n), {"status": {"containerStatuses": statuses}}, namespace=NAMESPACE)
    elif kind == "rank-restart":
        if h is not None:
            h.model.etcd_put(event[4], event[5], 2)
        return 0
    elif kind == "pod-delete":
        _, j, n = event
        api.delete("Pod", layout.pod(j, n), namespace=NAMESPACE)
    elif kind == "pod-create":
        _, j, n = event
        api.create(objects.pod(NAMESPACE, layout.pod(j, n), job=layout.job(j), node=n, annotations=ANNOTATIONS))
    return 1


class StampingSink:
    """Passes observations to the model, each stamped with when its write entered the
    stand-in (each watch delivers its kind's events in write order)."""

    KINDS = {"node_changed": "node", "node_deleted": "node", "pod_changed": "pod", "pod_deleted": "pod"}

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.written: dict[str, deque[float | None]] = {"node": deque(), "pod": deque()}
        self.seen = 0

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.h.model, name)
        kind = self.KINDS.get(name)
        if kind is None:
            return target

        def stamped(*args: Any) -> None:
            self.seen += 1
            written = self.written[kind]
            self.h.origin = written.popleft() if written else None
            target(*args)

        return stamped


@contextlib.asynccontextmanager
async def standin(layout: Layout) -> AsyncIterator[tuple[Any, Any]]:
    """The Kubernetes API stand-in loaded with the cluster, and a real client for it."""
    from controller.kube.api import load_api_client
    from kubeapi.server import FakeKubeAPI

    api = FakeKubeAPI(history_limit=1_000_000)
    for obj in _kube_objects(layout):
        api.create(obj)
    await api.start()
    with tempfile.TemporaryDirectory(prefix="regroup-bench-") as folder:
        api_client = await load_api_client(api.write_kubeconfig(Path(folder) / "kubeconfig"))
        try:
            yield api, api_client
        finally:
            await api_client.close()
            await api.stop()


@contextlib.asynccontextmanager
async def watched(layout: Layout, workers: int) -> AsyncIterator[tuple[Any, Harness, StampingSink, float]]:
    """A fresh stand-in and a controller harness fed by the real list+watch source from
    it, listed and settled: (stand-in, harness, sink, seconds the initial list took)."""
    from controller.kube.api import RawKube
    from controller.kube.source import KubeSource

    async with standin(layout) as (api, api_client):
        h = Harness(workers)
        sink = StampingSink(h)
        h.seed_etcd(layout)
        source = KubeSource(RawKube(api_client), h.settings.kube, h.reconciler.metrics)
        h.start()
        listed_at = time.perf_counter()
        source_task = asyncio.create_task(source.run(sink))  # type: ignore[arg-type]
        try:
            while not (h.model.nodes_synced and h.model.pods_synced and api.open_watches() == 2):
                await asyncio.sleep(0.005)
            list_seconds = time.perf_counter() - listed_at
            await h.settled()
            yield api, h, sink, list_seconds
        finally:
            source_task.cancel()
            await asyncio.gather(source_task, return_exceptions=True)
            await h.stop()


async def run_http(layout: Layout, count: int, seed: int, workers: int) -> dict[str, Any]:
    """Throughput: the storm written as fast as the stand-in takes it."""
    async with watched(layout, workers) as (api, h, sink, list_seconds):
        events = [encoded(layout, h.settings.etcd_prefix, e) for e in storm(layout, count, seed)]
        base = expected = sink.seen
        start, cpu = time.perf_counter(), time.process_time()
        for i, event in enumerate(events):
            if event[0] != "rank-restart":
                sink.written["node" if event[0] in NODE_EVENTS else "pod"].append(None)
            h.origin = None
            expected += write_event(api, h, layout, event)
            if i % 50 == 49:
                await asyncio.sleep(0)
        applied = time.perf_counter() - start
        while sink.seen < expected:
            await asyncio.sleep(0.001)
        await h.drained()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        result = {"path": "http", "events": len(events), "seconds": round(elapsed, 3),
                  "events_per_s": round(len(events) / elapsed, 1), "decisions": h.decisions,
                  "initial_list_s": round(list_seconds, 2), "standin_writes_s": round(applied, 3),
                  "kube_events": expected - base, "kube_events_per_s": round((expected - base) / elapsed, 1),
                  "cpu_s": round(cpu, 3), "events_per_cpu_s": round(len(events) / cpu, 1), "peak_rss_mb": peak_rss_mb()}  # fmt: skip
    return result


async def run_http_paced(layout: Layout, seed: int, workers: int, rate: float, count: int) -> dict[str, Any]:
    """Latency: a storm offered at ``rate`` events/s to a fresh stand-in, every decision
    timed from the moment each event was written there."""
    async with watched(layout, workers) as (api, h, sink, _):
        return await _paced(layout, seed + 1, rate, count, api, h, sink)


async def _paced(layout: Layout, seed: int, rate: float, count: int, api: Any, h: Harness,
                 sink: StampingSink) -> dict[str, Any]:  # fmt: skip
    """A storm offered at ``rate`` events/s to the stand-in."""
    paced = [encoded(layout, h.settings.etcd_prefix, e) for e in storm(layout, count, seed)]
    expected = sink.seen

    def deliver(event: Event, arrived: float) -> None:
        nonlocal expected
        if event[0] == "rank-restart":
            h.origin = arrived
        else:
            sink.written["node" if event[0] in NODE_EVENTS else "pod"].append(arrived)
        expected += write_event(api, h, layout, event)

    start, cpu = time.perf_counter(), time.process_time()
    await offer(paced, rate, deliver)
    while sink.seen < expected:
        await asyncio.sleep(0.001)
    await h.drained()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return paced_summary(rate, len(paced), elapsed, cpu, h)


async def run_anchor(layout: Layout, count: int, seed: int) -> dict[str, Any]:
    """The stand-in alone: the same storm, read by a watch consumer that only decodes lines."""
    async with standin(layout) as (api, api_client):
        return await _run_anchor(layout, count, seed, api, api_client)


async def _run_anchor(layout: Layout, count: int, seed: int, api: Any, api_client: Any) -> dict[str, Any]:
    from controller.kube.api import RawKube

    raw = RawKube(api_client)
    seen = 0

    async def consume(path: str, query: dict[str, Any]) -> None:
        nonlocal seen
        listing = await raw.request("GET", path, {**query, "limit": 500})
        version = listing["metadata"]["resourceVersion"]
        async for event in raw.watch(path, {**query, "resourceVersion": version, "allowWatchBookmarks": True,
                                             "timeoutSeconds": 3600}, timeout=3600):
            if event.get("type") != "BOOKMARK":
                seen += 1

    tasks = [asyncio.create_task(consume("/api/v1/nodes", {})),
             asyncio.create_task(consume("/api/v1/pods", {"labelSelector": "regroup.dev/job"}))]
    try:
        while api.open_watches() < 2:
            await asyncio.sleep(0.005)
        events = storm(layout, count, seed)
        expected = 0
        start, cpu = time.perf_counter(), time.process_time()
        for i, event in enumerate(events):
            expected += write_event(api, None, layout, event)
            if i % 50 == 49:
                await asyncio.sleep(0)
        while seen < expected:
            await asyncio.sleep(0.001)
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "path": "anchor (stand-in only)",
        "events": expected,
        "seconds": round(elapsed, 3),
        "events_per_s": round(expected / elapsed, 1),
        "kube_events_per_s": round(expected / elapsed, 1),
        "cpu_s": round(cpu, 3),
        "events_per_cpu_s": round(expected / cpu, 1),
        "peak_rss_mb": peak_rss_mb(),
    }
