"""Re-forms that cannot finish end, loudly, and a leaving node stays out: pure decisions.

The failures these pin came from a leader change in the middle of a planned shrink: the
reclaimed node's pod was restarted on its still-tainted node and the agents, with no
leader present, let it back in; the new leader then read that round as its own and waited
for a trainer size that could never come.
"""

from __future__ import annotations

import dataclasses

from regroup.controller.cluster import NodeInfo
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import AFTER_PREVIOUS_PLAN, PostPodEvents, WriteCheckpointRequest, WriteExclusions, WritePlan

from regroup.records import Progress

from .builders import T0, acked, annotations, decide, job, member, of, pod, with_taint
from .builders import step as reconcile

S = ControllerSettings()
SPOT = "aws-node-termination-handler/spot-itn"


def step(s, now):
    return reconcile(s, now, S)


def _shrink_in_rendezvous():
    """n2 of n1..n3 under a spot notice; checkpoint acked; re-forming to n1, n3."""
    s = with_taint(job(), "n2", SPOT, time_added=T0)
    s, _ = step(s, T0 + 1)
    s, _ = step(acked(s, s.plan.generation, 120), T0 + 2)
    assert s.plan.phase == "rendezvous" and s.plan.nodes_after == ["n1", "n3"]
    return s


def _round(s, number: int, nodes: list[str]):
    """Round ``number`` formed with ``nodes``, whose members report it; no other member is left."""
    return s.round_formed(number, nodes).with_members(member(n, number) for n in nodes)


def test_a_round_of_other_nodes_than_planned_abandons_the_plan_and_decides_again() -> None:
    s = _shrink_in_rendezvous()
    generation = s.plan.generation
    # The reclaimed node came back before the planned round: round 2 has all three.
    s, d = step(_round(s, 2, ["n1", "n2", "n3"]), T0 + 3)
    ended, plan = of(d.actions, WritePlan)
    assert ended.plan.phase == "done" and ended.plan.outcome == "superseded"
    assert ended.plan.why == "round 2 formed with n1, n2, n3, not the planned n1, n3"
    [events] = [e for e in of(d.actions, PostPodEvents) if e.reason == "ReformAbandoned"]
    assert sorted(pod.name for pod in events.pods) == ["llama-n1", "llama-n2", "llama-n3"]
    assert events.type_ == "Warning" and "phase rendezvous" in events.message
    # Decided afresh in the same decision: n2 still carries its notice, so a new planned
    # shrink starts, written after the ended plan.
    assert plan.plan.generation == generation + 1 and plan.plan.phase == "checkpoint"
    assert plan.plan.nodes_after == ["n1", "n3"] and of(d.actions, WriteCheckpointRequest)
    assert d.actions.index(ended) < d.actions.index(plan) and plan.expected_revision == AFTER_PREVIOUS_PLAN
    assert s.plan == plan.plan and s.status.state == "reforming"


def test_the_planned_round_completes_the_rendezvous_phase_as_before() -> None:
    s = _shrink_in_rendezvous()
    s, d = step(_round(s, 2, ["n1", "n3"]), T0 + 3)
    assert s.plan.phase == "resume" and s.plan.round_after == 2
    assert not [e for e in of(d.actions, PostPodEvents) if e.reason == "ReformAbandoned"]


def test_a_newer_round_of_other_nodes_before_the_trainer_resumed_abandons_the_plan() -> None:
    s = _shrink_in_rendezvous()
    s, _ = step(_round(s, 2, ["n1", "n3"]), T0 + 3)
    # A round of the same nodes again (a rank restart) keeps waiting for the trainer ...
    s, d = step(_round(s, 3, ["n1", "n3"]), T0 + 4)
    assert s.plan.phase == "resume" and d.requeue_after is not None
    # ... one with other nodes cannot give the planned size: abandoned, not waited on.
    s, d = step(_round(s, 4, ["n1", "n2", "n3"]), T0 + 5)
    ended = of(d.actions, WritePlan)[0].plan
    assert ended.outcome == "superseded" and "before the trainer resumed" in ended.why


def test_every_phase_ends_by_its_deadline() -> None:
    s = with_taint(job(), "n2", SPOT, time_added=T0)
    s, _ = step(s, T0 + 1)
    deadline = s.plan.checkpoint_deadline
    s, d = step(s, deadline)  # no ack: unplanned fallback, never a wait past the deadline
    assert s.plan.phase == "rendezvous" and s.plan.fallback
    s, d = step(s, T0 + 1 + deadline - T0 + S.reform.rendezvous_timeout.total_seconds())
    ended = of(d.actions, WritePlan)[0].plan
    assert ended.outcome == "timeout" and ended.why == "expected members did not all join the new round"
    [events] = [e for e in of(d.actions, PostPodEvents) if e.reason == "ReformAbandoned"]
    assert len(events.pods) == 3


