"""A running controller against real etcd and the Kubernetes API stand-in.

The tests play the agents and trainers by writing their records into etcd directly
(the real agents are tested in tests/rendezvous), and play the kubelet and the cloud
through the stand-in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import time
import weakref
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import yaml
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from regroup.controller.kube.actuator import KubeActuator
from regroup.controller.kube.api import RawKube
from regroup.controller.kube.source import KubeSource
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.runtime import run_controller
from regroup.controller.settings import ControllerSettings, KubeSettings, RuntimeSettings
from regroup.etcd import EtcdSettings, EventKind
from regroup.keys import JobKeys
from regroup.records import CheckpointAck, MemberRecord, Progress, Record
from kubeapi import objects
from kubeapi.rbac import Authorizer, manifest_authorizer
from kubeapi.server import FakeKubeAPI

R = TypeVar("R", bound=Record)

NS = "ml"
WAIT = 15.0

DEPLOY_BASE = Path(__file__).resolve().parents[2] / "deploy" / "base"
CONTROLLER_NS: str = yaml.safe_load((DEPLOY_BASE / "kustomization.yaml").read_text())["namespace"]
"""Where deploy/base installs the controller, its RBAC and so its leader-election Lease."""


@functools.cache
def controller_rbac() -> Authorizer:
    """What deploy/base/rbac.yaml lets the controller Deployment's ServiceAccount do."""
    docs = list(yaml.safe_load_all((DEPLOY_BASE / "controller.yaml").read_text()))
    (deployment,) = [d for d in docs if d and d["kind"] == "Deployment"]
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    return manifest_authorizer(DEPLOY_BASE / "rbac.yaml", CONTROLLER_NS, account)


_OTHER_CLIENTS: weakref.WeakKeyDictionary[FakeKubeAPI, set[int]] = weakref.WeakKeyDictionary()
"""Per stand-in, the ids of the requests a test made over HTTP playing another client (a
drain's eviction, say): not the controller's, so not checked against its RBAC."""


def check_rbac(api: FakeKubeAPI, first: int, who: str = "the controller") -> None:
    """Every request the stand-in received from index ``first`` on is one deploy/base/rbac.yaml
    allows, leaving out those the test made as another client (``Cluster.evict``)."""
    others = _OTHER_CLIENTS.get(api, set())
    controller_rbac().check([r for r in api.requests[first:] if id(r) not in others], who)


def controller_namespace(api: FakeKubeAPI) -> str:
    """The controller's namespace (its Lease lives there), made if the stand-in lacks it."""
    if api.get("Namespace", CONTROLLER_NS) is None:
        api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": CONTROLLER_NS}})
    return CONTROLLER_NS


def fast_settings(identity: str = "ctl-a") -> ControllerSettings:
    return ControllerSettings(
        runtime=RuntimeSettings(identity=identity, lease_ttl=timedelta(seconds=3), etcd_retry=timedelta(milliseconds=100)),
        kube=KubeSettings(
            backoff=timedelta(milliseconds=50),
            backoff_max=timedelta(milliseconds=500),
            lease_duration=timedelta(seconds=3),
            renew_deadline=timedelta(seconds=2),
            retry_period=timedelta(milliseconds=200),
        ),
    )


def notes(min_nodes: int = 2, max_nodes: int = 4, **extra: str) -> dict[str, str]:
    out = {"regroup.dev/min-nodes": str(min_nodes), "regroup.dev/max-nodes": str(max_nodes)}
    out.update({f"regroup.dev/{k.replace('_', '-')}": v for k, v in extra.items()})
    return out


