"""The benchmark's cluster and its seeded storm of events.

2,000 nodes, 10,000 worker pods, 200 jobs of 50 nodes (each node hosts 5 jobs' pods),
and a storm of reclaim taints, taint removals, NotReady flips, pod deletions and
re-creations, container restarts and rank restarts.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass
from typing import Any

from regroup.controller.cluster import PodInfo
from regroup.controller.signals import RECLAIM_SIGNALS
from regroup.keys import JobKeys
from regroup.records import MemberRecord

NAMESPACE = "bench"
RECLAIM_KEYS = [s.key for s in RECLAIM_SIGNALS if s.path == "planned" and s.value is None and not s.value_is_unix_time]
ANNOTATIONS = {
    "regroup.dev/min-nodes": "10",
    "regroup.dev/max-nodes": "60",
    "regroup.dev/checkpoint-timeout": "120s",
    "regroup.dev/restart-storm": "3/10m",
}

Event = tuple[Any, ...]
"""``(kind, ...)``: ``taint``/``untaint``/``ready`` on a node, ``pod-*`` and ``rank-restart`` on a placement."""


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

    def placements(self) -> list[tuple[int, str]]:
        return [(j, n) for j in range(self.jobs) for n in self.job_nodes(j)]


def storm(layout: Layout, count: int, seed: int) -> list[Event]:
    """A seeded list of cluster events; each touches one node or one pod.

    Churn stays around 1% of the fleet at a time (taints and NotReady nodes are mostly
    lifted again, deleted pods come back), and restarts cluster on 1% flaky nodes, as they
    do in a real fleet; the rest of the fleet restarts rarely, below the storm threshold.
    """
    rng = random.Random(seed)
    placements = layout.placements()
    flaky_nodes = {layout.node(i) for i in rng.sample(range(layout.nodes), layout.nodes // 100)}
    flaky = [(j, n) for j, n in placements if n in flaky_nodes]
    scale = max(1, layout.nodes // 100)
    tainted: list[str] = []
    notready: list[str] = []
    deleted: list[tuple[int, str]] = []
    pod_restarts: dict[tuple[int, str], int] = {}
    rank_restarts: dict[tuple[int, str], int] = {}
    events: list[Event] = []

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


def pod_info(layout: Layout, j: int, node: str, restarts: int = 0) -> PodInfo:
    return PodInfo(
        namespace=NAMESPACE, name=layout.pod(j, node), uid=f"uid-{j}-{node}", job=layout.job(j), node=node,
        annotations=ANNOTATIONS, restart_count=restarts, created_at=1.0, labels={"regroup.dev/job": layout.job(j)},
    )


def member(layout: Layout, j: int, node: str, restarts: int = 0) -> bytes:
    return MemberRecord(node=node, pod=layout.pod(j, node), namespace=NAMESPACE, round=1, local_world_size=8,
                        restart_count=restarts).to_json()


def replayed(layout: Layout, prefix: str, count: int, seed: int) -> list[Event]:
    """The storm a run replays, encoded ahead of time, and frozen out of the cyclic
    collector's sight as the controller freezes its listed heap: these tens of thousands
    of tuples are the benchmark's, not the controller's, and a collection walking them
    would be a pause the controller never has in production."""
    events = [encoded(layout, prefix, e) for e in storm(layout, count, seed)]
    gc.freeze()
    return events


def encoded(layout: Layout, prefix: str, event: Event) -> Event:
    """Encode what etcd would deliver ahead of time: the bench times the controller only."""
    if event[0] == "rank-restart":
        _, j, n, count = event
        keys = JobKeys(NAMESPACE, layout.job(j), prefix)
        return (*event, keys.member(n), member(layout, j, n, count))
    return event
