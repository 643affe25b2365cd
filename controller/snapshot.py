"""What ``decide`` sees of one job at one moment, and what it asks for.

A ``JobSnapshot`` is a read-only view the model builds (``regroup.controller.snapshot_builder``);
a ``Decision`` is a list of ``Action`` values with the reason behind them. Neither holds
any I/O handle.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal, NamedTuple

from regroup.controller.cluster import NodeInfo, ObjectRef, PodInfo
from regroup.controller.jobconfig import ResolvedConfig
from regroup.controller.signals import NodeVerdict
from regroup.records import (
    CheckpointAck,
    CheckpointRequest,
    ControllerPresence,
    Exclusions,
    ExpectedMembership,
    FinishedJob,
    JobStatus,
    MemberRecord,
    Progress,
    ReformPlan,
    ReformRequest,
)


class FleetView(NamedTuple):
    """Cluster-wide facts a single job's decision needs (the cordon budget)."""

    hosting_nodes: int = 0
    """Nodes running at least one regroup pod."""
    cordoned: AbstractSet[str] = frozenset()
    """Nodes carrying the restart-storm taint."""
    hosts: Mapping[str, str] = {}
    """A pod-named member key -> the node its pod runs on (``Fleet.hosts``)."""


@dataclass(frozen=True)
class JobSnapshot:
    """One job as observed from Kubernetes and etcd, and what the model's indexes say of it.

    Built only by ``regroup.controller.snapshot_builder.build_snapshot``, from the model: the
    derived fields (``pods_by_name`` to ``disrupted``) are always there and always come
    from the same indexes. Collections are the model's own, not copies: a snapshot is
    valid until the model next changes, and nothing writes to it.
    """

    namespace: str
    job: str
    pods: tuple[PodInfo, ...]
    """Every pod carrying the job label (workers and a labelled rendezvous pod)."""
    nodes: Mapping[str, NodeInfo]
    """Known nodes (the fleet's): a node absent from it is deleted once ``nodes_synced``."""
    nodes_synced: bool
    """The node list is complete: a node absent from ``nodes`` is deleted."""
    pods_synced: bool
    """The pod list is complete: a member whose pod is absent lost its pod."""
    etcd_synced: bool
    """The jobs' keys and the tombstones have been listed in full: a key absent from the
    model is absent from etcd."""
    members: Mapping[str, MemberRecord]
    """Live members by node."""
    world_round: int
    """The job's current round (``regroup.controller.rounds``); 0 before any member registered."""
    finished: bool
    """The rendezvous is closed: the job ended (its agents shut down after training)."""
    world_seen: AbstractSet[str]
    """Nodes seen as members of ``world_round``, including ones whose member has vanished since."""
    world_order: Sequence[str]
    """The nodes of ``world_round`` in rank order, as the rendezvous' round record lists them
    (empty when it has written none, or its record is of an older round): a re-form keeps
    each surviving node in its position, and a replacement takes the position it fills."""
    world_agents: Mapping[str, float]
    """Node -> ``joined_at`` of the agent the rendezvous' round record names there (empty when
    the rendezvous has written none): a member with another ``joined_at`` is a restarted agent."""
    first_seen: Mapping[str, float]
    """``signals.signal_key(node, what)`` -> unix time the model first saw it."""
    restarts: Mapping[str, Sequence[float]]
    """Per node, unix times (oldest first) of the rank/container restarts observed there for this job."""
    round_times: Sequence[float]
    """Unix times the job's round advanced (rendezvous rounds), as the controller saw it."""
    untrained_round_times: Sequence[float]
    """Those of ``round_times`` when the round advanced past one the trainers took no step
    in: it did not hold (``regroup.controller.rounds``)."""
    round_formed_at: float
    """Unix time the rendezvous formed the job's round, by its own clock (``rdzv/state``
    ``formed_at``); 0 when it has written none."""
    plan: ReformPlan | None
    plan_revision: int
    """``mod_revision`` of ``control/plan`` (0: absent): the fencing token for writing it."""
    checkpoint: CheckpointRequest | None
    checkpoint_revision: int
    """``mod_revision`` of ``control/checkpoint`` (0: absent): the fencing token for withdrawing it."""
    expected: ExpectedMembership | None
    reform: ReformRequest | None
    acks: Mapping[int, CheckpointAck]
    ack_generations: AbstractSet[int]
    """Generations of the ``acks/<generation>/commit`` keys etcd holds (``acks`` keeps the
    newest few records only)."""
    progress: Progress | None
    progress_revision: int
    presence: ControllerPresence | None
    status: JobStatus | None
    exclusions: Exclusions | None
    """``control/excluded``: the nodes agents must not bring back into the job."""
    tombstone: FinishedJob | None
    """The job finished and its keys were removed (``regroup.keys.JobKeys.tombstone``)."""
    tombstone_revision: int
    """``mod_revision`` of the tombstone (0: absent): the fencing token for rewriting it."""
    fleet: FleetView
    identity: str
    """This controller's identity (for its presence record)."""
    # --- derived: kept by the model's indexes ------------------------------------------
    pods_by_name: Mapping[str, PodInfo]
    """``pods`` by name."""
    resolved: ResolvedConfig
    """The job's config resolved from ``pods``."""
    verdicts: Mapping[str, NodeVerdict]
    """Node verdicts under the built-in signal table (``regroup.controller.fleet``)."""
    suspects: AbstractSet[str]
    """Nodes that may be unhealthy for this job (``regroup.controller.suspects``); every other
    node of the round is known healthy."""
    disrupted: Mapping[str, PodInfo]
    """The job's pods Kubernetes is taking away (``DisruptionTarget=True``, or being deleted), by name."""
    storm_marks: Mapping[str, float]
    """Node -> the time of its K-th newest restart, for nodes with at least K (K of the
    resolved config's restart-storm rule; empty without a config): ``signals.storm_mark``."""


