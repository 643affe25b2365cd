"""Dashboards and alerts speak the controller's metric names; the trace path is connected."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml

from tests.deploy.schemas import DEPLOY, load_documents, render

MONITORING = DEPLOY / "observability/monitoring"
COLLECTOR = DEPLOY / "observability/collector"

# The metric names the controller exports (fixed, shared with the controller), by type.
HISTOGRAMS = {"regroup_reform_duration_seconds", "regroup_reform_phase_duration_seconds"}
COUNTERS = {
    "regroup_reforms_total", "regroup_lost_steps_total", "regroup_cordons_total",
    "regroup_rendezvous_rounds_total", "regroup_watch_restarts_total", "regroup_reforms_abandoned_total",
    "regroup_events_dropped_total", "regroup_jobs_removed_total", "regroup_node_replacements_total",
}
GAUGES = {
    "regroup_job_nodes", "regroup_job_min_nodes", "regroup_job_max_nodes", "regroup_job_stalled",
    "regroup_cordoned_nodes", "regroup_rendezvous_flapping", "regroup_rendezvous_pod_on_gpu_node",
    "regroup_bad_config", "regroup_leader", "regroup_jobs_tracked", "regroup_spare_nodes", "regroup_spare_nodes_wanted",
}
EXPORTED_SERIES = (
    GAUGES | COUNTERS | {f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)
METRIC_NAME = re.compile(r"\bregroup_[a-z0-9_]+")

# Label names of each metric (fixed with the names), by family name.
LABELS: dict[str, tuple[str, ...]] = {
    "regroup_reform_duration_seconds": ("namespace", "job", "cause", "planned", "mode"),
    "regroup_reform_phase_duration_seconds": ("cause", "phase"),
    "regroup_reforms": ("namespace", "job", "cause", "planned"),
    "regroup_reforms_abandoned": ("namespace", "job", "cause", "phase", "outcome"),
    "regroup_job_nodes": ("namespace", "job"),
    "regroup_job_min_nodes": ("namespace", "job"),
    "regroup_job_max_nodes": ("namespace", "job"),
    "regroup_job_stalled": ("namespace", "job"),
    "regroup_lost_steps": ("namespace", "job", "cause"),
    "regroup_cordoned_nodes": (),
    "regroup_cordons": ("reason",),
    "regroup_rendezvous_rounds": ("namespace", "job"),
    "regroup_rendezvous_flapping": ("namespace", "job"),
    "regroup_rendezvous_pod_on_gpu_node": ("namespace", "job"),
    "regroup_watch_restarts": ("source",),
    "regroup_bad_config": ("namespace", "job"),
    "regroup_events_dropped": ("cause",),
    "regroup_leader": (),
    "regroup_jobs_tracked": (),
    "regroup_jobs_removed": ("reason",),
    "regroup_spare_nodes": ("namespace", "job"),
    "regroup_spare_nodes_wanted": ("namespace", "job"),
    "regroup_node_replacements": ("namespace", "job", "strategy"),
}

# The dashboard and the etcd alerts also read etcd's own metrics and the standard process
# metrics (etcd's and the controller's). Those expressions are checked apart: they name no
# regroup series, and they may select only by the labels Prometheus gives every scraped
# target (their job is the scrape job, not a training job; tests/deploy/test_dashboard.py
# checks the names against a real etcd).
OTHER_EXPORTERS = re.compile(r"\b(?:etcd|process)_[a-z0-9_]+")
TARGET_LABELS = {"job", "instance", "namespace", "service", "pod", "container", "endpoint"}


def _family(series: str) -> str:
    for suffix in ("_bucket", "_sum", "_count", "_total"):
        if series.endswith(suffix) and series.removesuffix(suffix) in LABELS:
            return series.removesuffix(suffix)
    return series


def foreign_labels(expr: str) -> set[str]:
    """Labels a PromQL expression groups or filters by that none of its series carry: a regroup
    series its fixed labels, an etcd or process series the scrape target's."""
    series = METRIC_NAME.findall(expr)
    known = {"le"} | {label for name in series for label in LABELS.get(_family(name), ())}
    if OTHER_EXPORTERS.search(expr) and not series:
        known |= TARGET_LABELS
    used = {
        label.strip()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in group.split(",") if label.strip()
    }
    used |= set(re.findall(r"[{,]\s*([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", expr))
    return used - known


def _dashboard() -> dict[str, Any]:
    return json.loads((MONITORING / "grafana-dashboard.json").read_text())


def _dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def _rules() -> list[dict[str, Any]]:
    (rule,) = [d for d in load_documents(MONITORING / "prometheusrule.yaml") if d["kind"] == "PrometheusRule"]
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def unknown_series(exprs: list[str]) -> set[str]:
    """Series named in PromQL that the controller does not export."""
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)} - EXPORTED_SERIES


