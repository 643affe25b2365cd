"""Re-forms end to end: the controller on real etcd and the Kubernetes API stand-in."""

from __future__ import annotations

import time

import pytest

from regroup.keys import JobKeys
from regroup.records import (
    CheckpointRequest,
    ExpectedMembership,
    ReformPlan,
    ReformRequest,
)
from kubeapi import objects

from .harness import NS, Cluster, controller, notes, sample, until

JOB = "llama"
KEYS = JobKeys(NS, JOB)


@pytest.fixture
def cluster(kube_api, etcd_client) -> Cluster:
    return Cluster(kube_api, etcd_client)


async def test_planned_shrink_checkpoints_first_and_the_ack_gates_the_reform(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2", "n3"], notes(2, 4))
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, spans):
        tainted_at = time.time()
        kube_api.patch("Node", "n2", {"spec": {"taints": [objects.taint("aws-node-termination-handler/spot-itn")]}})
        request = await cluster.wait_record(KEYS.checkpoint, CheckpointRequest)
        # The notice is 2 minutes from first sight, minus the margin; the annotation default is 120 s.
        assert tainted_at + 100 < request.deadline <= tainted_at + 121 and request.hold
        assert request.traceparent.startswith("00-")
        assert await cluster.read(KEYS.reform, ReformRequest) is None  # gated on the ack
        await cluster.progress(JOB, 12, 6)
        await cluster.ack(JOB, request.generation, 12, 6)
        expected = await cluster.wait_record(KEYS.expected, ExpectedMembership)
        reform = await cluster.wait_record(KEYS.reform, ReformRequest)
        assert expected.nodes == ["n1", "n3"] and expected.generation == reform.generation == request.generation
        assert reform.cause == "reclaim" and reform.requested_at >= request.requested_at
        # Agents re-rendezvous: survivors reach round 2; the leaving agent exits.
        await cluster.member(JOB, "n1", 2)
        await cluster.member(JOB, "n3", 2)
        await cluster.drop_member(JOB, "n2")
        await cluster.wait_record(KEYS.plan, ReformPlan, lambda p: p.phase == "resume")
        # The survivors kept their processes; rank 0 says so, and where the resume time went.
        await cluster.progress(JOB, 12, 4, resumed_from=12, last_step=12, round=2, reform_mode="in-place",
                               resume_phases={"process_group": 0.002, "reshard": 0.003})
        plan = await cluster.wait_record(KEYS.plan, ReformPlan, lambda p: p.phase == "done")
        assert plan.outcome == "completed" and plan.planned and plan.lost_steps == 0 and plan.mode == "in-place"
        await until(lambda: sample(metrics, "regroup_reforms_total", namespace=NS, job=JOB, cause="reclaim", planned="true") == 1)
        assert sample(metrics, "regroup_job_nodes", namespace=NS, job=JOB) == 2

    finished = {s.name: s for s in spans.get_finished_spans()}
    assert set(finished) == {"regroup.reform", "regroup.detect", "regroup.checkpoint", "regroup.rendezvous", "regroup.resume",
                             "regroup.resume.process_group", "regroup.resume.reshard"}  # fmt: skip
    root = finished["regroup.reform"]
    assert root.parent is None
    for name in ("regroup.detect", "regroup.checkpoint", "regroup.rendezvous", "regroup.resume"):
        child = finished[name]
        assert child.parent.span_id == root.context.span_id and child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    expected_attributes = {
        "regroup.job": JOB, "regroup.cause": "reclaim", "regroup.node_count.before": 3,
        "regroup.node_count.after": 2, "regroup.planned": True, "regroup.lost_steps": 0, "regroup.reform.mode": "in-place",
    }
    assert {k: root.attributes[k] for k in expected_attributes} == expected_attributes
    # The trainers were told to parent their checkpoint spans on the checkpoint span.
    checkpoint = finished["regroup.checkpoint"]
    assert request.traceparent == f"00-{checkpoint.context.trace_id:032x}-{checkpoint.context.span_id:016x}-01"
    # Durations match the events: the checkpoint span runs from the request to the ack.
    ns = 1e9
    assert abs(checkpoint.start_time / ns - request.requested_at) < 0.01
    assert checkpoint.end_time / ns >= checkpoint.start_time / ns
    assert abs(finished["regroup.rendezvous"].start_time / ns - reform.requested_at) < 0.01
    assert finished["regroup.detect"].start_time / ns >= tainted_at - 0.01
    assert finished["regroup.detect"].end_time / ns <= request.requested_at + 0.01
    resume = finished["regroup.resume"]
    assert resume.attributes["regroup.resume.reshard_s"] == 0.003
    for name in ("regroup.resume.process_group", "regroup.resume.reshard"):
        assert finished[name].parent.span_id == resume.context.span_id
        assert resume.start_time <= finished[name].start_time <= finished[name].end_time <= resume.end_time


