"""The resource types the stand-in serves, with the per-type rules the real API server applies."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Strategic-merge-patch strategies from the Go struct tags (`patchStrategy:"merge"`,
# `patchMergeKey`). A path names a list field ("[]" stands for "any element");
# the value is the merge key, or None for a list of scalars merged as a set.
# Every list not named here is replaced whole, e.g. node `spec.taints`, which has no strategy.
_META_LISTS: dict[str, str | None] = {
    "metadata.finalizers": None,
    "metadata.ownerReferences": "uid",
}
_CONTAINER_LISTS = {
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "resizePolicy": "resourceName",
}
_POD_LISTS: dict[str, str | None] = {
    **_META_LISTS,
    "spec.volumes": "name",
    "spec.imagePullSecrets": "name",
    "spec.hostAliases": "ip",
    "status.conditions": "type",
    "status.podIPs": "ip",
}
for _list in ("containers", "initContainers", "ephemeralContainers"):
    _POD_LISTS[f"spec.{_list}"] = "name"
    for _field, _key in _CONTAINER_LISTS.items():
        _POD_LISTS[f"spec.{_list}[].{_field}"] = _key
_NODE_LISTS: dict[str, str | None] = {
    **_META_LISTS,
    "spec.podCIDRs": None,
    "status.conditions": "type",
    "status.addresses": "type",
}
_NAMESPACE_LISTS: dict[str, str | None] = {**_META_LISTS, "status.conditions": "type"}
_BUDGET_LISTS: dict[str, str | None] = {**_META_LISTS, "status.conditions": "type"}
# policy/v1 PodDisruptionBudgetStatus: these four counts are always serialized (no omitempty).
_BUDGET_STATUS = {"disruptionsAllowed": 0, "currentHealthy": 0, "desiredHealthy": 0, "expectedPods": 0}

# core/v1 Event fields under their events.k8s.io/v1 names: the two APIs serve one stored object.
_EVENT_RENAMES = {
    "involvedObject": "regarding",
    "message": "note",
    "reportingComponent": "reportingController",
    "source": "deprecatedSource",
    "firstTimestamp": "deprecatedFirstTimestamp",
    "lastTimestamp": "deprecatedLastTimestamp",
    "count": "deprecatedCount",
}


def _rename(obj: dict[str, Any], renames: Mapping[str, str], api_version: str) -> dict[str, Any]:
    out = {renames.get(k, k): v for k, v in obj.items()}
    out["apiVersion"] = api_version
    return out


def _event_to_events_v1(obj: dict[str, Any]) -> dict[str, Any]:
    return _rename(obj, _EVENT_RENAMES, "events.k8s.io/v1")


def _event_from_events_v1(obj: dict[str, Any]) -> dict[str, Any]:
    return _rename(obj, {v: k for k, v in _EVENT_RENAMES.items()}, "v1")


@dataclass(frozen=True)
class Resource:
    """One served resource type (group/version/plural) and the rules its strategy applies."""

    group: str
    """API group; "" for the core group."""
    version: str
    """API version within the group."""
    plural: str
    """URL path segment, e.g. "pods"."""
    kind: str
    """Object kind, e.g. "Pod"."""
    namespaced: bool
    """Whether objects live in a namespace."""
    storage: str
    """Key of the stored collection; two APIs serving one object share it (core and events.k8s.io Events)."""
    status_subresource: bool = False
    """Writes to the main resource keep the stored status; writes to /status change only status."""
    unconditional_update: bool = True
    """Whether PUT may omit metadata.resourceVersion (Leases require it)."""
    create_on_update: bool = False
    """Whether PUT of a missing object creates it (Events do)."""
    reset_status_on_create: dict[str, Any] | None = None
    """Status the server sets on create over HTTP, ignoring the client's (Pods start Pending)."""
    default_status: dict[str, Any] | None = None
    """Status an in-process create without one gets, as the server's defaulting fills it in."""
    field_labels: frozenset[str] = frozenset({"metadata.name", "metadata.namespace"})
    """Fields a fieldSelector may name; any other gives 400 as on the real server."""
    field_defaults: Mapping[str, str] = field(default_factory=dict)
    """What a fieldSelector reads for an absent field, where the server's field set fills one in."""
    field_aliases: Mapping[str, str] = field(default_factory=dict)
    """Field labels that stand for another path (Events' `source` is `source.component`)."""
    merge_lists: Mapping[str, str | None] = field(default_factory=lambda: dict(_META_LISTS))
    """Strategic-merge-patch list strategies (see _META_LISTS)."""
    to_wire: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Converts a stored object to this API's representation, when the storage is shared."""
    from_wire: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    """Converts this API's representation to the stored one."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """How messages name the resource: "pods", "leases.coordination.k8s.io"."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    def wire(self, stored: dict[str, Any]) -> dict[str, Any]:
        return self.to_wire(stored) if self.to_wire else stored

    def unwire(self, received: dict[str, Any]) -> dict[str, Any]:
        return self.from_wire(received) if self.from_wire else received


