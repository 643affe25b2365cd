"""A member leaving with notice: its pod deleted or evicted with grace left, or its agent
leaving (``leaving_by``), is a planned shrink; with too little left it is a loss; and no
checkpoint request outlives the plan that wrote it."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from regroup.controller.kube.convert import parse_time, pod_info
from regroup.controller.settings import ControllerSettings, ReformSettings
from regroup.controller.snapshot import (
    AFTER_PREVIOUS_PLAN,
    WithdrawCheckpointRequest,
    WriteCheckpointRequest,
    WriteExclusions,
    WriteExpected,
    WritePlan,
    WriteReform,
)
from regroup.controller.status import job_status
from regroup.keys import JobKeys
from regroup.records import (
    CheckpointRequest,
    Exclusions,
    ExpectedMembership,
    JobStatus,
    MemberRecord,
    Progress,
    ReformPlan,
    ReformRequest,
)
from kubeapi import objects

from .builders import (
    JOB,
    KEYS,
    NS,
    T0,
    Scene,
    acked,
    annotations,
    decide,
    job,
    leaving,
    member,
    of,
    with_deletion,
    with_disruption,
    with_taint,
)
from .builders import step as reconcile
from .harness import NS as E2E_NS
from .harness import Cluster, controller, notes, sample, until

S = ControllerSettings()
MARGIN = S.reform.notice_margin.total_seconds()
MIN_GRACE = S.reform.min_planned_grace.total_seconds()


def step(s: Scene, now: float, settings: ControllerSettings = S):
    return reconcile(s, now, settings)


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def evicted(node: str = "n2", at: float = T0, grace: int = 30, spec_grace: int | None = 60) -> dict[str, Any]:
    """The job's pod on ``node`` as the API server stores it after an eviction at ``at``: the
    ``DisruptionTarget`` condition, ``deletionTimestamp`` and ``deletionGracePeriodSeconds``
    (the eviction's two writes, as a watch sees the second)."""
    obj = objects.pod(NS, f"{JOB}-{node}", job=JOB, node=node, annotations=annotations(),
                      termination_grace_period=spec_grace)
    obj["metadata"].update(uid=f"uid-{node}", deletionTimestamp=rfc3339(at + grace), deletionGracePeriodSeconds=grace)
    obj["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                                        "message": "Eviction API: evicting", "lastTransitionTime": rfc3339(at)})
    return obj


# --- a pod deleted with grace left ------------------------------------------------------


def test_an_eviction_written_in_one_go_is_a_planned_shrink_that_waits_for_the_ack() -> None:
    s = job().with_pod(pod_info(evicted(grace=30)), at=T0)
    s, d = step(s, T0 + 0.03)
    [plan] = [w.plan for w in of(d.actions, WritePlan)]
    assert plan.cause == "reclaim" and plan.planned and plan.phase == "checkpoint" and plan.nodes_after == ["n1", "n3"]
    assert "pod llama-n2 DisruptionTarget (EvictionByEvictionAPI)" in plan.reason
    # The checkpoint wait ends before the kubelet kills the pod (deletionTimestamp), with the margin.
    [request] = of(d.actions, WriteCheckpointRequest)
    assert request.request.deadline == pytest.approx(T0 + 30 - MARGIN, abs=1e-6) and request.request.hold
    # The pod is terminating, yet it is no loss while its grace lasts: the plan waits for the ack.
    for now in (T0 + 0.06, T0 + 10, T0 + 30 - MARGIN - 0.1):
        s, waiting = step(s, now)
        assert not of(waiting.actions, WriteReform) and "waiting for the checkpoint ack" in waiting.reason
    s, d = step(acked(s, plan.generation, 100), T0 + 20)
    [expected] = of(d.actions, WriteExpected)
    assert expected.expected.nodes == ["n1", "n3"] and of(d.actions, WriteReform)
    assert s.plan.planned and s.plan.fallback == "" and "vanished" not in d.reason
    assert s.exclusions.nodes == {"n2": "pod llama-n2 DisruptionTarget (EvictionByEvictionAPI)"}


def test_a_plain_pod_deletion_with_grace_is_a_planned_shrink_too() -> None:
    s = with_deletion(job(), "n2", at=T0, grace=30)
    s, d = step(s, T0 + 1)
    [plan] = [w.plan for w in of(d.actions, WritePlan)]
    assert plan.cause == "reclaim" and plan.planned and plan.detected_at == T0
    assert plan.checkpoint_deadline == pytest.approx(T0 + 30 - MARGIN, abs=1e-6)
    assert "pod llama-n2 deleted (30 s grace)" in plan.reason
    assert s.exclusions.nodes == {"n2": "pod llama-n2 deleted (30 s grace)"}


def test_the_deletions_own_grace_wins_over_the_pods_spec() -> None:
    info = pod_info(evicted(grace=10, spec_grace=40))
    assert info.deletion_deadline == T0 + 10 and info.deletion_grace_seconds == 10
    assert info.disruption is not None and info.disruption.grace_seconds == 10
    plan = of(decide(job().with_pod(info, at=T0), T0 + 1, S).actions, WritePlan)[0].plan
    assert plan.planned and plan.checkpoint_deadline == pytest.approx(T0 + 10 - MARGIN, abs=1e-6)


@pytest.mark.parametrize("grace", [0, MIN_GRACE / 2])
def test_a_deletion_with_less_than_min_planned_grace_is_a_loss_at_once(grace: float) -> None:
    s = with_deletion(job(), "n2", at=T0, grace=grace)
    d = decide(s, T0, S)
    [plan] = [w.plan for w in of(d.actions, WritePlan)]
    assert plan.cause == "node-lost" and not plan.planned and plan.phase == "rendezvous"
    assert "pod llama-n2 deleted or evicted" in plan.reason and of(d.actions, WriteReform)
    assert not of(d.actions, WriteCheckpointRequest)


def test_a_deletion_whose_deadline_is_unknown_is_a_loss() -> None:
    d = decide(job().changed_pod("n2", deleting=True), T0, S)
    assert of(d.actions, WritePlan)[0].plan.cause == "node-lost"


def test_a_deleted_pod_that_finished_is_a_loss_whatever_its_grace() -> None:
    s = with_deletion(job(), "n2", at=T0, grace=30, phase="Succeeded")
    plan = of(decide(s, T0 + 1, S).actions, WritePlan)[0].plan
    assert plan.cause == "node-lost" and "Succeeded" in plan.reason


def test_a_deletion_becomes_a_loss_when_too_little_of_its_grace_is_left() -> None:
    # No margin: the checkpoint may wait until the very end, so the loss comes first.
    settings = ControllerSettings(reform=ReformSettings(notice_margin=timedelta(0)))
    s = with_deletion(job(), "n2", at=T0, grace=30)
    s, d = step(s, T0 + 1, settings)
    assert s.plan.planned and s.plan.checkpoint_deadline == pytest.approx(T0 + 30, abs=1e-6)
    # The decision looks again when the notice turns into a loss, not only at the deadline.
    assert d.requeue_after == timedelta(seconds=30 - MIN_GRACE - 1)
    s, d = step(s, T0 + 30 - MIN_GRACE + 0.5, settings)
    assert "n2 vanished before the checkpoint ack" in d.reason and of(d.actions, WriteReform)
    assert not s.plan.planned and s.plan.fallback == "n2 vanished before the checkpoint ack"


def test_the_condition_before_the_deletion_gives_way_to_the_deletions_deadline() -> None:
    # DisruptionTarget alone (no deletion yet) gives the spec's grace from the condition.
    s = with_disruption(job(), "n2", reason="TerminationByKubelet", since=T0, grace=60)
    plan = of(decide(s, T0, S).actions, WritePlan)[0].plan
    assert plan.checkpoint_deadline == pytest.approx(T0 + 60 - MARGIN, abs=1e-6)
    # The deletion comes with its own, shorter grace: that is the notice.
    s = with_deletion(s, "n2", at=T0, grace=20)
    plan = of(decide(s, T0, S).actions, WritePlan)[0].plan
    assert plan.checkpoint_deadline == pytest.approx(T0 + 20 - MARGIN, abs=1e-6)


# --- an agent leaving ---------------------------------------------------------------------


def test_a_leaving_agent_is_a_planned_shrink_on_its_node() -> None:
    s = leaving(job(), "n2", since=T0, by=T0 + 30)
    s, d = step(s, T0 + 1)
    [plan] = [w.plan for w in of(d.actions, WritePlan)]
    assert plan.cause == "reclaim" and plan.planned and plan.nodes_after == ["n1", "n3"] and plan.detected_at == T0
    assert plan.checkpoint_deadline == pytest.approx(T0 + 30 - MARGIN, abs=1e-6)
    assert "reclaim notice on n2 (agent on n2 leaving, regroup agent)" in plan.reason
    # It stays out of the job while it leaves, and comes back in once its agent is replaced.
    assert s.exclusions.nodes == {"n2": "agent on n2 leaving"}
    back = s.with_member(member("n2", 1)).at(T0 + 2)
    assert of(decide(back, T0 + 2, S).actions, WriteExclusions)[0].exclusions.nodes == {}


def test_a_leaving_agent_with_too_little_time_left_is_a_loss() -> None:
    s = leaving(job(), "n2", since=T0, by=T0 + MIN_GRACE / 2)
    plan = of(decide(s, T0, S).actions, WritePlan)[0].plan
    assert plan.cause == "node-lost" and not plan.planned
    assert f"agent on n2 leaving, under {MIN_GRACE:g} s of its grace left" in plan.reason


def test_the_first_notice_to_end_bounds_the_checkpoint() -> None:
    s = with_deletion(job(), "n2", at=T0, grace=30)
    s = leaving(s, "n2", since=T0, by=T0 + 20)
    plan = of(decide(s, T0 + 1, S).actions, WritePlan)[0].plan
    assert plan.planned and plan.checkpoint_deadline == pytest.approx(T0 + 20 - MARGIN, abs=1e-6)
    s = with_taint(job(), "n2", "aws-node-termination-handler/spot-itn", time_added=T0)  # 2 minutes
    s = leaving(s, "n2", since=T0, by=T0 + 50)
    plan = of(decide(s, T0 + 1, S).actions, WritePlan)[0].plan
    assert plan.checkpoint_deadline == pytest.approx(T0 + 50 - MARGIN, abs=1e-6)


# --- no request outlives its plan -----------------------------------------------------------


def _checkpointing() -> tuple[Scene, int]:
    """n2's pod deleted with 30 s of grace: a planned shrink waiting for the ack."""
    s, _ = step(with_deletion(job(), "n2", at=T0, grace=30), T0 + 1)
    assert s.plan.phase == "checkpoint" and s.checkpoint is not None and s.checkpoint.generation == s.plan.generation
    return s, s.plan.generation


def test_a_plan_that_falls_back_withdraws_its_checkpoint_request() -> None:
    s, g = _checkpointing()
    # The leaving node's agent vanishes before the ack.
    s, d = step(s.at(T0 + 2).without_member("n2"), T0 + 2)
    assert "n2 vanished before the checkpoint ack" in d.reason
    kinds = [type(a) for a in d.actions]
    # The re-form is asked for first, then the request that nobody may hold on goes.
    assert kinds.index(WriteReform) < kinds.index(WithdrawCheckpointRequest)
    [withdraw] = of(d.actions, WithdrawCheckpointRequest)
    assert (withdraw.generation, withdraw.plan_revision) == (g, AFTER_PREVIOUS_PLAN) and withdraw.revision == 1
    assert s.checkpoint is None and s.plan.fallback
    # Once gone, nothing more is asked: the withdrawal is not repeated.
    assert not of(decide(s, T0 + 3, S).actions, WithdrawCheckpointRequest)


def test_a_plan_whose_deadline_passes_withdraws_its_request() -> None:
    s, g = _checkpointing()
    s, d = step(s, T0 + 30 - MARGIN)
    assert "no checkpoint ack by the deadline" in d.reason
    assert [w.generation for w in of(d.actions, WithdrawCheckpointRequest)] == [g] and s.checkpoint is None


def test_a_superseded_plan_withdraws_its_request() -> None:
    s, g = _checkpointing()
    # n3, a target, goes too: one node is left, below min 2.
    s, d = step(s.at(T0 + 2).without_member("n3"), T0 + 2)
    assert s.plan.generation == g and s.plan.outcome == "superseded"
    assert [w.generation for w in of(d.actions, WithdrawCheckpointRequest)] == [g] and s.checkpoint is None


def test_a_finished_job_withdraws_the_request_of_its_plan() -> None:
    s, g = _checkpointing()
    s, d = step(s.at(T0 + 2).closed(), T0 + 2)
    assert s.plan.outcome == "superseded" and [w.generation for w in of(d.actions, WithdrawCheckpointRequest)] == [g]


def test_an_acked_plan_keeps_its_request_until_it_ends() -> None:
    s, g = _checkpointing()
    s, d = step(acked(s.at(T0 + 2), g, 100), T0 + 2)
    assert s.plan.phase == "rendezvous" and s.plan.planned and not of(d.actions, WithdrawCheckpointRequest)
    s, d = step(s.at(T0 + 3).with_members(member(n, 2) for n in ("n1", "n3")), T0 + 3)
    assert s.plan.phase == "resume" and not of(d.actions, WithdrawCheckpointRequest)
    s = s.with_progress(Progress(step=101, loss=1.0, samples_seen=0, world_size=4, time=T0 + 4, resumed_from_step=100), 50)
    s, d = step(s, T0 + 4)
    assert s.plan.outcome == "completed" and [w.generation for w in of(d.actions, WithdrawCheckpointRequest)] == [g]


def test_a_request_newer_than_the_plan_is_left_alone() -> None:
    s, g = _checkpointing()
    s, _ = step(s.at(T0 + 2).without_member("n2"), T0 + 2)  # the fallback withdrew g's
    newer = CheckpointRequest(generation=g + 5, deadline=T0 + 100)
    assert not of(decide(s.with_record(KEYS.checkpoint, newer), T0 + 3, S).actions, WithdrawCheckpointRequest)


# --- lost steps -----------------------------------------------------------------------------


def test_lost_steps_come_from_the_trainers_own_last_step() -> None:
    # The controller last saw step 103; the trainers got to 105 and resumed from 104.
    s, _ = step(job(step=103).without_member("n3"), T0)
    assert s.plan.step_before == 103
    s, _ = step(s.with_members(member(n, 2) for n in ("n1", "n2")), T0 + 1)
    s = s.with_progress(Progress(step=105, loss=1.0, samples_seen=0, world_size=4, time=T0 + 2, resumed_from_step=104,
                                 last_step=105), 50)
    s, d = step(s, T0 + 2)
    assert s.plan.outcome == "completed" and s.plan.lost_steps == 1
    [resized] = [a for a in d.actions if getattr(a, "reason", None) == "Resized"]
    assert "1 step lost" in resized.message


# --- end to end -----------------------------------------------------------------------------

E2E_KEYS = JobKeys(E2E_NS, JOB)


async def _running(cluster: Cluster, grace: int = 60) -> dict[str, MemberRecord]:
    """Three nodes training at step 10, their pods giving ``grace`` seconds on deletion."""
    members = {}
    for node in ("n1", "n2", "n3"):
        cluster.add_node(node)
        cluster.add_pod(JOB, node, notes(2, 4), termination_grace_period=grace)
        members[node] = await cluster.member(JOB, node, 1)
    await cluster.progress(JOB, 10, 6)
    return members


async def test_an_evicted_member_is_checkpointed_out_within_its_grace(
    kube_api, kubeconfig, kube_client, etcd_settings, etcd_client
) -> None:
    kube_api.graceful_pod_deletion = True  # the test plays the kubelet's final delete
    cluster = Cluster(kube_api, etcd_client)
    members = await _running(cluster, grace=60)
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, _):
        await cluster.wait_record(E2E_KEYS.status, JobStatus, lambda s: s.node_count == 3)
        evicted = await cluster.evict(kube_client, f"{JOB}-n2")  # a drain: Eviction API, the pod's own grace
        assert evicted["metadata"]["deletionGracePeriodSeconds"] == 60
        kill_at = parse_time(evicted["metadata"]["deletionTimestamp"])
        request = await cluster.wait_record(E2E_KEYS.checkpoint, CheckpointRequest)
        # Planned: the checkpoint must be done before the kubelet kills the pod.
        # (A stand-in that writes the condition a write ahead of the deletion gives the notice
        # from the condition's lastTransitionTime, a second earlier at most.)
        assert request.hold and kill_at - MARGIN - 1.01 <= request.deadline <= kill_at - MARGIN + 0.01
        status = await cluster.wait_record(E2E_KEYS.status, JobStatus, lambda s: s.state == "reforming")
        assert status.reason.startswith("planned shrink (reclaim): n2 (pod llama-n2 ")
        await cluster.wait_record(E2E_KEYS.excluded, Exclusions, lambda e: "n2" in e.nodes)
        # n2's agent got SIGTERM: it says so, and stays until it is left out of the next round.
        await cluster.member(JOB, "n2", 1, joined_at=members["n2"].joined_at, leaving_since=kill_at - 60,
                             leaving_by=kill_at)
        await cluster.ack(JOB, request.generation, 10, 6)
        expected = await cluster.wait_record(E2E_KEYS.expected, ExpectedMembership)
        reform = await cluster.wait_record(E2E_KEYS.reform, ReformRequest)
        assert expected.nodes == ["n1", "n3"] and reform.generation == request.generation and reform.cause == "reclaim"
        plan = await cluster.read(E2E_KEYS.plan, ReformPlan)
        assert plan.planned and plan.fallback == ""
        # The survivors re-form; n2 hands over, exits 75, and the kubelet finishes the deletion.
        await cluster.member(JOB, "n1", 2, joined_at=members["n1"].joined_at)
        await cluster.member(JOB, "n3", 2, joined_at=members["n3"].joined_at)
        await cluster.drop_member(JOB, "n2")
        kube_api.delete("Pod", f"{JOB}-n2", E2E_NS)
        await cluster.wait_record(E2E_KEYS.plan, ReformPlan, lambda p: p.phase == "resume")
        await cluster.progress(JOB, 11, 4, resumed_from=10, last_step=10)
        plan = await cluster.wait_record(E2E_KEYS.plan, ReformPlan, lambda p: p.phase == "done")
        assert plan.outcome == "completed" and plan.planned and plan.fallback == "" and plan.lost_steps == 0
        resized = await kube_api.wait_for(lambda api: [e for e in api.events(E2E_NS) if e["reason"] == "Resized"])
        assert resized[0]["message"].startswith("3 → 2 nodes: eviction of n2, 0 steps lost, ")
        assert "unplanned" not in resized[0]["message"]
        await until(lambda: sample(metrics, "regroup_reforms_total", namespace=E2E_NS, job=JOB, cause="reclaim",
                                   planned="true") == 1)
        # The finished plan's request is withdrawn; the pod gone, the node is no longer excluded.
        await cluster.wait_deleted(E2E_KEYS.checkpoint)
        await cluster.wait_record(E2E_KEYS.excluded, Exclusions, lambda e: "n2" not in e.nodes)


async def test_a_leaving_agent_is_checkpointed_out(kube_api, kubeconfig, etcd_settings, etcd_client) -> None:
    cluster = Cluster(kube_api, etcd_client)
    members = await _running(cluster)
    async with controller(kube_api, kubeconfig, etcd_settings):
        await cluster.wait_record(E2E_KEYS.status, JobStatus, lambda s: s.node_count == 3)
        # A SIGTERM the controller saw no deletion for (the agent's container alone was stopped).
        now = time.time()
        await cluster.member(JOB, "n3", 1, joined_at=members["n3"].joined_at, leaving_since=now, leaving_by=now + 30)
        request = await cluster.wait_record(E2E_KEYS.checkpoint, CheckpointRequest)
        assert request.deadline == pytest.approx(now + 30 - MARGIN, abs=0.001) and "agent on n3 leaving" in request.reason
        excluded = await cluster.wait_record(E2E_KEYS.excluded, Exclusions, lambda e: "n3" in e.nodes)
        assert excluded.nodes["n3"] == "agent on n3 leaving"
        await cluster.ack(JOB, request.generation, 10, 6)
        expected = await cluster.wait_record(E2E_KEYS.expected, ExpectedMembership)
        assert expected.nodes == ["n1", "n2"]
        assert (await cluster.read(E2E_KEYS.plan, ReformPlan)).planned


async def test_a_dropped_plans_checkpoint_request_is_withdrawn(
    kube_api, kubeconfig, kube_client, etcd_settings, etcd_client
) -> None:
    kube_api.graceful_pod_deletion = True
    cluster = Cluster(kube_api, etcd_client)
    await _running(cluster, grace=60)
    async with controller(kube_api, kubeconfig, etcd_settings):
        await cluster.wait_record(E2E_KEYS.status, JobStatus, lambda s: s.node_count == 3)
        await cluster.evict(kube_client, f"{JOB}-n2")
        request = await cluster.wait_record(E2E_KEYS.checkpoint, CheckpointRequest)
        # The leaving node's agent vanishes before the ack: the unplanned fallback...
        await cluster.drop_member(JOB, "n2")
        reform = await cluster.wait_record(E2E_KEYS.reform, ReformRequest)
        assert reform.generation == request.generation
        plan = await cluster.read(E2E_KEYS.plan, ReformPlan)
        assert not plan.planned and plan.fallback == "n2 vanished before the checkpoint ack"
        assert (await cluster.read(E2E_KEYS.expected, ExpectedMembership)).nodes == ["n1", "n3"]
        # ... and no survivor is left to hold on the dropped plan's request.
        await cluster.wait_deleted(E2E_KEYS.checkpoint)
        assert await cluster.read(E2E_KEYS.checkpoint, CheckpointRequest) is None


async def test_lost_steps_reach_the_event_the_trace_the_metric_and_status(
    kube_api, kubeconfig, etcd_settings, etcd_client
) -> None:
    cluster = Cluster(kube_api, etcd_client)
    members = await _running(cluster)
    await cluster.progress(JOB, 103, 6)  # the last progress the controller sees before the loss
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, spans):
        await cluster.wait_record(E2E_KEYS.status, JobStatus, lambda s: s.node_count == 3)
        await cluster.drop_member(JOB, "n3")
        await cluster.wait_record(E2E_KEYS.reform, ReformRequest)
        await cluster.member(JOB, "n1", 2, joined_at=members["n1"].joined_at)
        await cluster.member(JOB, "n2", 2, joined_at=members["n2"].joined_at)
        await cluster.wait_record(E2E_KEYS.plan, ReformPlan, lambda p: p.phase == "resume")
        # The trainers had completed step 105 and resumed from the checkpoint of step 104.
        await cluster.progress(JOB, 105, 4, resumed_from=104, last_step=105)
        plan = await cluster.wait_record(E2E_KEYS.plan, ReformPlan, lambda p: p.phase == "done")
        assert plan.outcome == "completed" and plan.step_before == 103 and plan.lost_steps == 1
        resized = await kube_api.wait_for(lambda api: [e for e in api.events(E2E_NS) if e["reason"] == "Resized"])
        assert resized[0]["message"].startswith("3 → 2 nodes: loss of n3, 1 step lost, ")
        await until(lambda: sample(metrics, "regroup_lost_steps_total", namespace=E2E_NS, job=JOB, cause="node-lost") == 1)
        report = await job_status(E2E_KEYS, etcd_settings)
        assert report["last_reform"]["lost_steps"] == 1 and "1 step lost" in report["last_reform"]["summary"]
    [root] = [s for s in spans.get_finished_spans() if s.name == "regroup.reform"]
    assert root.attributes["regroup.lost_steps"] == 1
