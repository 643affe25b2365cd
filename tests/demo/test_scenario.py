"""Scenario files: the bundled ones load, bad ones name the bad field."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from regroup.demo.scenario import (
    ScenarioError,
    load_scenario,
    parse_scenario,
    resolve_scenario_path,
    with_overrides,
    with_spares,
)

GOOD = {
    "nodes": 3,
    "duration": "60s",
    "job": {"min_nodes": 1, "max_nodes": 3},
    "events": [
        {"at": "30s", "action": "lose", "node": "node-3"},
        {"at": 10, "action": "reclaim", "node": "node-2", "notice": "15s"},
    ],
}


def test_the_default_scenario_is_the_one_the_readme_promises() -> None:
    s = load_scenario(resolve_scenario_path("default"))
    assert s.nodes == ("node-1", "node-2", "node-3", "node-4")
    assert (s.job.min_nodes, s.job.max_nodes, s.job.nproc_per_node) == (2, 4, 1)
    actions = [(e.action, e.at.total_seconds()) for e in s.events]
    assert actions[0] == ("reclaim", 20.0) and s.events[0].notice == timedelta(seconds=30)
    assert [a for a, _ in actions] == ["reclaim", "lose", "restore", "flaky"]
    assert set(s.events[2].nodes) == {s.events[0].nodes[0], s.events[1].nodes[0]}


def test_events_are_sorted_and_durations_parsed() -> None:
    s = parse_scenario(GOOD)
    assert [e.action for e in s.events] == ["reclaim", "lose"]
    assert s.events[0].taint == "aws-node-termination-handler/spot-itn"
    assert s.duration == timedelta(seconds=60)
    assert s.job.annotations()["regroup.dev/min-nodes"] == "1"
    assert s.next_event(timedelta(seconds=11)).action == "lose"
    assert s.next_event(timedelta(seconds=31)) is None


def test_an_eviction_is_a_pod_disruption_with_its_grace_period() -> None:
    s = parse_scenario({**GOOD, "events": [{"at": "5s", "action": "evict", "node": "node-2", "notice": "20s"}]})
    [event] = s.events
    assert event.action == "evict" and event.notice == timedelta(seconds=20)
    assert event.describe() == "eviction of node-2's pod (DisruptionTarget, 20s grace)"


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"duration": "soon"}, "duration"),
        ({"nodes": 0}, "nodes"),
        ({"nodes": ["a", "a"]}, "nodes"),
        ({"job": {"min_nodes": 4, "max_nodes": 2}}, "job.min_nodes"),
        ({"job": {"min_nodes": "two"}}, "job.min_nodes"),
        ({"job": {"restart_storm": "often"}}, "job.restart_storm"),
        ({"job": {"colour": "red"}}, "job.colour"),
        ({"job": {"spare_nodes": -1}}, "job.spare_nodes"),
        ({"job": {"spare_nodes": "one"}}, "job.spare_nodes"),
        ({"job": {"spare_nodes": True}}, "job.spare_nodes"),
        ({"events": [{"at": "5s", "action": "explode", "node": "node-1"}]}, "events[0].action"),
        ({"events": [{"at": "5s", "action": "lose", "node": "node-9"}]}, "events[0].node"),
        ({"events": [{"at": "5s", "action": "reclaim", "node": "node-1"}]}, "events[0].notice"),
        ({"events": [{"at": "5s", "action": "reclaim", "node": "node-1", "notice": "x"}]}, "events[0].notice"),
        ({"events": [{"action": "lose", "node": "node-1"}]}, "events[0].at"),
        ({"events": [{"at": "5s", "action": "flaky", "node": "node-1"}]}, "events[0].crash_after_steps"),
        ({"events": [{"at": "5s", "action": "evict", "node": "node-1"}]}, "events[0].notice"),
        ({"events": [{"at": "5s", "action": "evict", "node": "node-1", "notice": "5s", "taint": "x"}]}, "events[0].taint"),
        ({"events": [{"at": "5s", "action": "lose", "node": "node-1", "notice": "3s"}]}, "events[0].notice"),
        ({"events": [{"at": "5s", "action": "restore", "nodes": []}]}, "events[0].nodes"),
        ({"speed": 3}, "speed"),
    ],
)
def test_a_bad_scenario_names_the_field(patch: dict, field: str) -> None:
    body = {**GOOD, **patch}
    with pytest.raises(ScenarioError) as err:
        parse_scenario(body)
    assert str(err.value).startswith(f"{field}:"), str(err.value)


def test_a_bad_file_names_the_file_and_the_field(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({**GOOD, "duration": -3}))
    with pytest.raises(ScenarioError, match=r"mine.yaml: duration: must not be negative"):
        load_scenario(path)
    path.write_text("nodes: [unclosed")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(path)


def test_unknown_scenario_lists_the_bundled_ones() -> None:
    with pytest.raises(ScenarioError, match=r"--scenario: .*default.*short"):
        resolve_scenario_path("nope")


def test_overrides_are_validated_like_the_file() -> None:
    s = parse_scenario(GOOD)
    more = with_overrides(s, nodes=5, duration="2m")
    assert len(more.nodes) == 5 and more.job.max_nodes == 5 and more.duration == timedelta(minutes=2)
    with pytest.raises(ScenarioError, match=r"^--nodes: events\[\d\] names 'node-3'"):
        with_overrides(s, nodes=2)
    with pytest.raises(ScenarioError, match="^--duration:"):
        with_overrides(s, duration="later")


def test_spare_nodes_default_to_none_and_go_on_the_pods() -> None:
    assert parse_scenario(GOOD).job.spare_nodes == 0
    assert parse_scenario(GOOD).job.annotations()["regroup.dev/spare-nodes"] == "0"
    s = parse_scenario({**GOOD, "nodes": 4, "job": {"min_nodes": 1, "max_nodes": 3, "spare_nodes": 1}})
    assert s.job.spare_nodes == 1 and s.job.annotations()["regroup.dev/spare-nodes"] == "1"


def test_the_spares_scenario_plays_the_default_churn_with_one_spare() -> None:
    spares = load_scenario(resolve_scenario_path("spares"))
    default = load_scenario(resolve_scenario_path("default"))
    assert spares.nodes == (*default.nodes, "node-5")
    assert (spares.job.min_nodes, spares.job.max_nodes, spares.job.spare_nodes) == (2, 4, 1)
    assert spares.events == default.events and spares.duration == default.duration
    assert spares.job == replace(default.job, spare_nodes=1)


def test_with_spares_adds_nodes_beyond_the_max_the_job_keeps_waiting() -> None:
    default = load_scenario(resolve_scenario_path("default"))
    spared = with_spares(default, 1)
    assert spared.nodes == (*default.nodes, "node-5")
    assert (spared.job.max_nodes, spared.job.spare_nodes) == (4, 1)
    assert spared.events == default.events
    named = parse_scenario({**GOOD, "nodes": ["a", "node-7", "b"], "events": []})
    assert with_spares(named, 2).nodes == ("a", "node-7", "b", "node-8", "node-9")


def test_nodes_override_keeps_the_spares_the_job_wants() -> None:
    spares = load_scenario(resolve_scenario_path("spares"))
    more = with_overrides(spares, nodes=7)
    assert (len(more.nodes), more.job.max_nodes, more.job.spare_nodes) == (7, 6, 1)
    with pytest.raises(ScenarioError, match=r"^--nodes: .*job.min_nodes \(2\) and job.spare_nodes \(1\)"):
        with_overrides(replace(spares, events=()), nodes=2)
