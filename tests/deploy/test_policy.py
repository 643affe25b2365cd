"""What the manifests promise beyond their schema: least privilege, restricted pods,
etcd off GPU nodes and consistent with its size, worker pods wired to regroup."""

from __future__ import annotations

import importlib.util

import re
from collections.abc import Iterator
from typing import Any

import pytest

from regroup.exit_codes import LEFT_JOB
from tests.deploy.schemas import DEPLOY, REPO, describe, load_documents, manifest_files, pod_specs, render

OVERLAYS = ("base", "overlays/dev", "overlays/prod")
EXAMPLE_FILES = [p for p in manifest_files() if DEPLOY / "examples" in p.parents]


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict[str, Any]]]:
    return {name: render(DEPLOY / name) for name in OVERLAYS}


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def _all_pod_specs(overlays: dict[str, list[dict[str, Any]]]) -> Iterator[tuple[str, dict[str, Any]]]:
    for name, docs in overlays.items():
        for doc in docs:
            for where, template in pod_specs(doc):
                yield f"{name}: {where}", template
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            for where, template in pod_specs(doc):
                yield f"{path.relative_to(REPO)}: {where}", template


# --- RBAC ---------------------------------------------------------------------------------


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str, str]]:
    return {
        (group, resource, verb, ",".join(rule.get("resourceNames", [])))
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_controller_cluster_role_grants_exactly_what_the_controller_uses(overlays: dict[str, Any]) -> None:
    role = _one(overlays["base"], "ClusterRole", "regroup-controller")
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
    role = _one(docs, "Role", "regroup-controller-leader-election")
    assert _grants(role["rules"]) == {
        ("coordination.k8s.io", "leases", "create", ""),
        ("coordination.k8s.io", "leases", "get", "regroup-controller"),
        ("coordination.k8s.io", "leases", "update", "regroup-controller"),
    }
    deployment = _one(docs, "Deployment", "regroup-controller")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--lease-name=regroup-controller" in args
    binding = _one(docs, "RoleBinding", "regroup-controller-leader-election")
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
    role = _one(overlays["base"], "ClusterRole", "regroup-worker-topology")
    assert _grants(role["rules"]) == {("", "nodes", "get", "")}
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            for where, template in pod_specs(doc):
                if "regroup.dev/job" in template["metadata"].get("labels", {}):
                    assert template["spec"]["serviceAccountName"] == "regroup-worker", where


# --- Pod Security Standard "restricted" ---------------------------------------------------

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


# --- controller ---------------------------------------------------------------------------


def test_controller_deployment_matches_the_process_interface(overlays: dict[str, Any]) -> None:
    deployment = _one(overlays["base"], "Deployment", "regroup-controller")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "controller" and "--leader-election" in args and "--http-port=8080" in args
    assert any(a.startswith("--etcd=regroup-etcd.") and a.endswith(":2379") for a in args)
    env = _env(container)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")  # OTLP/HTTP, what the SDK exporter speaks
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http-metrics": 8080}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    service = _one(overlays["base"], "Service", "regroup-controller-metrics")
    assert service["spec"]["ports"][0]["targetPort"] == "http-metrics"
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_controller_reaches_the_collector_service_that_exists(overlays: dict[str, Any]) -> None:
    docs = overlays["base"]
    env = _env(_one(docs, "Deployment", "regroup-controller")["spec"]["template"]["spec"]["containers"][0])
    host_port = env["OTEL_EXPORTER_OTLP_ENDPOINT"].removeprefix("http://")
    service_name, _, rest = host_port.partition(".")
    port = int(rest.rsplit(":", 1)[1])
    service = _one(docs, "Service", service_name)
    assert port in {p["port"] for p in service["spec"]["ports"]}


# --- etcd ---------------------------------------------------------------------------------


def _etcd(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    statefulset = _one(docs, "StatefulSet", "regroup-etcd")
    return statefulset, _env(statefulset["spec"]["template"]["spec"]["containers"][0])


@pytest.mark.parametrize(("overlay", "members", "scheme"), [("base", 3, "http"), ("overlays/dev", 1, "http"), ("overlays/prod", 3, "https")])
def test_etcd_initial_cluster_lists_exactly_its_members(overlays: dict[str, Any], overlay: str, members: int, scheme: str) -> None:
    statefulset, env = _etcd(overlays[overlay])
    assert statefulset["spec"]["replicas"] == members
    peers = dict(item.split("=", 1) for item in env["ETCD_INITIAL_CLUSTER"].split(","))
    assert sorted(peers) == [f"regroup-etcd-{i}" for i in range(members)]
    for name, url in peers.items():
        assert url == f"{scheme}://{name}.{statefulset['spec']['serviceName']}.$(POD_NAMESPACE).svc:2380"
    for key in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS", "ETCD_INITIAL_ADVERTISE_PEER_URLS"):
        assert env[key].startswith(f"{scheme}://"), key


def test_etcd_stays_off_gpu_nodes_and_spreads_one_member_per_node(overlays: dict[str, Any]) -> None:
    for name, docs in overlays.items():
        statefulset, _ = _etcd(docs)
        template = statefulset["spec"]["template"]
        affinity = template["spec"]["affinity"]
        terms = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        # Terms are ORed: every one of them must exclude GPU nodes.
        for term in terms:
            excluded = {e["key"] for e in term["matchExpressions"] if e["operator"] == "DoesNotExist"}
            assert "nvidia.com/gpu.present" in excluded, name
        (anti,) = affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert anti["labelSelector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
        assert "tolerations" not in template["spec"], f"{name}: etcd must not tolerate GPU taints"
        labels = template["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "etcd" and labels["regroup.dev/role"] == "rendezvous"


def test_etcd_services_and_budget_select_the_members(overlays: dict[str, Any]) -> None:
    docs = overlays["base"]
    statefulset, _ = _etcd(docs)
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    headless = _one(docs, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    client = _one(docs, "Service", "regroup-etcd")
    for selector in (headless["spec"]["selector"], client["spec"]["selector"],
                     _one(docs, "PodDisruptionBudget", "regroup-etcd")["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()


def test_network_policy_admits_only_workers_and_the_controller_to_etcd_clients(overlays: dict[str, Any]) -> None:
    docs = overlays["base"]
    policy = _one(docs, "NetworkPolicy", "regroup-etcd")
    etcd_labels = _etcd(docs)[0]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= etcd_labels.items()
    client_rules = [r for r in policy["spec"]["ingress"] if {"port": 2379, "protocol": "TCP"} in r.get("ports", [])]
    peers_from = [f for r in client_rules for f in r["from"]]
    controller_labels = _one(docs, "Deployment", "regroup-controller")["spec"]["template"]["metadata"]["labels"]
    assert any(f.get("podSelector", {}).get("matchLabels", {}).items() <= controller_labels.items()
               and "namespaceSelector" not in f for f in peers_from if "matchLabels" in f.get("podSelector", {}))
    assert any(f.get("podSelector", {}).get("matchExpressions") == [{"key": "regroup.dev/job", "operator": "Exists"}]
               for f in peers_from)
    for rule in policy["spec"]["ingress"]:
        assert rule.get("from") or rule["ports"] == [{"port": 2381, "protocol": "TCP"}], "only health/metrics is open"


def test_prod_mounts_the_secrets_cert_manager_issues(overlays: dict[str, Any]) -> None:
    docs = overlays["overlays/prod"]
    issued = {(d["metadata"]["namespace"], d["spec"]["secretName"]) for d in docs if d["kind"] == "Certificate"}
    mounted = {
        (d["metadata"]["namespace"], v["secret"]["secretName"])
        for d in docs if d["kind"] in ("Deployment", "StatefulSet")
        for v in d["spec"]["template"]["spec"].get("volumes", []) if "secret" in v
    }
    assert mounted and mounted <= issued
    _, env = _etcd(docs)
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true" and env["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    # The controller talks TLS with the certificate mounted from its Secret.
    controller = _one(docs, "Deployment", "regroup-controller")["spec"]["template"]["spec"]
    (container,) = controller["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "etcd-tls"]
    for flag in ("etcd-cacert", "etcd-cert", "etcd-key"):
        assert _flag(container["args"], flag).startswith(mount["mountPath"] + "/"), flag
    server = _one(docs, "Certificate", "regroup-etcd-server")
    assert "*.regroup-etcd-peer.regroup-system.svc" in server["spec"]["dnsNames"]
    assert "regroup-etcd.regroup-system.svc" in server["spec"]["dnsNames"]


# --- worker pods of the examples ----------------------------------------------------------


def _worker_templates() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            for where, template in pod_specs(doc):
                if "regroup.dev/job" in template["metadata"].get("labels", {}):
                    yield f"{path.relative_to(REPO)}: {where}", template


WORKERS = list(_worker_templates())


def test_every_workload_kind_has_an_example() -> None:
    kinds = {where.split(": ")[1].split(" ")[0] for where, _ in WORKERS}
    assert {"StatefulSet", "Job", "JobSet", "PyTorchJob"} <= kinds


def _flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


ENTRYPOINT = "/opt/regroup/bin/regroup-entrypoint"

# Examples that launch with plain torchrun on purpose, and why. Every other worker runs
# `regroup-run --standby`, so a slip back to torchrun fails the tests below.
TORCHRUN_EXAMPLES = {
    "deploy/examples/smoke-job.yaml": "regroup.trainer.smoke is a one-shot check without ElasticWorld: nothing to re-form",
}


def _file(where: str) -> str:
    return where.split(": ")[0]


def _runs_the_trainer(container: dict[str, Any]) -> bool:
    words = container.get("command", []) + container.get("args", [])
    return any(flag == "-m" and module == "regroup.trainer" for flag, module in zip(words, words[1:]))


def _example_containers() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            for where, template in pod_specs(doc):
                spec = template["spec"]
                for container in spec.get("initContainers", []) + spec["containers"]:
                    yield f"{path.relative_to(REPO)}: {where} {container['name']}", container


EXAMPLE_CONTAINERS = list(_example_containers())
TRAINER_CONTAINERS = [(w, c) for w, c in EXAMPLE_CONTAINERS if _runs_the_trainer(c)]


@pytest.mark.parametrize(("where", "template"), WORKERS, ids=[w for w, _ in WORKERS])
def test_worker_pod_is_wired_to_regroup(where: str, template: dict[str, Any]) -> None:
    job = template["metadata"]["labels"]["regroup.dev/job"]
    annotations = template["metadata"]["annotations"]
    low, high = int(annotations["regroup.dev/min-nodes"]), int(annotations["regroup.dev/max-nodes"])
    assert 1 <= low <= high
    for key in ("regroup.dev/checkpoint-timeout", "regroup.dev/join-window"):
        assert re.fullmatch(r"\d+(ms|s|m|h)", annotations[key]), key
    assert re.fullmatch(r"\d+/\d+(s|m|h)", annotations["regroup.dev/restart-storm"])
    spec = template["spec"]
    (trainer,) = spec["containers"]
    launcher = "torchrun" if _file(where) in TORCHRUN_EXAMPLES else "regroup-run"
    assert trainer["command"] == [ENTRYPOINT, launcher]
    args = trainer["args"]
    assert _flag(args, "rdzv-backend") == "etcd-v3"
    assert _flag(args, "rdzv-id") == job
    assert _flag(args, "rdzv-endpoint") == annotations["regroup.dev/rdzv-endpoint"]
    assert _flag(args, "nnodes") == (f"{low}:{high}" if low != high else str(low))
    gpus = int(_flag(args, "nproc-per-node"))
    on_kind = "deploy/examples/kind/" in where
    if on_kind:
        assert "nvidia.com/gpu" not in trainer["resources"]["limits"]
    else:
        assert trainer["resources"]["limits"]["nvidia.com/gpu"] == str(gpus)
    env = _env(trainer)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    # On a one-node kind cluster every worker shares the node, so members are named by pod.
    node_source = "metadata.name" if on_kind else "spec.nodeName"
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": node_source}}
    # The topology init container writes the env file into an emptyDir the trainer reads.
    (topology,) = [c for c in spec["initContainers"] if c["name"] == "topology"]
    assert topology["command"][0] == "/opt/regroup/bin/regroup-topology"
    out = topology["command"][topology["command"].index("--out") + 1]
    assert _env(topology)["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    volumes = {v["name"]: v for v in spec["volumes"]}
    (init_mount,) = [m for m in topology["volumeMounts"] if out.startswith(m["mountPath"] + "/")]
    assert "emptyDir" in volumes[init_mount["name"]]
    assert any(m["name"] == init_mount["name"] and m["mountPath"] == init_mount["mountPath"] for m in trainer["volumeMounts"])
    assert spec["terminationGracePeriodSeconds"] >= 60
    if launcher == "regroup-run":
        # SIGTERM is a notice: the agent trains on for the pod's grace, which it cannot read.
        assert float(_flag(args, "term-grace")) == spec["terminationGracePeriodSeconds"]


def _worker_jobs() -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, Job spec) of every Job, a JobSet's included, whose pods are regroup-run workers."""
    for path in EXAMPLE_FILES:
        for doc in load_documents(path):
            if doc.get("kind") == "Job":
                specs = [doc["spec"]]
            elif doc.get("kind") == "JobSet":
                specs = [r["template"]["spec"] for r in doc["spec"]["replicatedJobs"]]
            else:
                continue
            for spec in specs:
                template = spec["template"]
                if "regroup.dev/job" in template["metadata"].get("labels", {}) and any(
                    c.get("command") == [ENTRYPOINT, "regroup-run"] for c in template["spec"]["containers"]
                ):
                    yield f"{path.relative_to(REPO)}: {describe(doc)}", spec


WORKER_JOBS = list(_worker_jobs())


@pytest.mark.parametrize(("where", "job"), WORKER_JOBS, ids=[w for w, _ in WORKER_JOBS])
def test_a_worker_job_brings_back_a_node_that_left_and_counts_no_disruption(where: str, job: dict[str, Any]) -> None:
    """Exit 75 (a node left a job that goes on) and a disruption are not failures of the Job:
    the index comes back as a fresh pod instead of counting against the backoff limit (or,
    with exit 0, being done for good)."""
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # podFailurePolicy requires it
    rules = job["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
    exit_rules = [r["onExitCodes"] for r in rules if r["action"] == "Ignore" and "onExitCodes" in r]
    assert {"containerName": "trainer", "operator": "In", "values": [LEFT_JOB]} in exit_rules, rules


def test_worker_jobs_are_found() -> None:
    assert len(WORKER_JOBS) >= 3, WORKER_JOBS


def test_trainer_launching_examples_are_found() -> None:
    files = {_file(w) for w, _ in TRAINER_CONTAINERS}
    assert len(files) >= 8, files
    assert {_file(w) for w, _ in TRAINERS} <= files


@pytest.mark.parametrize(("where", "container"), TRAINER_CONTAINERS, ids=[w for w, _ in TRAINER_CONTAINERS])
def test_every_trainer_launching_example_uses_regroup_run_with_standby(where: str, container: dict[str, Any]) -> None:
    from regroup.rendezvous.inplace.launcher import build_parser

    if _file(where) in TORCHRUN_EXAMPLES:
        assert container["command"] == [ENTRYPOINT, "torchrun"]
        return
    # In-place re-forms, and a joining node starts its workers while the round forms.
    assert container["command"] == [ENTRYPOINT, "regroup-run"], "the trainer launches with regroup-run, not torchrun"
    assert container["args"][0] == "--standby"
    # The launcher's own parser takes the flags: --standby before the script, in place on.
    parsed = build_parser().parse_args(container["args"])
    assert parsed.standby is True and parsed.in_place == "auto"
    assert parsed.module is True and parsed.training_script == "regroup.trainer"
    assert "--standby" not in parsed.training_script_args


@pytest.mark.parametrize(("where", "container"), EXAMPLE_CONTAINERS, ids=[w for w, _ in EXAMPLE_CONTAINERS])
def test_every_module_an_example_runs_is_one_the_distribution_installs(where: str, container: dict[str, Any]) -> None:
    """One import name: ``-m trainer`` (the repository's folder) does not exist once installed."""
    words = container.get("command", []) + container.get("args", [])
    for flag, module in zip(words, words[1:]):
        if flag == "-m":
            assert module.split(".")[0] in ("regroup", "torch"), f"{where}: -m {module}"
            assert importlib.util.find_spec(module) is not None, f"{where}: -m {module}: no such module"


@pytest.mark.parametrize(("where", "container"), EXAMPLE_CONTAINERS, ids=[w for w, _ in EXAMPLE_CONTAINERS])
def test_plain_torchrun_only_where_an_example_says_why(where: str, container: dict[str, Any]) -> None:
    words = container.get("command", []) + container.get("args", [])
    if not any(w == "torchrun" or w.endswith("/torchrun") or w == "torch.distributed.run" for w in words):
        return
    assert _file(where) in TORCHRUN_EXAMPLES, f"{where} launches with torchrun; use regroup-run --standby"


@pytest.mark.parametrize("path", sorted(TORCHRUN_EXAMPLES))
def test_torchrun_exceptions_are_current_and_explained(path: str) -> None:
    from torch.distributed.run import get_args_parser

    text = (REPO / path).read_text()
    assert any(line.strip().startswith("#") and "torchrun" in line for line in text.splitlines()), (
        f"{path} must say in a comment why it keeps torchrun"
    )
    containers = [c for w, c in EXAMPLE_CONTAINERS if _file(w) == path and c.get("command", [None])[-1] == "torchrun"]
    assert containers, f"{path} no longer launches with torchrun: drop it from TORCHRUN_EXAMPLES"
    for container in containers:
        assert "--standby" not in container["args"]  # torchrun has no such flag
        get_args_parser().parse_args(container["args"])


def test_checkpoint_claim_is_read_write_many() -> None:
    (claim,) = [d for d in load_documents(DEPLOY / "examples/common/checkpoints-pvc.yaml")]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


# Training jobs (the smoke job runs regroup.trainer.smoke, which takes no config).
TRAINERS = [(w, t) for w, t in WORKERS if "regroup.trainer" in t["spec"]["containers"][0]["args"]]


@pytest.mark.parametrize(("where", "template"), TRAINERS, ids=[w for w, _ in TRAINERS])
def test_training_example_checkpoints_to_a_shared_volume_and_its_config_fits_every_world_size(
    where: str, template: dict[str, Any]
) -> None:
    from regroup.trainer.config_loading import load_config

    spec = template["spec"]
    (trainer,) = spec["containers"]
    # Checkpoints go to a claim every rank can read after a resize (ReadWriteMany; on a
    # one-node kind cluster, ReadWriteOnce shared by the pods of that node).
    on_kind = "deploy/examples/kind/" in where
    (checkpoints,) = [v for v in spec["volumes"] if "persistentVolumeClaim" in v]
    assert checkpoints["persistentVolumeClaim"]["claimName"] == ("regroup-checkpoints-kind" if on_kind else "regroup-checkpoints")
    (checkpoint_mount,) = [m for m in trainer["volumeMounts"] if m["name"] == checkpoints["name"]]
    assert checkpoint_mount["mountPath"] == "/checkpoints"
    args = trainer["args"]
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    env = {"REGROUP_ETCD_ENDPOINT": _env(trainer)["REGROUP_ETCD_ENDPOINT"], "TORCHELASTIC_RUN_ID": _flag(args, "rdzv-id")}
    # The file the pod reads: the ConfigMap key mounted at the --config path.
    config_path = args[args.index("--config") + 1]
    (mount,) = [m for m in trainer["volumeMounts"] if m["mountPath"] == config_path]
    (generator,) = load_documents(DEPLOY / "examples/common/kustomization.yaml")[0]["configMapGenerator"]
    assert mount["subPath"] in generator["files"]
    config = load_config(DEPLOY / "examples/common" / mount["subPath"], overrides, env)
    assert config.checkpoint.dir == f"/checkpoints/{_flag(args, 'rdzv-id')}", "jobs must not share a checkpoint folder"
    low, high = (int(n) for n in _flag(args, "nnodes").split(":"))
    gpus = int(_flag(args, "nproc-per-node"))
    for nodes in range(low, high + 1):
        assert config.batch.global_batch_size % (nodes * gpus) == 0, f"{nodes} nodes"


def test_gang_admission_variants() -> None:
    (kueue_job,) = [d for d in load_documents(DEPLOY / "examples/kueue/indexed-job.yaml") if d["kind"] == "Job"]
    queues = load_documents(DEPLOY / "examples/kueue/queues.yaml")
    local_queue = next(d for d in queues if d["kind"] == "LocalQueue")
    assert kueue_job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == local_queue["metadata"]["name"]
    template = kueue_job["spec"]["template"]
    assert kueue_job["metadata"]["annotations"]["kueue.x-k8s.io/job-min-parallelism"] == template["metadata"]["annotations"]["regroup.dev/min-nodes"]
    cluster_queue = next(d for d in queues if d["kind"] == "ClusterQueue")
    assert local_queue["spec"]["clusterQueue"] == cluster_queue["metadata"]["name"]

    volcano = load_documents(DEPLOY / "examples/volcano/statefulset.yaml")
    group = next(d for d in volcano if d["kind"] == "PodGroup")
    workload = next(d for d in volcano if d["kind"] == "StatefulSet")
    pod = workload["spec"]["template"]
    assert pod["spec"]["schedulerName"] == "volcano"
    assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == group["metadata"]["name"]
    assert group["spec"]["minMember"] == int(pod["metadata"]["annotations"]["regroup.dev/min-nodes"])

    (smoke,) = [d for d in load_documents(DEPLOY / "examples/smoke-job.yaml") if d["kind"] == "Job"]
    assert smoke["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == local_queue["metadata"]["name"]
    args = smoke["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-2:] == ["-m", "regroup.trainer.smoke"]
    assert smoke["spec"]["parallelism"] == smoke["spec"]["completions"] == int(_flag(args, "nnodes"))
    # A failed check must fail the Job, not retry until it passes.
    assert smoke["spec"]["backoffLimit"] == 0 and _flag(args, "max-restarts") == "0"


def test_tls_worker_uses_the_client_certificate_it_is_issued() -> None:
    (certificate,) = load_documents(DEPLOY / "examples/tls/worker-etcd-client.yaml")
    (workload,) = [d for d in load_documents(DEPLOY / "examples/tls/statefulset.yaml") if d["kind"] == "StatefulSet"]
    spec = workload["spec"]["template"]["spec"]
    (secret_volume,) = [v for v in spec["volumes"] if "secret" in v]
    assert secret_volume["secret"]["secretName"] == certificate["spec"]["secretName"]
    assert certificate["metadata"]["namespace"] == workload["metadata"]["namespace"]
    (trainer,) = spec["containers"]
    (mount,) = [m for m in trainer["volumeMounts"] if m["name"] == secret_volume["name"]]
    conf = dict(item.split("=", 1) for item in _flag(trainer["args"], "rdzv-conf").split(","))
    assert set(conf) == {"cacert", "cert", "key"}
    for key, path in conf.items():
        assert path.startswith(mount["mountPath"] + "/"), key
        assert f"etcd.{key}={path}" in trainer["args"], "the trainer's etcd channel uses the same certificate"
    # The prod issuer that signs it is the one the etcd server trusts.
    prod = render(DEPLOY / "overlays/prod")
    issuers = {d["metadata"]["name"] for d in prod if d["kind"] == "ClusterIssuer"}
    assert certificate["spec"]["issuerRef"]["name"] in issuers
