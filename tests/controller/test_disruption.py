"""``DisruptionTarget=True`` on a member's pod: a reclaim notice on its node, for that job
(with a deletion as well: see test_leaving)."""

from __future__ import annotations

import dataclasses
import time
from datetime import UTC, datetime

import pytest

from regroup.controller.cluster import PodDisruption
from regroup.controller.kube.convert import pod_info
from regroup.controller.model import ClusterModel
from regroup.controller.settings import ControllerSettings
from regroup.controller.signals import POD_DISRUPTION
from regroup.controller.snapshot import WriteCheckpointRequest, WriteExclusions, WritePlan, WriteReform
from regroup.keys import JobKeys
from regroup.records import (
    CheckpointRequest,
    Exclusions,
    ExpectedMembership,
    ReformPlan,
    ReformRequest,
)
from kubeapi import objects

from .builders import JOB, NS, T0, decide, job, of, pod, with_disruption, with_taint
from .builders import step as reconcile
from .harness import NS as E2E_NS
from .harness import Cluster, controller, notes

S = ControllerSettings()
MARGIN = S.reform.notice_margin.total_seconds()
WHY = "pod llama-n2 DisruptionTarget (PreemptionByScheduler)"


def step(s, now):
    return reconcile(s, now, S)


# --- the decision ----------------------------------------------------------------------


def test_disruption_target_starts_a_planned_shrink_within_the_grace_period() -> None:
    s = with_disruption(job(), "n2", since=T0, grace=60)
    s, d = step(s, T0 + 1)
    [plan] = [w.plan for w in of(d.actions, WritePlan)]
    assert plan.cause == "reclaim" and plan.planned and plan.phase == "checkpoint"
    assert plan.nodes_after == ["n1", "n3"] and WHY in plan.reason
    # The notice is the grace period from lastTransitionTime, less the margin.
    [request] = of(d.actions, WriteCheckpointRequest)
    assert request.request.deadline == pytest.approx(T0 + 60 - MARGIN)
    assert WHY in d.reason
    # The node is kept out of the job, with the pod condition as the reason.
    [excluded] = of(d.actions, WriteExclusions)
    assert excluded.exclusions.nodes == {"n2": WHY}


def test_without_last_transition_time_the_notice_starts_when_first_seen() -> None:
    s = with_disruption(job(), "n2", since=None, seen=T0 + 3)  # default grace: 30 s
    plan = of(decide(s, T0 + 4, S).actions, WritePlan)[0].plan
    assert plan.checkpoint_deadline == pytest.approx(T0 + 3 + 30 - MARGIN) and plan.detected_at == T0 + 3


def test_a_grace_period_shorter_than_twice_the_margin_keeps_half_for_the_reform() -> None:
    """A 4 s grace: the checkpoint must come within its first half (the second is the
    re-form's); past that half the shrink goes unplanned at once."""
    s = with_disruption(job(), "n2", since=T0, grace=4)
    [plan] = of(decide(s, T0 + 1, S).actions, WritePlan)
    assert plan.plan.planned and plan.plan.checkpoint_deadline == pytest.approx(T0 + 2)
    d = decide(s, T0 + 2.5, S)
    [plan] = of(d.actions, WritePlan)
    assert not plan.plan.planned and plan.plan.phase == "rendezvous" and of(d.actions, WriteReform)


def test_the_earlier_of_a_taint_and_a_pod_notice_bounds_the_checkpoint() -> None:
    s = with_taint(job(), "n2", "aws-node-termination-handler/spot-itn", time_added=T0)  # ends at T0 + 120
    s = with_disruption(s, "n2", since=T0, grace=40)
    plan = of(decide(s, T0 + 1, S).actions, WritePlan)[0].plan
    assert plan.checkpoint_deadline == pytest.approx(T0 + 40 - MARGIN) and WHY in plan.reason
    # The taint names the exclusion: it outlasts the pod.
    assert of(decide(s, T0 + 1, S).actions, WriteExclusions)[0].exclusions.nodes["n2"].startswith("taint aws-")


