"""GET of a collection: resourceVersion semantics, selectors, limit/continue paging."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Awaitable, Callable
from typing import Any

from kubeapi.errors import ApiError, bad_request, expired
from kubeapi.params import parse_int
from kubeapi.store import Filter, Key, Store


async def list_collection(
    store: Store, selected: Filter, query: dict[str, str], await_revision: Callable[[int], Awaitable[None]]
) -> dict[str, Any]:
    """The list document; `await_revision` waits for a version from the future (or raises 504)."""
    resource = selected.resource
    rv_text, match, token = query.get("resourceVersion"), query.get("resourceVersionMatch"), query.get("continue")
    limit = parse_int(query["limit"], "limit") if query.get("limit") else 0
    if rv_text == "0":
        limit = 0  # "any version" is served whole from the watch cache; limit does not apply
    start: Key | None = None
    if token:
        if rv_text:
            raise bad_request("specifying resource version is not allowed when using continue")
        rv, start = _decode_continue(token)
        try:
            state = store.state_at(resource.storage, rv)
        except ApiError:
            raise expired(
                "The provided continue parameter is too old to display a consistent list result. "
                "You can start a new list without the continue parameter."
            ) from None
    elif match is not None and match not in ("Exact", "NotOlderThan"):
        raise bad_request(f"resourceVersionMatch: unsupported value {match!r}")
    elif match is not None and not rv_text:
        raise bad_request("resourceVersionMatch: is forbidden unless resourceVersion is provided")
    elif match == "Exact":
        rv = parse_int(rv_text or "", "resourceVersion")
        if rv == 0:
            raise bad_request('resourceVersionMatch: "Exact" is forbidden for resourceVersion "0"')
        await await_revision(rv)
        try:
            state = store.state_at(resource.storage, rv)
        except ApiError:
            raise expired("The resourceVersion for the provided list is too old.") from None
    else:
        # Unset, "0" and NotOlderThan are all served from the newest state, which satisfies each.
        if rv_text:
            await await_revision(parse_int(rv_text, "resourceVersion"))
        rv, state = store.revision, store.items(resource.storage)
    matching = [(k, o) for k, o in sorted(state.items()) if (start is None or k > start) and selected.accepts(o)]
    metadata: dict[str, Any] = {"resourceVersion": str(rv)}
    if limit and len(matching) > limit:
        metadata["continue"] = _encode_continue(rv, matching[limit - 1][0])
        if not selected.labels.requirements and not selected.fields.terms:
            metadata["remainingItemCount"] = len(matching) - limit
        matching = matching[:limit]
    return {
        "kind": resource.list_kind,
        "apiVersion": resource.api_version,
        "metadata": metadata,
        "items": [_strip_type(resource.wire(o)) for _, o in matching],
    }


def _strip_type(obj: dict[str, Any]) -> dict[str, Any]:
    # Items of a typed list carry no kind/apiVersion of their own on the real server.
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


def _encode_continue(rv: int, key: Key) -> str:
    token = {"v": "meta.k8s.io/v1", "rv": rv, "start": list(key)}
    return base64.urlsafe_b64encode(json.dumps(token).encode()).decode()


def _decode_continue(token: str) -> tuple[int, Key]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), (str(data["start"][0]), str(data["start"][1]))
    except (ValueError, KeyError, IndexError, TypeError, binascii.Error):
        raise bad_request(f"continue: invalid continue token {token!r}") from None
