"""The model's bookkeeping, annotation parsing, the signal table and the work queue."""

from __future__ import annotations

import dataclasses

import asyncio
from datetime import timedelta

import pytest

from regroup.controller.cluster import NodeInfo, PodDisruption, Taint
from regroup.controller.jobconfig import parse_duration, parse_pod_config, resolve_job_config
from regroup.controller.model import ClusterModel
from regroup.controller.settings import (
    ControllerSettings,
    CordonSettings,
    JobDefaults,
    KubeSettings,
    RuntimeSettings,
)
from regroup.controller.signals import (
    AKS_NOTICE,
    AWS_NOTICE,
    GKE_NOTICE,
    RECLAIM_SIGNALS,
    member_seen_key,
    node_verdict,
    signal_key,
)
from regroup.controller.workqueue import WorkQueue
from regroup.keys import JobKeys

from .builders import JOB, NS, T0, annotations, member, pod

KEYS = JobKeys(NS, JOB)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def model() -> tuple[ClusterModel, Clock, list]:
    clock, dirty = Clock(), []
    m = ClusterModel(clock, dirty.append)
    m.nodes_listed([NodeInfo(n) for n in ("n1", "n2", "n3", "n4")])
    m.pods_listed([pod(n) for n in ("n1", "n2", "n3")])
    m.etcd_resynced([(KEYS.member(n), member(n, 1).to_json(), 5) for n in ("n1", "n2", "n3")])
    return m, clock, dirty


def test_world_round_moves_only_when_a_member_of_the_round_moves() -> None:
    m, clock, _ = model()
    snap = m.snapshot((NS, JOB))
    assert snap.world_round == 1 and snap.world_seen == {"n1", "n2", "n3"}
    # A joiner announcing round 2 does not move the world.
    clock.now += 1
    m.etcd_put(KEYS.member("n4"), member("n4", 2).to_json(), 6)
    snap = m.snapshot((NS, JOB))
    assert snap.world_round == 1 and "n4" not in snap.world_seen
    assert snap.first_seen[member_seen_key("n4", 0.0, 2)] == T0 + 1
    # A survivor moving to round 2 does; the vanished member stays in the old round's view.
    m.etcd_delete(KEYS.member("n3"), 7)
    m.etcd_put(KEYS.member("n1"), member("n1", 2).to_json(), 8)
    snap = m.snapshot((NS, JOB))
    assert snap.world_round == 2 and snap.world_seen == {"n1", "n4"} and list(snap.round_times) == [T0 + 1]


def test_restarts_count_from_member_records_and_pod_restart_counts() -> None:
    m, clock, dirty = model()
    clock.now += 5
    m.etcd_put(KEYS.member("n2"), member("n2", 1, restarts=2).to_json(), 9)
    m.pod_changed(pod("n2", restart_count=1))
    assert list(m.snapshot((NS, JOB)).restarts["n2"]) == [T0 + 5] * 3
    # A pod first seen with restarts does not count its past.
    m.pod_changed(pod("n4", restart_count=7))
    assert "n4" not in m.snapshot((NS, JOB)).restarts
    assert (NS, JOB) in dirty


def test_only_the_restart_that_makes_a_storm_wakes_a_decision() -> None:
    m, clock, dirty = model()
    m.snapshot((NS, JOB))  # a decision resolved the job's config: K = 3 restarts within 10 minutes
    dirty.clear()
    clock.now += 5
    m.pod_changed(pod("n2", restart_count=1))
    m.etcd_put(KEYS.member("n2"), member("n2", 1, restarts=1).to_json(), 9)
    assert dirty == [] and list(m.snapshot((NS, JOB)).restarts["n2"]) == [T0 + 5] * 2
    # The third restart within the window is a storm: the rule must see it.
    m.etcd_put(KEYS.member("n2"), member("n2", 1, restarts=2).to_json(), 10)
    assert dirty == [(NS, JOB)]
    # Later restarts of the crash-looping node keep it in the storm: they wake no one, and
    # the storm rule still counts them.
    dirty.clear()
    clock.now += 5
    m.pod_changed(pod("n2", restart_count=3))
    m.etcd_put(KEYS.member("n2"), member("n2", 1, restarts=3).to_json(), 11)
    assert dirty == [] and m.snapshot((NS, JOB)).storm_marks["n2"] == T0 + 10
    # Once its window has passed, the next restart starts counting afresh.
    clock.now += 700
    m.pod_changed(pod("n2", restart_count=4))
    assert dirty == []
    # Anything besides the count still wakes the job, below the threshold, in a storm or not.
    m.pod_changed(pod("n2", restart_count=4, deleting=True))
    m.pod_changed(pod("n3", restart_count=1, deleting=True))
    assert dirty == [(NS, JOB), (NS, JOB)]


