"""The Kubernetes API stand-in in a process of its own, as the API server is in production.

The controller process then spends its CPU on what the controller does (reading the
watch streams, decoding, deciding), not on serving them, and its peak RSS is its own.
The stand-in process builds the same seeded storm the controller process builds and
writes it on command: as fast as it takes it, or each event at ``start + i / rate`` on
the shared monotonic clock (``time.perf_counter`` is system-wide on Linux), so the
controller process knows when each write was due without a message per event.
"""

from __future__ import annotations

import asyncio
import gc
import multiprocessing
import shutil
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .storm import ANNOTATIONS, NAMESPACE, Event, Layout, storm

NODE_EVENTS = ("taint", "untaint", "ready")


def kube_objects(layout: Layout) -> list[dict[str, Any]]:
    from kubeapi import objects

    out = [objects.node(layout.node(i)) for i in range(layout.nodes)]
    for j, n in layout.placements():
        out.append(objects.pod(NAMESPACE, layout.pod(j, n), job=layout.job(j), node=n, annotations=ANNOTATIONS))
    return out


def write_event(api: Any, layout: Layout, event: Event) -> int:
    """Write one storm event into the stand-in; returns how many watch events it makes
    (rank restarts come from etcd, not from Kubernetes: none)."""
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
    elif kind == "pod-delete":
        _, j, n = event
        api.delete("Pod", layout.pod(j, n), namespace=NAMESPACE)
    elif kind == "pod-create":
        _, j, n = event
        api.create(objects.pod(NAMESPACE, layout.pod(j, n), job=layout.job(j), node=n, annotations=ANNOTATIONS))
    else:
        return 0
    return 1


def kube_event_count(events: list[Event]) -> int:
    """How many watch events writing ``events`` makes."""
    return sum(1 for e in events if e[0] != "rank-restart")


class StandinProcess:
    """``async with StandinProcess(layout) as standin``: the stand-in, loaded with the
    cluster and listening, in a child process; ``standin.kubeconfig`` reaches it."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self.kubeconfig = Path()
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, layout), name="kubeapi-standin", daemon=True)

    async def __aenter__(self) -> StandinProcess:
        self._process.start()
        self.kubeconfig = Path(await asyncio.to_thread(self._conn.recv))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._conn.send(("stop",))
        await asyncio.to_thread(self._process.join, 30)
        if self._process.is_alive():
            self._process.kill()

    async def _ask(self, *command: Any) -> Any:
        self._conn.send(command)
        return await asyncio.to_thread(self._conn.recv)

    async def open_watches(self) -> int:
        return int(await self._ask("watches"))

    async def write(self, seed: int, count: int, rate: float | None = None, start: float | None = None) -> dict[str, float]:
        """Write ``storm(layout, count, seed)``: as fast as the stand-in takes it (``rate``
        None), else event i at ``start + i / rate``. Returns the stand-in's seconds and CPU."""
        return dict(await self._ask("write", seed, count, rate, start))


def _serve(conn: Connection, layout: Layout) -> None:
    asyncio.run(_serve_async(conn, layout))


async def _serve_async(conn: Connection, layout: Layout) -> None:
    from kubeapi.server import FakeKubeAPI

    api = FakeKubeAPI(history_limit=1_000_000)
    for obj in kube_objects(layout):
        api.create(obj)
    await api.start()
    # The loaded cluster lives as long as the process: no collection walks it. Nor does one
    # walk what the storm writes: each version of an object and each change kept for the
    # watches is freed by reference counting, and a full collection over a growing history
    # stalls every watch stream for tens of milliseconds (p99 from write to watch receipt
    # 8-11 ms with it, 2.2 ms without, at 5,000 writes/s), which the real API server, whose
    # collector runs beside its goroutines, never does.
    gc.freeze()
    gc.disable()
    folder = tempfile.mkdtemp(prefix="regroup-bench-")
    try:
        conn.send(str(api.write_kubeconfig(Path(folder) / "kubeconfig")))
        while True:
            # The loop keeps serving the watches while this waits for the next command.
            command = await asyncio.to_thread(conn.recv)
            if command[0] == "watches":
                conn.send(api.open_watches())
            elif command[0] == "write":
                conn.send(await _write(api, layout, *command[1:]))
            else:
                return
    finally:
        await api.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def _write(api: Any, layout: Layout, seed: int, count: int, rate: float | None, start: float | None) -> dict[str, float]:
    from .harness import offer

    events = storm(layout, count, seed)
    began, cpu = time.perf_counter(), time.process_time()
    if rate is None:
        for i, event in enumerate(events):
            write_event(api, layout, event)
            if i % 50 == 49:
                await asyncio.sleep(0)  # let the watches stream what is written
    else:
        await offer(events, rate, lambda event, arrived: write_event(api, layout, event), start=start)
    return {"standin_writes_s": round(time.perf_counter() - began, 3), "standin_cpu_s": round(time.process_time() - cpu, 3)}
