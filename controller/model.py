"""The controller's model of the cluster: observations in, per-job snapshots out.

Cluster adapters call the ``ClusterSink`` methods; the etcd watcher calls ``etcd_put``,
``etcd_delete`` and ``etcd_resynced``. Each observation updates the model and names the
jobs it concerns through ``on_dirty``; the model never decides anything. It stamps the
first time it sees each signal (a taint, a lost member, a joiner), because that moment
starts a re-form's ``detect`` phase and, for taints without ``timeAdded``, its notice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace

from controller.cluster import NodeInfo, PodInfo
from controller.disruption import disruption_key
from controller.jobconfig import ResolvedConfig, resolve_job_config
from controller.settings import JobDefaults
from controller.signals import NodeVerdict, member_seen_key, node_verdict, signal_key
from controller.snapshot import FleetView, JobSnapshot
from regroup.keys import DEFAULT_PREFIX, JobKeys, KeyKind, read_record
from regroup.records import (
    CheckpointAck,
    CheckpointRequest,
    ControllerPresence,
    Exclusions,
    ExpectedMembership,
    JobStatus,
    MemberRecord,
    Progress,
    Record,
    RecordError,
    ReformPhase,
    ReformPlan,
    ReformRequest,
    RoundState,
)

JobId = tuple[str, str]
"""(namespace, job)."""

_HISTORY = 64
"""Restart and round timestamps kept per node/job: far more than any K of a storm rule."""


@dataclass
class JobState:
    """Everything the model knows about one job."""

    pods: dict[str, PodInfo] = field(default_factory=dict)
    members: dict[str, MemberRecord] = field(default_factory=dict)
    world_round: int | None = None
    world_seen: set[str] = field(default_factory=set)
    formed_round: int | None = None
    closed: bool = False
    """``rdzv/state`` says the run is closed: the job is over (``set_closed``/``shutdown``)."""
    """``rdzv/state``'s last formed round, when the rendezvous has written one."""
    world_agents: dict[str, float] = field(default_factory=dict)
    """Node -> ``joined_at`` of the agent in the formed round (from ``rdzv/state``)."""
    first_seen: dict[str, float] = field(default_factory=dict)
    restarts: dict[str, deque[float]] = field(default_factory=dict)
    pod_restarts: dict[str, int] = field(default_factory=dict)
    round_times: deque[float] = field(default_factory=lambda: deque(maxlen=_HISTORY))
    rounds: int = 0
    """Rounds the job's world advanced through while observed."""
    plan: ReformPlan | None = None
    plan_revision: int = 0
    checkpoint: CheckpointRequest | None = None
    expected: ExpectedMembership | None = None
    reform: ReformRequest | None = None
    acks: dict[int, CheckpointAck] = field(default_factory=dict)
    progress: Progress | None = None
    progress_revision: int = 0
    presence: ControllerPresence | None = None
    status: JobStatus | None = None
    exclusions: Exclusions | None = None
    disrupted: dict[str, PodInfo] = field(default_factory=dict)
    """Pods carrying ``DisruptionTarget=True``, by name."""
    pods_view: tuple[PodInfo, ...] | None = None
    """Cached ``tuple(pods.values())``; None after any pod change."""
    resolved: ResolvedConfig | None = None
    """Cached config resolved from the pods; None after any pod change other than a
    restart count (the cached pods may then show an older ``restart_count``)."""
    flagged: set[str] | None = None
    """Cached nodes of the job whose member or pod is not plainly healthy (see
    ``ClusterModel._job_flags``); None after a round change or a member leaving, updated
    node by node after a pod change or a member write within the round."""

    def empty(self) -> bool:
        return not self.pods and not self.members and self.plan is None and self.progress is None


_RECORD_FIELDS: dict[KeyKind, tuple[str, str | None]] = {
    KeyKind.PLAN: ("plan", "plan_revision"),
    KeyKind.CHECKPOINT: ("checkpoint", None),
    KeyKind.EXPECTED: ("expected", None),
    KeyKind.REFORM: ("reform", None),
    KeyKind.CONTROLLER: ("presence", None),
    KeyKind.STATUS: ("status", None),
    KeyKind.EXCLUDED: ("exclusions", None),
    KeyKind.PROGRESS: ("progress", "progress_revision"),
}
"""The ``JobState`` fields that hold each single-record key of a job: its record, and the
record's mod_revision where one is kept."""


