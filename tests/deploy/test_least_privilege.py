"""Least privilege: each role grants what its holder uses and nothing more, bindings name
accounts that exist, worker pods run as the worker account."""

from __future__ import annotations

from typing import Any

from tests.deploy.lookup import EXAMPLE_FILES, one
from tests.deploy.schemas import DEPLOY, load_documents, pod_specs, render


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    return {
        (group, resource, verb, ",".join(rule.get("resourceNames", [])))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_controller_cluster_role_grants_exactly_what_the_controller_uses(overlays: dict[str, Any]) -> None:
    role = one(overlays["base"], "ClusterRole", "regroup-controller")
    expected = {
        ("", "nodes", verb, "") for verb in ("get", "list", "watch", "patch")
    } | {("", "pods", verb, "") for verb in ("get", "list", "watch", "delete")} | {
        ("", "pods/eviction", "create", ""),
        ("", "events", "create", ""),
        ("", "events", "patch", ""),
    }
    assert _grants(role["rules"]) == expected


def test_leader_election_is_a_namespaced_role_on_one_lease(overlays: dict[str, Any]) -> None:
    docs = overlays["base"]
    role = one(docs, "Role", "regroup-controller-leader-election")
    assert _grants(role["rules"]) == {
        ("coordination.k8s.io", "leases", "create", ""),
        ("coordination.k8s.io", "leases", "get", "regroup-controller"),
        ("coordination.k8s.io", "leases", "update", "regroup-controller"),
    }
    deployment = one(docs, "Deployment", "regroup-controller")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--lease-name=regroup-controller" in args
    binding = one(docs, "RoleBinding", "regroup-controller-leader-election")
    assert binding["metadata"]["namespace"] == role["metadata"]["namespace"] == "regroup-system"


def test_no_role_grants_wildcards_or_secrets(overlays: dict[str, Any]) -> None:
    for name, docs in overlays.items():
        for doc in docs:
            if doc["kind"] not in ("Role", "ClusterRole"):
                continue
            for group, resource, verb, _ in _grants(doc["rules"]):
                assert "*" not in (group, resource, verb), f"{name}: {doc['metadata']['name']} has a wildcard"
                assert resource != "secrets", f"{name}: {doc['metadata']['name']} reads secrets"


def test_bindings_point_at_service_accounts_that_exist(overlays: dict[str, Any]) -> None:
    common = render(DEPLOY / "examples/common")
    docs = overlays["base"] + common
    accounts = {(d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs if d["kind"] == "ServiceAccount"}
    roles = {(d["kind"], d["metadata"]["name"]) for d in overlays["base"] if d["kind"] in ("Role", "ClusterRole")}
    for doc in docs:
        if doc["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        assert (doc["roleRef"]["kind"], doc["roleRef"]["name"]) in roles, doc["metadata"]["name"]
        for subject in doc["subjects"]:
            assert (subject["namespace"], subject["name"]) in accounts, doc["metadata"]["name"]


def test_worker_service_account_may_only_get_nodes(overlays: dict[str, Any]) -> None:
    role = one(overlays["base"], "ClusterRole", "regroup-worker-topology")
    assert _grants(role["rules"]) == {("", "nodes", "get", "")}
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            for where, template in pod_specs(doc):
                if "regroup.dev/job" in template["metadata"].get("labels", {}):
                    assert template["spec"]["serviceAccountName"] == "regroup-worker", where
