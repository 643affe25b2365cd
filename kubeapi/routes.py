"""Which resource, namespace, name and subresource a request path names; JSON bodies in and out."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kubeapi import resources
from kubeapi.errors import ApiError, bad_request
from kubeapi.resources import Resource


@dataclass(frozen=True)
class Route:
    """A request path, resolved."""

    resource: Resource
    namespace: str | None
    name: str | None
    subresource: str | None


def resolve(path: str) -> Route:
    """What a request path names; 404 for anything this server does not serve."""
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif len(parts) >= 3 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        raise ApiError(404, "the server could not find the requested resource")
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces" and not (len(rest) == 3 and group == "" and rest[2] == "status"):
        namespace, rest = rest[1], rest[2:]
    resource = resources.by_path(group, version, rest[0]) if rest else None
    if resource is None or len(rest) > 3 or (namespace is not None and not resource.namespaced):
        raise ApiError(404, "the server could not find the requested resource")
    name = rest[1] if len(rest) > 1 else None
    subresource = rest[2] if len(rest) > 2 else None
    if name is not None and resource.namespaced and namespace is None:
        raise ApiError(404, "the server could not find the requested resource")
    allowed = {"status"} if resource.status_subresource else set()
    if resource.storage == "pods":
        allowed.add("eviction")
    if subresource is not None and subresource not in allowed:
        raise ApiError(404, "the server could not find the requested resource")
    return Route(resource, namespace, name, subresource)


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(text=json.dumps(body), status=status, content_type="application/json")


async def read_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
