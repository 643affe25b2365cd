"""What ``decide`` sees of one job at one moment, and what it asks for.

A ``JobSnapshot`` is a frozen copy assembled by the model; a ``Decision`` is a list of
``Action`` values with the reason behind them. Neither holds any I/O handle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

from controller.cluster import NodeInfo, ObjectRef, PodInfo
from controller.jobconfig import ResolvedConfig
from controller.signals import NodeVerdict
from regroup.records import (
    CheckpointAck,
    CheckpointRequest,
    ControllerPresence,
    Exclusions,
    ExpectedMembership,
    JobStatus,
    MemberRecord,
    Progress,
    ReformPlan,
    ReformRequest,
)


@dataclass(frozen=True)
class FleetView:
    """Cluster-wide facts a single job's decision needs (the cordon budget)."""

    hosting_nodes: int = 0
    """Nodes running at least one regroup pod."""
    cordoned: frozenset[str] = frozenset()
    """Nodes carrying the restart-storm taint."""


@dataclass(frozen=True)
class JobSnapshot:
    """One job as observed from Kubernetes and etcd."""

    namespace: str
    job: str
    pods: tuple[PodInfo, ...] = ()
    """Every pod carrying the job label (workers and a labelled rendezvous pod)."""
    nodes: Mapping[str, NodeInfo] = field(default_factory=dict)
    """Nodes the job's pods and members are on, as far as they still exist."""
    nodes_synced: bool = True
    """The node list is complete: a node absent from ``nodes`` is deleted."""
    pods_synced: bool = True
    """The pod list is complete: a member whose pod is absent lost its pod."""
    members: Mapping[str, MemberRecord] = field(default_factory=dict)
    """Live members by node."""
    world_round: int = 0
    """The job's current round: the lowest round among live members (joiners wait for a later one)."""
    finished: bool = False
    """The rendezvous is closed: the job ended (its agents shut down after training)."""
    world_seen: frozenset[str] = frozenset()
    """Nodes seen as members of ``world_round``, including ones whose member has vanished since."""
    world_agents: Mapping[str, float] = field(default_factory=dict)
    """Node -> ``joined_at`` of the agent the rendezvous' round record names there (empty when
    the rendezvous has written none): a member with another ``joined_at`` is a restarted agent."""
    first_seen: Mapping[str, float] = field(default_factory=dict)
    """``signals.signal_key(node, what)`` -> unix time the model first saw it."""
    restarts: Mapping[str, tuple[float, ...]] = field(default_factory=dict)
    """Per node, unix times (oldest first) of the rank/container restarts observed there for this job."""
    round_times: tuple[float, ...] = ()
    """Unix times the job's round advanced (rendezvous rounds)."""
    plan: ReformPlan | None = None
    plan_revision: int = 0
    """``mod_revision`` of ``control/plan`` (0: absent): the fencing token for writing it."""
    checkpoint: CheckpointRequest | None = None
    expected: ExpectedMembership | None = None
    reform: ReformRequest | None = None
    acks: Mapping[int, CheckpointAck] = field(default_factory=dict)
    progress: Progress | None = None
    progress_revision: int = 0
    presence: ControllerPresence | None = None
    status: JobStatus | None = None
    exclusions: Exclusions | None = None
    """``control/excluded``: the nodes agents must not bring back into the job."""
    fleet: FleetView = field(default_factory=FleetView)
    identity: str = "regroup-controller"
    """This controller's identity (for its presence record)."""
    pods_by_name: Mapping[str, PodInfo] | None = None
    """``pods`` by name (the model passes its index); None: ``decide`` builds it."""
    verdicts: Mapping[str, NodeVerdict] | None = None
    """Node verdicts under the built-in signal table, cached by the model; None: computed."""
    suspects: frozenset[str] | None = None
    """Nodes that may be unhealthy for this job (an index the model keeps); every other
    node of the round is known healthy. None: ``decide`` examines every node."""
    resolved: ResolvedConfig | None = None
    """The job's config resolved from ``pods`` (the model caches it until the pods change);
    None: ``decide`` resolves it itself."""
    disrupted: Mapping[str, PodInfo] | None = None
    """The job's pods carrying ``DisruptionTarget=True``, by name (an index the model
    keeps); None: ``decide`` finds them in ``pods``."""


# --- actions -------------------------------------------------------------------------


@dataclass(frozen=True)
class WritePlan:
    """Compare-and-set ``control/plan`` against ``expected_revision`` (0: must not exist)."""

    plan: ReformPlan
    expected_revision: int
    finished: bool = False
    """The plan just reached ``done``: emit its trace and metrics once written."""


@dataclass(frozen=True)
class WriteCheckpointRequest:
    request: CheckpointRequest


@dataclass(frozen=True)
class WriteExpected:
    expected: ExpectedMembership


@dataclass(frozen=True)
class WriteReform:
    request: ReformRequest


@dataclass(frozen=True)
class WritePresence:
    presence: ControllerPresence


@dataclass(frozen=True)
class WriteStatus:
    status: JobStatus


@dataclass(frozen=True)
class WriteExclusions:
    exclusions: Exclusions


@dataclass(frozen=True)
class Cordon:
    node: str
    reason: str


@dataclass(frozen=True)
class DeletePod:
    namespace: str
    name: str
    reason: str


@dataclass(frozen=True)
class PostEvent:
    ref: ObjectRef
    type_: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = (
    WritePlan
    | WriteCheckpointRequest
    | WriteExpected
    | WriteReform
    | WritePresence
    | WriteStatus
    | Cordon
    | DeletePod
    | PostEvent
)


@dataclass(frozen=True)
class Alerts:
    """Conditions exported as 0/1 gauges."""

    stalled: bool = False
    bad_config: bool = False
    flapping: bool = False
    rendezvous_on_gpu: bool = False


@dataclass(frozen=True)
class Decision:
    """What to do for a job now, why, and when to look again (None: on the next event)."""

    actions: tuple[Action, ...]
    reason: str
    requeue_after: timedelta | None = None
    world_size: int = 0
    """Nodes in the job's current round."""
    min_nodes: int = 0
    max_nodes: int = 0
    alerts: Alerts = field(default_factory=Alerts)
