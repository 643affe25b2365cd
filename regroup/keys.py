"""The etcd key layout every part of regroup shares (DESIGN contract 3).

This is the one place the layout is written down. All keys of a job live under
``/regroup/jobs/<namespace>/<job>/``::

    members/<node>            MemberRecord, bound to the agent's lease
    rdzv/state                RoundState: the last formed round; compare-and-set on
                              its mod_revision (owned by rendezvous/)
    rdzv/joins/<node>         JoinRecord: an agent wants into a round (bound to its lease)
    rdzv/rounds/<round>/<key...>
                              the agents' c10d store of one round (raw values)
    control/controller        ControllerPresence, bound to the controller's lease:
                              while it exists, agents leave joins to the controller
    control/expected          ExpectedMembership for the next round
    control/reform            ReformRequest ("re-form now", with a generation)
    control/checkpoint        CheckpointRequest ("checkpoint now", with a generation)
    control/plan              ReformPlan: the controller's re-form in flight (or the last
                              one, finished), so a new leader continues it; also the
                              job's generation counter
    control/status            JobStatus: the controller's verdict on the job, for
                              ``regroup status``
    control/excluded          Exclusions: nodes under a reclaim notice or cordoned, which
                              no agent may bring back into the job until that lifts
    acks/<generation>/commit  CheckpointAck, written by trainer rank 0 once committed;
                              the controller deletes those older than the generation
                              before its plan's (no one reads them any more)
    progress                  Progress, written by trainer rank 0

``rdzv/rounds/`` holds one round's store at a time: the agent that closes a round deletes
the stores of the earlier ones in the same transaction.

Beside the jobs, outside their prefix (``/regroup/finished/`` for the default prefix
``/regroup/jobs``: the prefix's last segment replaced, ``finished_root``)::

    <namespace>/<job>         FinishedJob, the tombstone of a finished job whose keys
                              the controller removed: agents read it on start and
                              treat the job as closed, so a pod restarted after the
                              clean-up writes nothing and trains nothing

A job's keys go in one delete of its whole root, never while an agent of it is registered:
``retention`` after it finished (its tombstone written in the same transaction), or
``retention`` after its pods and members were all gone (no tombstone: a job created again
under the name starts afresh). The tombstone goes once the job has had no pod and no member
for ``retention`` (``docs/controller.md``, "Clean-up").

``KeyKind`` and ``RECORDS`` hold the same layout as a table, and ``decode`` reads any key
of a job (and its value) by it. The module imports nothing heavy: the controller image
has no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from regroup.records import (
    CheckpointAck,
    CheckpointRequest,
    ControllerPresence,
    Exclusions,
    ExpectedMembership,
    FinishedJob,
    JobStatus,
    JoinRecord,
    MemberRecord,
    Progress,
    Record,
    ReformPlan,
    ReformRequest,
    RoundState,
)

DEFAULT_PREFIX = "/regroup/jobs"
DEFAULT_NAMESPACE = "default"
FINISHED = "finished"
"""The last segment of the tombstones' root, beside the jobs' prefix."""


def finished_root(prefix: str = DEFAULT_PREFIX) -> str:
    """Where the tombstones of the jobs under ``prefix`` live: beside it, with its last
    segment replaced by ``finished`` (``/regroup/jobs`` -> ``/regroup/finished/``). Outside
    the jobs' prefix, so removing a job's keys leaves its tombstone. ValueError for a prefix
    with no segment or whose last segment is ``finished`` (the two would overlap)."""
    parent, _, last = prefix.rstrip("/").rpartition("/")
    if not last or last == FINISHED:
        raise ValueError(
            f"an etcd prefix needs a last segment other than {FINISHED!r} (tombstones go beside it): {prefix!r}"
        )
    return f"{parent}/{FINISHED}/"


@dataclass(frozen=True)
class JobKeys:
    """Keys of one job, identified by its namespace and its ``regroup.dev/job`` label."""

    namespace: str
    job: str
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        for field, value in (("namespace", self.namespace), ("job", self.job)):
            if not value or "/" in value:
                raise ValueError(f"JobKeys.{field} must be non-empty and contain no '/': {value!r}")

    @property
    def root(self) -> str:
        return f"{self.prefix.rstrip('/')}/{self.namespace}/{self.job}/"

    # members/
    @property
    def members(self) -> str:
        return self.root + "members/"

    def member(self, node: str) -> str:
        return self.key(KeyKind.MEMBER, node=node)

    # rdzv/
    @property
    def rdzv(self) -> str:
        return self.root + "rdzv/"

    @property
    def joins(self) -> str:
        return self.rdzv + "joins/"

    # control/
    @property
    def control(self) -> str:
        return self.root + "control/"

    @property
    def controller(self) -> str:
        return self.key(KeyKind.CONTROLLER)

    @property
    def expected(self) -> str:
        return self.key(KeyKind.EXPECTED)

    @property
    def reform(self) -> str:
        return self.key(KeyKind.REFORM)

    @property
    def checkpoint(self) -> str:
        return self.key(KeyKind.CHECKPOINT)

    @property
    def plan(self) -> str:
        return self.key(KeyKind.PLAN)

    @property
    def status(self) -> str:
        return self.key(KeyKind.STATUS)

    @property
    def excluded(self) -> str:
        return self.key(KeyKind.EXCLUDED)

    # acks/
    @property
    def acks(self) -> str:
        return self.root + "acks/"

    def ack(self, generation: int) -> str:
        return self.key(KeyKind.ACK, generation=generation)

    # progress
    @property
    def progress(self) -> str:
        return self.key(KeyKind.PROGRESS)

    # beside the jobs
    @property
    def tombstone(self) -> str:
        """``FinishedJob`` of this job, outside its root (see ``finished_root``)."""
        return f"{finished_root(self.prefix)}{self.namespace}/{self.job}"

    @classmethod
    def parse_tombstone(cls, key: str, prefix: str = DEFAULT_PREFIX) -> JobKeys | None:
        """The job whose tombstone ``key`` is, or None."""
        head = finished_root(prefix)
        if not key.startswith(head):
            return None
        namespace, sep, job = key[len(head) :].partition("/")
        if not sep or not namespace or not job or "/" in job:
            return None
        return cls(namespace, job, prefix)

    @classmethod
    def parse(cls, key: str, prefix: str = DEFAULT_PREFIX) -> tuple[JobKeys, str] | None:
        """Split a full key into its job and the part below the job root, or None."""
        head = prefix.rstrip("/") + "/"
        if not key.startswith(head):
            return None
        parts = key[len(head) :].split("/", 2)
        if len(parts) < 3 or not parts[0] or not parts[1]:
            return None
        return cls(parts[0], parts[1], prefix), parts[2]

    def key(self, kind: KeyKind, **params: str | int) -> str:
        """The full key of ``kind`` with its parameters, e.g. ``key(KeyKind.ACK, generation=3)``."""
        return self.root + kind.format(**params)


class KeyKind(enum.StrEnum):
    """What a key of a job is, as its pattern below the job's root: ``<name>`` stands for
    one segment, ``<name...>`` for the rest of the key."""

    MEMBER = "members/<node>"
    ROUND_STATE = "rdzv/state"
    JOIN = "rdzv/joins/<node>"
    ROUND_STORE = "rdzv/rounds/<round>/<key...>"
    CONTROLLER = "control/controller"
    EXPECTED = "control/expected"
    REFORM = "control/reform"
    CHECKPOINT = "control/checkpoint"
    PLAN = "control/plan"
    STATUS = "control/status"
    EXCLUDED = "control/excluded"
    ACK = "acks/<generation>/commit"
    PROGRESS = "progress"

    def format(self, **params: str | int) -> str:
        """The key below the job's root, parameters filled in."""
        if "<" not in self.value:
            return self.value
        parts = []
        for part in self.value.split("/"):
            if part.startswith("<"):
                part = str(params[part.strip("<.>")])
            parts.append(part)
        return "/".join(parts)

    @classmethod
    def match(cls, rest: str) -> tuple[KeyKind, dict[str, str]] | None:
        """What ``rest`` (a key below a job's root) is, and its parameters; None when it is
        nothing of the layout."""
        exact = _EXACT.get(rest)
        if exact is not None:
            return exact, {}
        segments = rest.split("/")
        for kind, pattern in _PATTERNS.get(segments[0], ()):
            params = _bind(pattern, segments)
            if params is not None:
                return kind, params
        return None


