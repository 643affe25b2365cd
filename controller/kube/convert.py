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


def container_restarts(status: dict[str, Any]) -> tuple[ContainerRestarts, ...]:
    """Each container's ``restartCount`` and whether its ``lastState.terminated`` (the
    termination behind the latest restart, as the kubelet keeps it) was a failure."""
    found = []
    for container in status.get("containerStatuses") or ():
        if not isinstance(container, dict):
            continue
        count = container.get("restartCount", 0)
        count = count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0
        last = (container.get("lastState") or {}).get("terminated")
        failed = True
        if isinstance(last, dict):
            code, reason, signal = last.get("exitCode"), last.get("reason"), last.get("signal")
            failed = termination_failed(
                code if isinstance(code, int) and not isinstance(code, bool) else None,
                reason if isinstance(reason, str) else "",
                signal if isinstance(signal, int) and not isinstance(signal, bool) else 0,
            )
        found.append(ContainerRestarts(str(container.get("name", "")), count, failed))
    return tuple(found)


def pod_info(obj: dict[str, Any]) -> PodInfo:
    meta: ObjectMeta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    labels = dict(meta.get("labels") or {})
    containers = container_restarts(status)
    deleting = bool(meta.get("deletionTimestamp"))
    return PodInfo(
        namespace=meta.get("namespace", "default"),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        job=labels.get(JOB_LABEL, ""),
        node=spec.get("nodeName") or None,
        annotations=dict(meta.get("annotations") or {}),
        phase=status.get("phase", "Pending"),
        deleting=deleting,
        deletion_deadline=parse_time(meta.get("deletionTimestamp")) if deleting else None,
        deletion_grace_seconds=_seconds(meta.get("deletionGracePeriodSeconds")) if deleting else None,
        restart_count=sum(c.count for c in containers),
        containers=containers,
        created_at=parse_time(meta.get("creationTimestamp")) or 0.0,
        labels=labels,
        disruption=pod_disruption(meta, spec, status),
    )
