"""Pod disruption notices: ``DisruptionTarget=True`` on a job's pod (``signals.POD_DISRUPTION``).

Kubernetes sets the condition before it evicts, preempts or deletes a pod. For the job
that owns the pod it is a reclaim notice on the pod's node, like a reclaim taint: a
planned shrink (checkpoint first) whose notice is the pod's grace period, counted from
the condition's ``lastTransitionTime`` (or from when the controller first saw it).

The node's pod is the job's newest worker pod there: a replacement without the condition
lifts the notice, as does the condition going away or the pod being deleted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from regroup.controller.cluster import PodInfo
from regroup.controller.signals import POD_DISRUPTION, ReclaimNotice, signal_key


@dataclass(frozen=True)
class PodNotice:
    """The disruption notice of the job's pod on one node."""

    pod: PodInfo
    notice: ReclaimNotice
    seen: float
    """When the controller first saw the condition (the re-form's detect phase starts there)."""

    @property
    def terminating(self) -> bool:
        """The pod is already going (deleted, or finished): a loss, no longer a notice."""
        return self.pod.deleting or self.pod.phase in ("Failed", "Succeeded")

    @property
    def why(self) -> str:
        return self.notice.signal


def disruption_key(pod: PodInfo) -> str:
    """Key under which the model records when it first saw ``pod``'s disruption condition."""
    return signal_key(pod.node or "", f"disruption:{pod.name}:{pod.uid}")


def describe(pod: PodInfo) -> str:
    """``pod llama-n2 DisruptionTarget (PreemptionByScheduler)``."""
    reason = pod.disruption.reason if pod.disruption is not None else "?"
    return f"pod {pod.name} {POD_DISRUPTION.condition} ({reason})"


def pod_notices(
    disrupted: Iterable[PodInfo],
    workers_by_node: Mapping[str, tuple[PodInfo, ...]],
    first_seen: Mapping[str, float],
    now: float,
) -> dict[str, PodNotice]:
    """Per node, the notice of the job's disrupted pod there, if that pod is still the
    node's newest worker pod (a replacement lifts it)."""
    notices: dict[str, PodNotice] = {}
    for pod in disrupted:
        disruption, node = pod.disruption, pod.node
        if disruption is None or node is None:
            continue
        workers = workers_by_node.get(node)
        if not workers or max(workers, key=_age).name != pod.name:
            continue  # replaced on its node, or not a worker (the job's etcd)
        seen = min(now, first_seen.get(disruption_key(pod), now))
        since = disruption.since if disruption.since is not None else seen
        notice = ReclaimNotice(node, describe(pod), POD_DISRUPTION.source, since, since + disruption.grace_seconds)
        notices[node] = PodNotice(pod, notice, seen)
    return notices


def _age(pod: PodInfo) -> tuple[float, str]:
    return pod.created_at, pod.name