def test_a_disrupted_pod_deleted_without_a_known_deadline_is_a_loss_and_its_node_stays_excluded() -> None:
    # An adapter that sets ``deleting`` but no ``deletion_deadline``: no grace is known to be left.
    s = with_disruption(job(), "n2", deleting=True)
    s, d = step(s, T0 + 1)
    plan = of(d.actions, WritePlan)[0].plan
    assert plan.cause == "node-lost" and not plan.planned and "deleted or evicted" in plan.reason
    assert s.exclusions.nodes == {"n2": WHY}


def test_the_exclusion_lifts_when_the_condition_goes_or_the_pod_is_replaced() -> None:
    s, _ = step(with_disruption(job(), "n2"), T0 + 1)
    assert "n2" in s.exclusions.nodes
    # The condition goes away (the eviction was refused, say).
    cleared = s.changed_pod("n2", disruption=None)
    assert of(decide(cleared, T0 + 2, S).actions, WriteExclusions)[0].exclusions.nodes == {}
    # A replacement pod on the node, newer and without the condition.
    fresh = dataclasses.replace(pod("n2", created=T0 + 2), name=f"{JOB}-n2-b", uid="uid-n2-b")
    replaced = s.with_pod(fresh)
    assert of(decide(replaced, T0 + 3, S).actions, WriteExclusions)[0].exclusions.nodes == {}
    # Until either, it holds: the same decision writes nothing.
    assert not of(decide(s, T0 + 2, S).actions, WriteExclusions)


def test_a_disrupted_rendezvous_pod_is_not_a_notice() -> None:
    s = with_disruption(job(), "n2")
    etcd_pod = dataclasses.replace(s.pods[1], name="llama-etcd", uid="uid-etcd", labels={"regroup.dev/role": "rendezvous"})
    only_etcd = job().with_pod(etcd_pod)
    d = decide(only_etcd, T0 + 1, S)
    assert not of(d.actions, WritePlan) and not of(d.actions, WriteExclusions)


def test_the_model_indexes_disrupted_pods_and_forgets_them() -> None:
    now = [T0]
    model = ClusterModel(lambda: now[0], lambda job: None)
    model.nodes_listed([])
    model.pods_listed([pod("n1"), pod("n2")])
    model.pod_changed(dataclasses.replace(pod("n2"), disruption=PodDisruption("EvictionByEvictionAPI", None, 30.0)))
    snap = model.snapshot((NS, JOB))
    assert list(snap.disrupted) == [f"{JOB}-n2"]
    now[0] = T0 + 5
    model.pod_changed(pod("n2"))  # the condition is gone
    assert not model.snapshot((NS, JOB)).disrupted
    assert not [k for k in model.jobs[(NS, JOB)].first_seen if "disruption:" in k]


# --- the kube source -------------------------------------------------------------------


def _condition(status: str = "True", reason: str = "PreemptionByScheduler", at: str | None = "2024-05-01T10:00:00Z"):
    cond = {"type": POD_DISRUPTION.condition, "status": status, "reason": reason}
    if at is not None:
        cond["lastTransitionTime"] = at
    return cond


@pytest.mark.parametrize(
    ("grace", "condition", "expected"),
    [
        (60, _condition(), PodDisruption("PreemptionByScheduler", datetime(2024, 5, 1, 10, tzinfo=UTC).timestamp(), 60.0)),
        ({"spec": 40, "deletion": 5}, _condition(reason="EvictionByEvictionAPI"),
         PodDisruption("EvictionByEvictionAPI", datetime(2024, 5, 1, 10, tzinfo=UTC).timestamp(), 5.0)),
        (None, _condition(reason="DeletionByTaintManager", at=None), PodDisruption("DeletionByTaintManager", None, 30.0)),
        ("soon", _condition(at="yesterday"), PodDisruption("PreemptionByScheduler", None, 30.0)),
        (-1, _condition(at=12), PodDisruption("PreemptionByScheduler", None, 30.0)),
        (60, _condition(status="False"), None),
        (60, None, None),
    ],
    ids=["full", "deletion-grace-wins", "defaults", "unparsable", "wrong-types", "status-false", "absent"],
)
def test_the_source_parses_the_condition_and_the_grace_period(grace, condition, expected) -> None:
    obj = objects.pod(NS, "w-0", job=JOB, node="n1")
    if isinstance(grace, dict):  # being deleted: the deletion's own grace is the notice
        obj["spec"]["terminationGracePeriodSeconds"] = grace["spec"]
        obj["metadata"].update(deletionTimestamp="2024-05-01T10:00:05Z", deletionGracePeriodSeconds=grace["deletion"])
    elif grace is not None:
        obj["spec"]["terminationGracePeriodSeconds"] = grace
    if condition is not None:
        obj["status"]["conditions"].append(condition)
    assert pod_info(obj).disruption == expected


