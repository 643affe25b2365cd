"""The fleet's nodes and the indexes from a node to the jobs on it.

Kept once for all jobs: each node's state, when each of its signals was first seen, its
verdict under the built-in signal table, whether a decision must look at it closely, the
cordoned nodes, and which jobs have a pod or a member on it (whom a node event wakes).

In a job whose members are pods (``regroup.dev/member: pod``), a member's key is its pod's
name, not a node's. Each such key is kept here as a guest of the node its pod runs on: the
node's state, signals (with the times they were first seen) and verdict, mirrored under the
key. Decisions read a member's node by its key either way, and a node's change wakes the jobs
of its guests: a reclaim of the node takes every member on it in one decision.
"""

from __future__ import annotations

import dataclasses

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
        self.hosts: dict[str, str] = {}
        """A pod-named member key -> the node its pod runs on (module docstring)."""
        self.guests: dict[str, set[str]] = {}
        """Node -> the pod-named member keys on it."""
        self._first_seen = FirstSeen({}, self.signals)

    @property
    def hosting_nodes(self) -> int:
        """Nodes running at least one regroup pod (the cordon budget counts them)."""
        hosts = self.hosts
        return len({hosts.get(name, name) for name in self.node_pods}) if hosts else len(self.node_pods)

    def jobs_on(self, node: str) -> set[JobId]:
        """Jobs with a pod or a member on ``node``."""
        jobs = {self.pod_job[key] for key in self.node_pods.get(node, ()) if key in self.pod_job}
        jobs.update(self.member_jobs.get(node, ()))
        return jobs

    def node_changed(self, node: NodeInfo, now: float) -> list[str]:
        """Record ``node``; the keys (the node's, its guests') for which anything a decision
        reads changed (none for kubelet heartbeats and label churn, which wake no job)."""
        changed = [node.name] if self._put(node, now) else []
        for guest in sorted(self.guests.get(node.name, ())):
            if self._put(dataclasses.replace(node, name=guest), now):
                changed.append(guest)
        return changed

    def _put(self, node: NodeInfo, now: float) -> bool:
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
        if node.name not in self.hosts:  # a guest's node is the one cordoned, not the guest
            if any(t.key == self._cordon_taint for t in node.taints):
                self.cordoned.add(node.name)
            else:
                self.cordoned.discard(node.name)
        return old is None or (old.taints, old.ready, old.unschedulable, old.has_gpus) != (
            node.taints, node.ready, node.unschedulable, node.has_gpus
        )

    def node_deleted(self, name: str, now: float) -> list[str]:
        """Record that node ``name`` is gone; the keys that are (the node's, its guests')."""
        gone = [name, *sorted(self.guests.get(name, ()))]
        for key in gone:
            self._gone(key, now)
        return gone

    def _gone(self, name: str, since: float) -> None:
        self.nodes.pop(name, None)
        self.signals[name] = {"gone": since}
        self.verdicts[name] = node_verdict(None, name, (), self._first_seen, since)
        self.flagged.add(name)
        self.cordoned.discard(name)

    def pod_placed(
        self, key: PodKey, job: JobId, old_node: str | None, node: str | None, host: str | None, now: float
    ) -> list[str]:
        """Pod ``key`` of ``job`` is now filed under ``node`` (it was under ``old_node``),
        running on ``host`` when that differs (a pod-named member). Returns the keys whose
        node state changed (a guest placed on a node, or moved)."""
        if old_node is not None and old_node != node:
            index_discard(self.node_pods, old_node, key)
            self._drop_guest(old_node)
        if node is not None:
            index_add(self.node_pods, node, key)
        self.pod_job[key] = job
        if node is None or host is None or self.hosts.get(node) == host:
            return []
        return self._place_guest(node, host, now)

    def _place_guest(self, guest: str, host: str, now: float) -> list[str]:
        """Mirror ``host``'s state under ``guest`` (module docstring)."""
        old = self.hosts.get(guest)
        if old is not None:
            index_discard(self.guests, old, guest)
        self.hosts[guest] = host
        index_add(self.guests, host, guest)
        info = self.nodes.get(host)
        if info is not None:
            self.signals[guest] = dict(self.signals.get(host, {}))  # first seen when the node's were
            self.nodes.pop(guest, None)
            self._put(dataclasses.replace(info, name=guest), now)
            return [guest]
        gone = self.signals.get(host, {}).get("gone")
        if gone is not None:
            self._gone(guest, gone)
            return [guest]
        return []  # its node is not listed yet

    def _drop_guest(self, guest: str) -> None:
        """Forget ``guest`` once no pod is filed under it and no member has its key."""
        host = self.hosts.get(guest)
        if host is None or self.node_pods.get(guest) or self.member_jobs.get(guest):
            return
        del self.hosts[guest]
        index_discard(self.guests, host, guest)
        for table in (self.nodes, self.signals, self.verdicts):
            table.pop(guest, None)
        self.flagged.discard(guest)

    def pod_removed(self, key: PodKey, node: str | None) -> JobId | None:
        """Forget pod ``key``; the job it belonged to, if it was known."""
        job = self.pod_job.pop(key, None)
        if node is not None:
            index_discard(self.node_pods, node, key)
            self._drop_guest(node)
        return job

    def member_added(self, node: str, job: JobId) -> None:
        index_add(self.member_jobs, node, job)

    def member_removed(self, node: str, job: JobId) -> None:
        index_discard(self.member_jobs, node, job)
        self._drop_guest(node)
