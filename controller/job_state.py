"""Everything the model knows about one job, and the job's own indexes.

Pods and members come in one at a time; the indexes beside them (pods by name and the
members naming each, disrupted pods, restart history, first sightings, the resolved
config) change with them, so a snapshot reads them instead of recomputing them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from regroup.controller.cluster import PodInfo
from regroup.controller.disruption import agent_exit, disruption_key, going, leaving_key, pod_gone_key
from regroup.controller.jobconfig import ResolvedConfig, update_resolved
from regroup.controller.multimap import index_add, index_discard
from regroup.controller.rounds import HISTORY, JobRound
from regroup.controller.sightings import FirstSeen
from regroup.controller.signals import member_seen_key, signal_key, storm_mark
from regroup import records


@dataclass
class JobState:
    """One job: its pods and members as observed, its etcd records, and their indexes."""

    pods: dict[str, PodInfo] = field(default_factory=dict)
    members: dict[str, records.MemberRecord] = field(default_factory=dict)
    round: JobRound = field(default_factory=JobRound)
    first_seen: dict[str, float] = field(default_factory=dict)
    """The job's own sightings (see ``regroup.controller.sightings``)."""
    restarts: dict[str, deque[float]] = field(default_factory=dict)
    """Per node, when rank restarts or failed container restarts (``failed_restarts``) were
    observed there, oldest first: the restart-storm rule's history."""
    plan: records.ReformPlan | None = None
    plan_revision: int = 0
    checkpoint: records.CheckpointRequest | None = None
    checkpoint_revision: int = 0
    expected: records.ExpectedMembership | None = None
    reform: records.ReformRequest | None = None
    acks: dict[int, records.CheckpointAck] = field(default_factory=dict)
    ack_generations: set[int] = field(default_factory=set)
    """Generations of the ack keys etcd holds (``acks`` keeps the newest records only)."""
    progress: records.Progress | None = None
    progress_revision: int = 0
    presence: records.ControllerPresence | None = None
    status: records.JobStatus | None = None
    exclusions: records.Exclusions | None = None
    tombstone: records.FinishedJob | None = None
    """Kept outside the job's keys: the job finished and they were removed."""
    tombstone_revision: int = 0
    # --- indexes -----------------------------------------------------------------------
    member_pods: dict[str, set[str]] = field(default_factory=dict)
    """Pod name -> the nodes whose member names it."""
    disrupted: dict[str, PodInfo] = field(default_factory=dict)
    """Pods Kubernetes is taking away (``DisruptionTarget=True``, or being deleted), by name."""
    pods_view: tuple[PodInfo, ...] | None = None
    """``tuple(pods.values())``; None after any pod change."""
    resolved: ResolvedConfig | None = None
    """The config resolved from the pods: kept through a restart count (which nothing
    resolved reads) and the pod changes ``update_resolved`` can apply; None after others."""
    suspects: set[str] | None = None
    """Nodes of the job that are not plainly healthy (``regroup.controller.suspects``); None after
    the round changes, else updated node by node."""
    sightings: FirstSeen | None = None
    """The job's sightings joined with its nodes' (made once, on the first snapshot)."""
    storm_k: int = 0
    """The K ``storm_marks`` are kept for (0: none yet)."""
    marks: dict[str, float] = field(default_factory=dict)
    """Node -> ``storm_mark`` of its restarts for ``storm_k`` (nodes with at least K restarts)."""

    def empty(self) -> bool:
        """Nothing of the job is left in the cluster or in etcd: the model may forget it."""
        records = (self.plan, self.checkpoint, self.expected, self.reform, self.progress, self.presence, self.status,
                   self.exclusions, self.tombstone)
        return (
            not self.pods and not self.members and not self.ack_generations and all(r is None for r in records)
            and self.round.formed_round is None and not self.round.closed
        )  # fmt: skip

    def without_keys(self, now: float) -> JobState:
        """This job as it stands once its keys and its tombstone are gone: its pods (and what
        they index) only."""
        state = JobState()
        for pod in self.pods.values():
            state.put_pod(pod, None, now)
        return state

    def restarted(self, node: str, count: int, now: float) -> None:
        history = self.restarts.setdefault(node, deque(maxlen=HISTORY))
        history.extend([now] * min(count, HISTORY))
        if self.storm_k:
            mark = storm_mark(history, self.storm_k)
            if mark is not None:
                self.marks[node] = mark

    def storm_marks(self, k: int) -> dict[str, float]:
        """Node -> ``storm_mark`` of its restarts for K = ``k``, for the nodes that have one:
        a node is at the storm threshold while its mark is in the window. Kept as restarts
        arrive, so the storm rule looks at these few nodes, not at every node's history."""
        if k != self.storm_k:
            self.storm_k = k
            marks = ((node, storm_mark(times, k)) for node, times in self.restarts.items())
            self.marks = {node: mark for node, mark in marks if mark is not None}
        return self.marks

    def put_pod(self, pod: PodInfo, old: PodInfo | None, now: float) -> bool:
        """Record ``pod`` (``old``: the pod of that name before, if any). Returns whether
        more than its containers' restarts changed, or they ended the agent of a member
        naming the pod (``disruption.agent_exit``). A restart alone changes nothing else the
        resolved config or the suspects read; the storm rule reads ``restarts``, kept here."""
        self.pods[pod.name] = pod
        self.pods_view = None
        touched = old is None or not restart_only(old, pod)
        if touched:
            self.resolved = update_resolved(self.resolved, old, pod)
        failed = failed_restarts(old, pod)
        if failed and pod.node is not None:
            self.restarted(pod.node, failed, now)
        if pod.node is not None:
            if pod.deleting and not (old is not None and old.deleting):
                self.first_seen.setdefault(pod_gone_key(pod.node, pod.name), now)
            elif not pod.deleting and (old is None or old.uid != pod.uid):
                self.first_seen.pop(pod_gone_key(pod.node, pod.name), None)  # placed afresh
        self._track_disruption(old, pod, now)
        return touched or self._ended_agents(old, pod)

    def _ended_agents(self, old: PodInfo | None, pod: PodInfo) -> bool:
        """Whether ``pod``'s containers ended (or no longer end) the agent of a member naming
        it, compared with ``old``: a live member's agent is gone at once (``agent_exit``),
        where a restart alone wakes nothing."""
        for node in self.member_pods.get(pod.name, ()):
            joined = self.members[node].joined_at
            if (agent_exit(pod, joined) is None) != (old is None or agent_exit(old, joined) is None):
                return True
        return False

    def storming(self, node: str, now: float, unresolved: bool = True) -> bool:
        """Whether ``node`` has had the job's restart-storm count of restarts within its
        window (the storm rule's condition); ``unresolved`` while the job's config is not
        resolved (True: wake a decision to be safe; False: not known to be in one)."""
        config = self.resolved.config if self.resolved is not None else None
        if config is None:
            return unresolved
        mark = self.storm_marks(config.storm_restarts).get(node)
        return mark is not None and mark >= now - config.storm_window.total_seconds()

    def remove_pod(self, name: str, now: float) -> PodInfo | None:
        pod = self.pods.pop(name, None)
        self.pods_view = None
        if pod is not None:
            self.resolved = update_resolved(self.resolved, pod, None)
        if pod is not None and pod.node is not None:
            self.first_seen.setdefault(pod_gone_key(pod.node, pod.name), now)
        self._track_disruption(pod, None, now)
        return pod

    def nodes_naming(self, pod: str) -> Iterable[str]:
        """Nodes whose member names pod ``pod``."""
        return self.member_pods.get(pod, ())

    def _track_disruption(self, old: PodInfo | None, pod: PodInfo | None, now: float) -> None:
        """Keep the index of going pods (``disruption.going``) and when each was first seen going."""
        if old is not None and going(old):
            if pod is None or not going(pod) or disruption_key(pod) != disruption_key(old):
                self.first_seen.pop(disruption_key(old), None)
            self.disrupted.pop(old.name, None)
        if pod is not None and going(pod):
            self.first_seen.setdefault(disruption_key(pod), now)
            self.disrupted[pod.name] = pod

    def put_member(self, node: str, member: records.MemberRecord, now: float) -> None:
        old = self.members.get(node)
        self.members[node] = member
        if old is not None and old.pod != member.pod:
            index_discard(self.member_pods, old.pod, node)
        if member.pod:
            index_add(self.member_pods, member.pod, node)
        self.first_seen.pop(signal_key(node, "member-gone"), None)
        self.first_seen.setdefault(member_seen_key(node, member.joined_at, member.round), now)
        if member.leaving_by > 0:
            self.first_seen.setdefault(leaving_key(node, member), now)
        if old is not None and old.joined_at != member.joined_at:
            self.first_seen.pop(leaving_key(node, old), None)
        if old is not None and member.restart_count > old.restart_count:
            self.restarted(node, member.restart_count - old.restart_count, now)

    def remove_member(self, node: str, now: float) -> bool:
        """Forget ``node``'s member; whether there was one."""
        old = self.members.pop(node, None)
        if old is None:
            return False
        index_discard(self.member_pods, old.pod, node)
        self.first_seen.setdefault(signal_key(node, "member-gone"), now)
        self.first_seen.pop(leaving_key(node, old), None)
        return True

    def put_ack(self, generation: int | None, ack: records.CheckpointAck, now: float) -> None:
        """The ack under ``acks/<generation>/commit`` (None: a key spelling its generation
        otherwise than the record, which the pruning leaves alone)."""
        if generation is not None:
            self.ack_generations.add(generation)
        self.acks[ack.generation] = ack
        self.first_seen.setdefault(signal_key("", f"ack:{ack.generation}"), now)
        for old in sorted(self.acks)[:-8]:
            del self.acks[old]

    def remove_acks(self, generations: Iterable[int]) -> None:
        for generation in generations:
            self.ack_generations.discard(generation)
            self.acks.pop(generation, None)

    def progress_arrived(self, now: float) -> None:
        # Not a first sighting: the time the latest progress record arrived.
        self.first_seen[signal_key("", "progress")] = now