class Cluster:
    """The test's hands: Kubernetes objects through the stand-in, agent/trainer records in etcd."""

    def __init__(self, api: FakeKubeAPI, client: Any) -> None:
        self.api = api
        self.etcd = client

    def add_node(self, name: str, **kw: Any) -> None:
        self.api.create(objects.node(name, **kw))

    def add_pod(self, job: str, node: str, annotations: dict[str, str], **kw: Any) -> str:
        name = f"{job}-{node}"
        self.api.create(objects.pod(NS, name, job=job, node=node, annotations=annotations, **kw))
        return name

    async def member(self, job: str, node: str, round_: int, restarts: int = 0, lease: Any = None,
                     joined_at: float | None = None, **fields: Any) -> MemberRecord:
        record = MemberRecord(node=node, pod=f"{job}-{node}", namespace=NS, round=round_, local_world_size=2,
                              restart_count=restarts, joined_at=time.time() if joined_at is None else joined_at,
                              **fields)
        await self.etcd.put(JobKeys(NS, job).member(node).encode(), record.to_json(), lease=lease)
        return record

    async def evict(self, kube_client: Any, pod: str, grace: int | None = None) -> dict[str, Any]:
        """``POST pods/<pod>/eviction`` as a drain does it (over HTTP, with the real client);
        returns the pod as stored after it. With ``graceful_pod_deletion`` the stand-in marks
        the pod (``deletionTimestamp``, ``deletionGracePeriodSeconds``) and the test plays the
        kubelet's final delete."""
        from kubernetes_asyncio import client

        first = len(self.api.requests)
        eviction = client.V1Eviction(
            metadata=client.V1ObjectMeta(name=pod, namespace=NS),
            delete_options=client.V1DeleteOptions(grace_period_seconds=grace) if grace is not None else None,
        )
        await client.CoreV1Api(kube_client).create_namespaced_pod_eviction(pod, NS, eviction)
        _OTHER_CLIENTS.setdefault(self.api, set()).update(id(r) for r in self.api.requests[first:])
        stored = self.api.get("Pod", pod, NS)
        assert stored is not None, f"pod {pod} was deleted at once, not marked"
        return stored

    async def drop_member(self, job: str, node: str) -> None:
        await self.etcd.delete(JobKeys(NS, job).member(node).encode())

    async def ack(self, job: str, generation: int, step: int, world_size: int) -> None:
        ack = CheckpointAck(generation=generation, step=step, checkpoint_id=f"step-{step}", duration_s=0.1,
                            world_size=world_size, acked_at=time.time())
        await self.etcd.put(JobKeys(NS, job).ack(generation).encode(), ack.to_json())

    async def progress(self, job: str, step: int, world_size: int, resumed_from: int = 0, **fields: Any) -> None:
        record = Progress(step=step, loss=1.0, samples_seen=step * 8, world_size=world_size, time=time.time(),
                          resumed_from_step=resumed_from, **fields)
        await self.etcd.put(JobKeys(NS, job).progress.encode(), record.to_json())

    async def job(self, job: str, nodes: list[str], annotations: dict[str, str], round_: int = 1, step: int = 10) -> None:
        """A running job: nodes, one pod and one member each, trainer progress."""
        for node in nodes:
            if self.api.get("Node", node) is None:
                self.add_node(node)
            self.add_pod(job, node, annotations)
            await self.member(job, node, round_)
        await self.progress(job, step, 2 * len(nodes))

    async def read(self, key: str, cls: type[R]) -> R | None:
        got = await self.etcd.get(key.encode())
        return cls.from_json(got.value) if got is not None else None

    async def wait_record(self, key: str, cls: type[R], predicate: Callable[[R], bool] = lambda r: True,
                          timeout: float = WAIT) -> R:
        """Await the first value of ``key`` that satisfies ``predicate`` (watching, not polling)."""
        listing = await self.etcd.get_prefix(key.encode())
        for kv in listing.kvs:
            if kv.key.decode() == key and predicate(record := cls.from_json(kv.value)):
                return record
        start = listing.header.revision + 1
        watch = await self.etcd.watch(key.encode(), start_revision=start)
        try:
            async with asyncio.timeout(timeout):
                async for event in watch:
                    if event.kind == EventKind.PUT and predicate(record := cls.from_json(event.kv.value)):
                        return record
        finally:
            await watch.cancel()
        raise AssertionError(f"{key} watch ended")

    async def wait_deleted(self, key: str, timeout: float = WAIT) -> None:
        """Await ``key``'s absence (watching, not polling)."""
        listing = await self.etcd.get_prefix(key.encode())
        if not any(kv.key.decode() == key for kv in listing.kvs):
            return
        watch = await self.etcd.watch(key.encode(), start_revision=listing.header.revision + 1)
        try:
            async with asyncio.timeout(timeout):
                async for event in watch:
                    if event.kind == EventKind.DELETE and event.kv.key.decode() == key:
                        return
        finally:
            await watch.cancel()
        raise AssertionError(f"{key} watch ended")


@contextlib.asynccontextmanager
async def controller(
    api: FakeKubeAPI,
    kubeconfig: Any,
    etcd: EtcdSettings,
    settings: ControllerSettings | None = None,
) -> AsyncIterator[tuple[ControllerMetrics, InMemorySpanExporter]]:
    """``run_controller`` with the real Kubernetes adapter, until the block ends. A block
    that ends cleanly also checks every API call the controller made against the RBAC."""
    from regroup.controller.kube.api import load_api_client

    first = len(api.requests)
    settings = settings or fast_settings()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = ControllerMetrics()
    api_client = await load_api_client(kubeconfig)
    raw = RawKube(api_client)
    ready = asyncio.Event()
    task = asyncio.create_task(
        run_controller(settings, KubeSource(raw, settings.kube, metrics), KubeActuator(raw, settings.kube), etcd,
                       ready=ready, tracer_provider=provider, metrics=metrics)
    )
    waiter = asyncio.create_task(ready.wait())
    try:
        async with asyncio.timeout(WAIT):
            done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            task.result()
        yield metrics, exporter
    finally:
        waiter.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(asyncio.CancelledError):
            await waiter
        await api_client.close()
    check_rbac(api, first)


@contextlib.asynccontextmanager
async def replica(
    api: FakeKubeAPI, kubeconfig: Any, etcd: EtcdSettings, settings: ControllerSettings
) -> AsyncIterator[tuple[Any, asyncio.Task[None], ControllerMetrics]]:
    """One controller replica behind leader election (Lease ``regroup-controller`` in the
    controller's namespace), as ``regroup controller`` runs it; yields (elector, task,
    metrics). A block that ends cleanly checks the calls made meanwhile against the RBAC."""
    from regroup.controller.kube.api import load_api_client
    from regroup.controller.kube.leader import LeaderElector

    first = len(api.requests)
    metrics = ControllerMetrics()
    api_client = await load_api_client(kubeconfig)
    raw = RawKube(api_client)
    identity = settings.runtime.identity
    elector = LeaderElector(raw, controller_namespace(api), "regroup-controller", identity, settings.kube, metrics)

    async def lead() -> None:
        await run_controller(settings, KubeSource(raw, settings.kube, metrics), KubeActuator(raw, settings.kube), etcd,
                             metrics=metrics)

    task = asyncio.create_task(elector.run(lead))
    try:
        yield elector, task, metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await api_client.close()
    check_rbac(api, first, f"replica {identity}")


def sample(metrics: ControllerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def replace_settings(settings: ControllerSettings, **runtime: Any) -> ControllerSettings:
    return dataclasses.replace(settings, runtime=dataclasses.replace(settings.runtime, **runtime))


async def until(predicate: Callable[[], Any], timeout: float = WAIT) -> Any:
    """Await a condition of in-process state (metrics, exported spans) that another task sets."""
    async with asyncio.timeout(timeout):
        while not (value := predicate()):
            await asyncio.sleep(0.01)
    return value
