"""The controller and etcd as deployed: the controller wired as its process expects, etcd
off GPU nodes and consistent with its size, reachable only by workers and the controller,
and on TLS in prod."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.lookup import container_env, flag_value, one


# --- controller ---------------------------------------------------------------------------


def test_controller_deployment_matches_the_process_interface(overlays: dict[str, Any]) -> None:
    deployment = one(overlays["base"], "Deployment", "regroup-controller")
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[0] == "controller" and "--leader-election" in args and "--http-port=8080" in args
    assert any(a.startswith("--etcd=regroup-etcd.") and a.endswith(":2379") for a in args)
    env = container_env(container)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")  # OTLP/HTTP, what the SDK exporter speaks
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http-metrics": 8080}
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    service = one(overlays["base"], "Service", "regroup-controller-metrics")
    assert service["spec"]["ports"][0]["targetPort"] == "http-metrics"
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_controller_reaches_the_collector_service_that_exists(overlays: dict[str, Any]) -> None:
    docs = overlays["base"]
    env = container_env(one(docs, "Deployment", "regroup-controller")["spec"]["template"]["spec"]["containers"][0])
    host_port = env["OTEL_EXPORTER_OTLP_ENDPOINT"].removeprefix("http://")
    service_name, _, rest = host_port.partition(".")
    port = int(rest.rsplit(":", 1)[1])
    service = one(docs, "Service", service_name)
    assert port in {p["port"] for p in service["spec"]["ports"]}


# --- etcd ---------------------------------------------------------------------------------


def _etcd(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    statefulset = one(docs, "StatefulSet", "regroup-etcd")
    return statefulset, container_env(statefulset["spec"]["template"]["spec"]["containers"][0])


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
    headless = one(docs, "Service", statefulset["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    client = one(docs, "Service", "regroup-etcd")
    for selector in (headless["spec"]["selector"], client["spec"]["selector"],
                     one(docs, "PodDisruptionBudget", "regroup-etcd")["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()


def test_network_policy_admits_only_workers_and_the_controller_to_etcd_clients(overlays: dict[str, Any]) -> None:
    docs = overlays["base"]
    policy = one(docs, "NetworkPolicy", "regroup-etcd")
    etcd_labels = _etcd(docs)[0]["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= etcd_labels.items()
    client_rules = [r for r in policy["spec"]["ingress"] if {"port": 2379, "protocol": "TCP"} in r.get("ports", [])]
    peers_from = [f for r in client_rules for f in r["from"]]
    controller_labels = one(docs, "Deployment", "regroup-controller")["spec"]["template"]["metadata"]["labels"]
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
    controller = one(docs, "Deployment", "regroup-controller")["spec"]["template"]["spec"]
    (container,) = controller["containers"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "etcd-tls"]
    for flag in ("etcd-cacert", "etcd-cert", "etcd-key"):
        assert flag_value(container["args"], flag).startswith(mount["mountPath"] + "/"), flag
    server = one(docs, "Certificate", "regroup-etcd-server")
    assert "*.regroup-etcd-peer.regroup-system.svc" in server["spec"]["dnsNames"]
    assert "regroup-etcd.regroup-system.svc" in server["spec"]["dnsNames"]
