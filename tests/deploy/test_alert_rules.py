"""The alert rules as Prometheus reads them: promtool checks them and runs their unit tests.

The unit tests (alert_rules_test.yaml, beside this file) feed series in and expect alerts
out; they are test input, not a manifest, so they live here rather than in deploy/, where
every YAML file must be a Kubernetes object.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.schemas import DEPLOY, load_documents, render

MONITORING = DEPLOY / "observability/monitoring"
UNIT_TESTS = Path(__file__).with_name("alert_rules_test.yaml")
RULES_NAME = "regroup.rules.yaml"
"""The rules file the unit tests name in rule_files."""


def _groups() -> list[dict[str, Any]]:
    (rule,) = [d for d in load_documents(MONITORING / "prometheusrule.yaml") if d["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


def _alerts(groups: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for group in groups for r in group["rules"] if "alert" in r}


def _write_rules(directory: Path, groups: list[dict[str, Any]]) -> Path:
    """The PrometheusRule's spec.groups as a Prometheus rules file, beside a copy of the unit tests."""
    rules = directory / RULES_NAME
    rules.write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(UNIT_TESTS, directory / UNIT_TESTS.name)
    return rules


def _promtool(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run promtool; its absence fails the test (the suite runs through `make test`, which installs it)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found on PATH: `make test` installs it (Debian package prometheus)")
    return subprocess.run(
        [promtool, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_rules_pass_promtool_check(tmp_path: Path) -> None:
    rules = _write_rules(tmp_path, _groups())
    result = _promtool("check", "rules", rules, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in _groups())} rules found" in result.stdout


def test_alerts_fire_as_their_unit_tests_expect(tmp_path: Path) -> None:
    _write_rules(tmp_path, _groups())
    result = _promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_unit_tests_catch_an_alert_that_fires_before_its_for(tmp_path: Path) -> None:
    groups = _groups()
    _alerts(groups)["RegroupJobBelowMinSize"]["for"] = "4m"
    _write_rules(tmp_path, groups)
    result = _promtool("test", "rules", UNIT_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert "alertname: RegroupJobBelowMinSize, time: 4m" in result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_silent() -> None:
    cases = yaml.safe_load(UNIT_TESTS.read_text())
    assert cases["rule_files"] == [RULES_NAME]
    fired: set[str] = set()
    silent: set[str] = set()
    for test in cases["tests"]:
        for case in test["alert_rule_test"]:
            (fired if case["exp_alerts"] else silent).add(case["alertname"])
    alerts = set(_alerts(_groups()))
    assert alerts - fired == set(), "alerts no unit test makes fire"
    assert alerts - silent == set(), "alerts no unit test shows silent"
    assert fired | silent <= alerts, "unit tests of alerts that do not exist"


def test_etcd_alerts_select_regroups_etcd_by_the_job_its_service_monitor_gives() -> None:
    # The control plane's etcd exports the same names: every etcd series needs the selector.
    monitors = load_documents(MONITORING / "servicemonitor.yaml")
    monitor = next(d for d in monitors if d["metadata"]["name"] == "regroup-etcd")
    # Without spec.jobLabel, the Prometheus Operator names the scrape job after the Service.
    assert "jobLabel" not in monitor["spec"]
    ports = {endpoint["port"] for endpoint in monitor["spec"]["endpoints"]}
    selector = monitor["spec"]["selector"]["matchLabels"].items()
    (service,) = [
        d for d in render(DEPLOY / "base")
        if d["kind"] == "Service" and selector <= d["metadata"]["labels"].items()
        and ports & {p["name"] for p in d["spec"]["ports"]}
    ]
    wanted = f'{{job="{service["metadata"]["name"]}"}}'
    etcd_series = re.compile(r"\betcd_[a-z0-9_]+(\{[^}]*\})?")
    used = [m for rule in _alerts(_groups()).values() for m in etcd_series.finditer(rule["expr"])]
    assert len(used) >= 4
    for match in used:
        assert match.group(1) == wanted, match.group(0)
