"""What the controller observes of a cluster, and what it can do to it.

Two adapters implement these: the Kubernetes one (raw watches on Nodes and Pods,
cordons and taints through the API, Events) and the local one behind ``regroup demo``
(nodes are local process groups). The decision code sees only these types, so it is
exactly the same code in both.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

JOB_LABEL = "regroup.dev/job"


@dataclass(frozen=True)
class Taint:
    key: str
    value: str = ""
    effect: str = "NoSchedule"
    time_added: float | None = None
    """Unix time the taint was added, when the API says."""


@dataclass(frozen=True)
class NodeInfo:
    """A node as the controller needs it."""

    name: str
    taints: tuple[Taint, ...] = ()
    ready: bool | None = True
    """Status of the ``Ready`` condition; None when unknown."""
    unschedulable: bool = False
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    gpus: int = 0
    """``nvidia.com/gpu`` capacity (a node labelled ``nvidia.com/gpu*`` counts as having GPUs too)."""

    @property
    def has_gpus(self) -> bool:
        return self.gpus > 0 or any(k.startswith("nvidia.com/gpu") for k in self.labels)


@dataclass(frozen=True)
class PodDisruption:
    """The pod's ``DisruptionTarget`` condition with status True: Kubernetes is about to
    evict, preempt or delete the pod (see ``regroup.controller.disruption``)."""

    reason: str
    """The condition's reason (``PreemptionByScheduler``, ``EvictionByEvictionAPI``, ...)."""
    since: float | None
    """Unix time of the condition's ``lastTransitionTime``, when the API gives one."""
    grace_seconds: float
    """The pod's ``spec.terminationGracePeriodSeconds`` (30 when unset): the notice."""


@dataclass(frozen=True)
class PodInfo:
    """A worker pod of a regroup job (it carries the ``regroup.dev/job`` label)."""

    namespace: str
    name: str
    uid: str
    job: str
    node: str | None
    """``spec.nodeName``; None while unscheduled."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    phase: str = "Running"
    deleting: bool = False
    """``metadata.deletionTimestamp`` is set (deleted or evicted, still terminating)."""
    restart_count: int = 0
    """Sum of the containers' ``restartCount``."""
    created_at: float = 0.0
    """Unix time of ``metadata.creationTimestamp``."""
    labels: Mapping[str, str] = field(default_factory=dict)
    disruption: PodDisruption | None = None
    """Set while the pod carries ``DisruptionTarget=True``."""

    @functools.cached_property
    def ref(self) -> ObjectRef:
        """The pod as the subject of an Event (built once per observed version of the pod)."""
        return ObjectRef("Pod", self.name, self.namespace, self.uid)


@dataclass(frozen=True)
class ObjectRef:
    """What an Event is about."""

    kind: Literal["Pod", "Node"]
    name: str
    namespace: str = ""
    uid: str = ""


class ClusterSink(Protocol):
    """Receives observations; implemented by the controller's model."""

    def node_changed(self, node: NodeInfo) -> None: ...

    def node_deleted(self, name: str) -> None: ...

    def pod_changed(self, pod: PodInfo) -> None: ...

    def pod_deleted(self, namespace: str, name: str) -> None: ...

    def resynced(self, nodes: list[NodeInfo], pods: list[PodInfo]) -> None:
        """A full list: anything not in it is gone."""
        ...

    def nodes_listed(self, nodes: list[NodeInfo]) -> None:
        """A full list of nodes only (sources that list each kind on its own)."""
        ...

    def pods_listed(self, pods: list[PodInfo]) -> None:
        """A full list of the regroup pods only."""
        ...


class ClusterSource(Protocol):
    """Feeds a sink until cancelled: a full list first, then changes."""

    async def run(self, sink: ClusterSink) -> None: ...


class ClusterActuator(Protocol):
    """The controller's hands on the cluster. Every call is idempotent."""

    async def cordon(self, node: str, reason: str, taint_key: str, now: float) -> None:
        """Mark ``node`` unschedulable, add taint ``taint_key:NoSchedule`` and an annotation
        with the reason and time."""
        ...

    async def delete_pod(self, namespace: str, name: str, reason: str) -> None: ...

    async def post_event(
        self, ref: ObjectRef, type_: Literal["Normal", "Warning"], reason: str, message: str
    ) -> None: ...
