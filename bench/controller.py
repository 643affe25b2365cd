"""``python -m bench controller [--quick]``: the controller under an event storm.

2,000 nodes, 10,000 worker pods, 200 jobs of 50 nodes. A seeded storm of reclaim taints,
taint removals, NotReady flips, pod deletions and re-creations, container restarts and
rank restarts is replayed twice:

- ``direct``: events go straight into the model (what the controller itself can do);
- ``http``: events are written into the Kubernetes API stand-in and reach the model
  through the real list+watch adapter over HTTP (rank restarts still come from "etcd",
  i.e. straight into the model).

The anchor, run in the same invocation, is the stand-in alone: the same storm read by a
bare watch consumer that only decodes the lines. The ratio ``http / anchor`` says how much
of the HTTP path's ceiling is the stand-in. Each path runs in its own process so peak RSS
(``ru_maxrss``) is its own. Goals: >= 5,000 events/s, p99 signal->decision <= 20 ms, <= 300 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from controller.cluster import NodeInfo, ObjectRef, PodInfo, Taint
from controller.decide import decide
from controller.metrics import ControllerMetrics
from controller.model import ClusterModel, JobId
from controller.reconciler import Reconciler
from controller.runtime import ReconcileLoop
from controller.settings import ControllerSettings
from controller.signals import RECLAIM_SIGNALS
from controller.snapshot import Decision
from controller.workqueue import WorkQueue
from regroup.keys import JobKeys
from regroup.records import MemberRecord, Progress

NAMESPACE = "bench"
RECLAIM_KEYS = [s.key for s in RECLAIM_SIGNALS if s.path == "planned" and s.value is None and not s.value_is_unix_time]


@dataclass(frozen=True)
class Layout:
    nodes: int = 2000
    jobs: int = 200
    per_job: int = 50

    def node(self, i: int) -> str:
        return f"node-{i:04d}"

    def job(self, j: int) -> str:
        return f"job-{j:03d}"

    def job_nodes(self, j: int) -> list[str]:
        # Job j runs on 50 consecutive nodes starting at 10*j: each node hosts 5 jobs' pods.
        stride = self.nodes // self.jobs
        return [self.node((j * stride + k) % self.nodes) for k in range(self.per_job)]

    def pod(self, j: int, node: str) -> str:
        return f"{self.job(j)}-{node}"


ANNOTATIONS = {
    "regroup.dev/min-nodes": "10",
    "regroup.dev/max-nodes": "60",
    "regroup.dev/checkpoint-timeout": "120s",
    "regroup.dev/restart-storm": "3/10m",
}


def storm(layout: Layout, count: int, seed: int) -> list[tuple[Any, ...]]:
    """A seeded list of cluster events; each touches one node or one pod.

    Churn stays around 1% of the fleet at a time (taints and NotReady nodes are mostly
    lifted again, deleted pods come back), and restarts cluster on 1% flaky nodes, as they
    do in a real fleet; the rest of the fleet restarts rarely, below the storm threshold.
    """
    rng = random.Random(seed)
    placements = [(j, n) for j in range(layout.jobs) for n in layout.job_nodes(j)]
    flaky_nodes = {layout.node(i) for i in rng.sample(range(layout.nodes), layout.nodes // 100)}
    flaky = [(j, n) for j, n in placements if n in flaky_nodes]
    scale = max(1, layout.nodes // 100)
    tainted: list[str] = []
    notready: list[str] = []
    deleted: list[tuple[int, str]] = []
    pod_restarts: dict[tuple[int, str], int] = {}
    rank_restarts: dict[tuple[int, str], int] = {}
    events: list[tuple[Any, ...]] = []

    def lift(held: list[Any]) -> bool:
        return bool(held) and rng.random() < len(held) / (len(held) + scale)

    while len(events) < count:
        roll = rng.random()
        if roll < 0.45:
            j, n = rng.choice(flaky if rng.random() < 0.8 else placements)
            if (j, n) in deleted:
                continue
            if roll < 0.30:
                pod_restarts[(j, n)] = pod_restarts.get((j, n), 0) + 1
                events.append(("pod-restart", j, n, pod_restarts[(j, n)]))
            else:
                rank_restarts[(j, n)] = rank_restarts.get((j, n), 0) + 1
                events.append(("rank-restart", j, n, rank_restarts[(j, n)]))
        elif roll < 0.65:
            if lift(tainted):
                events.append(("untaint", tainted.pop(rng.randrange(len(tainted)))))
            else:
                node = layout.node(rng.randrange(layout.nodes))
                if node not in tainted:
                    tainted.append(node)
                    events.append(("taint", node, rng.choice(RECLAIM_KEYS)))
        elif roll < 0.80:
            if lift(notready):
                events.append(("ready", notready.pop(rng.randrange(len(notready))), True))
            else:
                node = layout.node(rng.randrange(layout.nodes))
                if node not in notready:
                    notready.append(node)
                    events.append(("ready", node, False))
        elif lift(deleted):
            j, n = deleted.pop(rng.randrange(len(deleted)))
            events.append(("pod-create", j, n))
        else:
            j, n = rng.choice(placements)
            if (j, n) not in deleted:
                deleted.append((j, n))
                events.append(("pod-delete", j, n))
    return events


def affected_jobs(layout: Layout) -> dict[str, list[int]]:
    jobs: dict[str, list[int]] = {}
    for j in range(layout.jobs):
        for n in layout.job_nodes(j):
            jobs.setdefault(n, []).append(j)
    return jobs


class NullActuator:
    """Cluster actions cost nothing here: the bench measures observing and deciding."""

    async def cordon(self, node: str, reason: str, taint_key: str, now: float) -> None:
        return None

    async def delete_pod(self, namespace: str, name: str, reason: str) -> None:
        return None

    async def post_event(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        return None


def pod_info(layout: Layout, j: int, node: str, restarts: int = 0) -> PodInfo:
    return PodInfo(
        namespace=NAMESPACE, name=layout.pod(j, node), uid=f"uid-{j}-{node}", job=layout.job(j), node=node,
        annotations=ANNOTATIONS, restart_count=restarts, created_at=1.0, labels={"regroup.dev/job": layout.job(j)},
    )


def member(layout: Layout, j: int, node: str, restarts: int = 0) -> bytes:
    return MemberRecord(node=node, pod=layout.pod(j, node), namespace=NAMESPACE, round=1, local_world_size=8,
                        restart_count=restarts).to_json()


class Harness:
    """Model, queue, reconciler and workers, with latencies recorded per decision."""

    def __init__(self, workers: int) -> None:
        self.settings = ControllerSettings()
        self.queue: WorkQueue[JobId] = WorkQueue(time.perf_counter)
        self.model = ClusterModel(time.time, self.queue.add, prefix=self.settings.etcd_prefix, job_defaults=self.settings.jobs)
        self.reconciler = Reconciler(self.model, self.settings, None, NullActuator(), ControllerMetrics())
        self.latencies: list[float] = []
        self.decisions = 0
        self.loop = ReconcileLoop(self.reconciler, self.queue, self._observe)
        self.workers = workers
        self.tasks: list[asyncio.Task[None]] = []

    def _observe(self, job: JobId, decision: Decision, latency: float) -> None:
        self.decisions += 1
        self.latencies.append(latency)

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self.loop.worker()) for _ in range(self.workers)]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.queue.close()

    async def drained(self) -> None:
        while len(self.queue) or self.queue._active:
            await asyncio.sleep(0.001)

    def seed_etcd(self, layout: Layout) -> None:
        items = []
        for j in range(layout.jobs):
            keys = JobKeys(NAMESPACE, layout.job(j), self.settings.etcd_prefix)
            for n in layout.job_nodes(j):
                items.append((keys.member(n), member(layout, j, n), 1))
            items.append((keys.progress, Progress(step=100, loss=1.0, samples_seen=0, world_size=400, time=time.time()).to_json(), 1))
        self.model.etcd_resynced(items)


def summarize(name: str, events: int, seconds: float, harness: Harness, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    lat = sorted(harness.latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3 if lat else 0.0

    return {
        "path": name,
        "events": events,
        "seconds": round(seconds, 3),
        "events_per_s": round(events / seconds, 1),
        "decisions": harness.decisions,
        "p50_ms": round(pct(0.50), 3),
        "p99_ms": round(pct(0.99), 3),
        "mean_ms": round(statistics.fmean(lat) * 1e3, 3) if lat else 0.0,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        **(extra or {}),
    }


# --- direct ----------------------------------------------------------------------------


async def _direct_harness(layout: Layout, workers: int) -> Harness:
    h = Harness(workers)
    h.model.nodes_listed([NodeInfo(layout.node(i)) for i in range(layout.nodes)])
    h.model.pods_listed([pod_info(layout, j, n) for j in range(layout.jobs) for n in layout.job_nodes(j)])
    h.seed_etcd(layout)
    h.start()
    await h.drained()
    h.latencies.clear()
    h.decisions = 0
    return h


async def run_direct(
    layout: Layout, count: int, seed: int, workers: int, rate: float, chunk: int, paced_count: int
) -> dict[str, Any]:
    """Throughput: the storm delivered in watch-sized chunks as fast as the controller takes
    them. Latency: a second storm paced at ``rate`` events/s, every decision timed."""
    h = await _direct_harness(layout, workers)
    events = [prepare(h, layout, e) for e in storm(layout, count, seed)]
    nodes: dict[str, NodeInfo] = {}
    start, cpu = time.perf_counter(), time.process_time()
    for i, event in enumerate(events):
        apply_direct(h, layout, nodes, event)
        if i % chunk == chunk - 1:
            await asyncio.sleep(0)
    await h.drained()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    await h.stop()
    # On a shared machine wall time includes other processes' turns; CPU time does not.
    throughput = summarize("direct", len(events), elapsed, h,
                           {"cpu_s": round(cpu, 3), "events_per_cpu_s": round(len(events) / cpu, 1)})

    h = await _direct_harness(layout, workers)
    paced = [prepare(h, layout, e) for e in storm(layout, paced_count, seed + 1)]
    nodes = {}
    tick = 0.005
    per_tick = max(1, round(rate * tick))
    start, cpu = time.perf_counter(), time.process_time()
    for i in range(0, len(paced), per_tick):
        for event in paced[i : i + per_tick]:
            apply_direct(h, layout, nodes, event)
        due = start + (i // per_tick + 1) * tick
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
    await h.drained()
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    await h.stop()
    lat = sorted(h.latencies)
    throughput.update(
        paced_rate=rate,
        paced_events=len(paced),
        paced_achieved_per_s=round(len(paced) / elapsed, 1),
        paced_decisions=h.decisions,
        paced_cpu_share=round(cpu / elapsed, 2),
        p50_ms=round(lat[len(lat) // 2] * 1e3, 3) if lat else 0.0,
        p99_ms=round(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3, 3) if lat else 0.0,
        peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    )
    return throughput


def prepare(h: Harness, layout: Layout, event: tuple[Any, ...]) -> tuple[Any, ...]:
    """Encode what etcd would deliver ahead of time: the bench times the controller only."""
    if event[0] == "rank-restart":
        _, j, n, count = event
        keys = JobKeys(NAMESPACE, layout.job(j), h.settings.etcd_prefix)
        return (*event, keys.member(n), member(layout, j, n, count))
    return event


def apply_direct(h: Harness, layout: Layout, nodes: dict[str, NodeInfo], event: tuple[Any, ...]) -> None:
    kind = event[0]
    model = h.model
    if kind in ("taint", "untaint", "ready"):
        node = event[1]
        info = nodes.get(node) or NodeInfo(node)
        if kind == "taint":
            info = NodeInfo(node, taints=(Taint(event[2]),), ready=info.ready)
        elif kind == "untaint":
            info = NodeInfo(node, taints=(), ready=info.ready)
        else:
            info = NodeInfo(node, taints=info.taints, ready=event[2])
        nodes[node] = info
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


# --- through the stand-in ----------------------------------------------------------------


def _kube_objects(layout: Layout) -> list[dict[str, Any]]:
    from kubeapi import objects

    out = [objects.node(layout.node(i)) for i in range(layout.nodes)]
    for j in range(layout.jobs):
        for n in layout.job_nodes(j):
            out.append(objects.pod(NAMESPACE, layout.pod(j, n), job=layout.job(j), node=n, annotations=ANNOTATIONS))
    return out


def apply_kube(api: Any, h: Harness | None, layout: Layout, event: tuple[Any, ...]) -> int:
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


class CountingSink:
    """Passes observations to the model and counts them."""

    def __init__(self, model: ClusterModel, on_event: Callable[[], None]) -> None:
        self.model = model
        self.on_event = on_event

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.model, name)
        if name in ("node_changed", "node_deleted", "pod_changed", "pod_deleted"):
            def counted(*args: Any) -> None:
                target(*args)
                self.on_event()
            return counted
        return target


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


async def run_http(layout: Layout, count: int, seed: int, workers: int) -> dict[str, Any]:
    async with standin(layout) as (api, api_client):
        return await _run_http(layout, count, seed, workers, api, api_client)


async def _run_http(layout: Layout, count: int, seed: int, workers: int, api: Any, api_client: Any) -> dict[str, Any]:
    from controller.kube.api import RawKube
    from controller.kube.source import KubeSource

    h = Harness(workers)
    seen = 0
    sink = CountingSink(h.model, lambda: None)
    h.seed_etcd(layout)
    source = KubeSource(RawKube(api_client), ControllerSettings().kube, h.reconciler.metrics)
    h.start()
    listed_at = time.perf_counter()
    source_task = asyncio.create_task(source.run(sink))  # type: ignore[arg-type]
    try:
        while not (h.model.nodes_synced and h.model.pods_synced and api.open_watches() == 2):
            await asyncio.sleep(0.005)
        list_seconds = time.perf_counter() - listed_at
        await h.drained()
        h.latencies.clear()
        h.decisions = 0

        def on_event() -> None:
            nonlocal seen
            seen += 1

        sink.on_event = on_event
        events = [prepare(h, layout, e) for e in storm(layout, count, seed)]
        expected = 0
        start, cpu = time.perf_counter(), time.process_time()
        for i, event in enumerate(events):
            expected += apply_kube(api, h, layout, event)
            if i % 50 == 49:
                await asyncio.sleep(0)
        applied = time.perf_counter() - start
        while seen < expected:
            await asyncio.sleep(0.001)
        await h.drained()
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    finally:
        source_task.cancel()
        await asyncio.gather(source_task, return_exceptions=True)
        await h.stop()
    return summarize("http", len(events), elapsed, h, {
        "initial_list_s": round(list_seconds, 2),
        "standin_writes_s": round(applied, 3),
        "kube_events": expected,
        "kube_events_per_s": round(expected / elapsed, 1),
        "cpu_s": round(cpu, 3),
        "events_per_cpu_s": round(len(events) / cpu, 1),
    })


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
            expected += apply_kube(api, None, layout, event)
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
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }


async def run_costs(layout: Layout) -> dict[str, Any]:
    """CPU cost of the storm's common events on one 50-node job (best of 15 x N calls):
    the model update plus the snapshot the next decision takes, and ``decide`` itself."""
    import timeit

    h = await _direct_harness(layout, 1)
    await h.stop()
    m, settings, j = h.model, h.settings, 7
    job = (NAMESPACE, layout.job(j))
    keys = JobKeys(NAMESPACE, layout.job(j), settings.etcd_prefix)
    other = layout.job_nodes(j)[5]

    def best(fn: Callable[[], None], number: int = 200) -> float:
        return round(min(timeit.repeat(fn, number=number, repeat=15)) / number * 1e6, 1)

    def decision() -> None:
        decide(m.snapshot(job), time.time(), settings)

    costs: dict[str, Any] = {"path": "costs (us per call)", "decide_steady_us": best(decision)}
    tainted = layout.job_nodes(j)[3]
    m.node_changed(NodeInfo(tainted, taints=(Taint("karpenter.sh/disrupted"),)))
    costs["decide_one_tainted_node_us"] = best(decision)
    m.node_changed(NodeInfo(tainted))
    restarts = iter(range(1, 10**9))

    def pod_restart() -> None:
        m.pod_changed(pod_info(layout, j, other, next(restarts)))
        m.snapshot(job)

    costs["pod_restart_and_snapshot_us"] = best(pod_restart)
    records = [member(layout, j, other, k) for k in range(1500)]
    ranks = iter(range(10**9))

    def rank_restart() -> None:
        m.etcd_put(keys.member(other), records[next(ranks) % len(records)], 2)
        m.snapshot(job)

    costs["rank_restart_and_snapshot_us"] = best(rank_restart, 100)

    def pod_delete_create() -> None:
        m.pod_deleted(NAMESPACE, layout.pod(j, other))
        m.snapshot(job)
        m.pod_changed(pod_info(layout, j, other))
        m.snapshot(job)

    costs["pod_delete_or_create_and_snapshot_us"] = round(best(pod_delete_create, 50) / 2, 1)
    return costs


def _one(args: argparse.Namespace) -> int:
    from regroup.telemetry import configure_logging

    # The storm makes the controller log thousands of cordons and re-forms; keep errors only.
    configure_logging(__import__("os").environ.get("REGROUP_LOG_LEVEL", "error"))
    layout = Layout()
    if args.costs:
        print(json.dumps(asyncio.run(run_costs(layout))))
        return 0
    if args.only == "direct":
        result = asyncio.run(run_direct(layout, args.events, args.seed, args.workers, args.rate, args.chunk,
                                        args.paced_events))
    elif args.only == "http":
        result = asyncio.run(run_http(layout, args.http_events, args.seed, args.workers))
    else:
        result = asyncio.run(run_anchor(layout, args.http_events, args.seed))
    print(json.dumps(result))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench controller", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events (under a minute)")
    parser.add_argument("--events", type=int, default=None, help="storm events fed directly (default 100000; quick 20000)")
    parser.add_argument("--http-events", type=int, default=None, help="storm events through the stand-in (default 20000; quick 4000)")
    parser.add_argument("--paced-events", type=int, default=None,
                        help="events of the paced latency run (default 50000; quick 10000)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=5000.0, help="offered events/s of the paced latency run (default 5000)")
    parser.add_argument("--chunk", type=int, default=500, help="events per delivery in the throughput run (a watch read)")
    parser.add_argument("--only", choices=("direct", "http", "anchor"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--costs", action="store_true", help="only print per-event CPU costs on one job (timeit)")
    args = parser.parse_args(argv)
    args.events = args.events or (20_000 if args.quick else 100_000)
    args.http_events = args.http_events or (4_000 if args.quick else 20_000)
    args.paced_events = args.paced_events or (10_000 if args.quick else 50_000)
    if args.only or args.costs:
        return _one(args)
    results = []
    for path in ("direct", "anchor", "http"):
        cmd = [sys.executable, "-m", "bench", "controller", "--only", path, "--events", str(args.events),
               "--http-events", str(args.http_events), "--seed", str(args.seed), "--workers", str(args.workers),
               "--rate", str(args.rate), "--chunk", str(args.chunk),
               "--paced-events", str(args.paced_events)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=timedelta(minutes=20).total_seconds(),
                             env={**__import__("os").environ, "REGROUP_LOG_LEVEL": "warning"})
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    direct, anchor, http = results
    report = {
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, Python {platform.python_version()}",
        "layout": "2000 nodes, 10000 pods, 200 jobs x 50 nodes",
        "results": results,
        "http_vs_anchor": round(http["kube_events_per_s"] / anchor["kube_events_per_s"], 3),
        "goals": {
            "events_per_s>=5000": direct["events_per_s"] >= 5000,
            "p99_ms<=20": direct["p99_ms"] <= 20,
            "peak_rss_mb<=300": direct["peak_rss_mb"] <= 300,
        },
    }
    print(f"{'path':<24}{'events':>8}{'events/s':>11}{'ev/CPU-s':>10}{'p50 ms':>9}{'p99 ms':>9}{'decisions':>11}{'peak MB':>9}")
    for r in results:
        print(f"{r['path']:<24}{r['events']:>8}{r['events_per_s']:>11}{r.get('events_per_cpu_s', '-'):>10}"
              f"{r.get('p50_ms', '-'):>9}{r.get('p99_ms', '-'):>9}{r.get('decisions', '-'):>11}{r['peak_rss_mb']:>9}")
    print(f"direct latency run: {direct['paced_events']} events offered at {direct['paced_rate']:.0f}/s, "
          f"achieved {direct['paced_achieved_per_s']}/s, {direct['paced_decisions']} decisions, "
          f"CPU share {direct['paced_cpu_share']}")
    print(f"http / anchor Kubernetes-event throughput: {report['http_vs_anchor']}  goals (direct): {report['goals']}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0
