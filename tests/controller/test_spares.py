"""Spare nodes: a waiting node replaces a lost or leaving one before the job shrinks, in
exactly its position in the round; the plan says how (``strategy``, ``replaced``), the
completion Event who took whose place, the status and the gauges how many spares wait."""

from __future__ import annotations

import dataclasses
import json

import pytest

from regroup.controller.cluster import NodeInfo
from regroup.controller.decide.positions import fill_positions
from regroup.controller.reform_summary import completion_event
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import (
    PostEvent,
    PostPodEvents,
    WriteCheckpointRequest,
    WriteExpected,
    WritePlan,
    WriteReform,
    WriteStatus,
)
from regroup.records import JobStatus, Progress, ReformPlan

from .builders import JOB, T0, Scene, acked, annotations, decide, job, member, of, pod, with_taint
from .builders import step as reconcile

S = ControllerSettings()

ORDER = ["n4", "n1", "n3", "n2"]
"""The round's rank order: not the names' order, so a test can tell positions from names."""


def step(s: Scene, now: float) -> tuple[Scene, object]:
    return reconcile(s, now, S)


def at_max(spares: tuple[str, ...] = ("n5",), **notes: str) -> Scene:
    """A job at its max of 4 nodes, round 1 formed in ``ORDER``, with ``spares`` waiting to
    join (registered, in no round yet), the first seen first."""
    config = annotations(2, 4, **notes)
    s = job(ORDER, notes=config).round_formed(1, ORDER, in_order=True)
    for i, node in enumerate(spares, start=1):
        s = s.with_node(NodeInfo(node), at=T0 + i).with_pod(pod(node, config), at=T0 + i)
        s = s.with_member(member(node, 0), at=T0 + i)
    return s.at(T0 + 5)


def resumed(s: Scene, order: list[str], round_: int, at: float, resumed_from: int = 98, last_step: int = 100) -> Scene:
    """The agents formed round ``round_`` in ``order`` (the nodes the plan left out went) and
    the trainer took its first step there, after ``last_step`` in the world before."""
    s = s.without_member(*(n for n in s.plan.nodes_before if n not in order))
    s = s.round_formed(round_, order, in_order=True, at=at)
    for node in order:
        s = s.with_member(member(node, round_), at=at)
    s, _ = step(s, at)
    assert s.plan.phase == "resume"
    progress = Progress(step=resumed_from + 1, loss=1.0, samples_seen=0, world_size=2 * len(order), time=at + 0.5,
                        resumed_from_step=resumed_from, last_step=last_step, round=round_)
    return s.at(at + 0.5).with_progress(progress, 50 + round_)


@pytest.mark.parametrize(
    ("vacated", "joiners", "max_nodes", "target", "replaced"),
    [
        ({"c"}, ["e"], 4, ["a", "b", "e", "d"], {"c": "e"}),
        ({"a"}, ["e"], 4, ["e", "b", "c", "d"], {"a": "e"}),
        ({"c"}, [], 4, ["a", "b", "d"], {}),
        ({"b", "c"}, ["e"], 4, ["a", "e", "d"], {"b": "e"}),
        ({"c"}, ["e", "f"], 4, ["a", "b", "e", "d"], {"c": "e"}),
        ({"c"}, ["e", "f"], 5, ["a", "b", "e", "d", "f"], {"c": "e"}),
        (set(), ["e"], 5, ["a", "b", "c", "d", "e"], {}),
        ({"d"}, [], 2, ["a", "b"], {}),
    ],
    ids=["middle", "first", "none-waiting", "two-lost-one-waiting", "room-for-one", "room-for-two", "grow", "above-max"],
)
def test_waiting_nodes_fill_vacated_positions_in_order_and_survivors_keep_theirs(
    vacated: set[str], joiners: list[str], max_nodes: int, target: list[str], replaced: dict[str, str]
) -> None:
    assert fill_positions(["a", "b", "c", "d"], vacated, joiners, max_nodes) == (target, replaced)


def test_a_loss_with_a_spare_is_one_unplanned_reform_at_the_same_size_with_the_spare_in_its_position() -> None:
    # No regroup.dev/spare-nodes: replacing before shrinking is the policy all the same.
    s = at_max().without_pod(f"{JOB}-n3")
    d = decide(s, T0 + 5, S)
    [write] = of(d.actions, WritePlan)
    plan = write.plan
    assert (plan.cause, plan.planned, plan.strategy, plan.replaced) == ("node-lost", False, "replace", {"n3": "n5"})
    assert plan.nodes_after == ["n4", "n1", "n5", "n2"]
    [expected] = of(d.actions, WriteExpected)
    assert expected.expected.nodes == ["n4", "n1", "n5", "n2"]  # the next round's rank order
    assert of(d.actions, WriteReform) and not of(d.actions, WriteCheckpointRequest)
    assert d.reason.startswith("unplanned re-form (node-lost, replace): lost n3 (") and d.reason.endswith(
        "; n5 takes n3's position"
    )


