"""The per-node channel between an in-place agent and its workers: two kinds of files.

The agent owns ``world.json`` (a ``NodeWorld``): what world its workers are in, or that a
re-form is pending. It replaces the file atomically; workers only read it (a ``stat`` per
step boundary, a read when it changed). Each worker owns ``worker-<local_rank>.json`` (a
``WorkerReport``): its pid, that it takes part in in-place re-forms, and the round it runs.
Files, not sockets: either side may die or restart at any moment and the other reads the
last state written, nothing is buffered, and nothing here imports torch.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Generic, TypeVar

from regroup.records import Record, RecordError

T = TypeVar("T")

CHANNEL_ENV = "REGROUP_INPLACE_DIR"
"""Set by the in-place agent in its workers' environment: the channel folder."""
MEMBER_ENV = "REGROUP_MEMBER"
"""Set by the in-place agent in its workers' environment: its member key (the node name, or
the pod name with ``regroup.dev/member: pod``), as the controller's requests name it."""
STANDBY_ENV = "REGROUP_STANDBY"
"""``1`` when the worker was started before its rank was known: it waits for ``world.json``."""
RESTART_ONLY_ENV = "REGROUP_RESTART_ONLY"
"""``1`` when the agent runs with ``--in-place=off``: it restarts its workers on every
re-form, so they take their worlds from the channel but never re-form in place."""

WORLD_FILE = "world.json"

REFORMING = "re-forming"
"""A worker's state (``WorkerReport.state``) from the moment its world ends for a re-form
until it leaves it."""

WAIT_EXPIRED = "in-place wait expired"
"""The one log event (a warning) of every bounded wait of the in-place hand-off that runs
out, on either side of the channel: ``waited_for`` (what), ``timeout_s`` and
``not_answered`` (who, and the last state each of them reported or wrote)."""


@dataclass(frozen=True)
class RankSlot:
    """One local worker's place in the world (what torchrun puts in RANK, WORLD_SIZE...)."""

    rank: int
    world_size: int
    role_rank: int
    role_world_size: int


@dataclass(frozen=True)
class NodeWorld(Record):
    """``world.json``: the world this node's workers belong to, written by the agent.

    ``seq`` grows with every write. ``pending`` says a re-form has begun and the workers
    should leave their process group at the next step boundary; the round and ranks are
    then still the old ones. A write with ``pending`` false and a newer ``round`` is the
    new world.
    """

    kind: ClassVar[str] = "node-world"
    seq: int
    round: int
    pending: bool
    master_addr: str
    master_port: int
    group_rank: int
    group_world_size: int
    slots: dict[str, RankSlot] = field(default_factory=dict)
    """Local rank (as a string: JSON keys) -> its place."""
    restart_count: int = 0
    reason: str = ""
    leaving: bool = False
    """With ``pending``: this node is left out of the next world (the controller's expected
    membership excludes it). Its workers hand their shards to survivors before they go."""
    traceparent: str = ""
    """W3C traceparent of the controller request the re-form answers, if any."""
    written_at: float = 0.0

    def slot(self, local_rank: int) -> RankSlot:
        raw = self.slots[str(local_rank)]
        return raw if isinstance(raw, RankSlot) else RankSlot(**raw)  # type: ignore[arg-type]

    @classmethod
    def read(cls, folder: Path) -> NodeWorld | None:
        try:
            return cls.from_json((folder / WORLD_FILE).read_bytes())
        except (OSError, RecordError):
            return None


@dataclass(frozen=True)
class WorkerReport(Record):
    """``worker-<local_rank>.json``: a worker that takes part in in-place re-forms."""

    kind: ClassVar[str] = "worker-report"
    local_rank: int
    pid: int
    round: int
    """The round of the process group it runs in (0: none yet)."""
    state: str
    """``waiting`` (for a world), ``running``, ``re-forming`` (its world ends for a re-form:
    agreed at a step boundary, or a collective failed for one) or ``leaving`` (its old group)."""
    written_at: float = 0.0
    peer_failure_round: int = 0
    """The round in which a collective of this worker failed because a peer went away (0:
    none): the first evidence of a loss, which the agent passes on to the controller."""
    peer_failure_at: float = 0.0
    """Unix time of that failure."""
    failed_peer: str = ""
    """The host the failed collective named (gloo does; "" when the backend does not)."""

    @classmethod
    def read(cls, folder: Path, local_rank: int) -> WorkerReport | None:
        try:
            return cls.from_json((folder / report_name(local_rank)).read_bytes())
        except (OSError, RecordError):
            return None


def describe_world(world: NodeWorld | None, now: float | None = None) -> dict[str, object]:
    """What the agent last wrote in ``world.json``, for a log line."""
    if world is None:
        return {"last_state": "nothing written"}
    state = ("pending, leaving" if world.leaving else "pending") if world.pending else "world handed out"
    return {
        "last_state": state,
        "last_round": world.round,
        "last_seq": world.seq,
        "reason": world.reason,
        "written_s_ago": round((time.time() if now is None else now) - world.written_at, 1),
    }


def describe_report(report: WorkerReport | None, pid: int, now: float | None = None) -> dict[str, object]:
    """Worker process ``pid``'s last report (``report``: the file's, maybe an earlier
    process's), for a log line."""
    if report is None:
        return {"pid": pid, "last_state": "no report"}
    if report.pid != pid:
        return {"pid": pid, "last_state": f"no report (the file is of an earlier process, pid {report.pid})"}
    return {
        "pid": pid,
        "last_state": report.state,
        "last_round": report.round,
        "reported_s_ago": round((time.time() if now is None else now) - report.written_at, 1),
    }


def report_name(local_rank: int) -> str:
    return f"worker-{local_rank}.json"


def write_atomically(path: Path, body: bytes) -> None:
    """Replace ``path`` with ``body`` so that a reader sees the old or the new file, whole."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.write(fd, body)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class StampedFile(Generic[T]):
    """A cheap change detector for a channel file the other side replaces whole
    (``write_atomically``): ``poll`` re-reads it only when its inode, mtime or size moved
    (every write replaces the file, so a new write is a new inode); a ``stat`` otherwise."""

    def __init__(self, path: Path, load: Callable[[], T | None]) -> None:
        self.path = path
        self._load = load
        self._stamp: tuple[int, int, int] | None = None
        self.latest: T | None = None

    def poll(self) -> T | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return self.latest
        stamp = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        if stamp != self._stamp:
            value = self._load()
            if value is not None:
                self._stamp = stamp
                self.latest = value
        return self.latest


class WorldFile(StampedFile[NodeWorld]):
    """``world.json`` of a channel folder, read on change."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder / WORLD_FILE, lambda: NodeWorld.read(folder))


def report_file(folder: Path, local_rank: int) -> StampedFile[WorkerReport]:
    """A worker's report in a channel folder, read on change."""
    return StampedFile(folder / report_name(local_rank), lambda: WorkerReport.read(folder, local_rank))
