"""A member's own notices: its pod's disruption or deletion, and its agent's leave.

Kubernetes marks a pod it is taking away with ``DisruptionTarget=True``
(``signals.POD_DISRUPTION``) and, in the next write of the same eviction, with its deletion
(``signals.POD_DELETION``: ``deletionTimestamp``, ``deletionGracePeriodSeconds``); an agent
told to stop writes ``leaving_since``/``leaving_by`` into its member record
(``signals.MEMBER_LEAVING``). For the job that owns the pod or the member, each is a reclaim
notice on its node, like a reclaim taint: a planned shrink (checkpoint first) that must
fit in the notice. The notice of a deletion ends at its ``deletionTimestamp``, when the
kubelet kills what is left; that of a condition without a deletion is the pod's grace
period from the condition's ``lastTransitionTime`` (or from when the controller first saw it).

A deletion or a leave turns into a loss (an unplanned re-form) once less than
``min_planned_grace`` of it is left, and a pod's once it is Failed or Succeeded.

The node's pod is the job's newest worker pod there: a replacement without the condition
or the deletion lifts the notice, as does the condition going away or the pod being deleted.

A member's agent whose container ended after the agent registered (``agent_exit``: the
container's latest termination, or the start of the instance running now, is later than
the member's ``joined_at``) is gone at once, whatever the member's lease still says: the
kubelet reports the exit within a second, the lease only expires a TTL later. Decided from
the pod's status and the member record as they are, so a restarted controller decides the
same. The exit of an agent that announced its leave (``leaving_by``) with a code that is
no failure (0, or 75: it handed over and left) ends that leave, and is no loss of its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from regroup.controller.cluster import OOM_KILLED, PodInfo
from regroup.controller.signals import MEMBER_LEAVING, POD_DELETION, POD_DISRUPTION, ReclaimNotice, signal_key
from regroup.records import MemberRecord

_FINISHED = ("Failed", "Succeeded")


@dataclass(frozen=True)
class PodNotice:
    """The notice of the job's pod on one node: its disruption condition, its deletion, or both."""

    pod: PodInfo
    notice: ReclaimNotice
    seen: float
    """When the controller first saw the pod going (the re-form's detect phase starts there)."""
    lost: str | None = None
    """Why the pod's leave is a loss now, not a notice: it finished, its deletion's grace
    (or too much of it) is gone, or the deletion's deadline is unknown. None: a notice."""
    lost_at: float | None = None
    """When a notice of a deletion turns into a loss (``min_planned_grace`` before its end)."""

    @property
    def why(self) -> str:
        return self.notice.signal


@dataclass(frozen=True)
class AgentNotice:
    """The leave the agent on one node announced in its member record (``leaving_by``)."""

    notice: ReclaimNotice
    seen: float
    lost: str | None = None
    """Why the leave is a loss now (too little of it left); None: a notice."""
    lost_at: float | None = None
    """When it turns into a loss."""


@dataclass(frozen=True)
class ContainerExit:
    """The end of the container a member's agent ran in, seen in its pod's status."""

    why: str
    """``pod llama-n2 container exited (code 137)``, or ``... container restarted`` when
    the kubelet kept no termination."""
    at: float
    """When, by the kubelet: the termination's ``finishedAt`` (else the next instance's start)."""
    voluntary: bool
    """The exit code is no failure (0 or 75, ``cluster.termination_failed``)."""


def agent_exit(pod: PodInfo, joined_at: float) -> ContainerExit | None:
    """The exit of ``pod``'s agent container (``PodInfo.agent_container``) after the agent
    that registered at ``joined_at`` did: its latest termination finished later, or the
    instance running now started later. None while it runs on, or when ``joined_at`` is
    unknown (0). The API gives whole seconds, rounded down: a time later than ``joined_at``
    is so, whatever was cut off (an exit within the second of the registration waits for
    the lease)."""
    if joined_at <= 0:
        return None
    for c in pod.containers:
        if pod.agent_container and c.name != pod.agent_container:
            continue  # a sidecar's restart leaves the agent running
        if c.exited_at is not None and c.exited_at > joined_at:
            code = "" if c.exit_code is None else f"code {c.exit_code}"
            reason = c.exit_reason if c.exit_reason == OOM_KILLED else ""
            detail = ", ".join(p for p in (code, reason) if p)
            return ContainerExit(f"pod {pod.name} container exited" + (f" ({detail})" if detail else ""), c.exited_at,
                                 not c.exit_failed)
        if c.running_since is not None and c.running_since > joined_at:
            return ContainerExit(f"pod {pod.name} container restarted", c.running_since, False)
    return None


def pod_gone_key(node: str, pod: str) -> str:
    """Key under which the model records when it first saw pod ``pod`` on ``node`` being
    deleted or gone (per pod name: a pod of that name placed afresh clears it)."""
    return signal_key(node, f"pod-gone:{pod}")