def test_a_loss_without_a_spare_shrinks_as_before_and_survivors_keep_their_order() -> None:
    s = at_max(spares=()).without_pod(f"{JOB}-n3")
    [write] = of(decide(s, T0 + 5, S).actions, WritePlan)
    assert (write.plan.strategy, write.plan.replaced, write.plan.nodes_after) == ("elastic", {}, ["n4", "n1", "n2"])


def test_two_losses_one_spare_fill_the_first_position_and_the_size_still_changes() -> None:
    s = at_max().without_pod(f"{JOB}-n4").without_pod(f"{JOB}-n3")
    [write] = of(decide(s, T0 + 5, S).actions, WritePlan)
    assert write.plan.nodes_after == ["n5", "n1", "n2"]
    assert (write.plan.strategy, write.plan.replaced) == ("elastic", {"n4": "n5"})


def test_a_reclaim_with_a_spare_checkpoints_first_and_migrates_the_leaving_position() -> None:
    s = with_taint(at_max(), "n3", "aws-node-termination-handler/spot-itn", time_added=T0 + 5, seen=T0 + 5)
    s, d = step(s, T0 + 5)
    plan = s.plan
    assert plan.phase == "checkpoint" and plan.planned and of(d.actions, WriteCheckpointRequest)
    assert not of(d.actions, WriteExpected) and not of(d.actions, WriteReform)
    assert (plan.strategy, plan.replaced, plan.nodes_after) == ("migrate", {"n3": "n5"}, ["n4", "n1", "n5", "n2"])
    assert d.reason.startswith("planned migrate (reclaim): n3 (")
    # The spare being brought in is no longer waiting: no spare is left.
    [status] = of(d.actions, WriteStatus)
    assert (status.status.spare_count, status.status.spares) == (0, [])
    # The ack: the next round is published with the spare in the leaving node's position.
    s, d = step(acked(s.at(T0 + 6), plan.generation, 120, acked_at=T0 + 6), T0 + 6)
    [expected] = of(d.actions, WriteExpected)
    assert expected.expected.nodes == ["n4", "n1", "n5", "n2"]
    assert (s.plan.phase, s.plan.planned, s.plan.strategy) == ("rendezvous", True, "migrate")


def test_a_migrate_that_falls_back_to_the_unplanned_path_is_a_replace() -> None:
    s = with_taint(at_max(), "n3", "aws-node-termination-handler/spot-itn", time_added=T0 + 5, seen=T0 + 5)
    s, _ = step(s, T0 + 5)
    s, d = step(s, s.plan.checkpoint_deadline)
    assert "deadline" in s.plan.fallback and not s.plan.planned
    assert (s.plan.strategy, s.plan.replaced, s.plan.nodes_after) == ("replace", {"n3": "n5"}, ["n4", "n1", "n5", "n2"])
    assert of(d.actions, WriteExpected)[0].expected.nodes == ["n4", "n1", "n5", "n2"]


def test_a_spare_lost_before_the_ack_fills_nothing_and_the_reclaim_shrinks() -> None:
    s = with_taint(at_max(), "n3", "aws-node-termination-handler/spot-itn", time_added=T0 + 5, seen=T0 + 5)
    s, _ = step(s, T0 + 5)
    s, d = step(s.without_pod(f"{JOB}-n5"), T0 + 6)
    assert "n5 lost before the checkpoint ack" in s.plan.fallback
    assert (s.plan.strategy, s.plan.replaced, s.plan.nodes_after) == ("elastic", {}, ["n4", "n1", "n2"])


