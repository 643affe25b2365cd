"""API discovery documents (/api, /apis, /api/v1, ...) for clients that look resources up.

Legacy discovery only: a client asking for aggregated discovery gets these plain JSON
documents and falls back to reading them, as against a server without it.
"""

from __future__ import annotations

from typing import Any

from kubeapi.resources import ALL, Resource

_VERBS = ["create", "delete", "get", "list", "patch", "update", "watch"]
_SHORT_NAMES = {
    ("", "nodes"): ["no"],
    ("", "pods"): ["po"],
    ("", "events"): ["ev"],
    ("", "namespaces"): ["ns"],
    ("policy", "poddisruptionbudgets"): ["pdb"],
}


def document(path: str, server_address: str) -> dict[str, Any] | None:
    """The discovery document served at `path`, or None when `path` is not a discovery path."""
    parts = [p for p in path.split("/") if p]
    if parts == ["api"]:
        return {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}],
        }
    if parts == ["api", "v1"]:
        return _resource_list("", "v1")
    if parts == ["apis"]:
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [_group(g) for g in _groups()]}
    if len(parts) == 2 and parts[0] == "apis" and parts[1] in _groups():
        return {"kind": "APIGroup", "apiVersion": "v1", **_group(parts[1])}
    if len(parts) == 3 and parts[0] == "apis" and parts[1] in _groups() and parts[2] == "v1":
        return _resource_list(parts[1], "v1")
    return None


def _groups() -> list[str]:
    return sorted({r.group for r in ALL if r.group})


def _group(name: str) -> dict[str, Any]:
    version = {"groupVersion": f"{name}/v1", "version": "v1"}
    return {"name": name, "versions": [version], "preferredVersion": version}


def _resource_list(group: str, version: str) -> dict[str, Any]:
    served = [r for r in ALL if (r.group, r.version) == (group, version)]
    entries: list[dict[str, Any]] = []
    for resource in served:
        entries.append(_entry(resource, resource.plural, resource.kind, _VERBS))
        if resource.status_subresource:
            entries.append(_entry(resource, f"{resource.plural}/status", resource.kind, ["get", "patch", "update"]))
        if resource.storage == "pods":
            eviction = _entry(resource, "pods/eviction", "Eviction", ["create"])
            eviction.update(group="policy", version="v1")
            entries.append(eviction)
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": f"{group}/{version}" if group else version,
        "resources": entries,
    }


def _entry(resource: Resource, name: str, kind: str, verbs: list[str]) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": name,
        "singularName": resource.kind.lower() if "/" not in name else "",
        "namespaced": resource.namespaced,
        "kind": kind,
        "verbs": verbs,
    }
    if (resource.group, name) in _SHORT_NAMES:
        entry["shortNames"] = _SHORT_NAMES[(resource.group, name)]
    return entry