RECORDS: Mapping[KeyKind, type[Record] | None] = {
    KeyKind.MEMBER: MemberRecord,
    KeyKind.ROUND_STATE: RoundState,
    KeyKind.JOIN: JoinRecord,
    KeyKind.ROUND_STORE: None,
    KeyKind.CONTROLLER: ControllerPresence,
    KeyKind.EXPECTED: ExpectedMembership,
    KeyKind.REFORM: ReformRequest,
    KeyKind.CHECKPOINT: CheckpointRequest,
    KeyKind.PLAN: ReformPlan,
    KeyKind.STATUS: JobStatus,
    KeyKind.EXCLUDED: Exclusions,
    KeyKind.ACK: CheckpointAck,
    KeyKind.PROGRESS: Progress,
}
"""The record stored under each kind of key (None: raw bytes, not a record of ours)."""

_EXACT = {kind.value: kind for kind in KeyKind if "<" not in kind.value}
_PATTERNS: dict[str, list[tuple[KeyKind, list[str]]]] = {}
for _kind in KeyKind:
    if "<" in _kind.value:
        _segments = _kind.value.split("/")
        _PATTERNS.setdefault(_segments[0], []).append((_kind, _segments))


def _bind(pattern: list[str], segments: list[str]) -> dict[str, str] | None:
    params: dict[str, str] = {}
    for i, part in enumerate(pattern):
        if part.endswith("...>"):
            rest = "/".join(segments[i:])
            if not rest:
                return None
            params[part[1:-4]] = rest
            return params
        if i >= len(segments) or not segments[i]:
            return None
        if part.startswith("<"):
            params[part[1:-1]] = segments[i]
        elif part != segments[i]:
            return None
    return params if len(segments) == len(pattern) else None


@dataclass(frozen=True)
class JobKey:
    """A key of a job, read: whose it is, what it is, its parameters and its record."""

    job: JobKeys
    kind: KeyKind
    params: Mapping[str, str] = field(default_factory=dict)
    record: Record | None = None
    """The value, decoded by ``RECORDS`` (None for a delete, or a kind with no record)."""


def read_record(kind: KeyKind, value: bytes | None) -> Record | None:
    """``value`` as the record ``RECORDS`` names for ``kind``; ``RecordError`` when it is not one."""
    cls = RECORDS[kind]
    return None if cls is None or value is None else cls.from_json(value)


def decode(key: str, value: bytes | None = None, prefix: str = DEFAULT_PREFIX) -> JobKey | None:
    """Read a full key (and the value it holds; None for a delete) by the layout: None for
    a key outside any job or not in the layout, ``RecordError`` for a value that is not the
    record its key holds."""
    parsed = JobKeys.parse(key, prefix)
    if parsed is None:
        return None
    job, rest = parsed
    found = KeyKind.match(rest)
    if found is None:
        return None
    kind, params = found
    return JobKey(job, kind, params, read_record(kind, value))
