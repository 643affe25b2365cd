"""A whole cluster on this machine, for the tests of what happens to a running job.

The Kubernetes API stand-in (``kubeapi``) with graceful pod deletion, evictions and
disruption budgets; a kubelet stand-in (``tests.kubeapi.kubelet``) that runs each bound
pod's container as a real process and restarts or ends it as a kubelet does; each
container a real ``regroup-run --standby`` agent (or plain ``torchrun`` on the ``etcd-v3``
backend, ``running(..., launcher="torchrun")``) whose workers run the built-in trainer on
gloo with real checkpoints; real etcd (with client-certificate auth and one identity per job,
``running(..., auth=...)``); and the real controller with its Kubernetes adapter.
Nothing is mocked; the test acts as ``kubectl`` (evict, cordon) and reads what etcd and the
API server hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kubeapi import objects
from kubeapi.server import FakeKubeAPI
from regroup.controller.settings import ControllerSettings
from regroup.demo.etcd_server import EtcdServer
from regroup.etcd import EtcdSettings
from regroup.etcd.watch import EventKind
from regroup.etcd.auth import job_user
from regroup.keys import JobKeys
from regroup.records import Progress, ReformCause, ReformPhase, ReformPlan
from tests.controller.harness import Cluster, controller, fast_settings
from tests.etcd_helpers import AuthEtcd
from tests.elastic.harness import events, write_config
from tests.kubeapi.kubelet import ContainerCommand, Kubelet

NS = "ml"
JOB = "llm"
WAIT = 120.0
"""Upper bound for what a loaded 2-core machine does well within it (a re-form, a start)."""


@dataclass
class Bed:
    """The test's hands on the cluster: nodes and pods through the stand-in, the job's
    records through etcd, the agents' logs on disk."""

    api: FakeKubeAPI
    etcd: EtcdServer | AuthEtcd
    cluster: Cluster
    root: Path
    env: dict[str, str]
    kubelet: Kubelet | None = None
    trainer: dict[str, Any] = field(default_factory=dict)
    term_grace: float = 30.0
    """``regroup-run --term-grace``: the pods' ``terminationGracePeriodSeconds``."""
    lease_ttl: float = 2.0
    """The agents' member lease TTL (``--rdzv-conf lease_ttl``)."""
    spans: InMemorySpanExporter | None = None
    """The controller's exported spans (one trace per finished re-form)."""
    auth: AuthEtcd | None = None
    """An etcd with client-certificate auth: the agents (and through ``regroup-run`` their
    workers) hold only the job's certificate, the controller makes the job's identity."""
    launcher: str = "regroup-run"
    """What each container runs: ``regroup-run --standby``, or ``torchrun`` (torch's own
    agent: every re-form restarts the workers, which load the newest checkpoint)."""
    max_nodes: int = 3
    """The job's ``--nnodes`` maximum (and ``regroup.dev/max-nodes``)."""
    member: str = "node"
    """What one member of the job is (``regroup.dev/member``): ``node``, or ``pod`` (each agent
    keyed by its pod's name, ``--rdzv-conf node_name={pod}``; logs are then per pod)."""

    def __post_init__(self) -> None:
        sections = {
            "batch": {"global_batch_size": 12},
            "checkpoint": {"dir": str(self.root / "ckpt"), "every_steps": 10},
            "etcd": {"endpoint": self.etcd.endpoint, "job": JOB, "namespace": NS, "progress_interval": "100ms"},
            "snapshot": {"every": 1},
            "max_steps": 100000,
            "step_time_floor": "50ms",
            "device": "cpu",
            **self.trainer,
        }
        self.config = write_config(self.root / "train.yaml", **sections)
        self.keys = JobKeys(NS, JOB)

    # -- the workload ------------------------------------------------------------------------

    def add(
        self, node: str, *, pod_name: str = "", restart_policy: str = "Always", min_nodes: int = 1, max_nodes: int = 0
    ) -> str:
        """A node and a worker pod of the job bound to it (``pod_name``: its name, default
        ``<job>-<node>``); the kubelet starts its agent."""
        if self.api.get("Node", node) is None:
            self.api.create(objects.node(node))
        name = pod_name or f"{JOB}-{node}"
        notes = {
            "regroup.dev/min-nodes": str(min_nodes), "regroup.dev/max-nodes": str(max_nodes or self.max_nodes),
            "regroup.dev/checkpoint-timeout": "20s", "regroup.dev/join-window": "1s",
            "regroup.dev/member": self.member,
        }  # fmt: skip
        pod = objects.pod(NS, name, job=JOB, node=node, annotations=notes, phase="Pending",
                          termination_grace_period=int(self.term_grace))  # fmt: skip
        pod["spec"]["restartPolicy"] = restart_policy
        self.api.create(pod)
        return name

    def launch(self, pod: dict[str, Any]) -> ContainerCommand:
        node = pod["spec"]["nodeName"]
        agent = ["torch.distributed.run"] if self.launcher == "torchrun" else [
            "regroup.rendezvous.inplace.launcher", "--standby", f"--term-grace={self.term_grace:g}",
        ]  # fmt: skip
        argv = [
            sys.executable, "-m", *agent,
            "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={self.etcd.endpoint}", f"--rdzv-id={JOB}",
            f"--nnodes=1:{self.max_nodes}", "--nproc-per-node=1", "--max-restarts=3", "--monitor-interval=0.1",
            f"--rdzv-conf={self.rdzv_conf()}",
            "--local-addr=127.0.0.1", "-m", "regroup.trainer", "--config", str(self.config),
        ]  # fmt: skip
        env = {**self.env, "POD_NAME": pod["metadata"]["name"], "POD_NAMESPACE": NS, "NODE_NAME": node}
        key = pod["metadata"]["name"] if self.member == "pod" else node
        return ContainerCommand(argv, env, self.root / "logs" / f"{key}.log")

    def rdzv_conf(self) -> str:
        conf = {"lease_ttl": f"{self.lease_ttl:g}", "last_call_timeout": "1", "join_timeout": "300"}
        if self.member == "pod":
            conf["node_name"] = "{pod}"
        if self.auth is not None:
            conf.update(self.auth.rdzv_conf(job_user(self.keys)))
        return ",".join(f"{k}={v}" for k, v in conf.items())

    def log(self, node: str) -> str:
        path = self.root / "logs" / f"{node}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, node: str, name: str) -> list[dict[str, Any]]:
        return events(self.log(node), name)

    async def logged(self, node: str, name: str, timeout: float = WAIT) -> list[dict[str, Any]]:
        """Await the agent or workers of ``node`` logging event ``name`` (a file: polled)."""
        async with asyncio.timeout(timeout):
            while not (found := self.events(node, name)):
                await asyncio.sleep(0.1)
        return found

    def pod(self, node: str) -> dict[str, Any] | None:
        return self.api.get("Pod", f"{JOB}-{node}", NS)

    def kube_events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.api.events(NS) if e.get("reason") == reason]

    # -- the job's records -------------------------------------------------------------------

    async def progress(self, what: str, predicate: Callable[[Progress], bool], timeout: float = WAIT) -> Progress:
        try:
            return await self.cluster.wait_record(self.keys.progress, Progress, predicate, timeout)
        except TimeoutError:
            raise AssertionError(f"no progress with {what} within {timeout:.0f}s") from None

    async def plan(self, what: str, predicate: Callable[[ReformPlan], bool], timeout: float = WAIT) -> ReformPlan:
        try:
            return await self.cluster.wait_record(self.keys.plan, ReformPlan, predicate, timeout)
        except TimeoutError:
            raise AssertionError(f"no re-form plan with {what} within {timeout:.0f}s") from None

    async def until(self, what: str, predicate: Callable[[FakeKubeAPI], Any], timeout: float = WAIT) -> Any:
        try:
            return await self.api.wait_for(predicate, timeout=timeout)
        except TimeoutError:
            raise AssertionError(f"the cluster did not reach: {what} within {timeout:.0f}s") from None


