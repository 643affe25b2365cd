"""The jobs of one run, as the cluster and the agents see them.

Each change is made where production makes it: nodes, pods and taints in the Kubernetes
API stand-in that the controller watches (the kubelet's and the cloud's part), agents
started, killed or finished in their host process. ``News`` collects what the agents
report (a world formed, a trainer stepped in it, a job finished) for whoever awaits it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

from bench.platform.agent_host import AgentHost
from bench.platform.agent_specs import JobPlacement, JobTls
from kubeapi import objects
from kubeapi.server import FakeKubeAPI

T = TypeVar("T")

NAMESPACE = "bench"
RECLAIM_TAINT = "aws-node-termination-handler/spot-itn"
"""A built-in reclaim signal with a 2 min notice: the controller plans a shrink."""


@dataclass(frozen=True)
class Formed:
    round: int
    world_size: int
    at: float
    """Unix time the last agent of the world returned from ``next_rendezvous``."""


@dataclass
class News:
    """What the agent hosts reported; ``until`` awaits a condition on it."""

    worlds: dict[str, list[Formed]] = field(default_factory=dict)
    resumed: dict[str, int] = field(default_factory=dict)
    """The newest round each job's trainer stepped in."""
    finished: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def take(self, news: tuple[Any, ...]) -> None:
        kind = news[0]
        if kind == "formed":
            _, job, round_, size, at = news
            self.worlds.setdefault(job, []).append(Formed(round_, size, at))
        elif kind == "resumed":
            self.resumed[news[1]] = max(news[2], self.resumed.get(news[1], 0))
        elif kind == "finished":
            self.finished.add(news[1])
        elif kind == "error":
            self.errors.append(f"{news[1]} {news[2]}: {news[3]}".strip())
        self._changed.set()

    def world(self, job: str) -> Formed | None:
        worlds = self.worlds.get(job)
        return worlds[-1] if worlds else None

    async def until(self, predicate: Callable[[], T | None], timeout: float) -> T | None:
        """``predicate()`` once it is truthy, checked after each piece of news; None after ``timeout``."""
        try:
            async with asyncio.timeout(timeout):
                while not (value := predicate()):
                    self._changed.clear()
                    await self._changed.wait()
                return value
        except TimeoutError:
            return None


@dataclass
class Job:
    name: str
    host: AgentHost
    min_nodes: int
    max_nodes: int
    live: list[str] = field(default_factory=list)
    """Nodes whose agent runs (not killed, not under a reclaim notice)."""
    gone: list[str] = field(default_factory=list)
    """Nodes lost or reclaimed whose node and pod are still in the cluster."""
    next_index: int = 0
    busy: bool = False
    """A change is in flight (churn leaves the job alone until it is replaced)."""
    ended: bool = False


class Jobs:
    """Every job of the run; each method is one change, made in the cluster and the agents."""

    def __init__(
        self, api: FakeKubeAPI, annotations: dict[str, str], tls: Callable[[str, str], JobTls] | None = None
    ) -> None:
        """``tls(namespace, job)``: the job's certificate, with authentication on."""
        self.api = api
        self.annotations = annotations
        self.tls = tls
        self.all: dict[str, Job] = {}

    @staticmethod
    def pod_name(job: str, node: str) -> str:
        return f"{job}-{node.rsplit('-', 1)[-1]}"

    def _add_node(self, job: Job) -> tuple[str, str]:
        node = f"{job.name}-n{job.next_index:03d}"
        job.next_index += 1
        pod = self.pod_name(job.name, node)
        self.api.create(objects.node(node))
        self.api.create(objects.pod(NAMESPACE, pod, job=job.name, node=node, annotations=self.annotations))
        job.live.append(node)
        return node, pod

    def start(self, name: str, host: AgentHost, nodes: int, min_nodes: int) -> Job:
        """Nodes and pods in the cluster, then the agents and rank 0 in ``host`` (with the
        job's certificate, when auth is on: issued here the first time, in milliseconds)."""
        job = self.all[name] = Job(name, host, min_nodes, nodes)
        pods = tuple(self._add_node(job) for _ in range(nodes))
        tls = self.tls(NAMESPACE, name) if self.tls is not None else None
        host.send("start", JobPlacement(NAMESPACE, name, min_nodes, nodes, pods, tls))
        return job

    def kill(self, job: Job, node: str) -> None:
        """An abrupt loss: the agent dies, its lease runs out; Kubernetes is told nothing yet."""
        job.live.remove(node)
        job.gone.append(node)
        job.host.send("kill", job.name, node)

    def reclaim(self, job: Job, node: str) -> None:
        """A spot reclaim notice: the taint on the node, as the termination handler puts it."""
        job.live.remove(node)
        job.gone.append(node)
        taint = objects.taint(RECLAIM_TAINT, str(int(time.time())))
        self.api.patch("Node", node, {"spec": {"taints": [taint]}})

    def replace(self, job: Job) -> None:
        """The nodes gone leave the cluster (with their pods); a fresh node joins."""
        self._remove(job, job.gone)
        job.gone = []
        node, pod = self._add_node(job)
        job.host.send("join", job.name, node, pod)

    def _remove(self, job: Job, nodes: list[str]) -> None:
        for node in nodes:
            self.api.delete("Pod", self.pod_name(job.name, node), NAMESPACE)
            self.api.delete("Node", node)

    async def finish(self, job: Job, news: News, timeout: timedelta) -> bool:
        """The run ends: rendezvous closed, agents gone, then its pods and nodes leave the
        cluster. False if the host did not report it finished in time."""
        job.ended = True
        job.host.send("finish", job.name)
        done = await news.until(lambda: job.name in news.finished, timeout.total_seconds())
        self._remove(job, job.live + job.gone)
        job.live, job.gone = [], []
        return bool(done)
