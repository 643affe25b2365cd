"""The RBAC check: requests resolved as the API server does, rules matched as RBAC does."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubeapi.rbac import Authorizer, Grant, PolicyRule, manifest_authorizer, request_info


@pytest.mark.parametrize(
    ("method", "path", "query", "expected"),
    [
        ("GET", "/api/v1/nodes", {"limit": "500"}, ("list", "", "", "nodes", "", "")),
        ("GET", "/api/v1/nodes", {"watch": "true", "resourceVersion": "7"}, ("watch", "", "", "nodes", "", "")),
        ("GET", "/api/v1/pods", {"watch": "1", "labelSelector": "regroup.dev/job"}, ("watch", "", "", "pods", "", "")),
        ("GET", "/api/v1/pods", {"watch": "false"}, ("list", "", "", "pods", "", "")),
        ("GET", "/api/v1/nodes/n1", {}, ("get", "", "", "nodes", "", "n1")),
        ("PATCH", "/api/v1/nodes/n1", {}, ("patch", "", "", "nodes", "", "n1")),
        ("PUT", "/api/v1/nodes/n1/status", {}, ("update", "", "", "nodes", "status", "n1")),
        ("DELETE", "/api/v1/namespaces/ml/pods/w-0", {}, ("delete", "", "ml", "pods", "", "w-0")),
        ("DELETE", "/api/v1/namespaces/ml/pods", {}, ("deletecollection", "", "ml", "pods", "", "")),
        ("POST", "/api/v1/namespaces/ml/pods/w-0/eviction", {}, ("create", "", "ml", "pods", "eviction", "w-0")),
        ("POST", "/api/v1/namespaces/ml/events", {}, ("create", "", "ml", "events", "", "")),
        ("GET", "/api/v1/namespaces/ml", {}, ("get", "", "ml", "namespaces", "", "ml")),
        ("PUT", "/api/v1/namespaces/ml/finalize", {}, ("update", "", "ml", "namespaces", "finalize", "ml")),
        ("GET", "/api/v1/namespaces/ml/pods", {"fieldSelector": "metadata.name=w-0"}, ("list", "", "ml", "pods", "", "w-0")),
        ("GET", "/api/v1/watch/namespaces/ml/pods/w-0", {}, ("watch", "", "ml", "pods", "", "w-0")),
        ("GET", "/apis/coordination.k8s.io/v1/namespaces/regroup-system/leases/regroup-controller", {},
         ("get", "coordination.k8s.io", "regroup-system", "leases", "", "regroup-controller")),
        ("POST", "/apis/coordination.k8s.io/v1/namespaces/regroup-system/leases", {},
         ("create", "coordination.k8s.io", "regroup-system", "leases", "", "")),
    ],
)
def test_requests_resolve_as_the_api_servers_request_info(method, path, query, expected) -> None:
    info = request_info(method, path, query)
    assert info.is_resource
    assert (info.verb, info.api_group, info.namespace, info.resource, info.subresource, info.name) == expected


@pytest.mark.parametrize("path", ["/version", "/healthz", "/api", "/api/v1", "/apis/coordination.k8s.io/v1", "/metrics"])
def test_paths_outside_a_resource_are_non_resource_urls(path) -> None:
    info = request_info("GET", path, {})
    assert not info.is_resource and info.verb == "get" and info.path == path


def _rule(**kw) -> PolicyRule:
    return PolicyRule.parse(kw, "test")


@pytest.mark.parametrize(
    ("rule", "request_", "allowed"),
    [
        (_rule(apiGroups=[""], resources=["pods"], verbs=["delete"]), ("DELETE", "/api/v1/namespaces/a/pods/p"), True),
        (_rule(apiGroups=[""], resources=["pods"], verbs=["delete"]), ("DELETE", "/api/v1/namespaces/a/pods"), False),
        (_rule(apiGroups=[""], resources=["pods"], verbs=["create"]), ("POST", "/api/v1/namespaces/a/pods/p/eviction"), False),
        (_rule(apiGroups=[""], resources=["pods/eviction"], verbs=["create"]), ("POST", "/api/v1/namespaces/a/pods/p/eviction"), True),
        (_rule(apiGroups=[""], resources=["*/status"], verbs=["update"]), ("PUT", "/api/v1/nodes/n/status"), True),
        (_rule(apiGroups=["*"], resources=["*"], verbs=["*"]), ("PATCH", "/apis/apps/v1/namespaces/a/deployments/d"), True),
        (_rule(apiGroups=[""], resources=["leases"], verbs=["get"]), ("GET", "/apis/coordination.k8s.io/v1/namespaces/a/leases/l"), False),
        (_rule(apiGroups=["coordination.k8s.io"], resources=["leases"], resourceNames=["l"], verbs=["get", "update"]),
         ("PUT", "/apis/coordination.k8s.io/v1/namespaces/a/leases/l"), True),
        (_rule(apiGroups=["coordination.k8s.io"], resources=["leases"], resourceNames=["l"], verbs=["get", "update"]),
         ("PUT", "/apis/coordination.k8s.io/v1/namespaces/a/leases/other"), False),
        (_rule(apiGroups=["coordination.k8s.io"], resources=["leases"], resourceNames=["l"], verbs=["create"]),
         ("POST", "/apis/coordination.k8s.io/v1/namespaces/a/leases"), False),
        (_rule(nonResourceURLs=["/metrics"], verbs=["get"]), ("GET", "/metrics"), True),
        (_rule(nonResourceURLs=["/logs/*"], verbs=["get"]), ("GET", "/logs/kubelet.log"), True),
        (_rule(nonResourceURLs=["/metrics"], verbs=["get"]), ("GET", "/metrics/slis"), False),
    ],
)
def test_rules_match_as_rbac_does(rule, request_, allowed) -> None:
    assert rule.allows(request_info(*request_, {})) is allowed


def test_a_role_grants_only_in_its_namespace_and_discovery_is_open() -> None:
    role = Grant("Role leases", "system", (_rule(apiGroups=["coordination.k8s.io"], resources=["leases"], verbs=["get"]),))
    authorizer = Authorizer([role])
    assert authorizer.allows(request_info("GET", "/apis/coordination.k8s.io/v1/namespaces/system/leases/l", {}))
    assert not authorizer.allows(request_info("GET", "/apis/coordination.k8s.io/v1/namespaces/ml/leases/l", {}))
    assert not authorizer.allows(request_info("GET", "/apis/coordination.k8s.io/v1/leases", {}))
    assert authorizer.allows(request_info("GET", "/version", {}))


MANIFEST = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: ctl}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: ctl}
rules:
  - {apiGroups: [""], resources: ["nodes"], verbs: ["get", "patch"]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: ctl}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: ctl}
subjects: [{kind: ServiceAccount, name: ctl, namespace: sys}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: lease}
rules:
  - {apiGroups: ["coordination.k8s.io"], resources: ["leases"], verbs: ["create"]}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: lease}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: lease}
subjects: [{kind: ServiceAccount, name: ctl, namespace: sys}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: unbound}
rules:
  - {apiGroups: [""], resources: ["secrets"], verbs: ["get"]}
"""


