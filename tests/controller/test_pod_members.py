"""A job whose members are pods (``regroup.dev/member: pod``): several of its pods share a
node, each a member under its pod's name, and the node is where they run.

The pods come through the Kubernetes adapter's own conversion (``pod_info`` of API objects),
then the scene replays them into the real model, as in production. A node's reclaim or loss
takes every member on it in one plan; a member whose pod goes leaves the other on its node
training; a storm of one pod's restarts cordons the node it runs on.
"""

from __future__ import annotations

import dataclasses

from kubeapi import objects
from regroup.controller.cluster import NodeInfo, Taint
from regroup.controller.jobconfig import MEMBER
from regroup.controller.kube.convert import pod_info
from regroup.controller.settings import ControllerSettings
from regroup.controller.signals import signal_key
from regroup.controller.snapshot import Cordon, DeletePod, PostEvent, WriteCheckpointRequest, WritePlan
from regroup.records import MemberRecord, Progress

from .builders import JOB, KEYS, NS, T0, Scene, annotations, decide, of, with_deletion

S = ControllerSettings()
PLACEMENT = {"a0": "n1", "a1": "n1", "b0": "n2"}
"""Pod (by suffix) -> the node it runs on: two pods of the job share n1."""


def pod_named(suffix: str, node: str, **notes: str) -> dict:
    return objects.pod(NS, f"{JOB}-{suffix}", job=JOB, node=node,
                       annotations={**annotations(min_nodes=1, max_nodes=4, member="pod"), **notes})  # fmt: skip


def member(suffix: str, round_: int = 1, restarts: int = 0) -> MemberRecord:
    name = f"{JOB}-{suffix}"
    return MemberRecord(node=name, pod=name, namespace=NS, round=round_, local_world_size=1, restart_count=restarts)


def packed_job(hosting: int = 0) -> Scene:
    """Three members in round 1: pods a0 and a1 on n1, b0 on n2 (``hosting``: other nodes
    hosting other jobs' pods, for the cordon budget)."""
    pods = [pod_info(pod_named(s, n)) for s, n in PLACEMENT.items()]
    others = [f"other-{i}" for i in range(hosting)]
    fleet = [NodeInfo(n) for n in ("n1", "n2", *others)]
    pods += [pod_info(objects.pod(NS, f"x-{n}", job="other", node=n, annotations=annotations())) for n in others]
    items = [(KEYS.member(f"{JOB}-{s}"), member(s).to_json(), 1) for s in PLACEMENT]
    progress = Progress(step=100, loss=1.0, samples_seen=800, world_size=3, time=T0)
    items.append((KEYS.progress, progress.to_json(), 10))

    def observe(m):
        m.nodes_listed(fleet)
        m.pods_listed(pods)
        m.etcd_resynced(items)

    return Scene().then(observe).round_formed(1, [f"{JOB}-{s}" for s in PLACEMENT])


def node_tainted(s: Scene, node: str, key: str) -> Scene:
    return s.with_node(NodeInfo(node, taints=(Taint(key, "", "NoSchedule"),)))


def test_a_pod_is_filed_under_its_own_name_on_the_node_it_runs_on() -> None:
    packed = pod_info(pod_named("a0", "n1"))
    assert (packed.node, packed.host, packed.host_node) == (f"{JOB}-a0", "n1", "n1")
    plain = pod_info(objects.pod(NS, f"{JOB}-c", job=JOB, node="n3", annotations=annotations()))
    assert (plain.node, plain.host, plain.host_node) == ("n3", None, "n3")
    unscheduled = pod_info(pod_named("a2", ""))
    assert unscheduled.node is None and unscheduled.host_node is None


def test_two_pods_on_one_node_form_one_healthy_world_of_three() -> None:
    s = packed_job()
    assert set(s.members) == {f"{JOB}-{x}" for x in PLACEMENT}
    assert s.resolved.config is not None and s.resolved.config.member == "pod"
    # Each member reads its pod's node: all healthy, nothing to do.
    assert s.nodes[f"{JOB}-a0"].name == f"{JOB}-a0" and s.nodes[f"{JOB}-a0"].ready
    assert not s.suspects
    d = decide(s, T0 + 1, S)
    assert not of(d.actions, WritePlan) and not of(d.actions, Cordon) and not of(d.actions, DeletePod)