def test_signals_are_stamped_when_first_seen_and_forgotten_when_gone() -> None:
    m, clock, _ = model()
    clock.now += 3
    m.node_changed(NodeInfo("n1", taints=(Taint("karpenter.sh/disrupted"),)))
    clock.now += 3
    m.node_changed(NodeInfo("n1", taints=(Taint("karpenter.sh/disrupted"),), labels={"x": "1"}))
    assert m.snapshot((NS, JOB)).first_seen[signal_key("n1", "taint:karpenter.sh/disrupted")] == T0 + 3
    m.node_changed(NodeInfo("n1"))
    assert signal_key("n1", "taint:karpenter.sh/disrupted") not in m.snapshot((NS, JOB)).first_seen
    m.node_deleted("n2")
    assert m.snapshot((NS, JOB)).verdicts["n2"].lost == "node deleted"


def test_a_full_relist_forgets_what_is_gone() -> None:
    m, _, _ = model()
    m.pods_listed([pod("n1")])
    m.etcd_resynced([(KEYS.member("n1"), member("n1").to_json(), 10)])
    snap = m.snapshot((NS, JOB))
    assert [p.name for p in snap.pods] == ["llama-n1"] and set(snap.members) == {"n1"}


def test_durations() -> None:
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration("500ms") == timedelta(milliseconds=500)
    assert parse_duration("15") == timedelta(seconds=15)
    for bad in ("", "soon", "10 m", "1d", "m5"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_annotations_parse_with_defaults_and_name_every_problem() -> None:
    config = parse_pod_config(annotations(2, 8, join_window="0s", restart_storm="5/1h", reclaim_taints="a.io/x,b"), JobDefaults())
    assert config.min_nodes == 2 and config.join_window == timedelta(0) and config.storm_restarts == 5
    assert config.storm_window == timedelta(hours=1) and config.reclaim_taints == {"a.io/x", "b"}
    assert config.checkpoint_timeout == timedelta(seconds=120)
    problems = parse_pod_config({"regroup.dev/min-nodes": "x", "regroup.dev/checkpoint-timeout": "-1s"}, JobDefaults())
    assert {name for name, _ in problems} == {"regroup.dev/min-nodes", "regroup.dev/max-nodes", "regroup.dev/checkpoint-timeout"}


def test_newest_pod_wins_and_older_disagreeing_pods_are_named() -> None:
    old = pod("n1", annotations(1, 4), created=1.0)
    new = pod("n2", annotations(1, 2), created=2.0)
    resolved = resolve_job_config([old, new], JobDefaults())
    assert resolved.config.max_nodes == 2 and resolved.newest == new
    [problem] = resolved.problems
    assert problem.pod == old and problem.annotation == "regroup.dev/max-nodes" and problem.kind == "ConfigDisagreement"
    # A bad newest pod leaves the job alone even if older pods are fine.
    broken = pod("n3", annotations(3, 2), created=3.0)
    assert resolve_job_config([old, broken], JobDefaults()).config is None


def test_the_signal_table_names_every_source_and_notice() -> None:
    sources = {s.source for s in RECLAIM_SIGNALS}
    assert {"Kubernetes", "AWS node-termination-handler", "Karpenter", "cluster-autoscaler", "GKE node termination handler",
            "AKS"} <= sources
    notices = {s.key: s.notice for s in RECLAIM_SIGNALS}
    assert notices["aws-node-termination-handler/spot-itn"] == AWS_NOTICE == timedelta(minutes=2)
    assert notices["cloud.google.com/impending-node-termination"] == GKE_NOTICE == timedelta(seconds=30)
    assert notices["remediator.kubernetes.azure.com/unschedulable"] == AKS_NOTICE
    node = NodeInfo("n1", taints=(Taint("cloud.google.com/impending-node-termination", time_added=T0),))
    verdict = node_verdict(node, "n1", (), {}, T0 + 1)
    assert verdict.notice.ends_at == T0 + 30 and verdict.lost is None
    assert node_verdict(NodeInfo("n1", ready=None), "n1", (), {}, T0).lost == "node Ready=Unknown"
    assert node_verdict(NodeInfo("n1", taints=(Taint("my.io/bye"),)), "n1", {"my.io/bye"}, {}, T0).notice.source == \
        "regroup.dev/reclaim-taints"


def test_settings_name_the_bad_field() -> None:
    with pytest.raises(ValueError, match="JobDefaults.checkpoint_timeout"):
        JobDefaults(checkpoint_timeout=timedelta(0))
    with pytest.raises(ValueError, match="CordonSettings.budget_fraction"):
        CordonSettings(budget_fraction=2)
    with pytest.raises(ValueError, match="RuntimeSettings.workers"):
        RuntimeSettings(workers=0)
    with pytest.raises(ValueError, match="retry_period < renew_deadline < lease_duration"):
        KubeSettings(renew_deadline=timedelta(seconds=20))
    assert ControllerSettings().cordon.budget(35) == 3 and ControllerSettings().cordon.budget(4) == 1


async def test_work_queue_dedupes_and_never_hands_one_key_to_two_workers() -> None:
    q: WorkQueue[str] = WorkQueue(lambda: 0.0)
    q.add("a")
    q.add("a")
    q.add("b")
    assert len(q) == 2
    key, _ = await q.get()
    assert key == "a"
    q.add("a")  # while a is being processed: once more afterwards, not concurrently
    assert len(q) == 1
    assert (await q.get())[0] == "b"
    q.done("b")
    q.done("a")
    assert (await q.get())[0] == "a"
    q.done("a")
    q.add_after("c", 0.01)
    assert (await asyncio.wait_for(q.get(), 1))[0] == "c"
    q.close()


def test_the_rendezvous_round_record_is_the_authority_on_the_current_round() -> None:
    import json as _json

    clock, dirty = Clock(), []
    m = ClusterModel(clock, dirty.append)
    m.nodes_listed([NodeInfo(n) for n in ("n1", "n2")])
    m.pods_listed([pod("n1"), pod("n2")])
    # One node in round 5, one freshly registered agent (round 0): a tie the members alone cannot break.
    state = _json.dumps({"v": 1, "kind": "rdzv-state", "round": 5, "nodes": ["n1"], "min_nodes": 1, "max_nodes": 4})
    m.etcd_resynced([(KEYS.member("n1"), member("n1", 5).to_json(), 3), (KEYS.member("n2"), member("n2", 0).to_json(), 4),
                     (KEYS.rdzv + "state", state.encode(), 5)])
    snap = m.snapshot((NS, JOB))
    assert snap.world_round == 5 and snap.world_seen == {"n1"}
    clock.now += 2
    state6 = _json.dumps({"v": 1, "kind": "rdzv-state", "round": 6, "nodes": ["n1", "n2"], "min_nodes": 1, "max_nodes": 4,
                          "agents": ["n1@1700000000.25", "n2@1700000003.5"]})
    m.etcd_put(KEYS.rdzv + "state", state6.encode(), 6)
    snap = m.snapshot((NS, JOB))
    assert snap.world_round == 6 and snap.world_seen == {"n1", "n2"} and list(snap.round_times) == [T0 + 2]
    assert snap.world_agents == {"n1": 1700000000.25, "n2": 1700000003.5}
    assert not snap.finished
    closed = _json.dumps({"v": 1, "kind": "rdzv-state", "round": 6, "nodes": ["n1", "n2"], "min_nodes": 1,
                          "max_nodes": 4, "closed": True})
    m.etcd_put(KEYS.rdzv + "state", closed.encode(), 7)
    assert m.snapshot((NS, JOB)).finished, "a closed rendezvous is a finished job"


async def test_the_plan_is_compare_and_set_on_its_revision(etcd_client) -> None:
    from regroup.controller.etcd_mirror import OwnWrites
    from regroup.controller.reconciler import PlanConflict
    from regroup.controller.runtime import EtcdLeaseWriter

    own = OwnWrites()
    writer = EtcdLeaseWriter(etcd_client, own)
    first = await writer.compare_and_put(KEYS.plan, b"{}", 0)
    with pytest.raises(PlanConflict):
        await writer.compare_and_put(KEYS.plan, b"{}", 0)  # a stale replica: must not overwrite
    second = await writer.compare_and_put(KEYS.plan, b"{}", first)
    assert second > first and own.claim(second) and not own.claim(second)


async def test_a_checkpoint_request_is_withdrawn_only_as_it_was_seen(etcd_client) -> None:
    """The withdrawal is fenced on the request's revision and the plan's: a stale view deletes nothing."""
    from regroup.controller.etcd_mirror import OwnWrites
    from regroup.controller.reconciler import PlanConflict
    from regroup.controller.runtime import EtcdLeaseWriter

    own = OwnWrites()
    writer = EtcdLeaseWriter(etcd_client, own)
    plan = await writer.compare_and_put(KEYS.plan, b"{}", 0)
    request = await writer.put(KEYS.checkpoint, b"{}")
    with pytest.raises(PlanConflict):
        await writer.compare_and_delete(KEYS.checkpoint, request, (KEYS.plan, plan - 1))  # the plan moved on
    newer = await writer.put(KEYS.checkpoint, b"{}")
    with pytest.raises(PlanConflict):
        await writer.compare_and_delete(KEYS.checkpoint, request, (KEYS.plan, plan))  # a newer request
    assert await etcd_client.get(KEYS.checkpoint.encode()) is not None
    await writer.compare_and_delete(KEYS.checkpoint, newer, (KEYS.plan, plan))
    assert await etcd_client.get(KEYS.checkpoint.encode()) is None
    # The delete's revision is the controller's own: its watch event wakes no one.
    assert own.claim(newer + 1)


def test_node_changes_no_decision_reads_wake_no_job() -> None:
    m, _, dirty = model()
    dirty.clear()
    m.node_changed(NodeInfo("n1", labels={"heartbeat": "1"}))
    assert dirty == []
    m.node_changed(NodeInfo("n1", labels={"heartbeat": "1"}, ready=False))
    assert dirty == [(NS, JOB)]


def test_a_snapshot_is_the_frozen_dataclass_its_fields_say() -> None:
    """The builder fills the snapshot's dict directly (cheaper than the frozen __init__):
    it names every field, and the object stays read-only."""
    from regroup.controller.snapshot import JobSnapshot

    m, _, _ = model()
    s = m.snapshot((NS, JOB))
    assert set(vars(s)) == {f.name for f in dataclasses.fields(JobSnapshot)}
    assert JobSnapshot(**vars(s)) == s
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.plan = None  # type: ignore[misc]


def test_the_model_indexes_always_equal_a_fresh_computation() -> None:
    """Random churn of nodes, pods (restart-only updates included), members and rounds:
    every index the model keeps between decisions (suspects, resolved config, disrupted
    pods, members by pod, pods by node) equals what it would compute from scratch."""
    import random

    from regroup.controller.decide import decide
    from regroup.controller.snapshot import WritePlan
    from regroup.controller.signals import storm_mark
    from regroup.controller.suspects import job_suspects
    from regroup.records import RoundState

    def grouped(resolved):
        """The pods it groups, up to their restart counts (which nothing resolved reads)."""
        return {n: [dataclasses.replace(p, restart_count=0) for p in ps] for n, ps in resolved.workers_by_node.items()}

    rng = random.Random(23)
    settings = ControllerSettings()
    clock, dirty = Clock(), []
    m = ClusterModel(clock, dirty.append)
    names = [f"n{i}" for i in range(10)]
    m.nodes_listed([NodeInfo(n) for n in names])
    m.pods_listed([pod(n, annotations(2, 8)) for n in names[:7]])
    m.etcd_resynced([(KEYS.member(n), member(n, 1).to_json(), 1) for n in names[:7]])
    taints = ["karpenter.sh/disrupted", "node.kubernetes.io/unreachable", "other.io/irrelevant"]
    restarts: dict[str, int] = {}
    formed = 1
    for step in range(800):
        clock.now += rng.random()
        node = rng.choice(names)
        roll = rng.random()
        if roll < 0.25:
            # Mostly a container restart on an unchanged pod; sometimes its phase, deletion or disruption too.
            restarts[node] = restarts.get(node, 0) + 1
            changed = dataclasses.replace(pod(node, annotations(2, 8)), restart_count=restarts[node])
            if rng.random() < 0.2:
                disruption = PodDisruption("PreemptionByScheduler", None, 30.0) if rng.random() < 0.5 else None
                changed = dataclasses.replace(changed, phase=rng.choice(["Running", "Failed"]),
                                              deleting=rng.random() < 0.5, disruption=disruption)
            m.pod_changed(changed)
        elif roll < 0.33:
            # Now and then with another K of the restart-storm rule (the storm index follows it).
            notes = annotations(2, rng.choice([8, 9]), restart_storm=rng.choice(["3/10m", "3/10m", "2/10m"]))
            m.pod_changed(pod(node, notes, created=rng.random()))
        elif roll < 0.4:
            m.pod_deleted(NS, f"{JOB}-{node}")
            restarts.pop(node, None)
        elif roll < 0.6:
            record = dataclasses.replace(member(node, rng.choice([formed, formed, formed + 1]), restarts=rng.randrange(4)),
                                         pod=f"{JOB}-{rng.choice([node, node, rng.choice(names)])}")
            m.etcd_put(KEYS.member(node), record.to_json(), step + 2)
        elif roll < 0.7:
            m.etcd_delete(KEYS.member(node), step + 2)
        elif roll < 0.75:
            formed += 1
            agents = [f"{n}@{rng.choice([0.0, 1.0])}" for n in rng.sample(names, 4)]
            state_record = RoundState(min_nodes=2, max_nodes=9, round=formed, agents=agents)
            m.etcd_put(KEYS.root + "rdzv/state", state_record.to_json(), step + 2)
        elif roll < 0.85:
            m.node_changed(NodeInfo(node, taints=(Taint(rng.choice(taints)),) if rng.random() < 0.5 else ()))
        elif roll < 0.95:
            m.node_changed(NodeInfo(node, ready=rng.choice([True, False, None])))
        else:
            m.node_deleted(node)
        state = m.jobs[(NS, JOB)]
        snap = m.snapshot((NS, JOB))
        assert state.suspects == job_suspects(state, m.fleet), f"step {step}"
        fresh = resolve_job_config(snap.pods, settings.jobs)
        assert (snap.resolved.config, snap.resolved.newest and snap.resolved.newest.name) == (
            fresh.config, fresh.newest and fresh.newest.name), f"step {step}"
        assert [(p.pod.name, p.message) for p in snap.resolved.problems] == [
            (p.pod.name, p.message) for p in fresh.problems], f"step {step}"
        assert (grouped(snap.resolved), snap.resolved.rendezvous_pods) == (
            grouped(fresh), fresh.rendezvous_pods), f"step {step}"
        assert snap.disrupted == {p.name: p for p in snap.pods if p.disruption is not None or p.deleting}, f"step {step}"
        k = snap.resolved.config.storm_restarts if snap.resolved.config else 0
        marks = {n: mark for n, times in snap.restarts.items() if (mark := storm_mark(times, k)) is not None} if k else {}
        assert snap.storm_marks == marks, f"step {step}"
        by_pod: dict[str, set[str]] = {}
        for n, record in snap.members.items():
            by_pod.setdefault(record.pod, set()).add(n)
        assert state.member_pods == by_pod, f"step {step}"
        on_nodes: dict[str, set[tuple[str, str]]] = {}
        for p in snap.pods:
            on_nodes.setdefault(p.node, set()).add((p.namespace, p.name))
        assert m.fleet.node_pods == on_nodes and set(m.fleet.pod_job) == set().union(*on_nodes.values()), f"step {step}"
        for action in decide(snap, clock.now, settings).actions:
            if isinstance(action, WritePlan):
                m.etcd_put(KEYS.plan, action.plan, snap.plan_revision + 1)


def test_plan_and_status_records_roundtrip_and_encode_like_asdict() -> None:
    import dataclasses
    import json

    from regroup.records import SCHEMA_VERSION, JobStatus, Progress, ReformPlan

    def record_json(record):  # the reference encoding: a deep copy of every field
        body = {"v": SCHEMA_VERSION, "kind": record.kind, **dataclasses.asdict(record)}
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    plan = ReformPlan(generation=3, cause="reclaim", planned=True, phase="done", reason="r", nodes_before=["a", "b"],
                      nodes_after=["a"], trace_id="ab" * 16, detected_at=1.5, decided_at=2.5, mode="restart",
                      resume_phases={"startup": 4.0, "process_group": 0.5, "load": 2.0, "first_step": 0.25})
    status = JobStatus(state="stalled", reason="x", node_count=1, nodes=["a"], alerts=["rendezvous-flapping"])
    progress = Progress(step=7, loss=0.5, samples_seen=70, world_size=4, time=3.0, extra={"lr": [0.1, 0.2]})
    for record in (plan, status, progress):
        assert record.to_json() == record_json(record)
        assert type(record).from_json(record.to_json()) == record


def test_an_agent_coming_back_to_a_node_is_a_new_joiner_not_an_old_sighting() -> None:
    m, clock, _ = model()
    first = dataclasses.replace(member("n4", 0), joined_at=T0)
    m.etcd_put(KEYS.member("n4"), first.to_json(), 6)
    m.etcd_delete(KEYS.member("n4"), 7)
    clock.now += 100
    again = dataclasses.replace(member("n4", 0), joined_at=T0 + 100)
    m.etcd_put(KEYS.member("n4"), again.to_json(), 8)
    snap = m.snapshot((NS, JOB))
    # The join window of the returning agent starts when it registered, not 100 s ago.
    assert snap.first_seen[member_seen_key("n4", T0 + 100, 0)] == T0 + 100
