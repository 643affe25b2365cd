"""The pure policy: snapshots built by hand, any ``now``, no I/O and no sleeps."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import pytest

from regroup.controller.cluster import NodeInfo, Taint
from regroup.controller.settings import ControllerSettings
from regroup.controller.signals import RECLAIM_SIGNALS
from regroup.controller.snapshot import (
    AFTER_PREVIOUS_PLAN,
    Cordon,
    DeletePod,
    PostEvent,
    WriteCheckpointRequest,
    WriteExpected,
    WritePlan,
    WriteReform,
    WriteStatus,
)
from regroup.controller.status import render
from regroup.records import Progress

from .builders import T0, Scene, acked, annotations, applied, decide, job, member, of, pod, with_taint
from .builders import step as reconcile

S = ControllerSettings()


def step(s, now):
    """One reconcile: decide, then let the writes land."""
    return reconcile(s, now, S)


PLANNED_TAINTS = [(sig.key, sig.value or "") for sig in RECLAIM_SIGNALS if sig.path == "planned"]


@pytest.mark.parametrize(("key", "value"), PLANNED_TAINTS, ids=[k for k, _ in PLANNED_TAINTS])
def test_each_reclaim_taint_starts_a_planned_shrink_checkpoint_first(key: str, value: str) -> None:
    if key == "ToBeDeletedByClusterAutoscaler":
        value = str(int(T0))
    s = with_taint(job(), "n2", key, value)
    d = decide(s, T0 + 1, S)
    plans = of(d.actions, WritePlan)
    assert len(plans) == 1 and plans[0].plan.phase == "checkpoint" and plans[0].plan.planned
    assert plans[0].plan.cause == "reclaim" and plans[0].plan.nodes_after == ["n1", "n3"]
    # The request names the member that leaves: its ranks secure their state before the ack.
    [request] = of(d.actions, WriteCheckpointRequest)
    assert request.request.leaving == ["n2"]
    # No re-form before the ack: the checkpoint request precedes the reform request.
    assert not of(d.actions, WriteReform) and not of(d.actions, WriteExpected)


def test_node_unschedulable_is_a_reclaim_and_custom_taints_count() -> None:
    s = job().with_node(NodeInfo("n1", unschedulable=True))
    assert of(decide(s, T0, S).actions, WritePlan)[0].plan.nodes_after == ["n2", "n3"]
    notes = annotations(reclaim_taints="example.com/going-away, other.io/x")
    custom = with_taint(job(notes=notes), "n3", "example.com/going-away")
    assert of(decide(custom, T0, S).actions, WritePlan)[0].plan.nodes_after == ["n1", "n2"]
    # Without the annotation the same taint means nothing.
    plain = with_taint(job(), "n3", "example.com/going-away")
    assert not of(decide(plain, T0, S).actions, WritePlan)


def test_karpenter_v1beta1_taint_counts_only_with_value_disrupting() -> None:
    s = with_taint(job(), "n1", "karpenter.sh/disruption", "candidate")
    assert not of(decide(s, T0, S).actions, WritePlan)


def test_ack_gates_the_reform_and_then_expected_excludes_the_leaving_node() -> None:
    s = with_taint(job(), "n2", "aws-node-termination-handler/spot-itn", time_added=T0)
    s, d = step(s, T0 + 1)
    g = of(d.actions, WritePlan)[0].plan.generation
    # Without an ack, nothing but waiting (and a requeue before the deadline).
    s2, d2 = step(s, T0 + 5)
    assert not of(d2.actions, WriteReform) and d2.requeue_after is not None
    s3, d3 = step(acked(s2.at(T0 + 6), g, 120), T0 + 6)
    [expected] = of(d3.actions, WriteExpected)
    [reform] = of(d3.actions, WriteReform)
    assert expected.expected.nodes == ["n1", "n3"] and expected.expected.generation == g == reform.request.generation
    plan = s3.plan
    assert plan.phase == "rendezvous" and plan.planned and plan.ack_step == 120 and plan.acked_at == T0 + 6
    # Repeating the same moment asks for nothing new: idempotent.
    again = decide(s3, T0 + 6, S)
    assert not of(again.actions, WriteReform) and not of(again.actions, WritePlan)


def test_aws_notice_bounds_the_checkpoint_wait_and_missing_ack_falls_back_in_time() -> None:
    # Taint added 100 s before the controller looks: 2 min notice leaves 20 s minus the margin.
    s = with_taint(job(), "n2", "aws-node-termination-handler/spot-itn", time_added=T0 - 100)
    s, d = step(s, T0)
    plan = s.plan
    assert plan.checkpoint_deadline == pytest.approx(T0 + 20 - S.reform.notice_margin.total_seconds())
    assert d.requeue_after == timedelta(seconds=plan.checkpoint_deadline - T0)
    s2, d2 = step(s, plan.checkpoint_deadline)
    assert of(d2.actions, WriteReform) and of(d2.actions, WriteExpected)[0].expected.nodes == ["n1", "n3"]
    assert not s2.plan.planned and "deadline" in s2.plan.fallback


def test_gke_notice_is_30s_and_an_expired_notice_goes_unplanned_at_once() -> None:
    s = with_taint(job(), "n1", "cloud.google.com/impending-node-termination", time_added=T0 - 40)
    d = decide(s, T0, S)
    [plan] = of(d.actions, WritePlan)
    assert not plan.plan.planned and plan.plan.phase == "rendezvous" and of(d.actions, WriteReform)


def test_cluster_autoscaler_value_is_the_notice_start() -> None:
    s = with_taint(job(), "n1", "ToBeDeletedByClusterAutoscaler", value=str(int(T0 - 30)), seen=T0)
    plan = of(decide(s, T0, S).actions, WritePlan)[0].plan
    assert plan.planned and plan.detected_at == T0


def test_leaving_node_vanishing_before_the_ack_falls_back_to_unplanned() -> None:
    s = with_taint(job(), "n2", "karpenter.sh/disrupted")
    s, _ = step(s, T0)
    s2, d = step(s.without_member("n2"), T0 + 2)
    assert of(d.actions, WriteReform) and "n2" in s2.plan.fallback and not s2.plan.planned


@pytest.mark.parametrize("loss", ["pod-deleted", "pod-evicted", "node-notready", "node-deleted", "lease-expired"])
def test_unplanned_loss_reforms_immediately(loss: str) -> None:
    s = job(("n1", "n2", "n3", "n4"))
    if loss == "pod-deleted":
        s = s.without_pod("llama-n4")
    elif loss == "pod-evicted":
        s = s.changed_pod("n4", deleting=True)
    elif loss == "node-notready":
        s = s.with_node(NodeInfo("n4", ready=False))
    elif loss == "node-deleted":
        s = s.without_node("n4")
    else:
        s = s.without_member("n4")
    d = decide(s, T0, S)
    [plan] = of(d.actions, WritePlan)
    assert plan.plan.cause == "node-lost" and not plan.plan.planned
    assert of(d.actions, WriteExpected)[0].expected.nodes == ["n1", "n2", "n3"]
    assert of(d.actions, WriteReform) and not of(d.actions, WriteCheckpointRequest)


def test_grow_gathers_joiners_for_the_join_window_then_checkpoints() -> None:
    s = job(("n1", "n2"), notes=annotations(2, 4, join_window="10s"))
    for i, node in enumerate(("n3", "n4")):
        s = s.with_node(NodeInfo(node)).with_pod(pod(node, annotations(2, 4, join_window="10s")))
        s = s.with_member(member(node, 2), at=T0 + i * 3)
        if i == 0:
            d = decide(s, T0 + 1, S)
            assert not of(d.actions, WritePlan) and d.requeue_after == timedelta(seconds=9)
    # Both joiners reach max (4): no need to wait the window out.
    d = decide(s, T0 + 4, S)
    [plan] = of(d.actions, WritePlan)
    assert plan.plan.cause == "grow" and plan.plan.planned and plan.plan.nodes_after == ["n1", "n2", "n3", "n4"]
    assert plan.plan.detected_at == T0


def test_a_joiner_warming_up_is_reported_never_held_for_and_grows_the_job_once_warm() -> None:
    """A healed node left out of the round restarts its standby workers before it asks to
    join: until they are up the survivors train on (no checkpoint, no hold) and the status
    names it; once its member record says warm, the grow starts in that decision."""
    notes = annotations(2, 3, join_window="5s")
    s = job(("n1", "n2"), notes=notes).with_node(NodeInfo("n3")).with_pod(pod("n3", notes))
    warming = dataclasses.replace(member("n3", 0, joined_at=T0), warming_since=T0, not_before=T0 + 3600)
    s = s.with_member(warming, at=T0)
    s, d = step(s, T0 + 1)
    assert not of(d.actions, WritePlan) and not of(d.actions, WriteCheckpointRequest), d.reason
    assert d.reason.endswith("1 warming up to join (n3)")
    assert s.status.warming == ["n3"] and s.status.spares == []
    report = {"namespace": "ml", "job": "llm", "state": "healthy", "status": json.loads(s.status.to_json()), "members": []}
    shown = render(report)
    assert "  warming up to join: n3 (their workers are starting)" in shown.splitlines()
    # 14 s of warm-up later (the join window long closed) its workers wait: grow at once.
    s = s.with_member(dataclasses.replace(warming, warming_since=0.0, not_before=0.0), at=T0 + 15)
    d = decide(s, T0 + 15, S)
    [plan] = of(d.actions, WritePlan)
    assert plan.plan.cause == "grow" and plan.plan.nodes_after == ["n1", "n2", "n3"]
    [request] = of(d.actions, WriteCheckpointRequest)
    assert request.request.leaving == [] and "warming" not in d.reason  # a grow leaves nobody out


def test_the_record_of_a_lost_pods_agent_is_no_joiner_once_the_pod_is_made_again() -> None:
    """A node lost and restored: its pod is deleted and created again under the same name,
    while the dead agent's member record stands until its lease runs out. That record is
    older than the pod: no grow for it (the survivors would hold at the checkpoint for an
    agent that is not there). The new pod's agent registers afresh and is the joiner."""
    notes = annotations(2, 3)
    s = job(("n1", "n2"), notes=notes, round_=2).with_node(NodeInfo("n3")).with_pod(pod("n3", notes, created=T0 + 5))
    s = s.with_member(member("n3", 1, joined_at=T0 - 30), at=T0 + 5)  # the old agent's: round 1, when it died
    s, d = step(s, T0 + 20)
    assert not of(d.actions, WritePlan) and not of(d.actions, WriteCheckpointRequest), d.reason
    s = s.with_member(member("n3", 0, joined_at=T0 + 12), at=T0 + 21)  # the new pod's agent, registered afresh
    s, d = step(s, T0 + 40)
    assert len(of(d.actions, WritePlan)) == 1, d.reason
    [plan] = of(d.actions, WritePlan)
    assert plan.plan.cause == "grow" and plan.plan.nodes_after == ["n1", "n2", "n3"]


