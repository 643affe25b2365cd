"""Query parameters as the API server parses them."""

from __future__ import annotations

from kubeapi.errors import bad_request
from kubeapi.resources import Resource
from kubeapi.selectors import parse_field_selector, parse_label_selector
from kubeapi.store import Filter


def parse_bool(text: str | None, name: str) -> bool:
    """Go's strconv.ParseBool, which the server uses for boolean parameters (the client sends "True")."""
    if text is None:
        return False
    if text in ("1", "t", "T", "TRUE", "true", "True"):
        return True
    if text in ("0", "f", "F", "FALSE", "false", "False", ""):
        return False
    raise bad_request(f"{name}: invalid boolean {text!r}")


def parse_int(text: str, name: str) -> int:
    """A non-negative integer parameter; 400 naming it otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise bad_request(f"{name}: invalid value {text!r}: must be an integer") from None
    if value < 0:
        raise bad_request(f"{name}: invalid value {text!r}: must not be negative")
    return value


def selection(resource: Resource, namespace: str | None, query: dict[str, str]) -> Filter:
    """The Filter named by a request's path namespace, labelSelector and fieldSelector."""
    return Filter(
        resource,
        namespace,
        parse_label_selector(query.get("labelSelector")),
        parse_field_selector(
            query.get("fieldSelector"), resource.field_labels, resource.field_defaults, resource.field_aliases
        ),
    )
