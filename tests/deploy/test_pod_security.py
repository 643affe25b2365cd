"""Restricted pods: every pod of the overlays and examples meets the Pod Security Standard
"restricted", and the namespaces enforce it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tests.deploy.lookup import EXAMPLE_FILES
from tests.deploy.schemas import DEPLOY, REPO, load_documents, pod_specs, render


def _all_pod_specs(overlays: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, docs in overlays.items():
        for doc in docs:
            for where, template in pod_specs(doc):
                yield f"{name}: {where}", template
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            for where, template in pod_specs(doc):
                yield f"{path.relative_to(REPO)}: {where}", template


ALLOWED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"}


def restricted_violations(template: dict[str, Any]) -> list[str]:
    """The Pod Security Standard "restricted" checks (v1.29+) a pod template fails."""
    spec = template["spec"]
    pod_sc = spec.get("securityContext", {})
    problems = []
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            problems.append(host)
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']} type {sorted(kinds)}")
    if pod_sc.get("runAsUser") == 0:
        problems.append("pod runAsUser 0")
    for container in spec.get("initContainers", []) + spec["containers"]:
        sc = container.get("securityContext", {})
        name = container["name"]
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation not false")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            problems.append(f"{name}: runAsUser 0")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile {seccomp}")
        if any(port.get("hostPort") for port in container.get("ports", [])):
            problems.append(f"{name}: hostPort")
    return problems


def test_restricted_check_catches_a_root_container() -> None:
    template = {"spec": {"containers": [{"name": "c", "securityContext": {"runAsUser": 0}}], "volumes": [
        {"name": "h", "hostPath": {"path": "/"}}]}}
    problems = restricted_violations(template)
    assert any("hostPath" in p for p in problems) and any("runAsUser 0" in p for p in problems)


def test_every_pod_meets_the_restricted_pod_security_standard(overlays: dict[str, Any]) -> None:
    checked = 0
    for where, template in _all_pod_specs(overlays):
        assert restricted_violations(template) == [], where
        checked += 1
    assert checked >= 10


def test_namespaces_enforce_restricted(overlays: dict[str, Any]) -> None:
    namespaces = [d for d in overlays["base"] + render(DEPLOY / "examples/common") if d["kind"] == "Namespace"]
    assert {n["metadata"]["name"] for n in namespaces} == {"regroup-system", "ml-team"}
    for namespace in namespaces:
        assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