# --- actions -------------------------------------------------------------------------
# Named tuples, like ``Decision``: a decision makes a few, each in one C call.


AFTER_PREVIOUS_PLAN = -1
"""``WritePlan.expected_revision`` of a plan a decision starts after ending the one in
flight: the revision its own previous ``WritePlan`` wrote."""


class WritePlan(NamedTuple):
    """Compare-and-set ``control/plan`` against ``expected_revision`` (0: must not exist;
    ``AFTER_PREVIOUS_PLAN``: what this decision's previous plan write left)."""

    plan: ReformPlan
    expected_revision: int
    finished: bool = False
    """The plan just reached ``done``: emit its trace and metrics once written."""


class WriteCheckpointRequest(NamedTuple):
    request: CheckpointRequest


class WithdrawCheckpointRequest(NamedTuple):
    """Delete ``control/checkpoint`` (a request of ``generation``) if it is still at
    ``revision`` and ``control/plan`` at ``plan_revision`` (``AFTER_PREVIOUS_PLAN``: what
    this decision's last plan write left): a conflict means the view was stale."""

    generation: int
    revision: int
    plan_revision: int


class WriteExpected(NamedTuple):
    expected: ExpectedMembership


class WriteReform(NamedTuple):
    request: ReformRequest


class WritePresence(NamedTuple):
    presence: ControllerPresence


class WriteStatus(NamedTuple):
    status: JobStatus


class WriteExclusions(NamedTuple):
    exclusions: Exclusions


class Cordon(NamedTuple):
    node: str
    reason: str


class DeletePod(NamedTuple):
    namespace: str
    name: str
    reason: str


class RemoveJob(NamedTuple):
    """Delete every key of the job (one delete of its root) unless an agent of it registered
    meanwhile (a key under ``members/`` or ``rdzv/joins/``: the view was stale). A finished
    job's ``tombstone`` is written in the same transaction."""

    reason: Literal["finished", "gone"]
    """Why the job is over (the label of ``regroup_jobs_removed_total``)."""
    why: str
    tombstone: FinishedJob | None


class WriteTombstone(NamedTuple):
    """Compare-and-set the job's tombstone against ``expected_revision``."""

    tombstone: FinishedJob
    expected_revision: int


class RemoveTombstone(NamedTuple):
    """Delete the job's tombstone if it is still at ``revision``, with whatever an older
    agent wrote under the job's root since, unless an agent of it is registered."""

    revision: int
    why: str


class PruneAcks(NamedTuple):
    """Delete ``acks/<generation>/commit`` of each of ``generations``: no one reads them."""

    generations: tuple[int, ...]


class PostEvent(NamedTuple):
    ref: ObjectRef
    type_: Literal["Normal", "Warning"]
    reason: str
    message: str


class PostPodEvents(NamedTuple):
    """The same Event on each of ``pods``: how the end of a re-form is told on every pod
    of the job (one action, not one per pod: a storm ends many re-forms)."""

    pods: tuple[PodInfo, ...]
    type_: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = (
    WritePlan
    | WriteCheckpointRequest
    | WithdrawCheckpointRequest
    | WriteExpected
    | WriteReform
    | WritePresence
    | WriteStatus
    | WriteExclusions
    | Cordon
    | DeletePod
    | PostEvent
    | PostPodEvents
    | RemoveJob
    | WriteTombstone
    | RemoveTombstone
    | PruneAcks
)


class Alerts(NamedTuple):
    """Conditions exported as 0/1 gauges."""

    stalled: bool = False
    bad_config: bool = False
    flapping: bool = False
    rendezvous_on_gpu: bool = False


class Decision(NamedTuple):
    """What to do for a job now, why, and when to look again (None: on the next event).

    ``Decision``, ``Alerts`` and ``FleetView`` are named tuples, immutable as the frozen
    dataclasses they were, and made in one C call: a decision makes each of them, and a
    frozen dataclass sets every field through ``object.__setattr__``, whose C path alone
    took over 3% of the controller's instructions in the benchmark's event storm
    (``python -m bench controller --instructions``)."""

    actions: tuple[Action, ...]
    reason: str
    requeue_after: timedelta | None = None
    node_count: int = 0
    """Nodes in the job's current round."""
    min_nodes: int = 0
    max_nodes: int = 0
    alerts: Alerts = Alerts()
    spare_count: int = 0
    """Spare nodes: members waiting to join while the job trains at max."""
    spares_wanted: int = 0
    """Spare nodes the job asks for (``regroup.dev/spare-nodes``)."""