def test_grow_after_window_with_room_left_and_clamped_to_max() -> None:
    notes = annotations(1, 3, join_window="5s")
    s = job(("n1",), notes=notes)
    for i, node in enumerate(("n2", "n3", "n4")):
        s = s.with_node(NodeInfo(node)).with_pod(pod(node, notes)).with_member(member(node, 2), at=T0 + i)
    [plan] = of(decide(s, T0 + 5, S).actions, WritePlan)
    assert plan.plan.nodes_after == ["n1", "n2", "n3"]


def test_world_above_max_shrinks_to_max() -> None:
    s = job(("n1", "n2", "n3"), notes=annotations(1, 2))
    [plan] = of(decide(s, T0, S).actions, WritePlan)
    assert plan.plan.cause == "manual" and plan.plan.nodes_after == ["n1", "n2"]


def test_below_min_stalls_loudly_and_recovers_when_capacity_returns() -> None:
    s = job(("n1", "n2"), notes=annotations(2, 4))
    s = s.without_member("n2")
    d = decide(s, T0, S)
    assert not of(d.actions, WritePlan) and d.alerts.stalled
    assert [e.reason for e in of(d.actions, PostEvent)] == ["JobStalled"]
    [status] = of(d.actions, WriteStatus)
    assert status.status.state == "stalled"
    # A new node arrives: survivors + joiner reach min, the job re-forms.
    s = s.with_node(NodeInfo("n5")).with_pod(pod("n5")).with_member(member("n5", 2))
    d = decide(s, T0 + 30, S)
    [plan] = of(d.actions, WritePlan)
    assert plan.plan.nodes_after == ["n1", "n5"] and not d.alerts.stalled


