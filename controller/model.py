"""The controller's model of the cluster: observations in, per-job snapshots out.

Cluster adapters call the ``ClusterSink`` methods; the etcd watcher calls ``etcd_put``,
``etcd_delete`` and ``etcd_resynced``. Each observation updates the fleet (``Fleet``) or
a job (``JobState``) and their indexes, and names the jobs it concerns through
``on_dirty``; the model never decides anything. It stamps the first time it sees each
signal (a taint, a lost member, a joiner), because that moment starts a re-form's
``detect`` phase and, for taints without ``timeAdded``, its notice.

A restart alone (a container's or a rank's restart count going up) wakes a decision only
when it brings its node to the job's restart-storm threshold, or when it ends the agent of
a live member (its container exited after the member registered: ``disruption.agent_exit``,
a loss at once); a container's voluntary
restart (exit 0 or 75, ``job_state.failed_restarts``) never counts towards it. Short of it, the storm rule
reads nothing else a restart changes. Past it, the node is in a storm already: the
decision that found it there cordoned it, asked for its pods' deletion and to look again
when its window ends, and a later restart only keeps it in the storm longer (a
crash-looping node restarts many times a window; each would wake every job on it for
nothing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from regroup.controller.cluster import NodeInfo, PodInfo
from regroup.controller.fleet import Fleet, JobId
from regroup.controller.job_state import JobState, restart_only
from regroup.controller.rounds import JobRound
from regroup.controller.settings import JobDefaults
from regroup.controller.snapshot import JobSnapshot
from regroup.controller.snapshot_builder import build_snapshot
from regroup.controller.suspects import refresh
from regroup.keys import DEFAULT_PREFIX, JobKeys, KeyKind, read_record
from regroup.records import CheckpointAck, FinishedJob, MemberRecord, Progress, Record, RecordError, RoundState

__all__ = ["ClusterModel", "JobId", "JobState"]

RECORD_FIELDS: dict[KeyKind, tuple[str, str | None]] = {
    KeyKind.PLAN: ("plan", "plan_revision"),
    KeyKind.CHECKPOINT: ("checkpoint", "checkpoint_revision"),
    KeyKind.EXPECTED: ("expected", None),
    KeyKind.REFORM: ("reform", None),
    KeyKind.CONTROLLER: ("presence", None),
    KeyKind.STATUS: ("status", None),
    KeyKind.EXCLUDED: ("exclusions", None),
    KeyKind.PROGRESS: ("progress", "progress_revision"),
}
"""The ``JobState`` fields that hold each single-record key of a job: its record, and the
record's mod_revision where one is kept."""


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
        on_tracking: Callable[[JobId], None] | None = None,
    ) -> None:
        self._defaults = job_defaults or JobDefaults()
        self._clock = clock
        self._on_dirty = on_dirty
        self._on_synced = on_synced
        self._on_tracking = on_tracking
        """Told each job that starts or stops being tracked (enters or leaves ``jobs``)."""
        self._prefix = prefix
        self.identity = identity
        self.fleet = Fleet(cordon_taint)
        self.jobs: dict[JobId, JobState] = {}
        self.nodes_synced = False
        self.pods_synced = False
        self.etcd_synced = False

    @property
    def nodes(self) -> dict[str, NodeInfo]:
        return self.fleet.nodes

    @property
    def cordoned(self) -> set[str]:
        return self.fleet.cordoned

    @property
    def synced(self) -> bool:
        """Nodes, pods and etcd have each been listed in full at least once."""
        return self.nodes_synced and self.pods_synced and self.etcd_synced

    def snapshot(self, job: JobId) -> JobSnapshot:
        """Everything ``decide`` needs about ``job`` (``build_snapshot``): valid until the
        model next changes, so ``decide`` runs on it before the caller awaits anything."""
        return build_snapshot(
            job, self.jobs.get(job) or JobState(), self.fleet, nodes_synced=self.nodes_synced,
            pods_synced=self.pods_synced, etcd_synced=self.etcd_synced, identity=self.identity,
            defaults=self._defaults,
        )  # fmt: skip

    def _job(self, job: JobId) -> JobState:
        state = self.jobs.get(job)
        if state is None:
            state = self.jobs[job] = JobState()
            if self._on_tracking is not None:
                self._on_tracking(job)
        return state

    def _forget(self, job: JobId) -> None:
        """Nothing of ``job`` is left in the cluster or in etcd: stop tracking it."""
        del self.jobs[job]
        if self._on_tracking is not None:
            self._on_tracking(job)

    def _node_touched(self, node: str) -> None:
        """The node's state changed in a way decisions read: refresh and wake its jobs."""
        fleet = self.fleet
        for job in fleet.jobs_on(node):
            state = self.jobs.get(job)
            if state is not None:
                refresh(state, fleet, (node,))
            self._on_dirty(job)

    def _synced(self) -> None:
        if self._on_synced is not None and self.synced:
            self._on_synced()

    # --- nodes -----------------------------------------------------------------------

    def node_changed(self, node: NodeInfo) -> None:
        for key in self.fleet.node_changed(node, self._clock()):
            self._node_touched(key)

    def node_deleted(self, name: str) -> None:
        if name not in self.fleet.nodes and self.nodes_synced:
            return
        for key in self.fleet.node_deleted(name, self._clock()):
            self._node_touched(key)

    def nodes_listed(self, nodes: list[NodeInfo]) -> None:
        """A full node list: anything not in it is gone (a guest goes with its node)."""
        names = {n.name for n in nodes}
        hosts = self.fleet.hosts
        for name in [n for n in self.fleet.nodes if n not in names and n not in hosts]:
            self.node_deleted(name)
        for node in nodes:
            self.node_changed(node)
        self.nodes_synced = True
        self._synced()

    # --- pods ------------------------------------------------------------------------

    def pod_changed(self, pod: PodInfo) -> None:
        key = (pod.namespace, pod.name)
        job_id = (pod.namespace, pod.job)
        old_job = self.fleet.pod_job.get(key)
        if old_job is not None and old_job != job_id:
            self.pod_deleted(pod.namespace, pod.name)
        state = self._job(job_id)
        old = state.pods.get(pod.name)
        if old == pod:
            return
        now = self._clock()
        for guest in self.fleet.pod_placed(key, job_id, old.node if old is not None else None, pod.node, pod.host, now):
            self._node_touched(guest)
        in_storm = pod.node is not None and state.storming(pod.node, now, unresolved=False)
        if state.put_pod(pod, old, now):
            refresh(state, self.fleet, state.nodes_naming(pod.name))
        elif pod.node is not None and (in_storm or not state.storming(pod.node, now)):
            return  # a restart alone, short of a storm or in one already (module docstring)
        self._on_dirty(job_id)

    def pod_deleted(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        job_id = self.fleet.pod_job.get(key)
        if job_id is None:
            return
        state = self._job(job_id)
        pod = state.remove_pod(name, self._clock())
        self.fleet.pod_removed(key, pod.node if pod is not None else None)
        if state.empty():
            self._forget(job_id)  # a job whose pods never wrote anything: nothing to decide
            return
        refresh(state, self.fleet, state.nodes_naming(name))
        self._on_dirty(job_id)

    def pods_listed(self, pods: list[PodInfo]) -> None:
        """A full pod list: anything not in it is gone."""
        keys = {(p.namespace, p.name) for p in pods}
        for key in [k for k in self.fleet.pod_job if k not in keys]:
            self.pod_deleted(*key)
        for pod in pods:
            self.pod_changed(pod)
        if not self.pods_synced:
            self.pods_synced = True
            self._dirty(list(self.jobs))
        self._synced()

    def resynced(self, nodes: list[NodeInfo], pods: list[PodInfo]) -> None:
        """A full list of both kinds; see ``nodes_listed``/``pods_listed`` for one kind."""
        self.nodes_listed(nodes)
        self.pods_listed(pods)

    def _dirty(self, jobs: Iterable[JobId]) -> None:
        for job in jobs:
            self._on_dirty(job)

    # --- etcd ------------------------------------------------------------------------

    def etcd_put(self, key: str, value: bytes | Record, revision: int, wake: bool = True) -> None:
        parsed = JobKeys.parse(key, self._prefix)
        if parsed is not None:
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

    def own_write(self, job_id: JobId, kind: KeyKind, record: Record, revision: int) -> None:
        """A record the controller itself just wrote to one of the job's control keys (no
        parameters in its key): into the model as the watch will bring it, waking no one."""
        self._apply_put(job_id, self._job(job_id), kind, {}, record, revision, self._clock())

    def own_delete(self, job_id: JobId, kind: KeyKind) -> None:
        """A control record (no parameters in its key) the controller itself just deleted:
        out of the model as the watch will show it, waking no one."""
        state = self.jobs.get(job_id)
        if state is None or kind not in RECORD_FIELDS:
            return
        field, revision_field = RECORD_FIELDS[kind]
        setattr(state, field, None)
        if revision_field is not None:
            setattr(state, revision_field, 0)

    def _apply_put(
        self, job_id: JobId, state: JobState, kind: KeyKind, params: dict[str, str], record: Record | None,
        revision: int, now: float,
    ) -> bool:
        if isinstance(record, MemberRecord):
            node = params["node"]
            old = state.members.get(node)
            in_storm = state.storming(node, now, unresolved=False)
            state.put_member(node, record, now)
            self.fleet.member_added(node, job_id)
            if state.round.member_put(node, record, state.members, state.plan, now):
                state.suspects = None
                return True
            # Same round: the round's other nodes read nothing this member changed, and a
            # rank restart alone wakes a decision only as it brings a storm (module docstring).
            refresh(state, self.fleet, (node,))
            return old is None or not restart_only(old, record) or (not in_storm and state.storming(node, now))
        if isinstance(record, RoundState):
            changed, moved = state.round.formed(record, state.members, now)
            if moved:
                state.suspects = None
            return changed
        if isinstance(record, CheckpointAck):
            # Kept by the generation its key names, which the pruning deletes by.
            key_generation = params["generation"]
            state.put_ack(record.generation if key_generation == str(record.generation) else None, record, now)
            return True
        if kind not in RECORD_FIELDS:
            return False
        field, revision_field = RECORD_FIELDS[kind]
        setattr(state, field, record)
        if revision_field is not None:
            setattr(state, revision_field, revision)
        if kind is KeyKind.PROGRESS:
            state.progress_arrived(now)
            if isinstance(record, Progress):
                state.round.progressed(record)
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
        if kind is KeyKind.MEMBER:
            node = params["node"]
            state.remove_member(node, self._clock())
            self.fleet.member_removed(node, job_id)
            refresh(state, self.fleet, (node,))
        elif kind is KeyKind.ACK:
            # Only the pruning deletes acks, and no decision waits for one to go.
            generation = params["generation"]
            state.remove_acks([int(generation)] if generation.isdigit() else [])
            if not state.empty():
                return
        elif kind is KeyKind.ROUND_STATE:
            # Only a removal of the job's keys deletes it: the job starts again from its members.
            state.round = JobRound()
            state.suspects = None
        elif kind in RECORD_FIELDS:
            field, revision_field = RECORD_FIELDS[kind]
            setattr(state, field, None)
            if revision_field is not None:
                setattr(state, revision_field, 0)
        else:
            return
        if state.empty():
            self._forget(job_id)
        elif wake:
            self._on_dirty(job_id)

    # --- clean-up --------------------------------------------------------------------

    def tombstone_put(self, key: str, value: bytes, revision: int, wake: bool = True) -> None:
        """A finished job's tombstone (``regroup.keys.finished_root``) written."""
        keys = JobKeys.parse_tombstone(key, self._prefix)
        if keys is None:
            return
        try:
            record = FinishedJob.from_json(value)
        except RecordError:
            return  # a record this version cannot read is not ours to act on
        job_id = (keys.namespace, keys.job)
        self._put_tombstone(job_id, record, revision)
        if wake:
            self._on_dirty(job_id)

    def tombstone_delete(self, key: str, wake: bool = True) -> None:
        keys = JobKeys.parse_tombstone(key, self._prefix)
        if keys is not None:
            self._drop_tombstone((keys.namespace, keys.job), wake)

    def tombstones_listed(self, items: list[tuple[str, bytes, int]]) -> None:
        """Every tombstone there is as (key, value, mod_revision): any other is gone."""
        present = set()
        for key, value, revision in items:
            keys = JobKeys.parse_tombstone(key, self._prefix)
            if keys is not None:
                present.add((keys.namespace, keys.job))
                self.tombstone_put(key, value, revision)
        for job_id in [j for j, state in self.jobs.items() if state.tombstone is not None and j not in present]:
            self._drop_tombstone(job_id, wake=True)

    def own_tombstone(self, job_id: JobId, record: FinishedJob, revision: int) -> None:
        """The controller's own rewrite of a tombstone, as the watch will bring it, waking no one."""
        self._put_tombstone(job_id, record, revision)

    def job_removed(self, job_id: JobId, tombstone: FinishedJob | None = None, revision: int = 0) -> None:
        """The controller deleted every key of the job, and its tombstone or wrote
        ``tombstone`` at ``revision``: the job is forgotten but for its pods (and the new
        tombstone), as the watch will show it, waking no one."""
        state = self.jobs.get(job_id)
        if state is None:
            return
        for node in state.members:
            self.fleet.member_removed(node, job_id)
        state = state.without_keys(self._clock())
        state.tombstone, state.tombstone_revision = tombstone, revision
        if state.empty():
            self._forget(job_id)
        else:
            self.jobs[job_id] = state

    def own_acks_deleted(self, job_id: JobId, generations: Iterable[int]) -> None:
        state = self.jobs.get(job_id)
        if state is not None:
            state.remove_acks(generations)

    def _put_tombstone(self, job_id: JobId, record: FinishedJob, revision: int) -> None:
        state = self._job(job_id)
        state.tombstone, state.tombstone_revision = record, revision

    def _drop_tombstone(self, job_id: JobId, wake: bool) -> None:
        state = self.jobs.get(job_id)
        if state is None or state.tombstone is None:
            return
        state.tombstone, state.tombstone_revision = None, 0
        if state.empty():
            self._forget(job_id)
        elif wake:
            self._on_dirty(job_id)

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
            for kind, (field, _) in RECORD_FIELDS.items():
                if job_id in self.jobs and getattr(state, field) is not None and kind.value not in have:
                    self.etcd_delete(root + kind.value, 0)
            state.remove_acks([g for g in state.ack_generations if KeyKind.ACK.format(generation=g) not in have])
            if job_id in self.jobs and state.round.formed_round is not None and KeyKind.ROUND_STATE.value not in have:
                self.etcd_delete(root + KeyKind.ROUND_STATE.value, 0)
            elif job_id in self.jobs and state.empty():
                self._forget(job_id)
        self.etcd_synced = True
        self._dirty(list(self.jobs))
        self._synced()
