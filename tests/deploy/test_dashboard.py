"""The Grafana dashboard is what its generator writes, and its queries hold together."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from typing import Any

import pytest

from regroup.demo.etcd_server import EtcdServer
from tests.deploy.schemas import REPO
from tests.deploy.test_observability import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    LABELS,
    METRIC_NAME,
    MONITORING,
    OTHER_EXPORTERS,
    _family,
)

GENERATOR = MONITORING / "dashboard.py"
COMMITTED = MONITORING / "grafana-dashboard.json"
SELECTOR = re.compile(r"\b([a-z_][a-z0-9_]*)(?:\{([^}]*)\})?")
RATE_ARGUMENT = re.compile(r"\b(?:rate|irate|increase|changes)\(\s*([a-z_][a-z0-9_]*)")


def _dashboard() -> dict[str, Any]:
    return json.loads(COMMITTED.read_text())


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def _panel_exprs() -> list[str]:
    exprs = [t["expr"] for panel in _panels() for t in panel["targets"]]
    return exprs + [a["expr"] for a in _dashboard()["annotations"]["list"]]


def _selectors(expr: str, names: re.Pattern[str]) -> list[tuple[str, str]]:
    """``(series, matchers)`` of every series ``names`` matches in ``expr``."""
    return [(name, matchers or "") for name, matchers in SELECTOR.findall(expr) if names.fullmatch(name)]


def test_committed_dashboard_is_what_the_generator_writes() -> None:
    run = subprocess.run([sys.executable, str(GENERATOR)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert run.stdout == COMMITTED.read_text(), (
        f"{COMMITTED.relative_to(REPO)} differs from its generator's output: change "
        f"{GENERATOR.relative_to(REPO)} and run `python {GENERATOR.relative_to(REPO)} > {COMMITTED.relative_to(REPO)}`"
    )


def test_panels_are_numbered_in_order_and_every_query_has_its_own_ref() -> None:
    panels = _dashboard()["panels"]
    assert [p["id"] for p in panels] == list(range(1, len(panels) + 1))
    for panel in _panels():
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs) and all(refs), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel.get("description"), f"{panel['title']}: say what it shows and why it matters"


def test_every_variable_the_queries_use_is_defined_and_every_variable_is_used() -> None:
    dashboard = _dashboard()
    defined = {v["name"] for v in dashboard["templating"]["list"]}
    text = json.dumps(dashboard["panels"]) + json.dumps(dashboard["annotations"])
    text += json.dumps([v.get("query") for v in dashboard["templating"]["list"]])
    used = set(re.findall(r"\$\{?([a-z]\w*)", text)) - {"__rate_interval", "__range"}
    assert used == defined


def test_per_job_series_follow_the_namespace_and_job_variables() -> None:
    per_job = {family for family, labels in LABELS.items() if {"namespace", "job"} <= set(labels)}
    checked = 0
    for expr in _panel_exprs():
        for name, matchers in _selectors(expr, METRIC_NAME):
            if _family(name) in per_job:
                checked += 1
                assert 'namespace=~"$namespace"' in matchers and 'job=~"$job"' in matchers, expr
    assert checked >= 15


def test_etcd_and_process_series_select_their_scrape_job() -> None:
    # Prometheus may scrape other etcd clusters (the API server's) and many processes.
    for expr in _panel_exprs():
        for name, matchers in _selectors(expr, OTHER_EXPORTERS):
            wanted = {'job=~"$etcd"'} if name.startswith("etcd_") else {'job=~"$etcd"', 'job=~"$controller"'}
            assert matchers in wanted, expr


def test_histogram_quantiles_aggregate_by_bucket() -> None:
    quantiles = [e for e in _panel_exprs() if "histogram_quantile" in e]
    assert len(quantiles) >= 8
    for expr in quantiles:
        groups = re.findall(r"\bby \(([^)]*)\)", expr)
        assert groups and all("le" in [g.strip() for g in group.split(",")] for group in groups), expr


def _scrape(url: str) -> dict[str, tuple[str, set[str]]]:
    """Every series of a Prometheus text exposition: its family's type and the labels it carries."""
    types: dict[str, str] = {}
    series: dict[str, tuple[str, set[str]]] = {}
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split()
            types[family] = kind
        elif line and not line.startswith("#"):
            name, labels = re.match(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})?", line).groups()
            family = next((f for f in (name, re.sub(r"_(bucket|sum|count)$", "", name)) if f in types), name)
            seen = series.get(name, (types.get(family, "untyped"), set()))[1]
            seen |= set(re.findall(r"(\w+)=\"", labels or ""))
            series[name] = (types.get(family, "untyped"), seen)
    return series


