"""Scenes for the pure decision tests: any moment, no I/O.

A ``Scene`` is what the controller has observed of one job, as a history of
observations at given times. Its snapshot is what ``ClusterModel`` makes of that history,
built by ``build_snapshot`` exactly as in production, so the derived fields (suspects,
resolved config, verdicts, disrupted pods) come from the model's own indexes. A scene is
a value: every change returns a new one, and the history is replayed into a fresh model
when its snapshot is asked for. Attributes of the snapshot read through the scene
(``scene.plan``, ``scene.members``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from regroup.controller.cluster import NodeInfo, PodDisruption, PodInfo, Taint
from regroup.controller.decide import decide as decide_on
from regroup.controller.model import ClusterModel
from regroup.controller.settings import ControllerSettings
from regroup.controller import snapshot as actions
from regroup.controller.snapshot import Action, Decision, JobSnapshot, WritePlan
from regroup.keys import JobKeys
from regroup.records import CheckpointAck, MemberRecord, Progress, Record, RoundState

NS, JOB = "team", "llama"
T0 = 1_700_000_000.0
KEYS = JobKeys(NS, JOB)
OTHER = JobKeys(NS, "other")
"""A second job, whose pods make nodes host regroup pods (the cordon budget counts them)."""

Observation = Callable[[ClusterModel], None]


def annotations(min_nodes: int = 2, max_nodes: int = 4, **extra: str) -> dict[str, str]:
    notes = {"regroup.dev/min-nodes": str(min_nodes), "regroup.dev/max-nodes": str(max_nodes)}
    notes.update({f"regroup.dev/{k.replace('_', '-')}": v for k, v in extra.items()})
    return notes


def pod(node: str, notes: Mapping[str, str] | None = None, created: float = 0.0, **kw: Any) -> PodInfo:
    return PodInfo(
        namespace=NS,
        name=f"{JOB}-{node}",
        uid=f"uid-{node}",
        job=JOB,
        node=node,
        annotations=dict(notes if notes is not None else annotations()),
        created_at=created,
        **kw,
    )


def member(node: str, round_: int = 1, restarts: int = 0, lws: int = 2, joined_at: float = 0.0) -> MemberRecord:
    return MemberRecord(
        node=node, pod=f"{JOB}-{node}", namespace=NS, round=round_, local_world_size=lws, restart_count=restarts,
        joined_at=joined_at,
    )


@dataclasses.dataclass(frozen=True)
class Scene:
    """One job's observed history; ``now`` is when the next observation is made."""

    history: tuple[tuple[float, Observation], ...] = ()
    now: float = T0

    @functools.cached_property
    def snapshot(self) -> JobSnapshot:
        """What the model makes of the history."""
        clock = [T0]
        model = ClusterModel(lambda: clock[0], lambda job: None)
        for at, observe in self.history:
            clock[0] = at
            observe(model)
        return model.snapshot((NS, JOB))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "snapshot":
            raise AttributeError(name)
        return getattr(self.snapshot, name)

    def at(self, now: float) -> Scene:
        """The same history; later observations are made at ``now``."""
        return dataclasses.replace(self, now=now)

    def then(self, observe: Observation, at: float | None = None) -> Scene:
        """``observe`` made at ``at`` (default: the scene's ``now``)."""
        return dataclasses.replace(self, history=(*self.history, (self.now if at is None else at, observe)))

    # --- Kubernetes --------------------------------------------------------------------

    def with_node(self, info: NodeInfo, at: float | None = None) -> Scene:
        return self.then(lambda m: m.node_changed(info), at)

    def without_node(self, node: str) -> Scene:
        return self.then(lambda m: m.node_deleted(node))

    def with_pod(self, info: PodInfo, at: float | None = None) -> Scene:
        return self.then(lambda m: m.pod_changed(info), at)

    def without_pod(self, name: str) -> Scene:
        return self.then(lambda m: m.pod_deleted(NS, name))

    def changed_pod(self, node: str, at: float | None = None, **fields: Any) -> Scene:
        """The job's pod on ``node`` with ``fields`` changed."""
        return self.then(lambda m: m.pod_changed(dataclasses.replace(m.jobs[(NS, JOB)].pods[f"{JOB}-{node}"], **fields)), at)

    # --- etcd --------------------------------------------------------------------------

    def with_member(self, record: MemberRecord, at: float | None = None) -> Scene:
        return self.then(lambda m: m.etcd_put(KEYS.member(record.node), record.to_json(), 1), at)

    def without_member(self, *nodes: str) -> Scene:
        scene = self
        for node in nodes:
            scene = scene.then(functools.partial(_delete, KEYS.member(node)))
        return scene

    def with_members(self, records: Iterable[MemberRecord]) -> Scene:
        """Exactly these members: the others' leases expired."""
        records = list(records)
        scene = self.without_member(*(n for n in self.members if n not in {r.node for r in records}))
        for record in records:
            scene = scene.with_member(record)
        return scene

    def round_formed(self, number: int, nodes: Iterable[str], agents: Mapping[str, float] | None = None,
                     closed: bool = False, at: float | None = None, formed_at: float = 0.0,
                     in_order: bool = False) -> Scene:
        """The rendezvous wrote ``rdzv/state``: round ``number`` formed with ``nodes`` (at
        ``formed_at`` by its own clock), seen at ``at``; ``in_order``: ``nodes`` is the
        round's rank order (else the record lists them by name)."""
        nodes = list(nodes) if in_order else sorted(nodes)
        agents = {n: 0.0 for n in nodes} if agents is None else agents
        record = RoundState(min_nodes=1, max_nodes=len(nodes) or 1, round=number, nodes=nodes,
                            agents=[f"{n}@{t!r}" for n, t in agents.items()], closed=closed, formed_at=formed_at)
        return self.with_record(KEYS.rdzv + "state", record, at=at)

    def closed(self) -> Scene:
        """The agents closed the rendezvous: the job is over."""
        return self.round_formed(self.world_round, self.world_seen, self.world_agents, closed=True)

    def with_progress(self, progress: Progress, revision: int) -> Scene:
        return self.then(lambda m: m.etcd_put(KEYS.progress, progress.to_json(), revision))

    def with_record(self, key: str, record: Record, revision: int = 1, at: float | None = None) -> Scene:
        return self.then(lambda m: m.etcd_put(key, record.to_json(), revision), at)


