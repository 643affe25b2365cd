"""The ``direct`` path: events go straight into the model (what the controller itself can do)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from regroup.controller.cluster import NodeInfo, Taint

from .harness import Harness, latency_summary, offer, peak_rss_mb
from .storm import NAMESPACE, Event, Layout, pod_info, replayed


async def direct_harness(layout: Layout, workers: int, clock: Callable[[], float] = time.time) -> Harness:
    """The cluster listed, etcd seeded, every job decided once."""
    h = Harness(workers, clock)
    h.model.nodes_listed([NodeInfo(layout.node(i)) for i in range(layout.nodes)])
    h.model.pods_listed([pod_info(layout, j, n) for j, n in layout.placements()])
    h.seed_etcd(layout)
    h.start()
    await h.settled()
    return h


class DirectFeed:
    """Applies storm events to the model as the adapters would deliver them."""

    def __init__(self, h: Harness, layout: Layout) -> None:
        self.h = h
        self.layout = layout
        self.nodes: dict[str, NodeInfo] = {}

    def __call__(self, event: Event, arrived: float | None = None) -> None:
        self.h.origin = arrived
        kind, model, layout = event[0], self.h.model, self.layout
        if kind in ("taint", "untaint", "ready"):
            node = event[1]
            info = self.nodes.get(node) or NodeInfo(node)
            if kind == "taint":
                info = NodeInfo(node, taints=(Taint(event[2]),), ready=info.ready)
            elif kind == "untaint":
                info = NodeInfo(node, taints=(), ready=info.ready)
            else:
                info = NodeInfo(node, taints=info.taints, ready=event[2])
            self.nodes[node] = info
            model.node_changed(info)
        elif kind == "pod-restart":
            _, j, n, count = event
            model.pod_changed(pod_info(layout, j, n, count))
        elif kind == "rank-restart":
            model.etcd_put(event[4], event[5], 2)
        elif kind == "pod-delete":
            _, j, n = event
            model.pod_deleted(NAMESPACE, layout.pod(j, n))
        elif kind == "pod-create":
            _, j, n = event
            model.pod_changed(pod_info(layout, j, n))


async def run_direct(
    layout: Layout, count: int, seed: int, workers: int, rate: float, chunk: int, paced_count: int
) -> dict[str, Any]:
    """Throughput: the storm delivered in watch-sized chunks as fast as the controller takes
    them. Latency: a second storm offered at ``rate`` events/s, every decision timed."""
    h = await direct_harness(layout, workers)
    feed = DirectFeed(h, layout)
    events = replayed(layout, h.settings.etcd_prefix, count, seed)
    start, cpu = time.perf_counter(), time.process_time()
    for i, event in enumerate(events):
        feed(event)
        if i % chunk == chunk - 1:
            await asyncio.sleep(0)
    await h.drained()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    await h.stop()
    # On a shared machine wall time includes other processes' turns; CPU time does not.
    result = {"path": "direct", "events": len(events), "seconds": round(elapsed, 3),
              "events_per_s": round(len(events) / elapsed, 1), "decisions": h.decisions,
              "cpu_s": round(cpu, 3), "events_per_cpu_s": round(len(events) / cpu, 1)}  # fmt: skip

    h = await direct_harness(layout, workers)
    feed = DirectFeed(h, layout)
    paced = replayed(layout, h.settings.etcd_prefix, paced_count, seed + 1)
    start, cpu = time.perf_counter(), time.process_time()
    await offer(paced, rate, feed)
    await h.drained()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    await h.stop()
    result.update(paced_summary(rate, len(paced), elapsed, cpu, h))
    return result


def paced_summary(rate: float, events: int, elapsed: float, cpu: float, h: Harness) -> dict[str, Any]:
    return {
        "paced_rate": rate,
        "paced_events": events,
        "paced_achieved_per_s": round(events / elapsed, 1),
        "paced_decisions": h.decisions,
        "paced_cpu_share": round(cpu / elapsed, 2),
        **latency_summary(h.latencies),
        "peak_rss_mb": peak_rss_mb(),
    }
