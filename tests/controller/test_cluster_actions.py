"""Cordons, Events and config validation through the Kubernetes API stand-in."""

from __future__ import annotations

import json

import pytest

from regroup.keys import JobKeys
from regroup.records import (
    CheckpointRequest,
    ExpectedMembership,
    JobStatus,
    ReformRequest,
)
from kubeapi import objects

from .harness import NS, Cluster, controller, notes, sample, until

JOB = "llama"
KEYS = JobKeys(NS, JOB)


@pytest.fixture
def cluster(kube_api, etcd_client) -> Cluster:
    return Cluster(kube_api, etcd_client)


def restart(kube_api, pod: str, count: int) -> None:
    status = kube_api.get("Pod", pod, NS)["status"]
    status["containerStatuses"][0]["restartCount"] = count
    kube_api.patch("Pod", pod, {"status": {"containerStatuses": status["containerStatuses"]}}, namespace=NS)


async def test_restart_storm_cordons_exactly_once_and_deletes_the_pod(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    nodes = [f"n{i}" for i in range(1, 5)]
    await cluster.job(JOB, nodes, notes(1, 4, restart_storm="3/10m"))
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, _):
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.node_count == 4)
        # Container restarts (pod restartCount) and rank restarts (member records) both count.
        restart(kube_api, f"{JOB}-n2", 1)
        await cluster.member(JOB, "n2", 1, restarts=2)
        node = await kube_api.wait_for(lambda api: (n := api.get("Node", "n2"))["spec"].get("unschedulable") and n)
        assert next(t for t in node["spec"]["taints"] if t["key"] == "regroup.dev/restart-storm")["effect"] == "NoSchedule"
        assert "restart" in json.loads(node["metadata"]["annotations"]["regroup.dev/cordoned"])["reason"]
        await kube_api.wait_for(lambda api: api.get("Pod", f"{JOB}-n2", NS) is None)
        reform = await cluster.wait_record(KEYS.reform, ReformRequest)
        assert reform.cause == "restart-storm"
        assert (await cluster.read(KEYS.expected, ExpectedMembership)).nodes == ["n1", "n3", "n4"]
        # More restarts on the cordoned node: still one cordon; healthy nodes untouched.
        await cluster.member(JOB, "n2", 1, restarts=6)
        await until(lambda: sample(metrics, "regroup_cordons_total", reason="restart-storm") == 1)
        storm_events = [e for e in kube_api.events() if e["reason"] == "RestartStorm"]
        assert len(storm_events) == 1 and storm_events[0]["involvedObject"]["name"] == "n2"
        for healthy in ("n1", "n3", "n4"):
            assert not kube_api.get("Node", healthy)["spec"].get("unschedulable")
        # The gauge follows the model on the reconcile after the cordon.
        await until(lambda: sample(metrics, "regroup_cordoned_nodes") == 1)


async def test_cordon_budget_caps_cordons(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    # 4 nodes host regroup pods: the budget is max(1, 10%) = 1 node.
    await cluster.job(JOB, ["n1", "n2", "n3", "n4"], notes(1, 4, restart_storm="2/10m"))
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, _):
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.node_count == 4)
        await cluster.member(JOB, "n1", 1, restarts=2)
        await kube_api.wait_for(lambda api: api.get("Node", "n1")["spec"].get("unschedulable"))
        await cluster.member(JOB, "n3", 1, restarts=2)
        await kube_api.wait_for(lambda api: [e for e in api.events() if e["reason"] == "CordonBudgetExhausted"])
        assert not kube_api.get("Node", "n3")["spec"].get("unschedulable")
        assert kube_api.get("Pod", f"{JOB}-n3", NS) is not None
        assert sample(metrics, "regroup_cordons_total", reason="restart-storm") == 1


BAD = [
    ("regroup.dev/min-nodes", "two", "not a whole number"),
    ("regroup.dev/min-nodes", "0", "at least 1"),
    ("regroup.dev/max-nodes", None, "required"),
    ("regroup.dev/min-nodes", "5", "greater than max-nodes"),
    ("regroup.dev/checkpoint-timeout", "soon", "not a duration"),
    ("regroup.dev/join-window", "10 parsecs", "not a duration"),
    ("regroup.dev/restart-storm", "3-10m", "K/W"),
    ("regroup.dev/restart-storm", "x/10m", "K is not a whole number"),
    ("regroup.dev/rdzv-endpoint", "etcd", "host:port"),
    ("regroup.dev/reclaim-taints", "bad key!", "not a taint key"),
]


async def test_every_bad_annotation_gets_an_event_and_other_jobs_carry_on(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    for i, (name, value, _) in enumerate(BAD):
        bad = notes(1, 4)
        if value is None:
            del bad[name]
        else:
            bad[name] = value
        job = f"bad{i}"
        cluster.add_node(f"b{i}")
        cluster.add_pod(job, f"b{i}", bad)
        await cluster.member(job, f"b{i}", 1)
    await cluster.job(JOB, ["n1", "n2", "n3"], notes(2, 4))
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, _):
        for i, (name, _, reason) in enumerate(BAD):
            status = await cluster.wait_record(JobKeys(NS, f"bad{i}").status, JobStatus, lambda s: s.state == "bad-config")
            assert name in status.reason and reason in status.reason
        events = await kube_api.wait_for(
            lambda api: (ev := [e for e in api.events(NS) if e["reason"] == "BadConfig"]) and len(ev) >= len(BAD) and ev
        )
        for i, (name, _, reason) in enumerate(BAD):
            [event] = [e for e in events if e["involvedObject"]["name"] == f"bad{i}-b{i}"]
            assert event["type"] == "Warning" and name in event["message"] and reason in event["message"]
        assert sample(metrics, "regroup_bad_config", namespace=NS, job="bad0") == 1
        # The healthy job is unaffected and still re-forms.
        kube_api.patch("Node", "n3", {"spec": {"taints": [objects.taint("cloud.google.com/impending-node-termination")]}})
        await cluster.wait_record(KEYS.checkpoint, CheckpointRequest)
        assert sample(metrics, "regroup_bad_config", namespace=NS, job=JOB) == 0
        # No bad job was touched.
        for i in range(len(BAD)):
            assert await cluster.read(JobKeys(NS, f"bad{i}").checkpoint, CheckpointRequest) is None


async def test_pods_that_disagree_get_an_event_and_the_newest_wins(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2"], notes(1, 4))
    cluster.add_node("n3")
    cluster.add_pod(JOB, "n3", notes(1, 2))  # newest: max 2
    await cluster.member(JOB, "n3", 1)
    async with controller(kube_api, kubeconfig, etcd_settings):
        events = await kube_api.wait_for(lambda api: [e for e in api.events(NS) if e["reason"] == "ConfigDisagreement"])
        assert "regroup.dev/max-nodes" in events[0]["message"]
        # Three nodes exceed the newest max of 2: the job shrinks to it.
        await cluster.wait_record(KEYS.checkpoint, CheckpointRequest)
        status = await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.max_nodes == 2)
        assert status.min_nodes == 1