# --- end to end ------------------------------------------------------------------------

E2E_KEYS = JobKeys(E2E_NS, JOB)


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def test_a_preempted_member_pod_is_checkpointed_out_and_kept_out(kube_api, kubeconfig, etcd_settings, etcd_client) -> None:
    cluster = Cluster(kube_api, etcd_client)
    for node in ("n1", "n2", "n3"):
        cluster.add_node(node)
        cluster.add_pod(JOB, node, notes(2, 4), termination_grace_period=90)
        await cluster.member(JOB, node, 1)
    await cluster.progress(JOB, 10, 6)
    async with controller(kube_api, kubeconfig, etcd_settings):
        # The scheduler marks the pod for preemption (the API server keeps status as the test sets it).
        since = int(time.time())
        condition = _condition(at=_rfc3339(since))
        pod_status = kube_api.get("Pod", f"{JOB}-n2", E2E_NS)["status"]
        kube_api.patch("Pod", f"{JOB}-n2", {"status": {"conditions": [*pod_status["conditions"], condition]}},
                       namespace=E2E_NS)
        request = await cluster.wait_record(E2E_KEYS.checkpoint, CheckpointRequest)
        assert request.hold and request.deadline == pytest.approx(since + 90 - MARGIN)
        assert WHY in request.reason
        excluded = await cluster.wait_record(E2E_KEYS.excluded, Exclusions, lambda e: "n2" in e.nodes)
        assert excluded.nodes["n2"] == WHY
        assert await cluster.read(E2E_KEYS.reform, ReformRequest) is None  # gated on the ack
        await cluster.ack(JOB, request.generation, 10, 6)
        expected = await cluster.wait_record(E2E_KEYS.expected, ExpectedMembership)
        assert expected.nodes == ["n1", "n3"]
        await cluster.member(JOB, "n1", 2)
        await cluster.member(JOB, "n3", 2)
        await cluster.drop_member(JOB, "n2")
        await cluster.wait_record(E2E_KEYS.plan, ReformPlan, lambda p: p.phase == "resume")
        await cluster.progress(JOB, 11, 4, resumed_from=10, last_step=10)
        plan = await cluster.wait_record(E2E_KEYS.plan, ReformPlan, lambda p: p.phase == "done")
        assert plan.outcome == "completed" and plan.planned and plan.lost_steps == 0
        # Every pod of the job is told, with a Normal Event.
        resized = await kube_api.wait_for(
            lambda api: (found := [e for e in api.events(E2E_NS) if e["reason"] == "Resized"]) and len(found) == 3 and found
        )
        assert {e["involvedObject"]["name"] for e in resized} == {f"{JOB}-{n}" for n in ("n1", "n2", "n3")}
        assert all(e["type"] == "Normal" for e in resized)
        assert resized[0]["message"].startswith("3 → 2 nodes: preemption of n2, 0 steps lost, ")
        # The preemption is called off: the condition goes, and so does the exclusion.
        kube_api.patch("Pod", f"{JOB}-n2", {"status": {"conditions": pod_status["conditions"]}}, namespace=E2E_NS)
        await cluster.wait_record(E2E_KEYS.excluded, Exclusions, lambda e: "n2" not in e.nodes)

