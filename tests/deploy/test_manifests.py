"""Every manifest in deploy/ validates offline, strictly, and a typo is caught."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.schemas import (
    CRD_DIR,
    K8S_VERSIONS,
    REPO,
    InvalidManifest,
    kustomization_dirs,
    load_documents,
    manifest_files,
    render,
    validate_object,
)

MANIFEST_FILES = manifest_files()
KUSTOMIZATIONS = kustomization_dirs()


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def test_deploy_tree_has_the_expected_entry_points() -> None:
    names = {_rel(d) for d in KUSTOMIZATIONS}
    assert {"deploy/base", "deploy/overlays/dev", "deploy/overlays/prod"} <= names
    files = {_rel(p) for p in MANIFEST_FILES}
    for example in ("statefulset.yaml", "indexed-job.yaml", "jobset.yaml", "pytorchjob.yaml", "smoke-job.yaml"):
        assert f"deploy/examples/{example}" in files


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", MANIFEST_FILES, ids=_rel)
def test_manifest_file_validates(path: Path, version: str) -> None:
    docs = load_documents(path)
    assert docs, f"{_rel(path)} holds no object"
    for doc in docs:
        validate_object(doc, version)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {_rel(d): render(d) for d in KUSTOMIZATIONS}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_rel)
def test_kustomization_renders_and_validates(
    directory: Path, version: str, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    docs = rendered[_rel(directory)]
    assert docs, f"kubectl kustomize {_rel(directory)} rendered nothing"
    for doc in docs:
        validate_object(doc, version)


def test_rendered_objects_are_unique(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for directory, docs in rendered.items():
        keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
        assert len(keys) == len(set(keys)), f"{directory} renders an object twice"


@pytest.mark.parametrize("path", sorted(CRD_DIR.glob("*.yaml")), ids=_rel)
def test_kept_crds_are_valid_custom_resource_definitions(path: Path) -> None:
    for doc in load_documents(path):
        validate_object(doc, K8S_VERSIONS[-1])


# --- the validator rejects what the API server would reject -----------------------------


def _first(path: str, kind: str) -> dict[str, Any]:
    return copy.deepcopy(next(d for d in load_documents(REPO / path) if d["kind"] == kind))


def _pod_spec_of_deployment(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


TYPOS = [
    pytest.param(
        "deploy/base/controller.yaml", "Deployment",
        lambda d: _pod_spec_of_deployment(d)["containers"][0].__setitem__("imagePullPolicyy", "Always"),
        "imagePullPolicyy", id="core-container-field",
    ),
    pytest.param(
        "deploy/base/etcd.yaml", "StatefulSet",
        lambda d: d["spec"].__setitem__("replica", 3),
        "replica", id="core-statefulset-spec",
    ),
    pytest.param(
        "deploy/base/controller.yaml", "Deployment",
        lambda d: _pod_spec_of_deployment(d)["securityContext"].__setitem__("runAsNonRoot", "yes"),
        "runAsNonRoot", id="core-wrong-type",
    ),
    pytest.param(
        "deploy/examples/jobset.yaml", "JobSet",
        lambda d: d["spec"]["replicatedJobs"][0].__setitem__("replica", 2),
        "replica", id="jobset-field",
    ),
    pytest.param(
        "deploy/examples/jobset.yaml", "JobSet",
        lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"].__setitem__("paralelism", 4),
        "paralelism", id="jobset-embedded-job-spec",
    ),
    pytest.param(
        "deploy/examples/pytorchjob.yaml", "PyTorchJob",
        lambda d: d["spec"]["elasticPolicy"].__setitem__("minReplica", 2),
        "minReplica", id="pytorchjob-elastic-policy",
    ),
    pytest.param(
        "deploy/examples/pytorchjob.yaml", "PyTorchJob",
        lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0].__setitem__(
            "volumeMount", []
        ),
        "volumeMount", id="pytorchjob-embedded-pod-template",
    ),
    pytest.param(
        "deploy/examples/pytorchjob.yaml", "PyTorchJob",
        lambda d: d["spec"]["pytorchReplicaSpecs"]["Worker"].__setitem__("restartPolicy", "Sometimes"),
        "Sometimes", id="pytorchjob-enum",
    ),
    pytest.param(
        "deploy/examples/kueue/queues.yaml", "ClusterQueue",
        lambda d: d["spec"].__setitem__("queuingStrategy", "StrictFIFO"),
        "queuingStrategy", id="kueue-clusterqueue",
    ),
    pytest.param(
        "deploy/examples/volcano/statefulset.yaml", "PodGroup",
        lambda d: d["spec"].__setitem__("minMembers", 2),
        "minMembers", id="volcano-podgroup",
    ),
    pytest.param(
        "deploy/observability/monitoring/servicemonitor.yaml", "ServiceMonitor",
        lambda d: d["spec"]["endpoints"][0].__setitem__("honourLabels", True),
        "honourLabels", id="servicemonitor-endpoint",
    ),
    pytest.param(
        "deploy/observability/monitoring/servicemonitor.yaml", "ServiceMonitor",
        lambda d: d["spec"]["selector"].__setitem__("matchLabel", {"a": "b"}),
        "matchLabel", id="servicemonitor-embedded-label-selector",
    ),
    pytest.param(
        "deploy/observability/monitoring/prometheusrule.yaml", "PrometheusRule",
        lambda d: d["spec"]["groups"][0]["rules"][0].__setitem__("for", "five minutes"),
        "five minutes", id="prometheusrule-duration",
    ),
    pytest.param(
        "deploy/overlays/prod/certificates.yaml", "Certificate",
        lambda d: d["spec"].__setitem__("usages", ["server authentication"]),
        "server authentication", id="certificate-usage-enum",
    ),
    pytest.param(
        "deploy/overlays/prod/ca/ca.yaml", "ClusterIssuer",
        lambda d: d["metadata"].__setitem__("namespace", "cert-manager"),
        "cluster-scoped", id="cluster-scoped-with-namespace",
    ),
    pytest.param(
        "deploy/base/rbac.yaml", "ClusterRole",
        lambda d: d["metadata"].__setitem__("labelz", {}),
        "labelz", id="object-meta",
    ),
]


@pytest.mark.parametrize(("path", "kind", "mutate", "named"), TYPOS)
def test_invalid_field_is_rejected_and_named(path: str, kind: str, mutate: Any, named: str) -> None:
    doc = _first(path, kind)
    validate_object(doc, K8S_VERSIONS[-1])  # the real manifest is fine...
    mutate(doc)
    with pytest.raises(InvalidManifest, match=named):  # ...the typo is not
        validate_object(doc, K8S_VERSIONS[-1])


def test_unknown_kind_is_rejected() -> None:
    doc = {"apiVersion": "apps/v1", "kind": "Deploymnet", "metadata": {"name": "x"}}
    with pytest.raises(InvalidManifest, match="Deploymnet"):
        validate_object(doc, K8S_VERSIONS[-1])


def test_field_newer_than_the_oldest_supported_version_is_caught() -> None:
    # Pod-level resources arrived after 1.29: a manifest using them would not apply there.
    doc = _first("deploy/base/controller.yaml", "Deployment")
    _pod_spec_of_deployment(doc)["resources"] = {"limits": {"memory": "1Gi"}}
    validate_object(doc, "1.37")
    with pytest.raises(InvalidManifest, match="resources"):
        validate_object(doc, "1.29")


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_production_etcd_follows_the_sizing_table(rendered: dict[str, list[dict[str, Any]]]) -> None:
    # docs/deploy.md, "Sizing etcd": 200 jobs of 16 agents per etcd cluster.
    prod = rendered["deploy/overlays/prod"]
    etcd = _one(prod, "StatefulSet", "regroup-etcd")["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in etcd["env"]}
    assert env["ETCD_AUTO_COMPACTION_MODE"] == "periodic" and env["ETCD_AUTO_COMPACTION_RETENTION"] == "30m"
    assert int(env["ETCD_QUOTA_BACKEND_BYTES"]) == 4 * 2**30
    assert etcd["resources"]["requests"] == {"cpu": "2", "memory": "1Gi"}
    assert "cpu" not in etcd["resources"]["limits"]  # a throttled etcd misses its heartbeats
    controller = _one(prod, "Deployment", "regroup-controller")["spec"]["template"]["spec"]["containers"][0]
    assert controller["resources"]["requests"] == {"cpu": "250m", "memory": "256Mi"}


def test_production_defragments_etcd_through_its_network_policy(rendered: dict[str, list[dict[str, Any]]]) -> None:
    prod = rendered["deploy/overlays/prod"]
    job = _one(prod, "CronJob", "regroup-etcd-defrag")["spec"]["jobTemplate"]["spec"]["template"]
    command = job["spec"]["containers"][0]["command"]
    assert command[0].endswith("etcdctl") and command[-2:] == ["defrag", "--cluster"]
    assert any(arg.startswith("--cert=") for arg in command)  # the members require client certificates
    labels = job["metadata"]["labels"]
    allowed = _one(prod, "NetworkPolicy", "regroup-etcd")["spec"]["ingress"][0]["from"]
    assert any(
        peer.get("podSelector", {}).get("matchLabels", {}).items() <= labels.items() and "namespaceSelector" not in peer
        for peer in allowed if peer.get("podSelector", {}).get("matchLabels")
    )
    # Not selected as an etcd member by the Service or the policy itself.
    assert labels.get("app.kubernetes.io/name") != "etcd"