def test_restart_storm_cordons_once_deletes_the_pod_and_reforms() -> None:
    s = job(("n1", "n2", "n3"), hosting=20, restarts={"n2": (T0 - 50, T0 - 20, T0 - 1), "n1": (T0 - 5,)})
    d = decide(s, T0, S)
    assert [c.node for c in of(d.actions, Cordon)] == ["n2"]
    assert [p.name for p in of(d.actions, DeletePod)] == ["llama-n2"]
    [plan] = of(d.actions, WritePlan)
    assert plan.plan.cause == "restart-storm" and plan.plan.nodes_after == ["n1", "n3"]
    # Once the node carries the cordon, no second cordon.
    cordon = (Taint(S.cordon.taint_key),)
    s2 = applied(s, d.actions, T0).with_node(NodeInfo("n2", taints=cordon, unschedulable=True))
    assert s2.fleet.cordoned == {"n2"} and not of(decide(s2, T0 + 1, S).actions, Cordon)


def test_restart_storms_outside_the_window_are_ignored() -> None:
    s = job(restarts={"n2": (T0 - 700, T0 - 650, T0 - 1)})
    assert not of(decide(s, T0, S).actions, Cordon)


def test_cordon_budget_is_honoured() -> None:
    s = job(("n1", "n2", "n3"), hosting=10, cordoned=["elsewhere"], restarts={"n2": (T0 - 3, T0 - 2, T0 - 1)})
    d = decide(s, T0, S)
    assert not of(d.actions, Cordon) and not of(d.actions, DeletePod) and not of(d.actions, WritePlan)
    assert [e.reason for e in of(d.actions, PostEvent)] == ["CordonBudgetExhausted"]


