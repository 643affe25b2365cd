"""The controller's hands on Kubernetes: cordon with taint and annotation, delete pods, Events."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime
from typing import Any, Literal

import structlog

from regroup.controller.cluster import ObjectRef
from regroup.controller.kube.api import KubeError, RawKube
from regroup.controller.settings import KubeSettings

log = structlog.get_logger("regroup.controller.kube")

CORDON_ANNOTATION = "regroup.dev/cordoned"
"""Set on a node the controller cordoned: JSON ``{"reason", "time"}``."""

_CONFLICT_RETRIES = 5


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class KubeActuator:
    """A ``ClusterActuator`` over the Kubernetes API. Every call is idempotent."""

    def __init__(self, raw: RawKube, settings: KubeSettings, clock: Any = None) -> None:
        self._raw = raw
        self._settings = settings
        self._clock = clock or (lambda: datetime.now(UTC).timestamp())

    async def cordon(self, node: str, reason: str, taint_key: str, now: float) -> None:
        """``spec.unschedulable``, taint ``taint_key:NoSchedule`` and the reason annotation, in
        one merge patch guarded by resourceVersion (taints are a list patched whole)."""
        path = f"/api/v1/nodes/{node}"
        for _ in range(_CONFLICT_RETRIES):
            obj = await self._raw.request("GET", path)
            taints = list((obj.get("spec") or {}).get("taints") or [])
            if not any(t.get("key") == taint_key for t in taints):
                taints.append({"key": taint_key, "value": "true", "effect": "NoSchedule", "timeAdded": rfc3339(now)})
            patch = {
                "metadata": {
                    "resourceVersion": obj["metadata"]["resourceVersion"],
                    "annotations": {CORDON_ANNOTATION: json.dumps({"reason": reason, "time": rfc3339(now)})},
                },
                "spec": {"unschedulable": True, "taints": taints},
            }
            try:
                await self._raw.request("PATCH", path, body=patch, content_type="application/merge-patch+json")
                return
            except KubeError as exc:
                if exc.status != 409:
                    raise
        raise KubeError("PATCH", path, 409, f"node {node} kept changing; cordon not applied")

    async def delete_pod(self, namespace: str, name: str, reason: str) -> None:
        try:
            await self._raw.request("DELETE", f"/api/v1/namespaces/{namespace}/pods/{name}")
        except KubeError as exc:
            if exc.status != 404:
                raise

    async def post_event(
        self, ref: ObjectRef, type_: Literal["Normal", "Warning"], reason: str, message: str
    ) -> None:
        namespace = ref.namespace or "default"
        now = rfc3339(self._clock())
        involved = {"kind": ref.kind, "name": ref.name, "apiVersion": "v1"}
        if ref.namespace:
            involved["namespace"] = ref.namespace
        if ref.uid:
            involved["uid"] = ref.uid
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{ref.name}.{secrets.token_hex(8)}", "namespace": namespace},
            "involvedObject": involved,
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": self._settings.event_component},
            "reportingComponent": self._settings.event_component,
            "reportingInstance": self._settings.event_component,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._raw.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body)
