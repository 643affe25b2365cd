"""Kubernetes JSON objects -> the controller's ``NodeInfo`` / ``PodInfo``, at the edge."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypedDict

from regroup.controller.cluster import (
    JOB_LABEL,
    ContainerRestarts,
    NodeInfo,
    PodDisruption,
    PodInfo,
    Taint,
    member_key,
    termination_failed,
)
from regroup.controller.signals import POD_DISRUPTION


class ObjectMeta(TypedDict, total=False):
    name: str
    namespace: str
    uid: str
    labels: dict[str, str]
    annotations: dict[str, str]
    resourceVersion: str
    creationTimestamp: str
    deletionTimestamp: str
    deletionGracePeriodSeconds: int


def parse_time(text: str | None) -> float | None:
    """RFC 3339 (``2024-01-02T03:04:05Z``, optional fraction) -> unix seconds."""
    if not text:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def node_info(obj: dict[str, Any]) -> NodeInfo:
    meta: ObjectMeta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    taints = tuple(
        Taint(t.get("key", ""), t.get("value", "") or "", t.get("effect", "NoSchedule"), parse_time(t.get("timeAdded")))
        for t in spec.get("taints") or ()
    )
    ready: bool | None = None
    for condition in status.get("conditions") or ():
        if condition.get("type") == "Ready":
            ready = {"True": True, "False": False}.get(condition.get("status", ""))
    capacity = status.get("capacity") or {}
    try:
        gpus = int(str(capacity.get("nvidia.com/gpu", "0")))
    except ValueError:
        gpus = 0
    return NodeInfo(
        name=meta.get("name", ""),
        taints=taints,
        ready=ready,
        unschedulable=bool(spec.get("unschedulable")),
        labels=dict(meta.get("labels") or {}),
        annotations=dict(meta.get("annotations") or {}),
        gpus=gpus,
    )


def _seconds(value: Any) -> float | None:
    """A non-negative number of seconds, or None (the API server validates these, so
    anything else only guards the parse)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value)


def grace_seconds(meta: ObjectMeta, spec: dict[str, Any]) -> float:
    """The pod's grace period: the deletion's own ``metadata.deletionGracePeriodSeconds``
    once it is being deleted (an eviction or ``kubectl delete --grace-period`` may shorten
    it), else ``spec.terminationGracePeriodSeconds``, else the API default (30)."""
    for value in (meta.get("deletionGracePeriodSeconds"), spec.get("terminationGracePeriodSeconds")):
        seconds = _seconds(value)
        if seconds is not None:
            return seconds
    return POD_DISRUPTION.default_grace.total_seconds()


def pod_disruption(meta: ObjectMeta, spec: dict[str, Any], status: dict[str, Any]) -> PodDisruption | None:
    """The pod's ``DisruptionTarget=True`` condition, if it carries one."""
    for condition in status.get("conditions") or ():
        if isinstance(condition, dict) and condition.get("type") == POD_DISRUPTION.condition:
            if condition.get("status") != "True":
                return None
            reason = str(condition.get("reason") or "unknown reason")
            since = condition.get("lastTransitionTime")
            return PodDisruption(reason, parse_time(since if isinstance(since, str) else None), grace_seconds(meta, spec))
    return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _failed(termination: dict[str, Any]) -> bool:
    reason = termination.get("reason")
    code, signal = _int(termination.get("exitCode")), _int(termination.get("signal")) or 0
    return termination_failed(code, reason if isinstance(reason, str) else "", signal)


def _state(container: dict[str, Any], key: str) -> dict[str, Any]:
    """``container[key]`` (``state`` or ``lastState``) as a dict of its one entry."""
    state = container.get(key)
    return state if isinstance(state, dict) else {}


def _time(entry: Any, field: str) -> float | None:
    value = entry.get(field) if isinstance(entry, dict) else None
    return parse_time(value if isinstance(value, str) else None)


def container_restarts(status: dict[str, Any]) -> tuple[ContainerRestarts, ...]:
    """Each container's ``restartCount``, whether its ``lastState.terminated`` (the
    termination behind the latest restart, as the kubelet keeps it) was a failure, when the
    instance running now started, and its latest termination (``state.terminated`` while it
    is terminated, else ``lastState.terminated``): when, with which code, a failure or not."""
    found = []
    for container in status.get("containerStatuses") or ():
        if not isinstance(container, dict):
            continue
        count = _int(container.get("restartCount"))
        count = count if count is not None and count >= 0 else 0
        state, last = _state(container, "state"), _state(container, "lastState").get("terminated")
        failed = _failed(last) if isinstance(last, dict) else True
        latest = state.get("terminated")
        latest = latest if isinstance(latest, dict) else last if isinstance(last, dict) else None
        reason = latest.get("reason") if latest is not None else None
        found.append(
            ContainerRestarts(
                str(container.get("name", "")),
                count,
                failed,
                running_since=_time(state.get("running"), "startedAt"),
                exited_at=_time(latest, "finishedAt"),
                exit_code=_int(latest.get("exitCode")) if latest is not None else None,
                exit_reason=reason if isinstance(reason, str) else "",
                exit_failed=_failed(latest) if latest is not None else True,
            )
        )
    return tuple(found)


DEFAULT_CONTAINER = "kubectl.kubernetes.io/default-container"
"""The annotation naming a pod's main container (kubectl's, for logs and exec)."""


def agent_container(meta: ObjectMeta, spec: dict[str, Any]) -> str:
    """The container that runs the agent: the pod's ``kubectl.kubernetes.io/default-container``
    annotation, else its first container; "" when the pod names none."""
    named = (meta.get("annotations") or {}).get(DEFAULT_CONTAINER)
    if isinstance(named, str) and named:
        return named
    containers = spec.get("containers")
    first = containers[0] if isinstance(containers, list) and containers else None
    name = first.get("name") if isinstance(first, dict) else None
    return name if isinstance(name, str) else ""


def pod_info(obj: dict[str, Any]) -> PodInfo:
    meta: ObjectMeta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    labels = dict(meta.get("labels") or {})
    containers = container_restarts(status)
    deleting = bool(meta.get("deletionTimestamp"))
    annotations = dict(meta.get("annotations") or {})
    node = spec.get("nodeName") or None
    key = member_key(meta.get("name", ""), node, annotations)
    return PodInfo(
        namespace=meta.get("namespace", "default"),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        job=labels.get(JOB_LABEL, ""),
        node=key,
        annotations=annotations,
        phase=status.get("phase", "Pending"),
        deleting=deleting,
        deletion_deadline=parse_time(meta.get("deletionTimestamp")) if deleting else None,
        deletion_grace_seconds=_seconds(meta.get("deletionGracePeriodSeconds")) if deleting else None,
        restart_count=sum(c.count for c in containers),
        containers=containers,
        agent_container=agent_container(meta, spec),
        created_at=parse_time(meta.get("creationTimestamp")) or 0.0,
        labels=labels,
        disruption=pod_disruption(meta, spec, status),
        ip=status.get("podIP") or "",
        host=node if key != node else None,
    )
