"""What the API server checks of an object before storing it: kind, namespace, name, labels."""

from __future__ import annotations

import re
from typing import Any

from kubeapi.budgets import budget_causes
from kubeapi.errors import bad_request, invalid
from kubeapi.event_rules import event_causes
from kubeapi.resources import NAMESPACES, POD_DISRUPTION_BUDGETS, Resource

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# metadata fields only the server sets; a client's values are ignored (or checked, for uid)


def typed(resource: Resource, obj: Any) -> dict[str, Any]:
    """The stored form of a request body; a missing apiVersion/kind defaults to the endpoint's."""
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    api_version = obj.setdefault("apiVersion", resource.api_version)
    kind = obj.setdefault("kind", resource.kind)
    if (api_version, kind) != (resource.api_version, resource.kind):
        raise bad_request(
            f"apiVersion/kind: {api_version}/{kind} does not match the endpoint's "
            f"{resource.api_version}/{resource.kind}"
        )
    return resource.unwire(obj)

def check_namespace(resource: Resource, meta: dict[str, Any], namespace: str) -> str:
    if not resource.namespaced:
        meta.pop("namespace", None)
        return ""
    given = meta.get("namespace")
    if given and given != namespace:
        raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
    meta["namespace"] = namespace
    return namespace

def check_name(resource: Resource, name: str) -> None:
    pattern, limit = (_DNS_LABEL, 63) if resource is NAMESPACES else (_DNS_SUBDOMAIN, 253)
    if not isinstance(name, str) or not pattern.match(name) or len(name) > limit:
        raise invalid(
            resource.kind,
            str(name),
            resource.group,
            [
                (
                    "metadata.name",
                    "FieldValueInvalid",
                    f"Invalid value: {name!r}: a lowercase RFC 1123 "
                    f"{'label' if resource is NAMESPACES else 'subdomain'} must consist of lower case "
                    "alphanumeric characters, '-' or '.'",
                )
            ],
        )

def validate(resource: Resource, obj: dict[str, Any], *, creating: bool) -> None:
    meta = obj["metadata"]
    for field_name in ("labels", "annotations"):
        values = meta.get(field_name)
        if values is not None and (
            not isinstance(values, dict) or not all(isinstance(v, str) for v in values.values())
        ):
            raise invalid(
                resource.kind,
                meta["name"],
                resource.group,
                [(f"metadata.{field_name}", "FieldValueInvalid", "Invalid value: values must be strings")],
            )
    if resource.storage == "events":
        causes = event_causes(obj, events_api=resource.from_wire is not None, creating=creating)
        if causes:
            raise invalid(resource.kind, meta["name"], resource.group, causes)
    if resource is POD_DISRUPTION_BUDGETS:
        causes = budget_causes(obj)
        if causes:
            raise invalid(resource.kind, meta["name"], resource.group, causes)