def test_bindings_decide_what_a_service_account_gets(tmp_path: Path) -> None:
    path = tmp_path / "rbac.yaml"
    path.write_text(MANIFEST)
    authorizer = manifest_authorizer(path, "sys", "ctl")
    assert sorted((g.role, g.namespace) for g in authorizer.grants) == [("ClusterRole ctl", None), ("Role lease", "sys")]
    calls = [
        ("GET", "/api/v1/nodes/n1", {}),
        ("POST", "/apis/coordination.k8s.io/v1/namespaces/sys/leases", {}),
        ("POST", "/apis/coordination.k8s.io/v1/namespaces/ml/leases", {}),
        ("GET", "/api/v1/namespaces/sys/secrets/s", {}),
    ]
    assert authorizer.denied(calls) == [
        "POST /apis/coordination.k8s.io/v1/namespaces/ml/leases (create coordination.k8s.io leases, namespace ml)",
        "GET /api/v1/namespaces/sys/secrets/s (get secrets s, namespace sys)",
    ]
    # Another namespace's ServiceAccount of the same name is not bound.
    assert manifest_authorizer(path, "elsewhere", "ctl").grants == ()
    with pytest.raises(AssertionError, match=r"(?s)RBAC would refuse 1 call\(s\) of the tests.*PATCH /api/v1/nodes/n1 \(patch"):
        authorizer.without("patch", "nodes").check([("PATCH", "/api/v1/nodes/n1", {})], "the tests")


def test_a_malformed_rule_is_named(tmp_path: Path) -> None:
    path = tmp_path / "rbac.yaml"
    path.write_text(MANIFEST.replace('verbs: ["get", "patch"]', 'verbs: "get"'))
    with pytest.raises(ValueError, match="ClusterRole ctl rule 0: verbs must be a list of strings"):
        manifest_authorizer(path, "sys", "ctl")