def test_a_reclaim_of_the_node_takes_both_of_its_pods_in_one_plan() -> None:
    s = node_tainted(packed_job(), "n1", "karpenter.sh/disrupted")
    plans = of(decide(s, T0 + 1, S).actions, WritePlan)
    assert len(plans) == 1, plans
    plan = plans[0].plan
    assert (plan.cause, plan.planned, plan.nodes_after) == ("reclaim", True, [f"{JOB}-b0"])
    assert len(of(decide(s, T0 + 1, S).actions, WriteCheckpointRequest)) == 1


def test_a_node_lost_loses_both_of_its_members_and_keeps_the_other_node() -> None:
    s = packed_job().without_node("n1")
    [plan] = of(decide(s, T0 + 1, S).actions, WritePlan)
    assert plan.plan.nodes_after == [f"{JOB}-b0"] and not plan.plan.planned


def test_one_pod_deleted_leaves_the_other_on_its_node_training() -> None:
    s = with_deletion(packed_job(), "a1", at=T0, grace=30)
    [plan] = of(decide(s, T0 + 1, S).actions, WritePlan)
    assert plan.plan.nodes_after == [f"{JOB}-a0", f"{JOB}-b0"] and plan.plan.planned


def test_a_pod_placed_on_a_tainted_node_takes_the_time_its_notice_was_first_seen() -> None:
    base = node_tainted(packed_job(), "n2", "karpenter.sh/disrupted")
    later = base.at(T0 + 50).with_pod(pod_info(pod_named("b1", "n2")))
    key = "taint:karpenter.sh/disrupted"
    assert later.first_seen.get(signal_key(f"{JOB}-b1", key)) == T0 == later.first_seen.get(signal_key("n2", key))
    [plan] = of(decide(later, T0 + 51, S).actions, WritePlan)
    assert plan.plan.nodes_after == [f"{JOB}-a0", f"{JOB}-a1"], plan


def test_a_storm_of_one_pods_restarts_cordons_the_node_it_runs_on() -> None:
    s = packed_job(hosting=20)
    for count, at in enumerate((T0 - 50, T0 - 20, T0 - 1), start=1):
        s = s.with_member(member("a1", restarts=count), at=at)
    d = decide(s, T0, S)
    assert [c.node for c in of(d.actions, Cordon)] == ["n1"]
    assert [e.ref.name for e in of(d.actions, PostEvent) if e.reason == "RestartStorm"] == ["n1"]
    assert [p.name for p in of(d.actions, DeletePod)] == [f"{JOB}-a1"]
    [plan] = of(d.actions, WritePlan)
    assert plan.plan.cause == "restart-storm" and f"{JOB}-a1" not in plan.plan.nodes_after
    # Once n1 carries the cordon, no second one; its guests mirror the taint.
    cordon = (Taint(S.cordon.taint_key),)
    s2 = s.with_node(NodeInfo("n1", taints=cordon, unschedulable=True))
    assert s2.fleet.cordoned == {"n1"}
    assert not of(decide(s2, T0 + 1, S).actions, Cordon)


def test_a_bad_member_annotation_names_the_field() -> None:
    s = packed_job().with_pod(pod_info(pod_named("a0", "n1", **{MEMBER: "gpu"})))
    problems = [p for p in s.resolved.problems if p.annotation == MEMBER]
    assert problems and "expected node or pod, got 'gpu'" in problems[0].message


def test_a_guest_is_forgotten_once_its_pod_and_member_are_gone() -> None:
    s = packed_job().without_pod(f"{JOB}-a1").without_member(f"{JOB}-a1")
    assert f"{JOB}-a1" not in s.nodes and f"{JOB}-a1" not in s.fleet.hosts
    assert s.fleet.hosts == {f"{JOB}-a0": "n1", f"{JOB}-b0": "n2"}
    assert dataclasses.replace(s.nodes[f"{JOB}-a0"], name="n1") == s.nodes["n1"]
