"""The built-in reclaim signals (DESIGN contract 1): the one table in code.

A node carrying any of these is leaving. Each entry names the project it comes from and
the notice that project gives before the node goes, which bounds the checkpoint wait of
a planned shrink. ``lost`` entries mean the node is already gone for training purposes:
the re-form is unplanned.

Beside the taints, three signals that one member of a job is leaving (``LEAVE_SIGNALS``),
each a reclaim notice on the member's node for that job only:

- ``POD_DISRUPTION``. Source: Kubernetes (KEP-3329; beta in 1.26, GA in 1.31). Signal: a
  member's pod carries the condition ``DisruptionTarget=True``, reason
  ``PreemptionByScheduler``, ``DeletionByTaintManager``, ``EvictionByEvictionAPI``,
  ``DeletionByPodGC`` or ``TerminationByKubelet``. Path: planned. Notice: until the
  deletion's ``deletionTimestamp`` once the pod is being deleted, else the pod's
  ``terminationGracePeriodSeconds`` (30 s when unset) from the condition's
  ``lastTransitionTime`` (else from first sight). Kubernetes adds the condition when it
  evicts, preempts or deletes the pod (Kubernetes documentation, "Disruptions", section
  "Pod disruption conditions",
  https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions).
- ``POD_DELETION``. Source: Kubernetes (the Eviction API, ``kubectl drain``, Karpenter and
  cluster-autoscaler drains, ``kubectl delete pod``, the taint manager). Signal: a member's
  pod has ``metadata.deletionTimestamp`` set (its containers got SIGTERM). Path: planned
  while at least ``ReformSettings.min_planned_grace`` of the grace is left; a loss once less
  is, or when the pod object is gone, its phase is Failed or Succeeded, or its member
  vanished or restarted. Notice: from the deletion (``deletionTimestamp`` less
  ``deletionGracePeriodSeconds``) to ``deletionTimestamp``, when the kubelet kills what is left.
- ``MEMBER_LEAVING``. Source: the regroup agent (``regroup-run`` on SIGTERM, whoever sent it).
  Signal: its member record ``members/<node>`` carries ``leaving_by > 0``. Path: planned,
  with the same threshold as a pod deletion. Notice: from ``leaving_since`` to ``leaving_by``.

An eviction (one request to the Eviction API) writes ``DisruptionTarget`` and, at once in the
next write, the deletion (kube-apiserver ``pkg/registry/core/pod/storage/eviction.go``,
``addConditionAndDeletePod``): the condition comes milliseconds ahead of the deletion, never
as a notice of its own, so a deletion with time left must be a notice, not a loss. Where
several notices bound one node, the one that ends first counts. The node stays out of the
job while its pod leaves, until the condition is gone or the pod is replaced (see
``regroup.controller.disruption``), and while its agent leaves.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from regroup.controller.cluster import NodeInfo, Taint


@dataclass(frozen=True)
class ReclaimSignal:
    """One taint key that means "this node is going away"."""

    key: str
    source: str
    """Project that puts the taint on the node."""
    path: Literal["planned", "lost"] = "planned"
    """planned: checkpoint first; lost: re-form at once."""
    notice: timedelta | None = None
    """Time between the taint and the node's end, when the source promises one."""
    value: str | None = None
    """Only this taint value counts (None: any value)."""
    value_is_unix_time: bool = False
    """The taint's value is the unix time it was added (cluster-autoscaler)."""


@dataclass(frozen=True)
class PodSignal:
    """A pod condition that means "this pod is going away"."""

    condition: str
    source: str
    reasons: tuple[str, ...]
    """The reasons the source documents (others count too: the list is for people)."""
    default_grace: timedelta
    """The notice when the pod sets no ``terminationGracePeriodSeconds``."""


@dataclass(frozen=True)
class LeaveSignal:
    """A sign that one member of a job is leaving it, with time left to hand over."""

    signal: str
    """What is observed."""
    source: str
    """Who sets it."""
    notice: str
    """Where the notice's end comes from."""


