"""The ``http`` path and its ``anchor``: the storm through the Kubernetes API stand-in.

The stand-in runs in a process of its own (``standin_process``), as the API server does
in production. ``http``: the storm is written there and reaches the model through the
real list+watch adapter (``controller/kube/source.py``) over HTTP; rank restarts come
from "etcd", i.e. straight into the model. ``anchor``: the same storm read by a bare watch
consumer that only decodes the lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from .direct import paced_summary
from .harness import Harness, offer, peak_rss_mb
from .standin_process import NODE_EVENTS, StandinProcess, kube_event_count
from .storm import Event, Layout, replayed, storm

START_AHEAD_S = 0.5
"""How far ahead of now a paced storm starts: both processes are at their marks by then."""


class StampingSink:
    """Passes observations to the model, each stamped with when its write was due in the
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
        written, h = self.written[kind], self.h

        def stamped(*args: Any) -> None:
            self.seen += 1
            h.origin = written.popleft() if written else None
            target(*args)

        # Made once per name: the harness's own cost per event stays out of the measure.
        setattr(self, name, stamped)
        return stamped

    def expect(self, events: list[Event], start: float | None = None, rate: float = 0.0) -> int:
        """Stamp the watch events ``events`` will make, in order: event i was due at
        ``start + i / rate`` (not stamped when ``start`` is None). Returns how many."""
        for i, event in enumerate(events):
            if event[0] != "rank-restart":
                self.written["node" if event[0] in NODE_EVENTS else "pod"].append(
                    None if start is None else start + i / rate
                )
        return kube_event_count(events)


@contextlib.asynccontextmanager
async def watched(layout: Layout, workers: int) -> AsyncIterator[tuple[StandinProcess, Harness, StampingSink, float]]:
    """A fresh stand-in process and a controller harness fed by the real list+watch source
    from it, listed and settled: (stand-in, harness, sink, seconds the initial list took)."""
    from regroup.controller.kube.api import RawKube, load_api_client
    from regroup.controller.kube.source import KubeSource

    async with StandinProcess(layout) as standin:
        api_client = await load_api_client(standin.kubeconfig)
        h = Harness(workers)
        sink = StampingSink(h)
        h.seed_etcd(layout)
        source = KubeSource(RawKube(api_client), h.settings.kube, h.reconciler.metrics)
        h.start()
        listed_at = time.perf_counter()
        source_task = asyncio.create_task(source.run(sink))  # type: ignore[arg-type]
        try:
            while not (h.model.nodes_synced and h.model.pods_synced and await standin.open_watches() == 2):
                await asyncio.sleep(0.02)
            list_seconds = time.perf_counter() - listed_at
            await h.settled()
            yield standin, h, sink, list_seconds
        finally:
            source_task.cancel()
            await asyncio.gather(source_task, return_exceptions=True)
            await h.stop()
            await api_client.close()


async def _rank_restarts(h: Harness, events: list[Event]) -> None:
    """The storm's rank restarts, straight into the model as the etcd mirror delivers them."""
    for i, event in enumerate(events):
        if event[0] == "rank-restart":
            h.origin = None
            h.model.etcd_put(event[4], event[5], 2)
        if i % 50 == 49:
            await asyncio.sleep(0)


async def _all_seen(sink: StampingSink, expected: int) -> None:
    while sink.seen < expected:
        await asyncio.sleep(0.001)


async def run_http(layout: Layout, count: int, seed: int, workers: int) -> dict[str, Any]:
    """Throughput: the storm written as fast as the stand-in takes it."""
    async with watched(layout, workers) as (standin, h, sink, list_seconds):
        events = replayed(layout, h.settings.etcd_prefix, count, seed)
        kube_events = sink.expect(events)
        expected = sink.seen + kube_events
        start, cpu = time.perf_counter(), time.process_time()
        written = asyncio.create_task(standin.write(seed, count))
        await _rank_restarts(h, events)
        await _all_seen(sink, expected)
        await h.drained()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        result = {"path": "http", "events": len(events), "seconds": round(elapsed, 3),
                  "events_per_s": round(len(events) / elapsed, 1), "decisions": h.decisions,
                  "initial_list_s": round(list_seconds, 2), **await written,
                  "kube_events": kube_events, "kube_events_per_s": round(kube_events / elapsed, 1),
                  "cpu_s": round(cpu, 3), "events_per_cpu_s": round(len(events) / cpu, 1), "peak_rss_mb": peak_rss_mb()}  # fmt: skip
    return result


async def run_http_paced(layout: Layout, seed: int, workers: int, rate: float, count: int) -> dict[str, Any]:
    """Latency: a storm offered at ``rate`` events/s to a fresh stand-in, every decision
    timed from the moment each event was due to be written there."""
    async with watched(layout, workers) as (standin, h, sink, _):
        paced = replayed(layout, h.settings.etcd_prefix, count, seed + 1)
        start = time.perf_counter() + START_AHEAD_S
        expected = sink.seen + sink.expect(paced, start, rate)
        written = asyncio.create_task(standin.write(seed + 1, count, rate, start))

        def deliver(event: Event, arrived: float) -> None:
            if event[0] == "rank-restart":
                h.origin = arrived
                h.model.etcd_put(event[4], event[5], 2)

        cpu = time.process_time()
        await offer(paced, rate, deliver, start=start)
        await _all_seen(sink, expected)
        await h.drained()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        stand_in = {f"paced_{k}": v for k, v in (await written).items()}
        return {**paced_summary(rate, len(paced), elapsed, cpu, h), **stand_in}


async def run_anchor(layout: Layout, count: int, seed: int) -> dict[str, Any]:
    """The stand-in alone: the same storm, read by a watch consumer that only decodes lines."""
    from regroup.controller.kube.api import RawKube, load_api_client

    async with StandinProcess(layout) as standin:
        api_client = await load_api_client(standin.kubeconfig)
        raw = RawKube(api_client)
        seen = 0

        async def consume(path: str, query: dict[str, Any]) -> None:
            nonlocal seen
            listing = await raw.request("GET", path, {**query, "limit": 500})
            version = listing["metadata"]["resourceVersion"]
            async for events in raw.watch(path, {**query, "resourceVersion": version, "allowWatchBookmarks": True,
                                                  "timeoutSeconds": 3600}, timeout=3600):
                seen += sum(1 for event in events if event.get("type") != "BOOKMARK")

        tasks = [asyncio.create_task(consume("/api/v1/nodes", {})),
                 asyncio.create_task(consume("/api/v1/pods", {"labelSelector": "regroup.dev/job"}))]
        try:
            while await standin.open_watches() < 2:
                await asyncio.sleep(0.02)
            expected = kube_event_count(storm(layout, count, seed))
            start, cpu = time.perf_counter(), time.process_time()
            written = await standin.write(seed, count)
            while seen < expected:
                await asyncio.sleep(0.001)
            elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await api_client.close()
    return {
        "path": "anchor (stand-in only)",
        "events": expected,
        "seconds": round(elapsed, 3),
        "events_per_s": round(expected / elapsed, 1),
        "kube_events_per_s": round(expected / elapsed, 1),
        "cpu_s": round(cpu, 3),
        "events_per_cpu_s": round(expected / cpu, 1),
        **written,
        "peak_rss_mb": peak_rss_mb(),
    }
