"""RBAC as the real API server applies it, to check the requests a client sent the stand-in.

The stand-in authorizes nothing (every request with the token is served). This module
decides afterwards whether each recorded request would have been allowed, in two steps
taken from the Kubernetes sources:

- ``request_info``: method, path and query -> verb, API group, resource, subresource,
  name and namespace, as k8s.io/apiserver ``pkg/endpoints/request/requestinfo.go``
  (``RequestInfoFactory.NewRequestInfo``) resolves them: GET of a collection is ``list``,
  or ``watch`` with ``?watch=true``; DELETE of a collection is ``deletecollection``; a
  ``fieldSelector=metadata.name=X`` names the object a list or watch is about.
- ``PolicyRule.allows`` and ``Authorizer``: the rule matching of
  ``plugin/pkg/auth/authorizer/rbac`` (``RuleAllows``: verbs, apiGroups, resources with
  ``resource/subresource`` and ``*/subresource``, resourceNames, nonResourceURLs with a
  trailing ``*``), over the roles a ServiceAccount is bound to: a ClusterRoleBinding
  grants its ClusterRole everywhere, a RoleBinding grants its Role (or ClusterRole) in
  the binding's namespace only.

Every authenticated user may also read the discovery and health URLs (the default
``system:discovery`` and ``system:public-info-viewer`` ClusterRoles).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

_VERBS = {"POST": "create", "GET": "get", "HEAD": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}
_SPECIAL_VERBS = {"proxy", "watch"}
_NAMESPACE_SUBRESOURCES = {"status", "finalize"}
_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_NAMESPACED_KINDS = {"ServiceAccount", "Role", "RoleBinding"}


@dataclass(frozen=True)
class RequestInfo:
    """What RBAC sees of one request."""

    method: str
    path: str
    verb: str
    is_resource: bool
    api_group: str = ""
    namespace: str = ""
    resource: str = ""
    subresource: str = ""
    name: str = ""

    def describe(self) -> str:
        """``PATCH /api/v1/nodes/n1 (patch nodes n1, cluster-scoped)``."""
        call = f"{self.method} {self.path}"
        if not self.is_resource:
            return f"{call} ({self.verb}, non-resource URL)"
        resource = self.resource + (f"/{self.subresource}" if self.subresource else "")
        group = f"{self.api_group} " if self.api_group else ""
        named = f" {self.name}" if self.name else ""
        where = f"namespace {self.namespace}" if self.namespace else "cluster-scoped"
        return f"{call} ({self.verb} {group}{resource}{named}, {where})"


def request_info(method: str, path: str, query: Mapping[str, str]) -> RequestInfo:
    """The request's attributes as the API server's request-info resolver finds them."""
    parts = [p for p in path.strip("/").split("/") if p]
    info = RequestInfo(method=method, path=path, verb=method.lower(), is_resource=False)
    if len(parts) < 3 or parts[0] not in ("api", "apis"):
        return info
    prefix, parts = parts[0], parts[1:]
    group = ""
    if prefix == "apis":
        if len(parts) < 3:
            return info
        group, parts = parts[0], parts[1:]
    parts = parts[1:]  # the version
    if parts[0] in _SPECIAL_VERBS:
        if len(parts) < 2:
            raise ValueError(f"{method} {path}: unable to determine kind and namespace")
        verb, parts = parts[0], parts[1:]
    else:
        verb = _VERBS.get(method.upper(), "")
    namespace = ""
    if parts[0] == "namespaces" and len(parts) > 1:
        namespace = parts[1]
        if len(parts) > 2 and parts[2] not in _NAMESPACE_SUBRESOURCES:
            parts = parts[2:]
    resource = parts[0]
    name = parts[1] if len(parts) >= 2 else ""
    subresource = parts[2] if len(parts) >= 3 and verb != "proxy" else ""
    if not name and verb == "get":
        verb = "watch" if query.get("watch") in _TRUE else "list"
        name = _exact_name(query.get("fieldSelector", ""))
    if not name and verb == "delete":
        verb = "deletecollection"
    return replace(info, verb=verb, is_resource=True, api_group=group, namespace=namespace, resource=resource,
                   subresource=subresource, name=name)


def _exact_name(field_selector: str) -> str:
    for term in field_selector.split(","):
        if "!=" in term:
            continue
        key, sep, value = term.partition("==") if "==" in term else term.partition("=")
        if sep and key.strip() == "metadata.name":
            return value.strip()
    return ""


def _strings(rule: Mapping[str, Any], key: str, where: str) -> frozenset[str]:
    value = rule.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: {key} must be a list of strings, got {value!r}")
    return frozenset(value)


@dataclass(frozen=True)
class PolicyRule:
    """One ``rules`` entry of a Role or ClusterRole."""

    verbs: frozenset[str]
    api_groups: frozenset[str] = frozenset()
    resources: frozenset[str] = frozenset()
    resource_names: frozenset[str] = frozenset()
    non_resource_urls: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, rule: Any, where: str) -> PolicyRule:
        if not isinstance(rule, Mapping):
            raise ValueError(f"{where}: a rule must be a mapping, got {rule!r}")
        parsed = cls(
            verbs=_strings(rule, "verbs", where),
            api_groups=_strings(rule, "apiGroups", where),
            resources=_strings(rule, "resources", where),
            resource_names=_strings(rule, "resourceNames", where),
            non_resource_urls=_strings(rule, "nonResourceURLs", where),
        )
        if not parsed.verbs:
            raise ValueError(f"{where}: a rule needs verbs")
        return parsed

    def allows(self, info: RequestInfo) -> bool:
        if "*" not in self.verbs and info.verb not in self.verbs:
            return False
        if not info.is_resource:
            return any(
                url == "*" or url == info.path or (url.endswith("*") and info.path.startswith(url.rstrip("*")))
                for url in self.non_resource_urls
            )
        if "*" not in self.api_groups and info.api_group not in self.api_groups:
            return False
        if not self._resource_matches(info):
            return False
        return not self.resource_names or info.name in self.resource_names

    def _resource_matches(self, info: RequestInfo) -> bool:
        combined = f"{info.resource}/{info.subresource}" if info.subresource else info.resource
        for resource in self.resources:
            if resource in ("*", combined):
                return True
            if info.subresource and resource == f"*/{info.subresource}":
                return True
        return False


@dataclass(frozen=True)
class Grant:
    """A role's rules as bound to the subject: everywhere, or in one namespace."""

    role: str
    """``ClusterRole regroup-controller``, for messages."""
    namespace: str | None
    """None: cluster-wide (a ClusterRoleBinding); else only requests in this namespace."""
    rules: tuple[PolicyRule, ...]

    def allows(self, info: RequestInfo) -> bool:
        if self.namespace is not None and (not info.is_resource or info.namespace != self.namespace):
            return False
        return any(rule.allows(info) for rule in self.rules)


