"""Event validation as the API server applies it (pkg/apis/core/validation/events.go).

An Event without eventTime is "legacy" and only its namespace is checked; one with
eventTime must name its reporter, action and reason; and one created through
events.k8s.io/v1 must also leave the deprecated core fields unset.
"""

from __future__ import annotations

from typing import Any

Cause = tuple[str, str, str]
"""(field, reason, message), as a 422 Invalid Status lists them."""

_LIMITS = {"reportingInstance": 128, "action": 128, "reason": 128}
_NOTE_LIMIT = 1024


def event_causes(obj: dict[str, Any], *, events_api: bool, creating: bool) -> list[Cause]:
    """What is wrong with a stored-form Event; field names as the requesting API spells them."""
    causes: list[Cause] = []
    names = _names(events_api)
    namespace = obj["metadata"].get("namespace", "")
    involved_ns = (obj.get("involvedObject") or {}).get("namespace") or ""
    mismatch = (
        names["involvedObject"] + ".namespace",
        "FieldValueInvalid",
        f"Invalid value: {involved_ns!r}: does not match event.namespace",
    )
    if not obj.get("eventTime"):
        # legacy: an Event about a cluster-scoped object (a Node) lives in "default"
        if (involved_ns and involved_ns != namespace) or (not involved_ns and namespace not in ("", "default")):
            causes.append(mismatch)
    else:
        if not involved_ns and namespace not in ("default", "kube-system"):
            causes.append(mismatch)
        for field in ("reportingComponent", "reportingInstance", "action", "reason"):
            value = obj.get(field) or ""
            shown = names.get(field, field)
            if not value:
                causes.append((shown, "FieldValueRequired", "Required value"))
            elif field in _LIMITS and len(value) > _LIMITS[field]:
                causes.append(
                    (shown, "FieldValueInvalid", f"Invalid value: can have at most {_LIMITS[field]} characters")
                )
        if len(obj.get("message") or "") > _NOTE_LIMIT:
            causes.append(
                (names["message"], "FieldValueInvalid", f"Invalid value: can have at most {_NOTE_LIMIT} characters")
            )
    if events_api and creating:
        if not obj.get("eventTime"):
            causes.append(("eventTime", "FieldValueRequired", "Required value"))
        if obj.get("type") not in ("Normal", "Warning"):
            causes.append(("type", "FieldValueInvalid", f"Invalid value: has invalid value: {obj.get('type')}"))
        for field in ("firstTimestamp", "lastTimestamp", "count", "source"):
            if obj.get(field):
                causes.append((names[field], "FieldValueInvalid", "Invalid value: needs to be unset"))
    return causes


def _names(events_api: bool) -> dict[str, str]:
    if not events_api:
        return {"involvedObject": "involvedObject", "message": "message"}
    return {
        "involvedObject": "regarding",
        "message": "note",
        "reportingComponent": "reportingController",
        "firstTimestamp": "deprecatedFirstTimestamp",
        "lastTimestamp": "deprecatedLastTimestamp",
        "count": "deprecatedCount",
        "source": "deprecatedSource",
    }
