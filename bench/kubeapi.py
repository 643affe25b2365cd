"""How fast the stand-in serves, so a benchmark can tell its limits from the controller's.

    python -m bench kubeapi [--nodes 2000] [--pods 10000] [--events 10000]

Measures, with the cluster size of the controller benchmark loaded:
- watch delivery: in-process pod writes, read back as raw JSON lines from one HTTP watch;
  anchor: a bare aiohttp handler streaming the same lines (the transport's own ceiling);
- HTTP writes: sequential strategic-merge patches through kubernetes_asyncio; anchor: GET
  /version through the same client (the per-request cost of client and HTTP alone);
- peak resident memory of the process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from kubernetes_asyncio import client, config

from kubeapi import objects
from kubeapi.server import FakeKubeAPI


def _restart(i: int) -> dict[str, object]:
    return {"status": {"containerStatuses": [{"name": "worker", "image": "regroup:test", "imageID": "",
                                              "ready": True, "restartCount": i}]}}  # fmt: skip


async def _read_lines(response: aiohttp.ClientResponse, count: int) -> None:
    for _ in range(count):
        if not await response.content.readline():
            raise RuntimeError("the watch ended early")


async def _watch_delivery(api: FakeKubeAPI, v1: client.CoreV1Api, pods: int, count: int) -> float:
    version = str(api.resource_version)
    response = await v1.list_pod_for_all_namespaces(
        label_selector=objects.JOB_LABEL, watch=True, resource_version=version, _preload_content=False
    )
    try:
        reader = asyncio.create_task(_read_lines(response, count))
        await api.wait_for(lambda a: a.open_watches("Pod") == 1)
        start = time.perf_counter()
        for i in range(count):
            api.patch("Pod", f"p{i % pods}", _restart(i + 1), namespace=f"ns{i % pods % 200}")
            if i % 500 == 0:
                await asyncio.sleep(0)  # let the stream drain as a storm spread over time would
        await reader
        return count / (time.perf_counter() - start)
    finally:
        response.release()


async def _anchor_stream(line: bytes, count: int) -> float:
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for i in range(count):
            await response.write(line)
            if i % 500 == 0:
                await asyncio.sleep(0)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession() as session:
            start = time.perf_counter()
            async with session.get(f"http://127.0.0.1:{port}/") as response:
                for _ in range(count):
                    await response.content.readline()
            return count / (time.perf_counter() - start)
    finally:
        await runner.cleanup()


async def _http_writes(v1: client.CoreV1Api, count: int) -> tuple[float, float]:
    start = time.perf_counter()
    for i in range(count):
        response = await v1.patch_node(f"n{i}", {"spec": {"unschedulable": True}}, _preload_content=False)
        await response.read()
    patches = count / (time.perf_counter() - start)
    version = client.VersionApi(v1.api_client)
    start = time.perf_counter()
    for _ in range(count):
        response = await version.get_code(_preload_content=False)
        await response.read()
    anchor = count / (time.perf_counter() - start)
    return patches, anchor


async def measure(nodes: int, pods: int, events: int) -> dict[str, float]:
    api = FakeKubeAPI()
    await api.start()
    try:
        start = time.perf_counter()
        for i in range(nodes):
            api.create(objects.node(f"n{i}"))
        for i in range(pods):
            api.create(objects.pod(f"ns{i % 200}", f"p{i}", job=f"job{i % 200}", node=f"n{i % nodes}"))
        load_s = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as tmp:
            configuration = client.Configuration()
            await config.load_kube_config(
                config_file=str(api.write_kubeconfig(Path(tmp) / "kubeconfig")), client_configuration=configuration
            )
        async with client.ApiClient(configuration) as api_client:
            v1 = client.CoreV1Api(api_client)
            start = time.perf_counter()
            listed = await v1.list_pod_for_all_namespaces(label_selector=objects.JOB_LABEL, _preload_content=False)
            await listed.read()
            list_s = time.perf_counter() - start
            delivered = await _watch_delivery(api, v1, pods, events)
            sample = api.get("Pod", "p0", "ns0")
            anchor_stream = await _anchor_stream(
                json.dumps({"type": "MODIFIED", "object": sample}).encode() + b"\n", events
            )
            writes = min(1000, nodes)
            patches, anchor_requests = await _http_writes(v1, writes)
    finally:
        await api.stop()
    return {
        "load_objects_per_s": (nodes + pods) / load_s,
        "list_all_pods_s": list_s,
        "watch_events_per_s": delivered,
        "anchor_stream_lines_per_s": anchor_stream,
        "watch_vs_anchor": delivered / anchor_stream,
        "http_patches_per_s": patches,
        "anchor_requests_per_s": anchor_requests,
        "patches_vs_anchor": patches / anchor_requests,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench kubeapi", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("--nodes", type=int, default=2000, help="nodes loaded before measuring")
    parser.add_argument("--pods", type=int, default=10000, help="worker pods loaded (200 jobs, 200 namespaces)")
    parser.add_argument("--events", type=int, default=10000, help="pod writes streamed through one watch")
    args = parser.parse_args(argv)
    results = asyncio.run(measure(args.nodes, args.pods, args.events))
    for name, value in results.items():
        print(f"{name:28s} {value:12.2f}")
    return 0