def test_signals_during_a_reform_are_folded_into_the_next_decision() -> None:
    s = with_taint(job(("n1", "n2", "n3", "n4")), "n4", "karpenter.sh/disrupted")
    s, _ = step(s, T0)
    g = s.plan.generation
    s = with_taint(s, "n3", "karpenter.sh/disrupted")
    s, d = step(s, T0 + 1)
    assert not of(d.actions, WritePlan) and not of(d.actions, WriteCheckpointRequest)
    s, d = step(acked(s, g, 120), T0 + 2)
    assert of(d.actions, WriteExpected)[0].expected.nodes == ["n1", "n2", "n3"]
    # The round forms and the trainer resumes; the plan finishes, then n3's notice starts the next one.
    s, d = step(s.with_members(member(n, 2) for n in ("n1", "n2", "n3")), T0 + 3)
    assert s.plan.phase == "resume" and s.plan.round_after == 2
    s = s.with_progress(Progress(step=51, loss=1.0, samples_seen=0, world_size=6, time=T0 + 4, resumed_from_step=120,
                                 last_step=120), 99)
    s, d = step(s, T0 + 4)
    assert s.plan.phase == "done" and s.plan.outcome == "completed" and s.plan.lost_steps == 0
    s, d = step(s, T0 + 5)
    assert s.plan.generation == g + 1 and s.plan.nodes_after == ["n1", "n2"] and s.plan.phase == "checkpoint"


def test_lost_steps_count_from_the_trainers_last_step_before_to_the_resumed_step() -> None:
    """The controller saw step 230 when it asked; the trainers had completed 235 by the time
    the world broke, and say so: 35 lost, not 30 (the controller's view is a publishing
    interval behind)."""
    s = job(step=230).without_member("n3")
    s, _ = step(s, T0)
    assert s.plan.step_before == 230
    s, _ = step(s.with_members(member(n, 2) for n in ("n1", "n2")), T0 + 1)
    s = s.with_progress(Progress(step=201, loss=1.0, samples_seen=0, world_size=4, time=T0 + 2, resumed_from_step=200,
                                 last_step=235), 50)
    s, _ = step(s, T0 + 2)
    assert s.plan.outcome == "completed" and s.plan.lost_steps == 35