def settings(identities: bool = False) -> ControllerSettings:
    base = fast_settings()
    return dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, etcd_job_identities=identities))


@contextlib.asynccontextmanager
async def running(
    api: FakeKubeAPI,
    kubeconfig: Path,
    etcd: EtcdServer | AuthEtcd,
    etcd_client: Any,
    root: Path,
    env: dict[str, str],
    nodes: list[str],
    restart_policy: str = "Always",
    pods: dict[str, str] | None = None,
    **bed: Any,
) -> AsyncIterator[Bed]:
    """The cluster with the controller running and one worker pod per node (``restart_policy``
    theirs), or the ``pods`` given (pod name -> its node); ends every process and task it started. On an ``AuthEtcd`` the controller holds
    its own certificate and makes the job's identity (``--etcd-job-identities``), the agents
    hold the job's, and ``etcd_client`` must be a client of the controller's identity."""
    api.graceful_pod_deletion = True
    auth = etcd if isinstance(etcd, AuthEtcd) else None
    testbed = Bed(api, etcd, Cluster(api, etcd_client), root, env, auth=auth, **bed)
    etcd_settings = auth.settings(AuthEtcd.CONTROLLER) if auth else EtcdSettings.from_endpoint_string(etcd.endpoint)
    async with controller(api, kubeconfig, etcd_settings, settings(identities=auth is not None)) as (_, spans):
        testbed.spans = spans
        async with Kubelet(api, nodes, testbed.launch, restart_backoff=timedelta(seconds=0.5)) as kubelet:
            testbed.kubelet = kubelet
            for pod, node in (pods or {f"{JOB}-{n}": n for n in nodes}).items():
                testbed.add(node, pod_name=pod, restart_policy=restart_policy)
            yield testbed