async def test_missing_ack_falls_back_to_unplanned_at_the_deadline(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2", "n3"], notes(2, 4, checkpoint_timeout="1s"))
    async with controller(kube_api, kubeconfig, etcd_settings):
        kube_api.patch("Node", "n3", {"spec": {"taints": [objects.taint("karpenter.sh/disrupted")]}})
        request = await cluster.wait_record(KEYS.checkpoint, CheckpointRequest)
        assert request.deadline == pytest.approx(request.requested_at + 1.0, abs=0.01)
        reform = await cluster.wait_record(KEYS.reform, ReformRequest, timeout=5)
        # Not before the deadline, and not long after it.
        assert request.deadline <= reform.requested_at < request.deadline + 1.0
        assert (await cluster.read(KEYS.expected, ExpectedMembership)).nodes == ["n1", "n2"]
        plan = await cluster.read(KEYS.plan, ReformPlan)
        assert not plan.planned and "deadline" in plan.fallback and plan.generation == request.generation


@pytest.mark.parametrize("loss", ["pod-deleted", "node-not-ready", "node-deleted", "lease-expired"])
async def test_unplanned_loss_requests_a_reform_at_once(loss, cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2"], notes(1, 4))
    lease = await cluster.etcd.lease(2) if loss == "lease-expired" else None
    await cluster.member(JOB, "n3", 1, lease=lease)
    cluster.add_node("n3")
    cluster.add_pod(JOB, "n3", notes(1, 4))
    async with controller(kube_api, kubeconfig, etcd_settings):
        await cluster.wait_record(KEYS.status, __import__("regroup.records", fromlist=["JobStatus"]).JobStatus,
                                  lambda s: s.node_count == 3)
        lost_at = time.time()
        if loss == "pod-deleted":
            kube_api.delete("Pod", f"{JOB}-n3", namespace=NS)
        elif loss == "node-not-ready":
            kube_api.patch("Node", "n3", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        elif loss == "node-deleted":
            kube_api.delete("Node", "n3")
        # lease-expired: the member's lease is simply not refreshed.
        reform = await cluster.wait_record(KEYS.reform, ReformRequest, timeout=6)
        assert reform.cause == "node-lost"
        assert (await cluster.read(KEYS.expected, ExpectedMembership)).nodes == ["n1", "n2"]
        assert await cluster.read(KEYS.checkpoint, CheckpointRequest) is None
        if loss != "lease-expired":
            assert reform.requested_at - lost_at < 1.0  # no waiting for heartbeats


async def test_grow_batches_joiners_within_the_join_window(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2"], notes(2, 5, join_window="1s"))
    async with controller(kube_api, kubeconfig, etcd_settings):
        for node in ("n3", "n4"):
            cluster.add_node(node)
            cluster.add_pod(JOB, node, notes(2, 5, join_window="1s"))
            await cluster.member(JOB, node, 2)
        first = time.time()
        request = await cluster.wait_record(KEYS.checkpoint, CheckpointRequest, timeout=5)
        assert request.requested_at >= first + 0.8  # the window was waited out
        plan = await cluster.read(KEYS.plan, ReformPlan)
        assert plan.cause == "grow" and plan.nodes_after == ["n1", "n2", "n3", "n4"]
        await cluster.ack(JOB, request.generation, 10, 4)
        expected = await cluster.wait_record(KEYS.expected, ExpectedMembership)
        assert expected.nodes == ["n1", "n2", "n3", "n4"]


async def test_grow_stops_at_max_without_waiting(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2"], notes(1, 3, join_window="30s"))
    async with controller(kube_api, kubeconfig, etcd_settings):
        for node in ("n3", "n4"):
            cluster.add_node(node)
            cluster.add_pod(JOB, node, notes(1, 3, join_window="30s"))
            await cluster.member(JOB, node, 2)
        await cluster.wait_record(KEYS.checkpoint, CheckpointRequest, timeout=5)
        plan = await cluster.read(KEYS.plan, ReformPlan)
        assert len(plan.nodes_after) == 3 and plan.nodes_after[:2] == ["n1", "n2"]


async def test_below_min_stalls_loudly_and_recovers(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    from regroup.records import JobStatus

    await cluster.job(JOB, ["n1", "n2"], notes(2, 4))
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, _):
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "healthy")
        kube_api.delete("Pod", f"{JOB}-n2", namespace=NS)
        status = await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "stalled")
        assert "below min 2" in status.reason
        await until(lambda: sample(metrics, "regroup_job_stalled", namespace=NS, job=JOB) == 1)
        stalled = await kube_api.wait_for(lambda api: [e for e in api.events(NS) if e["reason"] == "JobStalled"])
        assert stalled[0]["type"] == "Warning"
        assert await cluster.read(KEYS.reform, ReformRequest) is None
        # Capacity returns: a new node joins, the job re-forms with it.
        cluster.add_node("n5")
        cluster.add_pod(JOB, "n5", notes(2, 4))
        await cluster.member(JOB, "n5", 2)
        await cluster.wait_record(KEYS.reform, ReformRequest)
        assert (await cluster.read(KEYS.expected, ExpectedMembership)).nodes == ["n1", "n5"]
        await until(lambda: sample(metrics, "regroup_job_stalled", namespace=NS, job=JOB) == 0)
