"""What started a re-form, in the words people use for it: one labelling for the
controller's Events (``regroup.controller.reform_summary``), ``regroup trace-report`` and
the demo's report.

A reclaim plan's reason names the notice of each leaving node: ``reclaim notice on n2
(<signal>, <source>), n3 (...)``. The signal reads as what sent it (``drain``, ``eviction``,
``spot reclaim``, ``scale-down`` ...; ``NOTICE_LABELS``). A drain cordons the node, then
evicts its pods, and the plan names the notice that ends first, the eviction's: an eviction
(or a pod deletion) of a node that was cordoned then is the drain it is.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable

from regroup.records import ReformCause

NOTICE_LABELS: tuple[tuple[str, str], ...] = (
    # What announced a planned leave (``regroup.controller.signals``), as the plan's reason
    # names it: "reclaim notice on n2 (<signal>, <source>)".
    ("spec.unschedulable", "drain"),  # a cordon (kubectl drain, cordon)
    ("node.kubernetes.io/unschedulable", "drain"),
    ("(EvictionByEvictionAPI)", "eviction"),  # the pod's DisruptionTarget reason
    ("(PreemptionByScheduler)", "preemption"),
    ("(DeletionByTaintManager)", "taint eviction"),
    ("(TerminationByKubelet)", "kubelet eviction"),
    ("(DeletionByPodGC)", "pod GC"),
    ("aws-node-termination-handler/spot-itn", "spot reclaim"),
    ("aws-node-termination-handler/rebalance-recommendation", "rebalance"),
    ("aws-node-termination-handler/scheduled-maintenance", "maintenance"),
    ("aws-node-termination-handler/asg-lifecycle-termination", "scale-in"),
    ("karpenter.sh/disrupt", "karpenter disruption"),  # v1 disrupted, v1beta1 disruption
    ("ToBeDeletedByClusterAutoscaler", "scale-down"),
    ("cloud.google.com/impending-node-termination", "preemption"),
    ("remediator.kubernetes.azure.com/unschedulable", "node repair"),
    (" deleted (", "pod deletion"),  # "pod n2-worker deleted (30 s grace)"
    (" deleted,", "pod deletion"),  # "pod n2-worker deleted, Kubernetes)" (no grace known)
    (" leaving,", "agent leaving"),  # "agent on n2 leaving, regroup agent)"
)
"""The words a planned leave's notice reads as, by what its reason names (first match by
position in the notice; several read as several words)."""

DRAIN = "drain"
EVICTIONS = ("eviction", "pod deletion")
"""What an eviction of a cordoned node's pod reads as, before the cordon makes it a drain."""
CORDON, UNCORDON = "NodeNotSchedulable", "NodeSchedulable"
"""The cluster's Events of a node's cordon (a drain's first half) and of its end, as a
``regroup demo`` run records them (``events.jsonl``)."""

_NODE = re.compile(r"(?:^reclaim notice on |\), )([^\s,()]+) \(")


def notices(reason: str) -> list[tuple[str, str]]:
    """(node, its notice) for each node a reclaim plan's reason names; the whole reason,
    for no node, when it names none in that form."""
    found = list(_NODE.finditer(reason))
    if not found:
        return [("", reason)]
    ends = [m.start() for m in found[1:]] + [len(reason)]
    return [(m.group(1), reason[m.start(1) : end]) for m, end in zip(found, ends)]


def cause_label(cause: str, reason: str, cordoned: Collection[str] = ()) -> str:
    """What started a re-form, as finely as its plan's ``reason`` says: a reclaim notice
    reads as the ``drain``, ``eviction``, ``spot reclaim``, ``scale-down`` ... that sent it
    (``reclaim`` when the reason names none of them, e.g. a taint of
    ``regroup.dev/reclaim-taints``), an eviction of a node in ``cordoned`` (cordoned when the
    re-form was decided) as a ``drain``; a shrink to a lowered max as ``scale``; any other
    cause as it is (``node-lost``, ``grow``, ``restart-storm``, ``crash``)."""
    if cause == ReformCause.RECLAIM:
        labels: list[str] = []
        for node, notice in notices(reason):
            found = sorted((at, label) for key, label in NOTICE_LABELS if (at := notice.find(key)) >= 0)
            labels += [DRAIN if label in EVICTIONS and node in cordoned else label for _, label in found]
        return "+".join(dict.fromkeys(labels)) or str(cause)
    if cause == ReformCause.MANUAL and "exceed max" in reason:
        return "scale"
    return str(cause)


def cordoned_at(marks: Iterable[tuple[float, str, Iterable[str]]], moment: float) -> set[str]:
    """The nodes cordoned at ``moment``: those whose last cordon Event (``CORDON``) at or
    before it was not lifted (``UNCORDON``) since. ``marks``: (time, reason, nodes) of a
    run's Events, in time order."""
    state: dict[str, bool] = {}
    for time, reason, nodes in marks:
        if reason in (CORDON, UNCORDON) and time <= moment:
            for node in nodes:
                state[node] = reason == CORDON
    return {node for node, cordoned in state.items() if cordoned}
