"""Kubernetes JSON objects -> the controller's ``NodeInfo`` / ``PodInfo``, at the edge."""

from __future__ import annotations

from datetime import datetime
from typing import Any, TypedDict

from regroup.controller.cluster import JOB_LABEL, NodeInfo, PodDisruption, PodInfo, Taint
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


def grace_seconds(spec: dict[str, Any]) -> float:
    """``spec.terminationGracePeriodSeconds``; the API default (30) when absent or not a
    non-negative number (the API server validates it, so that only guards the parse)."""
    value = spec.get("terminationGracePeriodSeconds")
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return POD_DISRUPTION.default_grace.total_seconds()
    return float(value)


def pod_disruption(spec: dict[str, Any], status: dict[str, Any]) -> PodDisruption | None:
    """The pod's ``DisruptionTarget=True`` condition, if it carries one."""
    for condition in status.get("conditions") or ():
        if isinstance(condition, dict) and condition.get("type") == POD_DISRUPTION.condition:
            if condition.get("status") != "True":
                return None
            reason = str(condition.get("reason") or "unknown reason")
            since = condition.get("lastTransitionTime")
            return PodDisruption(reason, parse_time(since if isinstance(since, str) else None), grace_seconds(spec))
    return None


def pod_info(obj: dict[str, Any]) -> PodInfo:
    meta: ObjectMeta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    labels = dict(meta.get("labels") or {})
    restarts = sum(int(c.get("restartCount", 0) or 0) for c in status.get("containerStatuses") or ())
    return PodInfo(
        namespace=meta.get("namespace", "default"),
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        job=labels.get(JOB_LABEL, ""),
        node=spec.get("nodeName") or None,
        annotations=dict(meta.get("annotations") or {}),
        phase=status.get("phase", "Pending"),
        deleting=bool(meta.get("deletionTimestamp")),
        restart_count=restarts,
        created_at=parse_time(meta.get("creationTimestamp")) or 0.0,
        labels=labels,
        disruption=pod_disruption(spec, status),
    )
