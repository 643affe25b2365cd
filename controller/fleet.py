"""The fleet's nodes and the indexes from a node to the jobs on it.

Kept once for all jobs: each node's state, when each of its signals was first seen, its
verdict under the built-in signal table, whether a decision must look at it closely, the
cordoned nodes, and which jobs have a pod or a member on it (whom a node event wakes).
"""

from __future__ import annotations

from regroup.controller.cluster import NodeInfo
from regroup.controller.multimap import index_add, index_discard
from regroup.controller.signals import NodeVerdict, node_verdict
from regroup.controller.sightings import FirstSeen

JobId = tuple[str, str]
"""(namespace, job)."""

PodKey = tuple[str, str]
"""(namespace, pod name)."""


class Fleet:
    """Nodes and node -> jobs indexes, updated one observation at a time."""

    def __init__(self, cordon_taint: str) -> None:
        self._cordon_taint = cordon_taint
        self.nodes: dict[str, NodeInfo] = {}
        self.signals: dict[str, dict[str, float]] = {}
        """Node -> signal (``taint:<key>``, ``notready``, ``unschedulable``, ``gone``) -> first seen."""
        self.verdicts: dict[str, NodeVerdict] = {}
        """Each known node's verdict under the built-in signal table (jobs without extra
        reclaim taints use it as is), recomputed when the node changes."""
        self.flagged: set[str] = set()
        """Nodes a decision must look at closely: deleted, not Ready, tainted or cordoned."""
        self.cordoned: set[str] = set()
        """Nodes carrying the restart-storm taint."""
        self.node_pods: dict[str, set[PodKey]] = {}
        self.pod_job: dict[PodKey, JobId] = {}
        self.member_jobs: dict[str, set[JobId]] = {}
        self._first_seen = FirstSeen({}, self.signals)

    @property
    def hosting_nodes(self) -> int:
        """Nodes running at least one regroup pod (the cordon budget counts them)."""
        return len(self.node_pods)

    def jobs_on(self, node: str) -> set[JobId]:
        """Jobs with a pod or a member on ``node``."""
        jobs = {self.pod_job[key] for key in self.node_pods.get(node, ()) if key in self.pod_job}
        jobs.update(self.member_jobs.get(node, ()))
        return jobs

    def node_changed(self, node: NodeInfo, now: float) -> bool:
        """Record ``node``; whether anything a decision reads changed (False for kubelet
        heartbeats and label churn, which wake no job)."""
        old = self.nodes.get(node.name)
        if old == node:
            return False
        signals = self.signals.setdefault(node.name, {})
        signals.pop("gone", None)
        present = {"taint:" + t.key for t in node.taints}
        if node.ready is not True:
            present.add("notready")
        if node.unschedulable:
            present.add("unschedulable")
        for key in [k for k in signals if k not in present]:
            del signals[key]
        for key in present:
            signals.setdefault(key, now)
        self.nodes[node.name] = node
        self.verdicts[node.name] = node_verdict(node, node.name, (), self._first_seen, now)
        if node.ready is not True or node.taints or node.unschedulable:
            self.flagged.add(node.name)
        else:
            self.flagged.discard(node.name)
        if any(t.key == self._cordon_taint for t in node.taints):
            self.cordoned.add(node.name)
        else:
            self.cordoned.discard(node.name)
        return old is None or (old.taints, old.ready, old.unschedulable, old.has_gpus) != (
            node.taints, node.ready, node.unschedulable, node.has_gpus
        )

    def node_deleted(self, name: str, now: float) -> None:
        self.nodes.pop(name, None)
        self.signals[name] = {"gone": now}
        self.verdicts[name] = node_verdict(None, name, (), self._first_seen, now)
        self.flagged.add(name)
        self.cordoned.discard(name)

    def pod_placed(self, key: PodKey, job: JobId, old_node: str | None, node: str | None) -> None:
        """Pod ``key`` of ``job`` now runs on ``node`` (it ran on ``old_node``)."""
        if old_node is not None and old_node != node:
            index_discard(self.node_pods, old_node, key)
        if node is not None:
            index_add(self.node_pods, node, key)
        self.pod_job[key] = job

    def pod_removed(self, key: PodKey, node: str | None) -> JobId | None:
        """Forget pod ``key``; the job it belonged to, if it was known."""
        job = self.pod_job.pop(key, None)
        if node is not None:
            index_discard(self.node_pods, node, key)
        return job

    def member_added(self, node: str, job: JobId) -> None:
        index_add(self.member_jobs, node, job)

    def member_removed(self, node: str, job: JobId) -> None:
        index_discard(self.member_jobs, node, job)
