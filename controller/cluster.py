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

from regroup.exit_codes import NOT_FAILURES

JOB_LABEL = "regroup.dev/job"

OOM_KILLED = "OOMKilled"
"""The kubelet's reason for a container the kernel killed for memory (exit code 137)."""


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


MEMBER_ANNOTATION = "regroup.dev/member"
"""What one member of the job is: ``node`` (the default: the agent's key is its node's name)
or ``pod`` (several pods of the job may share a node; each agent's key is its pod's name,
``--rdzv-conf node_name={pod}``)."""


def member_key(pod_name: str, node: str | None, annotations: Mapping[str, str]) -> str | None:
    """The key the job's member for a pod has, and the controller files the pod under: its
    node's name, or its own name in a job whose members are pods; None while unscheduled."""
    if node is None:
        return None
    return pod_name if annotations.get(MEMBER_ANNOTATION) == "pod" else node


@dataclass(frozen=True)
class PodDisruption:
    """The pod's ``DisruptionTarget`` condition with status True: Kubernetes is about to
    evict, preempt or delete the pod (see ``regroup.controller.disruption``)."""

    reason: str
    """The condition's reason (``PreemptionByScheduler``, ``EvictionByEvictionAPI``, ...)."""
    since: float | None
    """Unix time of the condition's ``lastTransitionTime``, when the API gives one."""
    grace_seconds: float
    """The notice: the deletion's ``metadata.deletionGracePeriodSeconds`` once the pod is
    being deleted, else its ``spec.terminationGracePeriodSeconds`` (30 when unset)."""


def termination_failed(exit_code: int | None, reason: str = "", signal: int = 0) -> bool:
    """Whether a container's termination was a failure: an exit code other than those of
    ``regroup.exit_codes.NOT_FAILURES`` (0: finished, 75: left the job), the kernel's OOM
    kill, or a signal. ``exit_code`` None (the kubelet kept no termination) counts as one."""
    return exit_code is None or exit_code not in NOT_FAILURES or reason == OOM_KILLED or signal != 0


@dataclass(frozen=True)
class ContainerRestarts:
    """One container's restarts and its latest exit, as the kubelet reports them in
    ``status.containerStatuses``. Times are unix seconds as the API gives them (whole
    seconds from a real API server: ``metav1.Time``)."""

    name: str
    count: int
    """``restartCount``."""
    last_failed: bool = True
    """Whether the termination behind its latest restart (``lastState.terminated``) was a
    failure (``termination_failed``); True when the kubelet kept none."""
    running_since: float | None = None
    """``state.running.startedAt``: when the instance running now started; None while none runs."""
    exited_at: float | None = None
    """``finishedAt`` of its latest termination (``state.terminated``, else
    ``lastState.terminated``); None when the kubelet reports none."""
    exit_code: int | None = None
    """That termination's ``exitCode`` (137: SIGKILL, an OOM kill included)."""
    exit_reason: str = ""
    """That termination's ``reason`` (``Error``, ``Completed``, ``OOMKilled``, ...)."""
    exit_failed: bool = True
    """Whether that termination was a failure (``termination_failed``)."""


@dataclass(frozen=True)
class PodInfo:
    """A worker pod of a regroup job (it carries the ``regroup.dev/job`` label)."""

    namespace: str
    name: str
    uid: str
    job: str
    node: str | None
    """Where the job's member for this pod is, as the controller keys members: ``spec.nodeName``,
    or the pod's own name in a job whose members are pods (``regroup.dev/member: pod``,
    ``member_key``); None while unscheduled."""
    annotations: Mapping[str, str] = field(default_factory=dict)
    phase: str = "Running"
    deleting: bool = False
    """``metadata.deletionTimestamp`` is set (deleted or evicted, still terminating)."""
    deletion_deadline: float | None = None
    """Unix time of ``metadata.deletionTimestamp``: when the kubelet kills the containers
    that have not stopped (the deletion's moment plus its grace). None when not deleting,
    or when the adapter does not know it (the pod's leave is then a loss, never planned)."""
    deletion_grace_seconds: float | None = None
    """``metadata.deletionGracePeriodSeconds``: the grace the deletion gave (None: unknown)."""
    restart_count: int = 0
    """Sum of the containers' ``restartCount``."""
    containers: tuple[ContainerRestarts, ...] = ()
    """Each container's restarts and latest exit. Empty where the adapter does not report
    them: every restart (``restart_count`` going up) is then a failure."""
    agent_container: str = ""
    """The container that runs the regroup agent: the pod's
    ``kubectl.kubernetes.io/default-container`` annotation, else its first container in
    ``spec.containers``; "" when unknown (every container then counts as the agent's)."""
    created_at: float = 0.0
    """Unix time of ``metadata.creationTimestamp``."""
    labels: Mapping[str, str] = field(default_factory=dict)
    disruption: PodDisruption | None = None
    """Set while the pod carries ``DisruptionTarget=True``."""
    ip: str = ""
    """``status.podIP``: the address a failed collective names for this pod's ranks."""
    host: str | None = None
    """``spec.nodeName`` where it differs from ``node`` (a member per pod); None otherwise."""

    @property
    def host_node(self) -> str | None:
        """The Kubernetes node the pod runs on (None while unscheduled)."""
        return self.host or self.node

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
