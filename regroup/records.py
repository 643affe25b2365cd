"""Versioned JSON records stored under the keys of ``regroup.keys``.

Every record is a frozen dataclass written as JSON with a ``"v"`` field. Readers
accept unknown fields (a newer writer may add some) and refuse a newer major
version with a clear error, so pods of two versions can share a job. Never pickle.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar

from regroup.reform_kinds import (  # noqa: F401 (re-exported: the records' field types)
    DETECT_PHASE,
    TRACED_PHASES,
    ReformCause,
    ReformOutcome,
    ReformPhase,
    ReformStrategy,
)

SCHEMA_VERSION = 1

_Frozen = TypeVar("_Frozen")


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
"""Field names per record class, cached for ``Record.to_json`` and ``Record.from_json``."""


def _field_names(cls: type) -> tuple[str, ...]:
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in dataclasses.fields(cls))
    return names


def _nested(value: Any) -> Any:
    """A dataclass nested in a record field encodes as ``dataclasses.asdict`` would."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def evolve(obj: _Frozen, **changes: Any) -> _Frozen:
    """``dataclasses.replace`` for an instance of a frozen dataclass with a ``__dict__``
    (every record, and the controller's ``PodInfo``): the fields are copied as they are
    instead of each going through the frozen ``__init__`` again (a re-form plan has 33:
    10 us against 3, and a storm ends a plan every few events). ``__post_init__`` still
    runs; a name that is not a field raises ``TypeError`` as ``dataclasses.replace`` does."""
    current = vars(obj)  # exactly the fields: a dataclass keeps nothing else there
    unknown = changes.keys() - current.keys()
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {', '.join(sorted(unknown))}")
    new = object.__new__(type(obj))
    fields = vars(new)
    fields.update(current)
    fields.update(changes)
    post_init = getattr(new, "__post_init__", None)
    if post_init is not None:
        post_init()
    return new


class RecordError(ValueError):
    """A stored value is not a valid record of the expected kind."""


