"""Factories for the objects tests put into the stand-in: nodes, worker pods, taints."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

JOB_LABEL = "regroup.dev/job"


def taint(key: str, value: str = "", effect: str = "NoSchedule") -> dict[str, str]:
    """A node taint; effect is NoSchedule, PreferNoSchedule or NoExecute."""
    if effect not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
        raise ValueError(f"effect: must be NoSchedule, PreferNoSchedule or NoExecute, got {effect!r}")
    entry = {"key": key, "effect": effect}
    if value:
        entry["value"] = value
    return entry


def node(
    name: str,
    *,
    taints: Iterable[Mapping[str, str]] = (),
    ready: bool = True,
    unschedulable: bool = False,
    labels: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A v1 Node with a Ready condition, as a kubelet reports it."""
    spec: dict[str, Any] = {}
    if taints:
        spec["taints"] = [dict(t) for t in taints]
    if unschedulable:
        spec["unschedulable"] = True
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": spec,
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "reason": "KubeletReady" if ready else "KubeletNotReady",
                    "message": "kubelet is posting ready status" if ready else "kubelet stopped posting node status",
                }
            ],
            "addresses": [{"type": "Hostname", "address": name}],
        },
    }


def pod(
    namespace: str,
    name: str,
    *,
    job: str,
    node: str,
    annotations: Mapping[str, str] | None = None,
    restart_count: int = 0,
    phase: str = "Running",
    labels: Mapping[str, str] | None = None,
    termination_grace_period: int | None = None,
) -> dict[str, Any]:
    """A worker pod of `job` scheduled on `node`, with one container named "worker"
    (and `spec.terminationGracePeriodSeconds` when given)."""
    running = phase == "Running"
    obj: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {JOB_LABEL: job, **(labels or {})},
            "annotations": dict(annotations or {}),
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Always",
            "containers": [{"name": "worker", "image": "regroup:test"}],
        },
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if running else "False"}],
            "containerStatuses": [
                {
                    "name": "worker",
                    "image": "regroup:test",
                    "imageID": "",
                    "ready": running,
                    "restartCount": restart_count,
                    "started": running,
                    "state": {"running": {}} if running else {"waiting": {"reason": "ContainerCreating"}},
                }
            ],
        },
    }
    if termination_grace_period is not None:
        obj["spec"]["terminationGracePeriodSeconds"] = termination_grace_period
    return obj