def _delete(key: str, m: ClusterModel) -> None:
    m.etcd_delete(key, 1)


def job(
    nodes: Iterable[str] = ("n1", "n2", "n3"),
    notes: Mapping[str, str] | None = None,
    round_: int = 1,
    step: int | None = 100,
    hosting: int = 0,
    cordoned: Iterable[str] = (),
    restarts: Mapping[str, Iterable[float]] | None = None,
) -> Scene:
    """A steady job seen at ``T0``: one pod and one member per node, all in ``round_``,
    trainer at ``step``. ``hosting``: nodes hosting regroup pods in all (other jobs' pods
    fill the rest); ``cordoned``: nodes elsewhere carrying the restart-storm cordon;
    ``restarts``: rank restarts seen on a node at those times."""
    names = list(nodes)
    others = [f"other-{i}" for i in range(max(0, hosting - len(names)))]
    fleet = [NodeInfo(n) for n in names + others]
    fleet += [NodeInfo(n, taints=(Taint("regroup.dev/restart-storm"),), unschedulable=True) for n in cordoned]
    pods = [pod(n, notes) for n in names] + [dataclasses.replace(pod(n), name=f"other-{n}", job="other") for n in others]
    items = [(KEYS.member(n), member(n, round_).to_json(), 1) for n in names]
    if step is not None:
        progress = Progress(step=step, loss=1.0, samples_seen=step * 8, world_size=2 * len(names), time=T0)
        items.append((KEYS.progress, progress.to_json(), 10))

    def observe(m: ClusterModel) -> None:
        m.nodes_listed(fleet)
        m.pods_listed(pods)
        m.etcd_resynced(items)

    scene = Scene().then(observe)
    for node, times in (restarts or {}).items():
        for count, at in enumerate(times, start=1):
            scene = scene.with_member(member(node, round_, restarts=count), at=at)
    return scene