DISCOVERY = Grant(
    "ClusterRoles system:discovery, system:public-info-viewer",
    None,
    (PolicyRule(verbs=frozenset({"get"}), non_resource_urls=frozenset(
        {"/api", "/api/*", "/apis", "/apis/*", "/healthz", "/livez", "/openapi", "/openapi/*", "/readyz",
         "/version", "/version/"})),),
)


class Authorizer:
    """Decides requests for one subject from the grants its bindings give it."""

    def __init__(self, grants: Iterable[Grant]) -> None:
        self.grants = tuple(grants)

    def allows(self, info: RequestInfo) -> bool:
        return any(grant.allows(info) for grant in (*self.grants, DISCOVERY))

    def denied(self, requests: Iterable[tuple[str, str, Mapping[str, str]]]) -> list[str]:
        """The distinct requests (``(method, path, query)``, as ``FakeKubeAPI.requests``) that
        would have been refused, each described with what RBAC saw."""
        refused: dict[str, None] = {}
        for method, path, query in requests:
            info = request_info(method, path, query)
            if not self.allows(info):
                refused.setdefault(info.describe())
        return list(refused)

    def check(self, requests: Iterable[tuple[str, str, Mapping[str, str]]], who: str = "the client") -> None:
        """Raise ``AssertionError`` naming every request the grants do not allow."""
        refused = self.denied(requests)
        if refused:
            roles = ", ".join(g.role + (f" (namespace {g.namespace})" if g.namespace else "") for g in self.grants)
            raise AssertionError(
                f"RBAC would refuse {len(refused)} call(s) of {who} (allowed by none of: {roles or 'no roles'}):\n  "
                + "\n  ".join(refused)
            )

    def without(self, verb: str, resource: str, api_group: str = "") -> Authorizer:
        """The same grants with ``verb`` removed from every rule on ``api_group``/``resource``."""
        def strip(rule: PolicyRule) -> PolicyRule:
            if api_group in rule.api_groups and resource in rule.resources:
                return replace(rule, verbs=rule.verbs - {verb})
            return rule

        return Authorizer(replace(g, rules=tuple(strip(r) for r in g.rules)) for g in self.grants)


def load_documents(path: Path, namespace: str) -> list[dict[str, Any]]:
    """The manifest's objects as installed into ``namespace``: namespaced RBAC objects
    without one get it, as kustomize's ``namespace:`` does."""
    with path.open() as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or "kind" not in doc or not isinstance(doc.get("metadata"), dict):
            raise ValueError(f"{path}: every document must be an object with kind and metadata, got {doc!r}")
        if doc["kind"] in _NAMESPACED_KINDS:
            doc["metadata"].setdefault("namespace", namespace)
    return docs


def service_account_grants(docs: Sequence[Mapping[str, Any]], namespace: str, name: str) -> list[Grant]:
    """What the ServiceAccount ``namespace/name`` is granted by the bindings in ``docs``."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
             for d in docs if d["kind"] in ("Role", "ClusterRole")}
    grants = []
    for binding in docs:
        if binding["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        where = f"{binding['kind']} {binding['metadata']['name']}"
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == name and s.get("namespace") == namespace
                   for s in binding.get("subjects") or ()):
            continue
        bound_ns = binding["metadata"].get("namespace") if binding["kind"] == "RoleBinding" else None
        ref = binding.get("roleRef") or {}
        kind = ref.get("kind")
        role = roles.get((kind, bound_ns if kind == "Role" else None, ref.get("name")))
        if role is None:
            raise ValueError(f"{where}: roleRef {kind} {ref.get('name')} is not in the manifest")
        label = f"{kind} {ref.get('name')}"
        rules = tuple(PolicyRule.parse(r, f"{label} rule {i}") for i, r in enumerate(role.get("rules") or ()))
        grants.append(Grant(label, bound_ns, rules))
    return grants


def manifest_authorizer(path: Path, namespace: str, service_account: str) -> Authorizer:
    """An ``Authorizer`` for ``service_account`` of the RBAC manifest at ``path`` installed into ``namespace``."""
    return Authorizer(service_account_grants(load_documents(path, namespace), namespace, service_account))