POD_DISRUPTION = PodSignal(
    condition="DisruptionTarget",
    source="Kubernetes",
    reasons=("PreemptionByScheduler", "DeletionByTaintManager", "EvictionByEvictionAPI", "DeletionByPodGC",
             "TerminationByKubelet"),
    default_grace=timedelta(seconds=30),
)

POD_DELETION = LeaveSignal(
    signal="pod metadata.deletionTimestamp",
    # Eviction API, kubectl drain/delete, Karpenter and cluster-autoscaler drains, taint manager.
    source="Kubernetes",
    notice="metadata.deletionTimestamp (the deletion plus its deletionGracePeriodSeconds)",
)

MEMBER_LEAVING = LeaveSignal(
    signal="member leaving_by",
    # regroup-run writes it on SIGTERM, before it hands its state over and exits 75.
    source="regroup agent",
    notice="the member record's leaving_by",
)

LEAVE_SIGNALS: tuple[PodSignal | LeaveSignal, ...] = (POD_DISRUPTION, POD_DELETION, MEMBER_LEAVING)
"""The signals that one member is leaving a job (module docstring), beside the node-wide
``RECLAIM_SIGNALS``."""


AWS_NOTICE = timedelta(minutes=2)
GKE_NOTICE = timedelta(seconds=30)
AKS_NOTICE = timedelta(seconds=30)

RECLAIM_SIGNALS: tuple[ReclaimSignal, ...] = (
    # Kubernetes (kubelet / node lifecycle controller; `kubectl cordon`).
    ReclaimSignal("node.kubernetes.io/unschedulable", "Kubernetes"),
    ReclaimSignal("node.kubernetes.io/not-ready", "Kubernetes", path="lost"),
    ReclaimSignal("node.kubernetes.io/unreachable", "Kubernetes", path="lost"),
    # aws/aws-node-termination-handler: spot interruption notices come 2 minutes ahead.
    ReclaimSignal("aws-node-termination-handler/spot-itn", "AWS node-termination-handler", notice=AWS_NOTICE),
    ReclaimSignal("aws-node-termination-handler/rebalance-recommendation", "AWS node-termination-handler", notice=AWS_NOTICE),
    ReclaimSignal("aws-node-termination-handler/scheduled-maintenance", "AWS node-termination-handler", notice=AWS_NOTICE),
    ReclaimSignal("aws-node-termination-handler/asg-lifecycle-termination", "AWS node-termination-handler", notice=AWS_NOTICE),
    # kubernetes-sigs/karpenter: v1 taint, and the v1beta1 key/value spelling.
    ReclaimSignal("karpenter.sh/disrupted", "Karpenter"),
    ReclaimSignal("karpenter.sh/disruption", "Karpenter", value="disrupting"),
    # kubernetes/autoscaler cluster-autoscaler: the value is the unix time of the decision.
    ReclaimSignal("ToBeDeletedByClusterAutoscaler", "cluster-autoscaler", value_is_unix_time=True),
    # GoogleCloudPlatform/k8s-node-termination-handler: 30 s before a preemption.
    ReclaimSignal("cloud.google.com/impending-node-termination", "GKE node termination handler", notice=GKE_NOTICE),
    # AKS node auto-repair / spot eviction remediator.
    ReclaimSignal("remediator.kubernetes.azure.com/unschedulable", "AKS", notice=AKS_NOTICE),
)
"""Besides these taints: node ``spec.unschedulable`` (a cordon), node ``Ready`` not
True, node deleted (see ``node_verdict``), and the ``LEAVE_SIGNALS`` of one member."""

_BY_KEY: Mapping[str, ReclaimSignal] = {s.key: s for s in RECLAIM_SIGNALS}


@dataclass(frozen=True)
class ReclaimNotice:
    """A node's announced departure."""

    node: str
    signal: str
    """Taint key (or ``spec.unschedulable``, or what announced a member's leave) that announced it."""
    source: str
    since: float
    """Unix time the notice began (taint timeAdded, the autoscaler's value, or first seen)."""
    ends_at: float | None
    """Unix time the node is due to vanish, when the source promises a notice."""


@dataclass(frozen=True)
class NodeVerdict:
    """What a node's state means for the jobs on it."""

    lost: str | None = None
    """Why the node is gone for training (unplanned re-form), if it is."""
    lost_since: float | None = None
    notice: ReclaimNotice | None = None
    """Its reclaim notice (planned re-form), if it has one and is not lost."""