@dataclass(frozen=True)
class Record:
    """Base of all records: JSON encoding with a schema version."""

    kind: ClassVar[str] = "record"

    def to_json(self) -> bytes:
        # A shallow dict: records are flat, and ``dataclasses.asdict`` deep-copies every
        # field (the controller writes several records per decision). Same bytes.
        body = {"v": SCHEMA_VERSION, "kind": self.kind}
        for name in _field_names(type(self)):
            body[name] = getattr(self, name)
        return json.dumps(body, separators=(",", ":"), sort_keys=True, default=_nested).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Self:
        try:
            body = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise RecordError(f"{cls.kind}: not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise RecordError(f"{cls.kind}: expected a JSON object")
        version = body.get("v")
        if not isinstance(version, int):
            raise RecordError(f"{cls.kind}: missing schema version 'v'")
        if version > SCHEMA_VERSION:
            raise RecordError(
                f"{cls.kind}: schema v{version} is newer than this reader (v{SCHEMA_VERSION}); upgrade regroup"
            )
        if body.get("kind", cls.kind) != cls.kind:
            raise RecordError(f"expected a {cls.kind} record, got {body.get('kind')!r}")
        try:
            return cls(**{name: body[name] for name in _field_names(cls) if name in body})
        except (TypeError, ValueError) as exc:  # ValueError: a value an enum field does not know
            raise RecordError(f"{cls.kind}: {exc}") from exc


@dataclass(frozen=True)
class MemberRecord(Record):
    """One live torchrun agent (``members/<node>``), bound to the agent's etcd lease."""

    kind: ClassVar[str] = "member"
    node: str
    pod: str
    namespace: str
    round: int
    local_world_size: int
    restart_count: int = 0
    """How many times this node's workers failed and were restarted by its agent."""
    host: str = ""
    """Address the agent is reachable at (for round-scoped stores)."""
    joined_at: float = 0.0
    """Unix time the agent registered."""
    not_before: float = 0.0
    """Unix time before which this member should not be admitted to a round: it is on
    probation after its own workers failed, or its restarted workers are still starting."""
    warming_since: float = 0.0
    """Unix time its ``--standby`` workers began starting before it asks to join (0: up): no joiner till then."""
    leaving_since: float = 0.0
    """Unix time the agent was told to stop (SIGTERM: a pod deletion, an eviction, a drain);
    0 while it is not leaving. A leaving member asks for a planned leave: hand its state
    over at the next agreed step boundary, then go."""
    leaving_by: float = 0.0
    """Unix time by which the leaving agent must be gone (its grace period's end as the
    agent knows it); 0 while it is not leaving."""
    peer_failure_round: int = 0
    """The round in which one of this agent's workers saw a collective fail because a peer
    went away, with no re-form announced (0: none): the first evidence of a loss."""
    peer_failure_at: float = 0.0
    """Unix time of the first such failure in that round."""
    failed_peer: str = ""
    """The host the failed collective named ("" when the backend names none)."""
    silent_peers: list[str] = field(default_factory=list)
    """Members of that round whose lease then went a second unrenewed (``rendezvous.silent``): dead."""
    worker_exit: str = ""
    """Why a worker of this agent exited during an in-place re-form, likely, in one line
    (``regroup.rendezvous.inplace.exits``; "" if none did): the re-form became a restart."""
    worker_exit_round: int = 0
    """The round of the world that worker was in (or leaving) when it exited."""


@dataclass(frozen=True)
class ControllerPresence(Record):
    """Written by the controller, bound to its lease: while present, agents do not
    re-form on their own when nodes join; the controller batches joins and checkpoints first."""

    kind: ClassVar[str] = "controller"
    identity: str
    since: float


@dataclass(frozen=True)
class ExpectedMembership(Record):
    """The exact nodes of the next round (``control/expected``).

    The round closes the moment exactly these nodes (at least min) have joined, with no
    last-call wait. A node not listed leaves cleanly. A generation applies once: the
    rendezvous records the generation it consumed and ignores it afterwards.
    """

    kind: ClassVar[str] = "expected"
    generation: int
    nodes: list[str]
    reason: str = ""
    traceparent: str = ""


@dataclass(frozen=True)
class ReformRequest(Record):
    """``control/reform``: every agent whose round predates this generation stops its
    workers and re-rendezvouses within one monitor interval."""

    kind: ClassVar[str] = "reform"
    generation: int
    cause: str
    """A ``ReformCause`` value, kept a plain string: an agent acts on a request whose cause
    it does not know (one from a newer controller) instead of refusing the record."""
    reason: str = ""
    traceparent: str = ""
    requested_at: float = 0.0


@dataclass(frozen=True)
class CheckpointRequest(Record):
    """``control/checkpoint``: all ranks agree on one step boundary, save, and rank 0
    acks under ``acks/<generation>/commit``. With ``hold``, the trainer then waits at that
    boundary (until ``deadline``) for the re-form instead of training on, so no step is lost."""

    kind: ClassVar[str] = "checkpoint"
    generation: int
    deadline: float
    """Unix time after which the request is stale and ignored."""
    hold: bool = True
    reason: str = ""
    traceparent: str = ""
    requested_at: float = 0.0
    leaving: list[str] = field(default_factory=list)
    """The members (node names, or pod names with ``regroup.dev/member: pod``) the re-form
    that follows leaves out. Answered from memory, their ranks hand what they hold to
    staying ranks before the ack, so a rank lost after it costs no step."""


@dataclass(frozen=True)
class CheckpointAck(Record):
    """``acks/<generation>/commit``: the trainers hold the state of ``step`` for the
    re-form that follows: committed on disk (``stored``), or, in place, in the ranks' memory
    for the hand-off, with the storage checkpoint written in the background once the next
    world has resumed (``stored`` False)."""

    kind: ClassVar[str] = "ack"
    generation: int
    step: int
    checkpoint_id: str
    """The step's checkpoint folder name (written later when not ``stored``)."""
    duration_s: float
    world_size: int
    acked_at: float = 0.0
    stored: bool = True


@dataclass(frozen=True)
class Progress(Record):
    """``progress``: rank 0's last completed step."""

    kind: ClassVar[str] = "progress"
    step: int
    loss: float
    samples_seen: int
    world_size: int
    time: float
    tokens_per_s: float = 0.0
    resumed_from_step: int = 0
    """Step of the checkpoint this incarnation of the trainer resumed from (0: fresh start)."""
    restart_count: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    round: int = 0
    """Rendezvous round of the world this progress comes from (0: not reported)."""
    reform_mode: str = ""
    """How this world came to be: ``in-place`` (the survivors' processes were kept) or
    ``restart`` (worker processes were started for it); "" unknown or first start."""
    resume_phases: dict[str, float] = field(default_factory=dict)
    """Seconds rank 0 spent resuming this world, by phase among ``RESUME_PHASES``; set once
    the first step at the new size completed."""

    last_step: int = -1
    """The newest step any rank of the worlds before this one completed, as the trainers
    know it (the survivors' own last step, or the newest progress record they found on
    start): ``last_step - resumed_from_step`` steps were redone. -1: unknown."""

    RESUME_PHASES: ClassVar[tuple[str, ...]] = ("startup", "process_group", "reshard", "load", "first_step")
    """In the order they happen. ``startup`` (restart only): process start until the process
    group's init begins; ``reshard``: state redistributed in memory; ``load``: state read
    from a checkpoint."""


@dataclass(frozen=True)
class ReformPlan(Record):
    """``control/plan``: the controller's re-form of a job, in flight or the last finished.

    Written by the leader with compare-and-set on its revision, so a new leader continues
    exactly where the old one stopped. ``generation`` is the job's counter for checkpoint,
    expected and reform requests. Times are unix seconds; 0 means "not yet".
    """

    kind: ClassVar[str] = "plan"
    generation: int
    cause: ReformCause
    planned: bool
    """True while the re-form goes through a checkpoint first."""
    phase: ReformPhase
    reason: str
    nodes_before: list[str]
    nodes_after: list[str]
    trace_id: str
    """Hex trace id of the re-form's trace; the span ids derive from it."""
    detected_at: float
    decided_at: float
    round_before: int = 0
    checkpoint_requested_at: float = 0.0
    checkpoint_deadline: float = 0.0
    acked_at: float = 0.0
    ack_step: int = -1
    fallback: str = ""
    """Why a planned re-form went unplanned (missing ack, node gone first), if it did."""
    reform_requested_at: float = 0.0
    step_before: int = -1
    progress_revision: int = 0
    """Revision of ``progress`` when the re-form was requested: newer progress is post-re-form."""
    world_size_target: int = 0
    """Ranks expected in the trainer's ``progress.world_size`` after the re-form."""
    round_after: int = 0
    rendezvous_done_at: float = 0.0
    resumed_at: float = 0.0
    resumed_from_step: int = -1
    lost_steps: int = -1
    outcome: ReformOutcome = ReformOutcome.PENDING
    """Set once ``phase`` is done."""
    finished_at: float = 0.0
    why: str = ""
    """Why the plan ended as it did: for ``timeout`` and ``superseded``, the reason it was
    abandoned (shown in the Warning Event, the trace's status and ``regroup status``)."""
    mode: str = ""
    """``progress.reform_mode`` of the world the trainer resumed in ("" unknown)."""
    resume_phases: dict[str, float] = field(default_factory=dict)
    """``progress.resume_phases`` of that world: where the resume phase's time went."""
    strategy: str = ReformStrategy.ELASTIC.value
    """A ``ReformStrategy`` value: ``replace`` or ``migrate`` when waiting nodes take every
    vacated position and the world keeps its size, else ``elastic`` (a record written before
    strategies were recorded reads as ``elastic``)."""
    replaced: dict[str, str] = field(default_factory=dict)
    """Leaving or lost node -> the waiting node that takes its position in ``nodes_after``
    (its ranks and mesh coordinates)."""
    worker_exit: str = ""
    """The nodes whose workers exited during the re-form instead of re-forming in place,
    with the likely cause their agents recorded, in one line ("" if none): shown in the
    ``WorkerExitedInReform`` Event and the trace (``regroup.worker_exit``)."""

    def __post_init__(self) -> None:
        # JSON (and older callers) hand in plain strings; an unknown one raises ValueError,
        # which ``from_json`` reports as a RecordError.
        for name, kind in (("cause", ReformCause), ("phase", ReformPhase), ("outcome", ReformOutcome)):
            value = getattr(self, name)
            if type(value) is not kind:
                object.__setattr__(self, name, kind(value))


@dataclass(frozen=True)
class Exclusions(Record):
    """``control/excluded``: nodes no agent may bring (back) into the job.

    The controller writes a node here while it carries a reclaim notice or a cordon (a
    restart storm's included) and removes it when that lifts. The record outlives the
    controller's leadership: an agent restarted on such a node reads it and waits instead
    of joining, whether or not a controller is present at that moment.
    """

    kind: ClassVar[str] = "excluded"
    nodes: dict[str, str] = field(default_factory=dict)
    """node -> why (the taint, cordon or pod condition that excludes it)."""
    updated_at: float = 0.0


@dataclass(frozen=True)
class JobStatus(Record):
    """``control/status``: the controller's verdict on a job, read by ``regroup status``."""

    kind: ClassVar[str] = "status"
    state: str
    """healthy, reforming, waiting, stalled, bad-config or finished (the rendezvous is closed)."""
    reason: str
    node_count: int
    """Nodes in the job's current round (its active nodes), lost ones left out."""
    min_nodes: int = 0
    max_nodes: int = 0
    nodes: list[str] = field(default_factory=list)
    alerts: list[str] = field(default_factory=list)
    updated_at: float = 0.0
    since: float = 0.0
    """Unix time the job entered ``state`` (kept while it stays there; 0 from a writer that
    did not say): for ``finished``, the start of the clean-up's retention."""
    vacant_since: float = 0.0
    """Unix time since which the job has had no pod and no registered member (0: it has one,
    or the controller has not listed the pods yet): the retention of a job whose pods went."""
    spare_count: int = 0
    """Spare nodes: live members waiting to join (healthy, not excluded, not on probation)
    while the job trains at its max; the next loss or reclaim is answered with one of them."""
    spares: list[str] = field(default_factory=list)
    """The spare nodes, the one that replaces the next leaving node first."""
    spares_wanted: int = 0
    """How many spares the job asks for (``regroup.dev/spare-nodes``)."""
    warming: list[str] = field(default_factory=list)
    """Nodes outside the round whose standby workers still start (``MemberRecord.warming_since``)."""


@dataclass(frozen=True)
class FinishedJob(Record):
    """The tombstone of a finished job whose keys the controller removed
    (``regroup.keys.finished_root``): an agent that starts under the job reads it and meets a
    closed rendezvous, so it writes nothing and trains nothing."""

    kind: ClassVar[str] = "finished-job"
    finished_at: float
    """Unix time the controller saw the job finished (its rendezvous closed)."""
    removed_at: float
    """Unix time its keys were removed."""
    vacant_since: float = 0.0
    """Unix time since which the job has had no pod and no registered member (0: it has one):
    the tombstone goes ``retention`` after that, when nothing of the run can restart."""


def agent_id(member: MemberRecord) -> str:
    """Identity of one agent process: its node and the time it registered, so a restarted
    agent on the same node is a different agent from the one a round remembers."""
    return f"{member.node}@{member.joined_at!r}"


@dataclass(frozen=True)
class RoundState(Record):
    """The last round formed for the job (``rdzv/state``)."""

    kind: ClassVar[str] = "rdzv-state"
    min_nodes: int
    max_nodes: int
    round: int = 0
    """Number of the last formed round (0: none yet)."""
    nodes: list[str] = field(default_factory=list)
    """Nodes of the round, in rank order."""
    agents: list[str] = field(default_factory=list)
    """Agent ids of the round, parallel to ``nodes``."""
    hosts: list[str] = field(default_factory=list)
    """Addresses of the round's agents, parallel to ``nodes``."""
    reform_generation: int = 0
    """The ``control/reform`` generation already seen when this round formed."""
    expected_generation: int = 0
    """The last ``control/expected`` generation a round consumed."""
    excluded: list[str] = field(default_factory=list)
    """Agents left out by the consumed expected membership: they exit cleanly."""
    closed: bool = False
    """The job is finished: no more rounds (``set_closed``)."""
    formed_at: float = 0.0
    reason: str = ""
    """Why the round closed when it did."""

    def joined_at(self) -> dict[str, float]:
        """Node -> registration time of its agent in the round (from the agent ids)."""
        times = {}
        for agent in self.agents:
            node, sep, joined = agent.rpartition("@")
            if sep:
                try:
                    times[node] = float(joined)
                except ValueError:
                    continue
        return times


@dataclass(frozen=True)
class JoinRecord(Record):
    """An agent asking to be part of round ``round`` (``rdzv/joins/<node>``)."""

    kind: ClassVar[str] = "rdzv-join"
    node: str
    agent: str
    round: int
    host: str
    joined_at: float
    not_before: float = 0.0
    """Unix time before which the round does not wait for or count this agent: it is on
    probation after its own workers failed (in-place jobs train on without it meanwhile)."""