def test_a_leaving_node_is_excluded_until_its_taint_lifts() -> None:
    s = with_taint(job(), "n2", SPOT, time_added=T0)
    s, d = step(s, T0 + 1)
    [write] = of(d.actions, WriteExclusions)
    assert write.exclusions.nodes == {"n2": f"taint {SPOT} (AWS node-termination-handler)"}
    # Nothing new to write while it holds, even after n2 left the round and its member is gone,
    # or its node went NotReady with the taint still on.
    gone = _round(s, 2, ["n1", "n3"])
    assert not of(decide(gone, T0 + 5, S).actions, WriteExclusions)
    not_ready = gone.with_node(dataclasses.replace(gone.nodes["n2"], ready=False))
    assert not of(decide(not_ready, T0 + 6, S).actions, WriteExclusions)
    # The taint lifts: so does the exclusion.
    clean = gone.with_node(NodeInfo("n2"))
    [lifted] = of(decide(clean, T0 + 7, S).actions, WriteExclusions)
    assert lifted.exclusions.nodes == {}
    # A deleted node has nothing left to exclude.
    deleted = gone.without_node("n2")
    assert of(decide(deleted, T0 + 7, S).actions, WriteExclusions)[0].exclusions.nodes == {}


def test_a_restart_storm_node_is_excluded_with_its_cordon() -> None:
    storm = (T0 - 30, T0 - 20, T0 - 10)
    s = job(restarts={"n3": storm})
    d = decide(s, T0, S)
    [write] = of(d.actions, WriteExclusions)
    assert write.exclusions.nodes == {"n3": "restart storm"}


def test_a_closed_rendezvous_finishes_the_job_and_nothing_is_re_formed() -> None:
    # The agents closed the run (training ended); then their members vanish one by one.
    s = _shrink_in_rendezvous().closed()
    s, d = step(s, T0 + 3)
    assert s.plan.outcome == "superseded" and s.plan.why == "the job finished (its rendezvous is closed)"
    assert s.status.state == "finished"
    gone = s.without_member("n2", "n3")
    assert not of(decide(gone, T0 + 4, S).actions, WritePlan)


def _joiners_waiting(progress_round: int):
    """n1, n2 in round 3 (the job's round), n3 and n4 waiting to join; the trainer's last
    progress came from ``progress_round``."""
    notes = annotations(2, 4, join_window="1s")
    s = job(("n1", "n2"), notes=notes, round_=3)
    s = s.with_progress(Progress(step=120, loss=1.0, samples_seen=960, world_size=4, time=T0, round=progress_round), 11)
    for node in ("n3", "n4"):
        s = s.with_node(NodeInfo(node)).with_pod(pod(node, notes)).with_member(member(node, 4), at=T0)
    return s


def test_a_grow_asks_for_a_checkpoint_only_when_the_round_trains() -> None:
    # Seed 7, fault 31 of the chaos campaign: two grows each waited their whole checkpoint
    # deadline on a round that had formed but whose trainer never resumed (superseded).
    [training] = of(decide(_joiners_waiting(progress_round=3), T0 + 2, S).actions, WritePlan)
    assert training.plan.cause == "grow" and training.plan.planned
    [stuck] = of(decide(_joiners_waiting(progress_round=2), T0 + 2, S).actions, WritePlan)
    assert stuck.plan.cause == "grow" and not stuck.plan.planned, "nobody in round 3 would ack"
    assert stuck.plan.nodes_after == ["n1", "n2", "n3", "n4"]


def test_a_reclaim_on_a_round_whose_trainer_has_not_resumed_is_unplanned() -> None:
    s = with_taint(job(round_=3), "n2", SPOT, time_added=T0)
    s = s.with_progress(Progress(step=120, loss=1.0, samples_seen=960, world_size=6, time=T0, round=2), 11)
    [plan] = of(decide(s, T0 + 0.5, S).actions, WritePlan)
    assert plan.plan.cause == "reclaim" and not plan.plan.planned and plan.plan.nodes_after == ["n1", "n3"]
    assert not of(decide(s, T0 + 0.5, S).actions, WriteCheckpointRequest)