PODS = Resource(
    "",
    "v1",
    "pods",
    "Pod",
    namespaced=True,
    storage="pods",
    status_subresource=True,
    reset_status_on_create={"phase": "Pending"},
    field_labels=frozenset(
        {
            "metadata.name",
            "metadata.namespace",
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        }
    ),
    field_defaults={"spec.hostNetwork": "false"},
    merge_lists=_POD_LISTS,
)
NODES = Resource(
    "",
    "v1",
    "nodes",
    "Node",
    namespaced=False,
    storage="nodes",
    status_subresource=True,
    field_labels=frozenset({"metadata.name", "spec.unschedulable"}),
    field_defaults={"spec.unschedulable": "false"},
    merge_lists=_NODE_LISTS,
)
NAMESPACES = Resource(
    "",
    "v1",
    "namespaces",
    "Namespace",
    namespaced=False,
    storage="namespaces",
    status_subresource=True,
    reset_status_on_create={"phase": "Active"},
    default_status={"phase": "Active"},
    field_labels=frozenset({"metadata.name", "status.phase"}),
    merge_lists=_NAMESPACE_LISTS,
)
_EVENT_FIELDS = frozenset(
    {
        "metadata.name",
        "metadata.namespace",
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "source",
        "type",
    }
)
EVENTS = Resource(
    "",
    "v1",
    "events",
    "Event",
    namespaced=True,
    storage="events",
    create_on_update=True,
    field_labels=_EVENT_FIELDS,
    field_aliases={"source": "source.component"},
)
EVENTS_V1 = Resource(
    "events.k8s.io",
    "v1",
    "events",
    "Event",
    namespaced=True,
    storage="events",
    create_on_update=True,
    field_labels=frozenset(
        {
            "metadata.name",
            "metadata.namespace",
            "regarding.kind",
            "regarding.name",
            "regarding.namespace",
            "reason",
            "type",
        }
    ),
    to_wire=_event_to_events_v1,
    from_wire=_event_from_events_v1,
)
LEASES = Resource(
    "coordination.k8s.io",
    "v1",
    "leases",
    "Lease",
    namespaced=True,
    storage="leases",
    unconditional_update=False,
)

POD_DISRUPTION_BUDGETS = Resource(
    "policy",
    "v1",
    "poddisruptionbudgets",
    "PodDisruptionBudget",
    namespaced=True,
    storage="poddisruptionbudgets",
    status_subresource=True,
    # The strategy clears a created budget's status; the disruption controller fills it in.
    reset_status_on_create=_BUDGET_STATUS,
    default_status=_BUDGET_STATUS,
    merge_lists=_BUDGET_LISTS,
)

ALL = (PODS, NODES, NAMESPACES, EVENTS, EVENTS_V1, LEASES, POD_DISRUPTION_BUDGETS)

# The stored (canonical) API of each storage, used by the in-process test API.
CANONICAL = {r.storage: r for r in ALL if r.to_wire is None}


def by_path(group: str, version: str, plural: str) -> Resource | None:
    for resource in ALL:
        if (resource.group, resource.version, resource.plural) == (group, version, plural):
            return resource
    return None


def by_name(name: str) -> Resource:
    """The canonical resource for a kind ("Pod") or plural ("pods"), case-insensitive."""
    wanted = name.lower()
    for resource in CANONICAL.values():
        if wanted in (resource.kind.lower(), resource.plural):
            return resource
    raise ValueError(f"kind: unknown resource {name!r}; served: {sorted(CANONICAL)}")


def by_api_version_kind(api_version: str, kind: str) -> Resource:
    for resource in ALL:
        if (resource.api_version, resource.kind) == (api_version, kind):
            return resource
    raise ValueError(f"apiVersion/kind: {api_version}/{kind} is not served")