def test_lost_steps_are_unknown_when_the_trainers_do_not_say() -> None:
    """No ``last_step`` from the trainers (none of them knew a step before this world): -1,
    never the controller's own stale view of their progress."""
    s, _ = step(job(step=230).without_member("n3"), T0)
    s, _ = step(s.with_members(member(n, 2) for n in ("n1", "n2")), T0 + 1)
    s = s.with_progress(Progress(step=201, loss=1.0, samples_seen=0, world_size=4, time=T0 + 2, resumed_from_step=200), 50)
    s, d = step(s, T0 + 2)
    assert s.plan.outcome == "completed" and s.plan.lost_steps == -1
    [resized] = [a for a in d.actions if getattr(a, "reason", None) == "Resized"]
    assert "steps lost unknown" in resized.message


def _resuming_after_a_loss() -> Scene:
    """n3 lost at step 230; the round without it formed: the plan waits for the resume."""
    s, _ = step(job(step=230).without_member("n3"), T0)
    s, _ = step(s.with_members(member(n, 2) for n in ("n1", "n2")), T0 + 1)
    return s


def test_the_completed_plan_keeps_how_the_trainer_resumed() -> None:
    s = _resuming_after_a_loss()
    assert s.plan.phase == "resume" and (s.plan.mode, s.plan.resume_phases) == ("", {})
    phases = {"process_group": 0.4, "reshard": 1.5, "first_step": 0.3}
    s = s.with_progress(Progress(step=231, loss=1.0, samples_seen=0, world_size=4, time=T0 + 3, resumed_from_step=230,
                                 round=2, reform_mode="in-place", resume_phases=phases), 50)  # fmt: skip
    s, _ = step(s, T0 + 3)
    assert s.plan.outcome == "completed" and s.plan.mode == "in-place" and s.plan.resume_phases == phases


def test_a_plan_that_times_out_says_nothing_of_how_the_trainer_resumed() -> None:
    s = _resuming_after_a_loss()
    # Progress from the old world (six ranks) is not the resume, whatever mode it carries.
    s = s.with_progress(Progress(step=231, loss=1.0, samples_seen=0, world_size=6, time=T0 + 3, reform_mode="restart",
                                 resume_phases={"startup": 3.0}), 50)  # fmt: skip
    s, _ = step(s, T0 + 1 + S.reform.resume_timeout.total_seconds())
    assert s.plan.outcome == "timeout" and (s.plan.mode, s.plan.resume_phases) == ("", {})


def test_a_target_lost_during_rendezvous_supersedes_the_plan_and_the_same_decision_goes_on() -> None:
    s, _ = step(job(("n1", "n2", "n3")).without_member("n3"), T0)
    s, d = step(s.without_member("n2"), T0 + 1)
    assert s.plan.outcome == "superseded" and s.plan.why == "n2 lost during the rendezvous"
    # Decided afresh in the same decision: one node is left, below min, so the job stalls
    # (no new plan, and nothing to look at again at once).
    assert len(of(d.actions, WritePlan)) == 1 and s.status.state == "stalled"
    assert d.reason.endswith("then stalled: lost n2 (member lease expired), n3 (member lease expired): "
                             "1 nodes left, below min 2")
    assert d.requeue_after != timedelta(0)


def test_rendezvous_timeout_finishes_the_plan_and_starts_the_next_after_it() -> None:
    s, _ = step(job().without_member("n3"), T0)
    generation = s.plan.generation
    s, d = step(s, T0 + S.reform.rendezvous_timeout.total_seconds())
    ended, started = of(d.actions, WritePlan)
    assert ended.plan.outcome == "timeout" and ended.finished and ended.expected_revision == s.plan_revision - 2
    # The next plan is written against the revision the ended one leaves.
    assert started.expected_revision == AFTER_PREVIOUS_PLAN and not started.finished
    assert (s.plan.generation, s.plan.phase, s.plan.nodes_after) == (generation + 1, "rendezvous", ["n1", "n2"])


def test_controller_presence_is_written_when_missing() -> None:
    from regroup.controller.snapshot import WritePresence

    s = job()
    assert of(decide(s, T0, S).actions, WritePresence)
    s = applied(s, decide(s, T0, S).actions, T0)
    assert not of(decide(s, T0, S).actions, WritePresence)