def _regroup_types() -> dict[str, str]:
    types = {name: "counter" for name in COUNTERS} | {name: "gauge" for name in GAUGES}
    return types | {f"{h}{suffix}": "histogram" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}


def rate_misuse(exprs: list[str], types: dict[str, str]) -> set[str]:
    """Series read against their type: a gauge through rate() or increase(), or a counter
    (a histogram's series are counters) plotted raw. Both draw nonsense."""
    wrong = set()
    for expr in exprs:
        rated = set(RATE_ARGUMENT.findall(expr))
        for name, _ in _selectors(expr, METRIC_NAME) + _selectors(expr, OTHER_EXPORTERS):
            if (name in rated) != (types[name] in ("counter", "histogram")):
                wrong.add(name)
    return wrong


def test_rate_check_catches_a_rated_gauge_and_a_raw_counter() -> None:
    types = {"etcd_debugging_mvcc_keys_total": "gauge", "etcd_mvcc_put_total": "counter"}
    assert rate_misuse(["rate(etcd_debugging_mvcc_keys_total[5m])", "etcd_mvcc_put_total"], types) == {
        "etcd_debugging_mvcc_keys_total", "etcd_mvcc_put_total",
    }  # fmt: skip
    assert rate_misuse(["etcd_debugging_mvcc_keys_total", "rate(etcd_mvcc_put_total[5m])"], types) == set()


def test_etcd_panels_read_series_a_real_etcd_serves(etcd: EtcdServer) -> None:
    served = _scrape(f"{etcd.url}/metrics")
    used = {name for expr in _panel_exprs() for name, _ in _selectors(expr, OTHER_EXPORTERS)}
    assert {name for name in used if name.startswith("etcd_")} >= {
        "etcd_mvcc_db_total_size_in_bytes", "etcd_server_quota_backend_bytes", "etcd_server_has_leader",
        "etcd_disk_wal_fsync_duration_seconds_bucket", "etcd_mvcc_put_total", "etcd_debugging_mvcc_watcher_total",
    }  # fmt: skip
    assert used - served.keys() == set()
    # No labels of their own but le: the dashboard selects them by scrape target only.
    assert {name: labels for name in used if (labels := served[name][1] - {"le"})} == {}
    types = _regroup_types() | {name: kind for name, (kind, _) in served.items()}
    assert rate_misuse(_panel_exprs(), types) == set()


@pytest.mark.parametrize(
    ("title", "needles"),
    [
        ("Re-form latency p50 / p95, planned vs unplanned", ["sum by (le, planned)"]),
        ("Phase p50 / p95", ["histogram_quantile(0.5, sum by (le, phase)", "histogram_quantile(0.95, sum by (le, phase)"]),
        ("Abandoned re-forms", ["regroup_reforms_abandoned_total"]),
        ("Jobs tracked and removed", ["regroup_jobs_tracked", "sum by (reason) (increase(regroup_jobs_removed_total"]),
        ("Dropped Events", ["regroup_events_dropped_total"]),
        ("etcd database size vs quota",
         ["etcd_mvcc_db_total_size_in_bytes", "etcd_mvcc_db_total_size_in_use_in_bytes", "etcd_server_quota_backend_bytes"]),
        ("etcd disk latency p99",
         ["histogram_quantile(0.99", "etcd_disk_wal_fsync_duration_seconds_bucket",
          "etcd_disk_backend_commit_duration_seconds_bucket"]),
        ("etcd leader", ["etcd_server_has_leader", "etcd_server_leader_changes_seen_total"]),
        ("etcd requests", ["etcd_mvcc_put_total", "etcd_mvcc_delete_total", "etcd_mvcc_range_total"]),
        ("etcd leases", ["etcd_debugging_server_lease_expired_total"]),
        ("Controller CPU and memory", ['process_cpu_seconds_total{job=~"$controller"}', "process_resident_memory_bytes"]),
        ("etcd CPU and memory", ['process_cpu_seconds_total{job=~"$etcd"}', "process_resident_memory_bytes"]),
    ],
)  # fmt: skip
def test_the_dashboard_shows_what_the_platform_team_reads(title: str, needles: list[str]) -> None:
    (panel,) = [p for p in _panels() if p["title"] == title]
    exprs = "\n".join(t["expr"] for t in panel["targets"])
    for needle in needles:
        assert needle in exprs, needle