def _match(taint: Taint, extra_keys: Collection[str]) -> ReclaimSignal | None:
    signal = _BY_KEY.get(taint.key)
    if signal is not None and (signal.value is None or signal.value == taint.value):
        return signal
    if taint.key in extra_keys:
        return ReclaimSignal(taint.key, "regroup.dev/reclaim-taints")
    return None


def _taint_since(taint: Taint, signal: ReclaimSignal, first_seen: float) -> float:
    if signal.value_is_unix_time:
        try:
            return float(taint.value)
        except ValueError:
            pass
    return taint.time_added if taint.time_added is not None else first_seen


def node_verdict(
    node: NodeInfo | None,
    name: str,
    extra_keys: Collection[str],
    first_seen: Mapping[str, float],
    now: float,
    ignore_taints: Collection[str] = (),
) -> NodeVerdict:
    """Classify a node for the jobs on it. ``node`` None means deleted.

    ``first_seen`` maps ``signal_key(name, what)`` to the time the model first saw it;
    ``ignore_taints`` are keys this controller put there itself (its own cordon is a
    reclaim for other jobs, but it is also flagged through ``spec.unschedulable``).
    """
    if node is None:
        return NodeVerdict(lost="node deleted", lost_since=first_seen.get(signal_key(name, "gone"), now))
    if node.ready is not True:
        state = "Unknown" if node.ready is None else "False"
        return NodeVerdict(lost=f"node Ready={state}", lost_since=first_seen.get(signal_key(name, "notready"), now))
    best: ReclaimNotice | None = None
    for taint in node.taints:
        if taint.key in ignore_taints:
            continue
        signal = _match(taint, extra_keys)
        if signal is None:
            continue
        since = _taint_since(taint, signal, first_seen.get(signal_key(name, "taint:" + taint.key), now))
        if signal.path == "lost":
            return NodeVerdict(lost=f"taint {taint.key}", lost_since=since)
        ends = since + signal.notice.total_seconds() if signal.notice is not None else None
        notice = ReclaimNotice(name, taint.key, signal.source, since, ends)
        if best is None or ends_earlier(notice, best):
            best = notice
    if best is None and node.unschedulable:
        since = first_seen.get(signal_key(name, "unschedulable"), now)
        best = ReclaimNotice(name, "spec.unschedulable", "Kubernetes", since, None)
    return NodeVerdict(notice=best)


def leaving_signal(node: NodeInfo, extra_keys: Collection[str]) -> str | None:
    """The reclaim taint (or ``spec.unschedulable``) that marks ``node`` as leaving, whether
    or not the node is also NotReady: what keeps it out of the job (``control/excluded``)."""
    for taint in node.taints:
        signal = _match(taint, extra_keys)
        if signal is not None and signal.path == "planned":
            return f"taint {taint.key} ({signal.source})"
    return "spec.unschedulable (cordoned)" if node.unschedulable else None


def ends_earlier(a: ReclaimNotice, b: ReclaimNotice) -> bool:
    """Whether notice ``a`` ends before ``b`` (a notice without an end never does)."""
    if a.ends_at is None:
        return False
    return b.ends_at is None or a.ends_at < b.ends_at


def storm_mark(restarts: Sequence[float], k: int) -> float | None:
    """The time of the ``k``-th newest of ``restarts`` (times, oldest first), None when
    there are fewer. The restart-storm rule's condition, read by ``decide`` and by the
    model's wake-ups: a node is at the threshold (``k`` restarts in the window) while its
    mark is in the window."""
    return restarts[-k] if len(restarts) >= k else None


def signal_key(node: str, what: str) -> str:
    """Key under which the model records when it first saw ``what`` on ``node``."""
    return f"{node}\x00{what}"


def member_seen_key(node: str, joined_at: float, round_: int) -> str:
    """Key for when a member was first seen at a round. It includes the agent's
    registration time: an agent that comes back to the same node announces round 0
    again, and must not inherit the sighting of the agent before it."""
    return signal_key(node, f"member:{joined_at!r}:{round_}")