def disruption_key(pod: PodInfo) -> str:
    """Key under which the model records when it first saw ``pod`` going (its disruption
    condition or its deletion, whichever came first)."""
    return signal_key(pod.node or "", f"disruption:{pod.name}:{pod.uid}")


def leaving_key(node: str, member: MemberRecord) -> str:
    """Key under which the model records when it first saw ``member`` leaving (per agent:
    one that comes back to the node does not inherit it)."""
    return signal_key(node, f"leaving:{member.joined_at!r}")


def going(pod: PodInfo) -> bool:
    """Whether Kubernetes is taking ``pod`` away: it carries ``DisruptionTarget`` or is being deleted."""
    return pod.disruption is not None or pod.deleting


def describe(pod: PodInfo) -> str:
    """``pod llama-n2 DisruptionTarget (PreemptionByScheduler)``, or ``pod llama-n2 deleted (30 s grace)``."""
    if pod.disruption is not None:
        return f"pod {pod.name} {POD_DISRUPTION.condition} ({pod.disruption.reason})"
    grace = pod.deletion_grace_seconds
    return f"pod {pod.name} deleted" + (f" ({grace:g} s grace)" if grace is not None else "")


def pod_notice(pod: PodInfo, node: str, seen: float, now: float, min_grace: float) -> PodNotice:
    """The notice of ``pod`` (going, on ``node``), first seen going at ``seen``."""
    disruption = pod.disruption
    ends: float | None
    if pod.deleting:
        # The deletion's own deadline, whatever the spec or the condition said.
        ends = pod.deletion_deadline
        grace = pod.deletion_grace_seconds
        since = ends - grace if ends is not None and grace is not None else seen
        source = POD_DISRUPTION.source if disruption is not None else POD_DELETION.source
    else:
        assert disruption is not None
        since = disruption.since if disruption.since is not None else seen
        ends = since + disruption.grace_seconds
        source = POD_DISRUPTION.source
    if disruption is not None and disruption.since is not None:
        since = min(since, disruption.since)
    notice = ReclaimNotice(node, describe(pod), source, since, ends)
    lost, lost_at = None, None
    if pod.phase in _FINISHED:
        lost = f"pod {pod.name} {pod.phase}"
    elif pod.deleting:
        if ends is None:
            lost = f"pod {pod.name} deleted or evicted"
        elif ends - now < min_grace:
            lost = f"pod {pod.name} deleted or evicted, {_grace_left(ends, now, min_grace)}"
        else:
            lost_at = ends - min_grace
    return PodNotice(pod, notice, seen, lost, lost_at)


def pod_notices(
    disrupted: Iterable[PodInfo],
    workers_by_node: Mapping[str, tuple[PodInfo, ...]],
    first_seen: Mapping[str, float],
    now: float,
    min_grace: float,
) -> dict[str, PodNotice]:
    """Per node, the notice of the job's going pod there (``disrupted``: those carrying the
    condition or being deleted), if that pod is still the node's newest worker pod (a
    replacement lifts it). ``min_grace``: seconds of a deletion's grace below which it is a loss."""
    notices: dict[str, PodNotice] = {}
    for pod in disrupted:
        node = pod.node
        if node is None or not going(pod):
            continue
        workers = workers_by_node.get(node)
        if not workers or max(workers, key=_age).name != pod.name:
            continue  # replaced on its node, or not a worker (the job's etcd)
        seen = min(now, first_seen.get(disruption_key(pod), now))
        notices[node] = pod_notice(pod, node, seen, now, min_grace)
    return notices


def agent_notice(
    node: str, member: MemberRecord, first_seen: Mapping[str, float], now: float, min_grace: float
) -> AgentNotice | None:
    """The leave ``member``'s agent announced (``leaving_by``), if it did."""
    if member.leaving_by <= 0:
        return None
    seen = min(now, first_seen.get(leaving_key(node, member), now))
    since = member.leaving_since if member.leaving_since > 0 else seen
    notice = ReclaimNotice(node, f"agent on {node} leaving", MEMBER_LEAVING.source, since, member.leaving_by)
    if member.leaving_by - now < min_grace:
        return AgentNotice(notice, seen, f"agent on {node} leaving, {_grace_left(member.leaving_by, now, min_grace)}")
    return AgentNotice(notice, seen, None, member.leaving_by - min_grace)


def _grace_left(ends: float, now: float, min_grace: float) -> str:
    """Why a leave with too little time left is a loss (one wording per case, so the reason
    of a decision does not change with the clock)."""
    return "its grace ran out" if ends <= now else f"under {min_grace:g} s of its grace left"


def _age(pod: PodInfo) -> tuple[float, str]:
    return pod.created_at, pod.name