def test_two_losses_in_a_row_take_two_spares_each_in_its_position_and_each_is_told() -> None:
    s = at_max(spares=("n5", "n6"), spare_nodes="2")
    s, d = step(s.without_pod(f"{JOB}-n3"), T0 + 5)
    assert (s.plan.replaced, s.plan.nodes_after) == ({"n3": "n5"}, ["n4", "n1", "n5", "n2"])
    assert (s.status.spares, s.status.spares_wanted) == (["n6"], 2)
    assert (d.spare_count, d.spares_wanted) == (1, 2)
    # The agents form round 2 in the published order; the trainer resumes from step 98.
    s = resumed(s, ["n4", "n1", "n5", "n2"], 2, T0 + 6)
    s, d = step(s, T0 + 7)
    assert (s.plan.outcome, s.plan.strategy) == ("completed", "replace")
    [told] = of(d.actions, PostPodEvents)
    assert (told.type_, told.reason) == ("Normal", "NodeReplaced")
    assert told.message == "n3 replaced by n5 at step 98, 2 steps lost, 1.5 s"
    assert {p.name for p in told.pods} == {f"{JOB}-{n}" for n in ("n1", "n2", "n4", "n5", "n6")}
    # The second loss: the next spare takes n1's position in round 2's order.
    s, d = step(s.without_pod(f"{JOB}-n1"), T0 + 10)
    assert (s.plan.strategy, s.plan.replaced) == ("replace", {"n1": "n6"})
    assert of(d.actions, WriteExpected)[0].expected.nodes == ["n4", "n6", "n5", "n2"]
    assert (s.status.spare_count, s.status.spares, d.spare_count) == (0, [], 0)


def test_a_returning_node_grows_a_job_below_max_at_the_end_of_the_round() -> None:
    notes = annotations(2, 5, join_window="5s", spare_nodes="1")
    s = job(["n3", "n1", "n2"], notes=notes).round_formed(1, ["n3", "n1", "n2"], in_order=True)
    s = s.with_node(NodeInfo("n4")).with_pod(pod("n4", notes)).with_member(member("n4", 0))
    d = decide(s, T0 + 1, S)
    assert not of(d.actions, WritePlan) and d.spare_count == 0  # gathered for a grow (room for 2): not a spare
    [write] = of(decide(s, T0 + 6, S).actions, WritePlan)
    assert (write.plan.cause, write.plan.strategy, write.plan.nodes_after) == ("grow", "elastic", ["n3", "n1", "n2", "n4"])


def test_a_node_waiting_at_max_is_a_spare_in_the_status_and_the_decision() -> None:
    s = at_max(spare_nodes="2")
    s, d = step(s, T0 + 5)
    assert not of(d.actions, WritePlan) and d.reason == "1 nodes waiting, job at max 4"
    assert s.status.state == "healthy" and s.status.node_count == 4
    assert (s.status.spare_count, s.status.spares, s.status.spares_wanted) == (1, ["n5"], 2)
    assert (d.node_count, d.spare_count, d.spares_wanted) == (4, 1, 2)
    # A second spare arrives: the status says so at once.
    s = s.with_node(NodeInfo("n6")).with_pod(pod("n6", annotations(2, 4, spare_nodes="2")))
    s, d = step(s.with_member(member("n6", 0)), T0 + 5.2)
    [write] = of(d.actions, WriteStatus)
    assert (write.status.spare_count, write.status.spares) == (2, ["n5", "n6"])
    # A waiting member on probation (its workers just failed) is no spare yet.
    s = s.with_member(dataclasses.replace(member("n6", 0), not_before=T0 + 60))
    s, d = step(s, T0 + 6.5)
    assert s.status.spares == ["n5"] and d.spare_count == 1


@pytest.mark.parametrize(
    ("value", "reason"),
    [("-1", "must be at least 0, got -1"), ("two", "not a whole number: 'two'"), ("1.5", "not a whole number: '1.5'")],
)
def test_a_bad_spare_nodes_annotation_leaves_the_job_alone_with_a_warning(value: str, reason: str) -> None:
    s = at_max(spare_nodes=value).without_pod(f"{JOB}-n3")
    d = decide(s, T0 + 5, S)
    assert not of(d.actions, WritePlan) and d.alerts.bad_config
    warnings = {(e.ref.name, e.type_, e.reason, e.message) for e in of(d.actions, PostEvent)}
    assert (f"{JOB}-n4", "Warning", "BadConfig", f"annotation regroup.dev/spare-nodes: {reason}") in warnings
    [status] = of(d.actions, WriteStatus)
    assert status.status.state == "bad-config" and status.status.spares_wanted == 0


def test_pods_disagreeing_on_spare_nodes_are_warned_and_the_newest_wins() -> None:
    s = at_max(spare_nodes="2").with_pod(pod("n1", annotations(2, 4, spare_nodes="1")))
    d = decide(s, T0 + 5, S)
    [event] = [e for e in of(d.actions, PostEvent) if e.reason == "ConfigDisagreement"]
    assert event.ref.name == f"{JOB}-n1" and event.type_ == "Warning"
    assert event.message.startswith("annotation regroup.dev/spare-nodes: '1' differs from newest pod ")
    assert d.spares_wanted == 2