def test_metric_check_catches_a_misspelt_series() -> None:
    assert unknown_series(["sum(regroup_job_nodess)", "rate(regroup_reforms_total[5m])"]) == {"regroup_job_nodess"}
    # A histogram is queried through its series, never by its bare name.
    assert unknown_series(["regroup_reform_duration_seconds"]) == {"regroup_reform_duration_seconds"}


def test_controller_exports_exactly_the_fixed_metric_names() -> None:
    from regroup.controller.metrics import ControllerMetrics

    exported: set[str] = set()
    for family in ControllerMetrics().registry.collect():
        if family.name.startswith("process_"):
            continue  # the standard process metrics (CPU, memory), not regroup's own
        if family.type == "counter":
            exported.add(f"{family.name}_total")
        elif family.type == "histogram":
            exported |= {f"{family.name}{suffix}" for suffix in ("_bucket", "_sum", "_count")}
        else:
            exported.add(family.name)
    assert exported == EXPORTED_SERIES


def test_controller_metrics_carry_the_fixed_labels() -> None:
    from regroup.controller.metrics import ControllerMetrics
    from prometheus_client import Counter, Gauge, Histogram

    metrics = [m for m in vars(ControllerMetrics()).values() if isinstance(m, Counter | Gauge | Histogram)]
    assert len(metrics) == len(LABELS)
    for metric in metrics:
        (family,) = metric.describe()
        labels = LABELS[family.name]
        if labels:
            metric.labels(**{label: "x" for label in labels})  # ValueError when the names differ
        else:
            with pytest.raises(ValueError):
                metric.labels("x")


def test_label_check_catches_a_filter_on_a_label_the_series_lacks() -> None:
    assert foreign_labels('sum by (le, phase) (rate(regroup_reform_phase_duration_seconds_bucket{job="a"}[5m]))') == {"job"}
    assert foreign_labels("sum by (reason) (increase(regroup_cordons_total[5m]))") == set()
    assert foreign_labels('max by (namespace) (etcd_server_has_leader{job="regroup-etcd"})') == set()
    assert foreign_labels("sum by (cause) (etcd_server_has_leader)") == {"cause"}
    # etcd's series: the scrape target's labels, nothing else, and no licence for regroup's.
    assert foreign_labels('max by (instance) (etcd_mvcc_db_total_size_in_bytes{job=~"$etcd"})') == set()
    assert foreign_labels('sum by (phase) (rate(etcd_mvcc_put_total{job=~"$etcd"}[5m]))') == {"phase"}
    assert foreign_labels('regroup_cordoned_nodes{instance="a"} / etcd_server_has_leader') == {"instance"}


def test_dashboard_and_alerts_group_only_by_labels_their_series_have() -> None:
    exprs = _dashboard_exprs(_dashboard()) + [r["expr"] for r in _rules()]
    for expr in exprs:
        if "label_values" in expr:
            continue
        assert foreign_labels(expr) == set(), expr


def test_dashboard_uses_only_exported_metrics() -> None:
    exprs = _dashboard_exprs(_dashboard())
    assert len(exprs) >= 15
    assert unknown_series(exprs) == set()


def test_dashboard_expressions_read_one_exporter_each() -> None:
    # Joined, their labels could not be told apart: `job` is the training job on one and
    # the scrape job on the other.
    for expr in _dashboard_exprs(_dashboard()):
        assert not (METRIC_NAME.search(expr) and OTHER_EXPORTERS.search(expr)), expr


def test_alert_rules_use_only_exported_metrics() -> None:
    exprs = [r["expr"] for r in _rules()]
    assert unknown_series(exprs) == set()


def test_dashboard_shows_what_the_platform_team_reads() -> None:
    exprs = _dashboard_exprs(_dashboard())
    joined = "\n".join(exprs)
    # p50 and p95 re-form latency, per cause.
    for quantile in ("0.5", "0.95"):
        assert re.search(
            rf"histogram_quantile\({quantile}, sum by \(le, cause\) \(rate\(regroup_reform_duration_seconds_bucket", joined
        ), quantile
    assert "sum by (phase) (rate(regroup_reform_phase_duration_seconds_sum" in joined
    for series in ("regroup_job_nodes", "regroup_lost_steps_total", "regroup_cordoned_nodes", "regroup_job_stalled"):
        assert series in joined, series
    titles = {panel["title"] for panel in _dashboard()["panels"]}
    assert {"Re-form latency p50 / p95 by cause", "Nodes per job", "Cordoned nodes"} <= titles