@dataclass(frozen=True)
class Change:
    """One change of a key under the job, as etcd ordered it."""

    revision: int
    key: str
    value: bytes | None
    """None: deleted."""


class History(list[Change]):
    """The changes seen so far, in etcd's order; ``until`` awaits one."""

    def __init__(self) -> None:
        super().__init__()
        self._more = asyncio.Event()

    def add(self, change: Change) -> None:
        self.append(change)
        self._more.set()

    async def until(self, what: str, predicate: Callable[[Change], bool], timeout: float = WAIT) -> Change:
        """The first change that satisfies ``predicate``, awaited if not seen yet."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    found = next((c for c in self if predicate(c)), None)
                    if found is not None:
                        return found
                    self._more.clear()
                    await self._more.wait()
        except TimeoutError:
            raise AssertionError(f"etcd's history did not show: {what} within {timeout:.0f}s") from None


@contextlib.asynccontextmanager
async def history(client: Any, keys: JobKeys) -> AsyncIterator[History]:
    """Every change under the job's keys from now on, in etcd's order (a watch), while the
    block runs: what happened before what, from etcd's revisions rather than from clocks."""
    start = (await client.get_prefix(keys.root.encode())).header.revision + 1
    changes = History()
    watch = await client.watch_prefix(keys.root.encode(), start_revision=start)

    async def record() -> None:
        async for event in watch:
            deleted = event.kind == EventKind.DELETE
            changes.add(Change(event.kv.mod_revision, event.kv.key.decode(), None if deleted else event.kv.value))

    recorder = asyncio.create_task(record())
    try:
        yield changes
    finally:
        await watch.cancel()
        recorder.cancel()
        await asyncio.gather(recorder, return_exceptions=True)


def done(cause: ReformCause, nodes_after: list[str]) -> Any:
    """A finished plan of ``cause`` to ``nodes_after``, in whatever positions the round gave them."""
    return lambda p: (p.phase == ReformPhase.DONE and p.cause == cause and sorted(p.nodes_after) == nodes_after)


async def evict(bed: Bed, kube_client: Any, node: str, grace: int) -> float:
    """``kubectl``'s eviction of the job's pod on ``node``; returns when it was asked."""
    at = time.time()
    await bed.cluster.evict(kube_client, f"{JOB}-{node}", grace)
    return at


async def left_inside_its_grace(bed: Bed, node: str, evicted_at: float, grace: float) -> float:
    """Await the pod's end (its agent exited, the kubelet removed it); returns how long it took."""
    await bed.until(f"pod {JOB}-{node} gone", lambda api: api.get("Pod", f"{JOB}-{node}", NS) is None, grace + 30)
    took = time.time() - evicted_at
    assert took < grace, f"{node} was still there when its {grace:g}s grace ended ({took:.1f}s)"
    assert not bed.events(node, "Received 15 death signal, shutting down workers"), bed.log(node)[-3000:]
    return took