def _done(strategy: str, replaced: dict[str, str], lost: int = 0, **kw: object) -> ReformPlan:
    return ReformPlan(
        generation=4, cause="reclaim" if strategy == "migrate" else "node-lost", planned=strategy == "migrate",
        phase="done", reason="", nodes_before=["n1", "n2", "n3", "n4"], nodes_after=["n1", "n5", "n3", "n6"],
        trace_id="0" * 32, detected_at=T0, decided_at=T0, resumed_at=T0 + 0.84, finished_at=T0 + 2,
        resumed_from_step=812, lost_steps=lost, outcome="completed", strategy=strategy, replaced=replaced, **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("plan", "event"),
    [
        (_done("replace", {"n3": "n5"}), ("NodeReplaced", "n3 replaced by n5 at step 812, 0 steps lost, 0.8 s")),
        (_done("migrate", {"n2": "n5"}), ("NodeMigrated", "n2 migrated to n5 at step 812, 0 steps lost, 0.8 s")),
        (_done("replace", {"n4": "n6", "n2": "n5"}, lost=1),
         ("NodeReplaced", "n2 replaced by n5, n4 replaced by n6 at step 812, 1 step lost, 0.8 s")),
        (_done("replace", {"n2": "n5"}, fallback="no checkpoint ack by the deadline"),
         ("NodeReplaced", "n2 replaced by n5 at step 812, 0 steps lost, 0.8 s, unplanned: no checkpoint ack by the deadline")),
        (_done("elastic", {}), ("Resized", "4 → 4 nodes: loss of n2, n4 (n5, n6 joined), 0 steps lost, 0.8 s")),
    ],
    ids=["replace", "migrate", "two", "fallback", "elastic"],
)
def test_the_completion_event_says_who_took_whose_place(plan: ReformPlan, event: tuple[str, str]) -> None:
    assert completion_event(plan) == event


def test_records_written_before_spares_read_as_elastic_with_no_spares() -> None:
    plan = _done("replace", {"n3": "n5"})
    body = {k: v for k, v in json.loads(plan.to_json()).items() if k not in ("strategy", "replaced")}
    old = ReformPlan.from_json(json.dumps(body))
    assert (old.strategy, old.replaced) == ("elastic", {})
    assert completion_event(old)[0] == "Resized"
    status = JobStatus.from_json('{"v": 1, "kind": "status", "state": "healthy", "reason": "", "node_count": 3}')
    assert (status.spare_count, status.spares, status.spares_wanted) == (0, [], 0)



# --- end to end: the controller on real etcd and the Kubernetes API stand-in --------------