def registered(s: Scene, joined_at: float) -> Scene:
    """The job's agents all registered at ``joined_at``: their member records say so, and the
    rendezvous' record of their round names them."""
    s = s.with_members(dataclasses.replace(m, joined_at=joined_at) for m in s.members.values())
    return s.round_formed(s.world_round, s.world_seen, agents={n: joined_at for n in s.world_seen})


def with_taint(s: Scene, node: str, key: str, value: str = "", seen: float = T0, time_added: float | None = None) -> Scene:
    """``node`` gets taint ``key``, first seen at ``seen``."""
    taint = Taint(key, value, "NoSchedule", time_added)
    return s.then(lambda m: m.node_changed(dataclasses.replace(m.nodes[node], taints=(*m.nodes[node].taints, taint))), seen)


def with_disruption(
    s: Scene,
    node: str,
    reason: str = "PreemptionByScheduler",
    since: float | None = T0,
    grace: float = 30.0,
    seen: float = T0,
    **pod_fields: Any,
) -> Scene:
    """``node``'s pod carries ``DisruptionTarget=True`` (first seen at ``seen``)."""
    return s.changed_pod(node, at=seen, disruption=PodDisruption(reason, since, grace), **pod_fields)


def with_deletion(
    s: Scene, node: str, at: float = T0, grace: float = 30.0, seen: float | None = None, **pod_fields: Any
) -> Scene:
    """``node``'s pod deleted at ``at`` with ``grace`` seconds (``deletionTimestamp`` at
    ``at + grace``), seen at ``seen`` (default: ``at``)."""
    return s.changed_pod(node, at=at if seen is None else seen, deleting=True, deletion_deadline=at + grace,
                         deletion_grace_seconds=grace, **pod_fields)


def leaving(s: Scene, node: str, since: float = T0, by: float = T0 + 30, seen: float | None = None) -> Scene:
    """The agent on ``node`` got SIGTERM at ``since`` and must be gone by ``by`` (its member record says so)."""
    record = dataclasses.replace(s.members[node], leaving_since=since, leaving_by=by)
    return s.with_member(record, at=since if seen is None else seen)


def acked(s: Scene, generation: int, step: int, acked_at: float = 0.0) -> Scene:
    """The trainer acked the checkpoint of ``generation`` (at ``acked_at`` by its clock; 0: not said)."""
    ack = CheckpointAck(generation=generation, step=step, checkpoint_id=f"step-{step}", duration_s=1.0, world_size=6,
                        acked_at=acked_at)
    return s.with_record(KEYS.root + f"acks/{generation}/commit", ack)


def of(actions: Iterable[Action], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def decide(s: Scene, now: float, settings: ControllerSettings) -> Decision:
    """``regroup.controller.decide.decide`` on the scene's snapshot."""
    return decide_on(s.snapshot, now, settings)


_WRITTEN = {
    actions.WriteCheckpointRequest: (KEYS.checkpoint, "request"), actions.WriteExpected: (KEYS.expected, "expected"),
    actions.WriteReform: (KEYS.reform, "request"), actions.WriteStatus: (KEYS.status, "status"),
    actions.WriteExclusions: (KEYS.excluded, "exclusions"), actions.WritePresence: (KEYS.controller, "presence"),
}
"""Each record write of a decision: (key, the action's attribute holding the record)."""


def applied(s: Scene, decided: Iterable[Action], now: float) -> Scene:
    """The scene after the controller's etcd writes of a decision at ``now`` landed (what
    the watch would show); later observations are made from ``now`` on."""
    s = s.at(now)
    for a in decided:
        if isinstance(a, WritePlan):
            s = s.then(lambda m, plan=a.plan: m.etcd_put(KEYS.plan, plan.to_json(), m.jobs[(NS, JOB)].plan_revision + 1))
        elif isinstance(a, actions.WithdrawCheckpointRequest):
            s = s.then(functools.partial(_delete, KEYS.checkpoint))
        elif type(a) in _WRITTEN:
            key, attr = _WRITTEN[type(a)]
            s = s.with_record(key, getattr(a, attr))
    return s


def step(s: Scene, now: float, settings: ControllerSettings) -> tuple[Scene, Decision]:
    """One reconcile: decide at ``now``, then let the writes land."""
    d = decide(s, now, settings)
    return applied(s, d.actions, now), d