def failed_restarts(old: PodInfo | None, new: PodInfo) -> int:
    """The restarts of ``new`` since ``old`` (the same pod as last seen; None: first seen,
    whose earlier restarts are not counted) that were failures: a container's
    ``restartCount`` increase counts when the termination behind it was a failure
    (``ContainerRestarts.last_failed``), never a voluntary exit (0, or 75: left the job).
    Without container details every increase of ``restart_count`` counts."""
    if old is None:
        return 0
    if not new.containers:
        return max(0, new.restart_count - old.restart_count)
    # A container the pod did not report before had no restarts then.
    before = {c.name: c.count for c in old.containers}
    return sum(c.count - before.get(c.name, 0) for c in new.containers if c.last_failed and c.count > before.get(c.name, 0))


def restart_only(old: PodInfo | records.MemberRecord, new: PodInfo | records.MemberRecord) -> bool:
    """Whether ``new`` (a pod or a member record) differs from ``old`` in its restart count alone
    (for a pod, in its containers' restarts and exits: counts, start and exit times, codes)."""
    if isinstance(old, PodInfo) and isinstance(new, PodInfo):
        if old.restart_count == new.restart_count and old.containers == new.containers:
            return False
        return old == records.evolve(new, restart_count=old.restart_count, containers=old.containers)
    if old.restart_count == new.restart_count:
        return False
    return old == records.evolve(new, restart_count=old.restart_count)