async def test_a_spare_replaces_a_lost_node_end_to_end_and_status_metrics_and_the_trace_say_so(
    kube_api, kubeconfig, etcd_settings, etcd_client
) -> None:
    from regroup.controller.status import job_status, render
    from regroup.keys import JobKeys
    from regroup.records import ExpectedMembership, ReformRequest, RoundState

    from .harness import NS, Cluster, controller, notes, sample, until

    keys = JobKeys(NS, JOB)
    cluster = Cluster(kube_api, etcd_client)
    config = notes(2, 3, spare_nodes="1")
    order, joined = ["n3", "n1", "n2"], 1000.0
    for node in order:
        cluster.add_node(node)
        cluster.add_pod(JOB, node, config)
        await cluster.member(JOB, node, 1, joined_at=joined)
    await cluster.progress(JOB, 10, 6)

    async def round_formed(number: int, nodes: list[str]) -> None:
        state = RoundState(min_nodes=2, max_nodes=3, round=number, nodes=nodes,
                           agents=[f"{n}@{joined!r}" for n in nodes], formed_at=0.0)
        await etcd_client.put((keys.rdzv + "state").encode(), state.to_json())

    await round_formed(1, order)
    # The spare: its agent registered (workers warm), in no round yet.
    cluster.add_node("n4")
    cluster.add_pod(JOB, "n4", config)
    await cluster.member(JOB, "n4", 0, joined_at=joined)
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, spans):
        status = await cluster.wait_record(keys.status, JobStatus, lambda s: s.spare_count == 1)
        assert (status.node_count, status.spares, status.spares_wanted) == (3, ["n4"], 1)
        await until(lambda: sample(metrics, "regroup_spare_nodes", namespace=NS, job=JOB) == 1)
        assert sample(metrics, "regroup_spare_nodes_wanted", namespace=NS, job=JOB) == 1

        kube_api.delete("Pod", f"{JOB}-n1", namespace=NS)
        reform = await cluster.wait_record(keys.reform, ReformRequest)
        assert reform.cause == "node-lost"
        assert (await cluster.read(keys.expected, ExpectedMembership)).nodes == ["n3", "n4", "n2"]
        plan = await cluster.read(keys.plan, ReformPlan)
        assert (plan.strategy, plan.replaced, plan.planned) == ("replace", {"n1": "n4"}, False)
        # The agents form round 2 in that order; the trainer resumes from step 9.
        await cluster.drop_member(JOB, "n1")
        for node in ("n3", "n4", "n2"):
            await cluster.member(JOB, node, 2, joined_at=joined)
        await round_formed(2, ["n3", "n4", "n2"])
        await cluster.wait_record(keys.plan, ReformPlan, lambda p: p.phase == "resume")
        await cluster.progress(JOB, 10, 6, resumed_from=9, last_step=10, round=2)
        plan = await cluster.wait_record(keys.plan, ReformPlan, lambda p: p.phase == "done")
        assert plan.outcome == "completed" and plan.strategy == "replace"
        told = await kube_api.wait_for(lambda api: [e for e in api.events(NS) if e["reason"] == "NodeReplaced"])
        assert told[0]["type"] == "Normal"
        assert told[0]["message"].startswith("n1 replaced by n4 at step 9, 1 step lost, ")
        assert not [e for e in kube_api.events(NS) if e["reason"] == "Resized"]
        await until(lambda: sample(metrics, "regroup_node_replacements_total", namespace=NS, job=JOB,
                                   strategy="replace") == 1)
        status = await cluster.wait_record(keys.status, JobStatus, lambda s: s.state == "healthy")
        assert (status.node_count, status.spare_count, status.spares_wanted) == (3, 0, 1)
        await until(lambda: sample(metrics, "regroup_spare_nodes", namespace=NS, job=JOB) == 0)

    [root] = [s for s in spans.get_finished_spans() if s.name == "regroup.reform"]
    assert (root.attributes["regroup.strategy"], root.attributes["regroup.replaced"]) == ("replace", "n1->n4")
    assert root.attributes["regroup.node_count.before"] == root.attributes["regroup.node_count.after"] == 3
    report = await job_status(keys, etcd_settings)
    assert (report["active_nodes"], report["spare_nodes"], report["spares_wanted"]) == (3, 0, 1)
    last = report["last_reform"]
    assert (last["strategy"], last["replaced"], last["event"]) == ("replace", {"n1": "n4"}, "NodeReplaced")
    text = render(report).splitlines()
    assert "  spares: 0 (wanted 1)  - below wanted: the next loss shrinks the job" in text
    assert any(line.startswith("  last re-form: #1 node-lost (unplanned, replace) 3 -> 3 nodes, done") for line in text)
    assert "    NodeReplaced: " + last["summary"] in text


def test_a_replacement_completes_on_the_new_rounds_progress_not_the_old_worlds() -> None:
    """The world keeps its size, so the old world's progress is at the planned size too: a
    record of round 1 published after the plan must not complete it (it would say the job
    resumed from that world's step with every step since lost)."""
    s, _ = step(at_max().without_pod(f"{JOB}-n3"), T0 + 5)
    order = ["n4", "n1", "n5", "n2"]
    s = s.without_member("n3").round_formed(2, order, in_order=True, at=T0 + 6)
    for node in order:
        s = s.with_member(member(node, 2), at=T0 + 6)
    s, _ = step(s, T0 + 6)
    assert s.plan.phase == "resume"
    stale = Progress(step=130, loss=1.0, samples_seen=0, world_size=8, time=T0 + 6.2, resumed_from_step=0, round=1)
    s, _ = step(s.at(T0 + 6.2).with_progress(stale, 60), T0 + 6.2)
    assert s.plan.phase == "resume", "completed on the old world's progress"
    s = s.at(T0 + 6.5).with_progress(
        Progress(step=130, loss=1.0, samples_seen=0, world_size=8, time=T0 + 6.5, resumed_from_step=129,
                 last_step=129, round=2), 61,
    )
    s, _ = step(s, T0 + 6.5)
    assert (s.plan.outcome, s.plan.resumed_from_step, s.plan.lost_steps) == ("completed", 129, 0)