class FirstSeen(Mapping[str, float]):
    """A read-only view joining a job's own sightings with its nodes' (no copying per decision)."""

    def __init__(self, job: Mapping[str, float], nodes: Mapping[str, Mapping[str, float]]) -> None:
        self._job = job
        self._nodes = nodes

    def __getitem__(self, key: str) -> float:
        if key in self._job:
            return self._job[key]
        node, sep, what = key.partition("\x00")
        if sep:
            signals = self._nodes.get(node)
            if signals is not None and what in signals:
                return signals[what]
        raise KeyError(key)

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        value = self._job.get(key)
        if value is not None:
            return value
        node, sep, what = key.partition("\x00")
        if sep:
            signals = self._nodes.get(node)
            if signals is not None:
                return signals.get(what, default)
        return default

    def __iter__(self) -> Iterator[str]:
        yield from self._job
        for node, signals in self._nodes.items():
            for what in signals:
                yield signal_key(node, what)

    def __len__(self) -> int:
        return len(self._job) + sum(len(s) for s in self._nodes.values())


class ClusterModel:
    """Nodes, pods and each job's etcd state; implements ``ClusterSink``."""

    def __init__(
        self,
        clock: Callable[[], float],
        on_dirty: Callable[[JobId], None],
        *,
        prefix: str = DEFAULT_PREFIX,
        cordon_taint: str = "regroup.dev/restart-storm",
        identity: str = "regroup-controller",
        on_synced: Callable[[], None] | None = None,
        job_defaults: JobDefaults | None = None,
    ) -> None:
        self._defaults = job_defaults or JobDefaults()
        self._clock = clock
        self._on_dirty = on_dirty
        self._on_synced = on_synced
        self._prefix = prefix
        self._cordon_taint = cordon_taint
        self.identity = identity
        self.nodes: dict[str, NodeInfo] = {}
        self.node_signals: dict[str, dict[str, float]] = {}
        self.jobs: dict[JobId, JobState] = {}
        self.node_pods: dict[str, set[tuple[str, str]]] = {}
        self.pod_job: dict[tuple[str, str], JobId] = {}
        self.member_jobs: dict[str, set[JobId]] = {}
        self.cordoned: set[str] = set()
        self.flagged_nodes: set[str] = set()
        """Nodes a decision must look at closely: deleted, not Ready, tainted or cordoned."""
        self.verdicts: dict[str, NodeVerdict] = {}
        """Each known node's verdict under the built-in signal table (jobs without extra
        reclaim taints use it as is), recomputed when the node changes."""
        self._node_first_seen = FirstSeen({}, self.node_signals)
        self.nodes_synced = False
        self.pods_synced = False
        self.etcd_synced = False

    # --- helpers ---------------------------------------------------------------------

    def _job(self, job: JobId) -> JobState:
        state = self.jobs.get(job)
        if state is None:
            state = self.jobs[job] = JobState()
        return state

    def _jobs_on(self, node: str) -> set[JobId]:
        jobs = {self.pod_job[key] for key in self.node_pods.get(node, ()) if key in self.pod_job}
        jobs.update(self.member_jobs.get(node, ()))
        return jobs

    def _dirty(self, jobs: Iterable[JobId]) -> None:
        for job in jobs:
            self._on_dirty(job)

    # --- nodes -----------------------------------------------------------------------

    def node_changed(self, node: NodeInfo) -> None:
        old = self.nodes.get(node.name)
        if old == node:
            return
        now = self._clock()
        signals = self.node_signals.setdefault(node.name, {})
        signals.pop("gone", None)
        present = {"taint:" + t.key for t in node.taints}
        if node.ready is not True:
            present.add("notready")
        if node.unschedulable:
            present.add("unschedulable")
        for key in list(signals):
            if key not in present:
                del signals[key]
        for key in present:
            signals.setdefault(key, now)
        self.nodes[node.name] = node
        self.verdicts[node.name] = node_verdict(node, node.name, (), self._node_first_seen, now)
        if node.ready is not True or node.taints or node.unschedulable:
            self.flagged_nodes.add(node.name)
        else:
            self.flagged_nodes.discard(node.name)
        if any(t.key == self._cordon_taint for t in node.taints):
            self.cordoned.add(node.name)
        else:
            self.cordoned.discard(node.name)
        # Kubelet heartbeats and label churn change nothing a decision reads: wake no job.
        if old is None or (old.taints, old.ready, old.unschedulable, old.has_gpus) != (
            node.taints, node.ready, node.unschedulable, node.has_gpus
        ):
            self._dirty(self._jobs_on(node.name))

    def node_deleted(self, name: str) -> None:
        if self.nodes.pop(name, None) is None and self.nodes_synced:
            return
        now = self._clock()
        self.node_signals[name] = {"gone": now}
        self.verdicts[name] = node_verdict(None, name, (), self._node_first_seen, now)
        self.flagged_nodes.add(name)
        self.cordoned.discard(name)
        self._dirty(self._jobs_on(name))

    # --- pods ------------------------------------------------------------------------

    def pod_changed(self, pod: PodInfo) -> None:
        key = (pod.namespace, pod.name)
        job_id = (pod.namespace, pod.job)
        old_job = self.pod_job.get(key)
        if old_job is not None and old_job != job_id:
            self.pod_deleted(pod.namespace, pod.name)
        state = self._job(job_id)
        old = state.pods.get(pod.name)
        if old == pod:
            return
        now = self._clock()
        if old is not None and old.node != pod.node and old.node is not None:
            self._unindex(old.node, key)
        if pod.node is not None:
            self.node_pods.setdefault(pod.node, set()).add(key)
        state.pods[pod.name] = pod
        if old is not None and old.restart_count != pod.restart_count and old == replace(pod, restart_count=old.restart_count):
            # A container restart changes nothing the resolved config or the flags read:
            # only the pod list is rebuilt (the storm rule reads ``restarts``, kept below).
            state.pods_view = None
        else:
            self._pod_touched(state, pod.name)
        self.pod_job[key] = job_id
        previous = state.pod_restarts.get(pod.name, pod.restart_count if old is None else 0)
        if pod.restart_count > previous and pod.node is not None:
            self._restarted(state, pod.node, pod.restart_count - previous, now)
        state.pod_restarts[pod.name] = pod.restart_count
        if pod.deleting and pod.node is not None and not (old is not None and old.deleting):
            state.first_seen.setdefault(signal_key(pod.node, "pod-gone"), now)
        self._track_disruption(state, old, pod, now)
        self._on_dirty(job_id)

    def _track_disruption(self, state: JobState, old: PodInfo | None, pod: PodInfo | None, now: float) -> None:
        """Keep the index of disrupted pods and when each condition was first seen."""
        if old is not None and old.disruption is not None:
            if pod is None or pod.disruption is None or disruption_key(pod) != disruption_key(old):
                state.first_seen.pop(disruption_key(old), None)
            state.disrupted.pop(old.name, None)
        if pod is not None and pod.disruption is not None:
            state.first_seen.setdefault(disruption_key(pod), now)
            state.disrupted[pod.name] = pod

    def pod_deleted(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        job_id = self.pod_job.pop(key, None)
        if job_id is None:
            return
        state = self._job(job_id)
        pod = state.pods.pop(name, None)
        self._pod_touched(state, name)
        state.pod_restarts.pop(name, None)
        if pod is not None and pod.node is not None:
            self._unindex(pod.node, key)
            state.first_seen.setdefault(signal_key(pod.node, "pod-gone"), self._clock())
        self._track_disruption(state, pod, None, 0.0)
        self._on_dirty(job_id)

    def _unindex(self, node: str, key: tuple[str, str]) -> None:
        keys = self.node_pods.get(node)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self.node_pods[node]

    def resynced(self, nodes: list[NodeInfo], pods: list[PodInfo]) -> None:
        """A full list of both kinds; see ``nodes_listed``/``pods_listed`` for one kind."""
        self.nodes_listed(nodes)
        self.pods_listed(pods)

    def nodes_listed(self, nodes: list[NodeInfo]) -> None:
        """A full node list: anything not in it is gone."""
        names = {n.name for n in nodes}
        for name in [n for n in self.nodes if n not in names]:
            self.node_deleted(name)
        for node in nodes:
            self.node_changed(node)
        self.nodes_synced = True
        self._synced()

    def pods_listed(self, pods: list[PodInfo]) -> None:
        """A full pod list: anything not in it is gone."""
        keys = {(p.namespace, p.name) for p in pods}
        for key in [k for k in self.pod_job if k not in keys]:
            self.pod_deleted(*key)
        for pod in pods:
            self.pod_changed(pod)
        if not self.pods_synced:
            self.pods_synced = True
            self._dirty(list(self.jobs))
        self._synced()

    # --- etcd ------------------------------------------------------------------------

    def etcd_put(self, key: str, value: bytes | Record, revision: int, wake: bool = True) -> None:
        parsed = JobKeys.parse(key, self._prefix)
        if parsed is None:
            return
        keys, rest = parsed
        self.job_put((keys.namespace, keys.job), rest, value, revision, wake)

    def job_put(self, job_id: JobId, rest: str, value: bytes | Record, revision: int, wake: bool = True) -> None:
        """``etcd_put`` for a key already split into its job and the part below the job root."""
        found = KeyKind.match(rest)
        if found is None or found[0] in (KeyKind.JOIN, KeyKind.ROUND_STORE):
            return
        kind, params = found
        try:
            # Our own writes arrive decoded already.
            record = value if isinstance(value, Record) else read_record(kind, value)
        except RecordError:
            return  # a record this version cannot read is not ours to act on
        state = self._job(job_id)
        if self._apply_put(job_id, state, kind, params, record, revision, self._clock()) and wake:
            self._on_dirty(job_id)

    def _apply_put(
        self, job_id: JobId, state: JobState, kind: KeyKind, params: dict[str, str], record: Record | None,
        revision: int, now: float,
    ) -> bool:
        if isinstance(record, MemberRecord):
            node, member = params["node"], record
            old = state.members.get(node)
            state.members[node] = member
            self.member_jobs.setdefault(node, set()).add(job_id)
            state.first_seen.pop(signal_key(node, "member-gone"), None)
            state.first_seen.setdefault(member_seen_key(node, member.joined_at, member.round), now)
            if old is not None and member.restart_count > old.restart_count:
                self._restarted(state, node, member.restart_count - old.restart_count, now)
            flagged, round_before = state.flagged, state.world_round
            self._update_world(state, now)
            if flagged is not None and state.world_round == round_before:
                # Same round: the round's other nodes read nothing this member changed.
                state.flagged = flagged
                self._reflag(state, (node,))
            return True
        if isinstance(record, RoundState):
            return self._round_formed(state, record, now)
        if isinstance(record, CheckpointAck):
            state.acks[record.generation] = record
            state.first_seen.setdefault(signal_key("", f"ack:{record.generation}"), now)
            for old in sorted(state.acks)[:-8]:
                del state.acks[old]
            return True
        if kind not in _RECORD_FIELDS:
            return False
        field, revision_field = _RECORD_FIELDS[kind]
        setattr(state, field, record)
        if revision_field is not None:
            setattr(state, revision_field, revision)
        if kind is KeyKind.PROGRESS:
            # Not a first sighting: the time the latest progress record arrived.
            state.first_seen[signal_key("", "progress")] = now
        return True

    def etcd_delete(self, key: str, revision: int, wake: bool = True) -> None:
        parsed = JobKeys.parse(key, self._prefix)
        if parsed is None:
            return
        keys, rest = parsed
        job_id = (keys.namespace, keys.job)
        state = self.jobs.get(job_id)
        found = KeyKind.match(rest)
        if state is None or found is None:
            return
        kind, params = found
        now = self._clock()
        if kind is KeyKind.MEMBER:
            node = params["node"]
            if state.members.pop(node, None) is not None:
                state.first_seen.setdefault(signal_key(node, "member-gone"), now)
            jobs = self.member_jobs.get(node)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self.member_jobs[node]
            self._update_world(state, now)
        elif kind in _RECORD_FIELDS:
            field, revision_field = _RECORD_FIELDS[kind]
            setattr(state, field, None)
            if revision_field is not None:
                setattr(state, revision_field, 0)
        else:
            return
        if state.empty() and job_id in self.jobs:
            self._forget(job_id)
        elif wake:
            self._on_dirty(job_id)

    def _forget(self, job_id: JobId) -> None:
        del self.jobs[job_id]

    def etcd_resynced(self, items: list[tuple[str, bytes, int]]) -> None:
        """Everything under the prefix as (key, value, mod_revision): anything else is gone."""
        present: dict[JobId, set[str]] = {}
        for key, value, revision in items:
            parsed = JobKeys.parse(key, self._prefix)
            if parsed is None:
                continue
            keys, rest = parsed
            present.setdefault((keys.namespace, keys.job), set()).add(rest)
            self.etcd_put(key, value, revision)
        for job_id, state in list(self.jobs.items()):
            have = present.get(job_id, set())
            root = JobKeys(job_id[0], job_id[1], self._prefix).root
            for node in [n for n in state.members if f"members/{n}" not in have]:
                self.etcd_delete(root + f"members/{node}", 0)
            for kind, (field, _) in _RECORD_FIELDS.items():
                if job_id in self.jobs and getattr(state, field) is not None and kind.value not in have:
                    self.etcd_delete(root + kind.value, 0)
        self.etcd_synced = True
        self._dirty(list(self.jobs))
        self._synced()

    @property
    def synced(self) -> bool:
        """Nodes, pods and etcd have each been listed in full at least once."""
        return self.nodes_synced and self.pods_synced and self.etcd_synced

    def _synced(self) -> None:
        if self._on_synced is not None and self.synced:
            self._on_synced()

    # --- derived state ---------------------------------------------------------------

    def _restarted(self, state: JobState, node: str, count: int, now: float) -> None:
        history = state.restarts.setdefault(node, deque(maxlen=_HISTORY))
        history.extend([now] * min(count, _HISTORY))

    def _round_formed(self, state: JobState, round_state: RoundState, now: float) -> bool:
        """The rendezvous' own record of the last formed round (``rdzv/state``, owned by
        rendezvous/): the authority on which round is current and who is in it."""
        formed, nodes, agents, closed = round_state.round, round_state.nodes, round_state.joined_at(), round_state.closed
        if closed != state.closed:
            state.closed = closed
            return True
        if formed < 1 or formed == state.formed_round:
            return False
        state.world_agents = agents
        if state.world_round is not None and formed > state.world_round:
            state.round_times.append(now)
            state.rounds += 1
        state.formed_round = state.world_round = formed
        state.flagged = None
        state.world_seen = set(nodes)
        state.world_seen.update(n for n, m in state.members.items() if m.round == formed)
        return True

    def _update_world(self, state: JobState, now: float) -> None:
        """Follow the job's current round (see ``JobSnapshot.world_round``).

        The round advances only when a node of the current round moves to a later one:
        joiners announcing a later round do not move it, nor do agents that restarted.
        """
        state.flagged = None
        if not state.members:
            return
        rounds = [m.round for m in state.members.values()]
        if state.formed_round is not None and state.world_round == state.formed_round:
            # rdzv/state leads; members only add themselves to the round they report.
            state.world_seen.update(n for n, m in state.members.items() if m.round == state.world_round)
            return
        if state.world_round is None:
            plan = state.plan
            if plan is not None and plan.round_after and plan.round_after in rounds:
                state.world_round = plan.round_after
            else:
                counts: dict[int, int] = {}
                for r in rounds:
                    counts[r] = counts.get(r, 0) + 1
                state.world_round = max(counts, key=lambda r: (counts[r], -r))
            state.world_seen = {n for n, m in state.members.items() if m.round == state.world_round}
            return
        moved = [m.round for n, m in state.members.items() if n in state.world_seen and m.round > state.world_round]
        if moved:
            state.world_round = max(moved)
            state.round_times.append(now)
            state.rounds += 1
            state.world_seen = set()
        state.world_seen.update(n for n, m in state.members.items() if m.round == state.world_round)

    def _job_flags(self, state: JobState) -> set[str]:
        """Nodes of the job (its round's and its members') that are not plainly healthy on
        the job's side: member missing or in another round, pod missing, deleting or
        finished, or the node unknown. Over-flagging is harmless (a closer look), missing
        one is not, so anything in doubt is flagged."""
        return {node for node in state.world_seen | state.members.keys() if self._node_flagged(state, node)}

    def _node_flagged(self, state: JobState, node: str) -> bool:
        """Whether ``_job_flags`` flags ``node``, a node of the job's round or members."""
        member = state.members.get(node)
        if member is None or member.round != state.world_round or node not in self.nodes:
            return True
        if node in state.world_agents and member.joined_at != state.world_agents[node]:
            return True
        if member.pod:
            pod = state.pods.get(member.pod)
            return pod is None or pod.deleting or pod.phase in ("Failed", "Succeeded")
        return False

    def _reflag(self, state: JobState, nodes: Iterable[str]) -> None:
        """Bring cached flags up to date after a change that concerns only ``nodes``."""
        flagged = state.flagged
        if flagged is None:
            return
        for node in nodes:
            if (node in state.members or node in state.world_seen) and self._node_flagged(state, node):
                flagged.add(node)
            else:
                flagged.discard(node)

    def _pod_touched(self, state: JobState, name: str) -> None:
        """A pod was added, changed or removed: refresh the views that read it."""
        state.pods_view = None
        state.resolved = None
        # Only the members naming this pod can change flags (a scan beats recomputing all).
        self._reflag(state, [n for n, m in state.members.items() if m.pod == name])

    def snapshot(self, job: JobId) -> JobSnapshot:
        """Everything ``decide`` needs about ``job``.

        Mappings are the live model's own, not copies (copying 50 members per decision
        costs more than deciding): a snapshot is valid until the model next changes, so
        ``decide`` runs on it before the caller awaits anything, and nothing writes to it.
        """
        state = self.jobs.get(job) or JobState()
        if state.pods_view is None:
            state.pods_view = tuple(state.pods.values())
        if state.resolved is None:
            state.resolved = resolve_job_config(state.pods_view, self._defaults)
        suspects: frozenset[str] | None = None
        if self.nodes_synced and self.pods_synced:
            if state.flagged is None:
                state.flagged = self._job_flags(state)
            # Intersect from the job's side: the fleet's flagged nodes can be hundreds.
            near = self.flagged_nodes.intersection(state.members)
            near.update(self.flagged_nodes & state.world_seen)
            plan = state.plan
            if plan is not None and plan.phase == ReformPhase.DONE and plan.round_after == state.world_round:
                # decide counts a completed plan's nodes in the round even if never seen there.
                near.update(n for n in plan.nodes_after if n not in state.members)
            suspects = frozenset(state.flagged | near) if near else frozenset(state.flagged)
        return JobSnapshot(
            namespace=job[0],
            job=job[1],
            pods=state.pods_view,
            nodes=self.nodes,
            nodes_synced=self.nodes_synced,
            pods_synced=self.pods_synced,
            members=state.members,
            world_round=state.world_round or 0,
            finished=state.closed,
            world_seen=frozenset(state.world_seen),
            world_agents=state.world_agents,
            first_seen=FirstSeen(state.first_seen, self.node_signals),
            restarts=state.restarts,
            round_times=tuple(state.round_times),
            plan=state.plan,
            plan_revision=state.plan_revision,
            checkpoint=state.checkpoint,
            expected=state.expected,
            reform=state.reform,
            acks=state.acks,
            progress=state.progress,
            progress_revision=state.progress_revision,
            presence=state.presence,
            status=state.status,
            exclusions=state.exclusions,
            fleet=FleetView(hosting_nodes=len(self.node_pods), cordoned=frozenset(self.cordoned)),
            identity=self.identity,
            resolved=state.resolved,
            pods_by_name=state.pods,
            verdicts=self.verdicts if self.nodes_synced else None,
            suspects=suspects,
            disrupted=state.disrupted,
        )