def test_dashboard_panels_do_not_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in _dashboard()["panels"]:
        grid = panel["gridPos"]
        area = {(x, y) for x in range(grid["x"], grid["x"] + grid["w"]) for y in range(grid["y"], grid["y"] + grid["h"])}
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        assert not area & cells, panel["title"]
        cells |= area
    ids = [panel["id"] for panel in _dashboard()["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize(
    ("alert", "series"),
    [
        ("RegroupJobBelowMinSize", "regroup_job_stalled"),
        ("RegroupRestartStorm", "regroup_cordons_total"),
        ("RegroupRendezvousFlapping", "regroup_rendezvous_flapping"),
        ("RegroupRendezvousPodOnGPUNode", "regroup_rendezvous_pod_on_gpu_node"),
    ],
)
def test_the_signals_platform_teams_page_on_have_alerts(alert: str, series: str) -> None:
    rules = {r["alert"]: r for r in _rules() if "alert" in r}
    assert series in rules[alert]["expr"]
    assert rules[alert]["labels"]["severity"] in ("warning", "critical")
    assert rules[alert]["annotations"]["summary"] and rules[alert]["annotations"]["description"]


def test_service_monitor_scrapes_the_controller_service_and_keeps_job_labels() -> None:
    base = render(DEPLOY / "base")
    (service,) = [d for d in base if d["kind"] == "Service" and d["metadata"]["name"] == "regroup-controller-metrics"]
    monitor = next(d for d in load_documents(MONITORING / "servicemonitor.yaml") if d["metadata"]["name"] == "regroup-controller")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    # The series carry the training job's namespace/job labels, which Prometheus would
    # otherwise rename to exported_namespace/exported_job and break every panel.
    assert endpoint["honorLabels"] is True


def test_etcd_service_monitor_targets_the_metrics_port() -> None:
    base = render(DEPLOY / "base")
    (service,) = [d for d in base if d["kind"] == "Service" and d["metadata"]["name"] == "regroup-etcd"]
    monitor = next(d for d in load_documents(MONITORING / "servicemonitor.yaml") if d["metadata"]["name"] == "regroup-etcd")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}


def test_dashboard_ships_as_a_grafana_sidecar_config_map() -> None:
    docs = render(MONITORING)
    (config_map,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["regroup.json"]) == _dashboard()


# --- traces ------------------------------------------------------------------------------


def _collector_config() -> dict[str, Any]:
    return yaml.safe_load((COLLECTOR / "otel-collector-config.yaml").read_text())


def test_collector_pipelines_reference_only_defined_components() -> None:
    config = _collector_config()
    for name, pipeline in config["service"]["pipelines"].items():
        for section in ("receivers", "processors", "exporters"):
            for component in pipeline.get(section, []):
                assert component in config[section], f"pipeline {name}: {section} {component} is not defined"
    for extension in config["service"].get("extensions", []):
        assert extension in config["extensions"]
    traces = config["service"]["pipelines"]["traces"]
    assert traces["receivers"] == ["otlp"]
    # memory_limiter must come first to refuse data before anything buffers it.
    assert traces["processors"][0] == "memory_limiter"
    assert any(e.startswith("otlp") for e in traces["exporters"])


def test_collector_listens_where_its_service_and_probes_point() -> None:
    config = _collector_config()
    listen_ports = {int(p["endpoint"].rsplit(":", 1)[1]) for p in config["receivers"]["otlp"]["protocols"].values()}
    docs = render(COLLECTOR)
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    service = next(d for d in docs if d["kind"] == "Service")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert {ports[p["targetPort"]] for p in service["spec"]["ports"]} == listen_ports
    health_port = int(config["extensions"]["health_check"]["endpoint"].rsplit(":", 1)[1])
    assert ports[container["readinessProbe"]["httpGet"]["port"]] == health_port
    # The exporter endpoint comes from the env the overlays patch.
    assert config["exporters"]["otlp/traces"]["endpoint"] == "${env:TRACES_ENDPOINT}"
    assert any(e["name"] == "TRACES_ENDPOINT" for e in container["env"])
    mount = container["volumeMounts"][0]["mountPath"]
    assert f"--config={mount}/config.yaml" in container["args"]


def test_dev_sends_traces_to_the_jaeger_it_deploys() -> None:
    docs = render(DEPLOY / "overlays/dev")
    collector = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "regroup-otel-collector")
    env = {e["name"]: e["value"] for e in collector["spec"]["template"]["spec"]["containers"][0]["env"]}
    host, port = env["TRACES_ENDPOINT"].rsplit(":", 1)
    service_name, namespace = host.split(".")[:2]
    (jaeger,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == service_name]
    assert jaeger["metadata"]["namespace"] == namespace
    assert int(port) in {p["port"] for p in jaeger["spec"]["ports"]}