def test_rendezvous_pod_on_gpu_node_raises_the_seed_alert() -> None:
    etcd_pod = dataclasses.replace(pod("n1"), name="llama-etcd", labels={"regroup.dev/role": "rendezvous"}, annotations={})
    s = job().with_pod(etcd_pod).with_node(NodeInfo("n1", gpus=8))
    d = decide(s, T0, S)
    assert d.alerts.rendezvous_on_gpu
    assert [e.reason for e in of(d.actions, PostEvent)] == ["RendezvousOnGPUNode"]


def test_rendezvous_flapping_alert() -> None:
    # Rounds that give way before a training step in them (tests/controller/test_flapping.py).
    s = job()
    for number, at in enumerate((T0 - 100, T0 - 80, T0 - 50, T0 - 30, T0 - 10), start=2):
        s = s.round_formed(number, ("n1", "n2", "n3"), at=at)
    assert list(s.untrained_round_times) == [T0 - 80, T0 - 50, T0 - 30, T0 - 10]
    d = decide(s, T0, S)
    assert d.alerts.flapping and [e.reason for e in of(d.actions, PostEvent)] == ["RendezvousFlapping"]
    assert not decide(s, T0 + 1000, S).alerts.flapping


def test_a_restarted_agent_in_the_round_is_a_lost_node_but_a_lagging_member_is_not() -> None:
    s = job().round_formed(2, ("n1", "n2", "n3"))
    # Members still report round 1 after round 2 formed: they are lagging, not lost.
    assert not of(decide(s, T0, S).actions, WritePlan)
    restarted = dataclasses.replace(s.members["n3"], joined_at=T0 - 5.0, round=0)
    d = decide(s.with_member(restarted), T0, S)
    [plan] = of(d.actions, WritePlan)
    assert plan.plan.cause == "node-lost" and "restarted" in plan.plan.reason and plan.plan.nodes_after == ["n1", "n2"]


def test_the_rendezvous_round_record_completes_the_rendezvous_phase() -> None:
    s, _ = step(job().without_member("n3"), T0)
    assert s.plan.phase == "rendezvous"
    # Round 2 formed with exactly the expected nodes; members have not updated yet.
    s, _ = step(s.round_formed(2, ("n1", "n2")), T0 + 1)
    assert s.plan.phase == "resume" and s.plan.round_after == 2 and s.plan.rendezvous_done_at == T0 + 1


def test_a_status_whose_nodes_alone_change_is_rewritten_at_most_once_a_second() -> None:
    s, d = step(job(("n1", "n2", "n3", "n4")).without_member("n4"), T0)
    assert s.status.state == "reforming" and s.status.nodes == ["n1", "n2", "n3"]
    # Another node lost 0.3 s later: the job is still re-forming, only its nodes moved.
    s, d = step(s.without_member("n3"), T0 + 0.3)
    assert not of(d.actions, WriteStatus) and s.status.nodes == ["n1", "n2", "n3"]
    assert d.requeue_after is not None and d.requeue_after <= timedelta(seconds=0.7)
    # The decision that the requeue brings writes the nodes as they are then.
    s, d = step(s, T0 + 1.0)
    [write] = of(d.actions, WriteStatus)
    assert write.status.nodes == ["n1", "n2"] and write.status.state == "reforming"
    # A change of state is written at once, whenever the last write was: one node left is
    # below the job's min.
    s, d = step(s.without_member("n2"), T0 + 1.1)
    [write] = of(d.actions, WriteStatus)
    assert write.status.state == "stalled" and write.status.nodes == ["n1"]


def test_a_rendezvous_reason_names_a_few_of_the_nodes_it_waits_for() -> None:
    s, _ = step(job([f"n{i}" for i in range(1, 7)], annotations(2, 8)).without_member("n6"), T0)
    s, d = step(s, T0 + 1)
    assert d.reason == f"re-form {s.plan.generation}: waiting for 5 nodes (n1, n2, n3, ...) to join the new round"
    s, d = step(s.with_members(member(n, 2) for n in ("n1", "n2", "n3")), T0 + 2)
    assert d.reason.endswith("waiting for n4, n5 to join the new round")
