"""What the campaign watches while it runs: etcd, the checkpoint folder, the processes.

Every observer pokes one ``Changes``; a fault or a check waits on a condition over what
they saw (``Changes.until``), never on a fixed sleep.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import structlog
import torch.distributed.checkpoint  # noqa: F401 - torch takes seconds to import: before any event loop runs

from regroup.demo.local_cluster import LocalCluster
from regroup.demo.nodes import RunLayout
from regroup.demo.processes import process_tree
from regroup.demo.recorder import JobRecorder
from regroup.elastic.checkpoint.folders import list_steps
from regroup.etcd import EtcdSettings
from regroup.keys import JobKey, JobKeys, KeyKind
from regroup.records import CheckpointAck, JoinRecord, Progress, ReformPhase, RoundState

log = structlog.get_logger("bench.chaos")

T = TypeVar("T")

RUN_MARKER_ENV = "REGROUP_CHAOS_RUN"
"""Set in every agent's environment (and so in its workers'): how the leak check finds
any process of this run, however it was re-parented."""


class Changes:
    """Wakes every waiter whenever an observer saw something new."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Event] = set()

    def notify(self) -> None:
        for waiter in self._waiters:
            waiter.set()

    async def until(self, predicate: Callable[[], T], timeout: float) -> T | None:
        """The first truthy value of ``predicate`` (re-checked at each change), or None
        once ``timeout`` seconds passed without one."""
        waiter = asyncio.Event()
        self._waiters.add(waiter)
        try:
            async with asyncio.timeout(timeout):
                while not (value := predicate()):
                    await waiter.wait()
                    waiter.clear()
                return value
        except TimeoutError:
            return None
        finally:
            self._waiters.discard(waiter)


# ---------------------------------------------------------------- etcd


@dataclass(frozen=True)
class SeenJoin:
    """A join record as it appeared: who wants into which round, and whether that agent
    belongs to the round formed now (a survivor re-forming, not a newcomer)."""

    seen: float
    node: str
    round: int
    survivor: bool


@dataclass(frozen=True)
class SeenAck:
    seen: float
    ack: CheckpointAck


class JobWatcher(JobRecorder):
    """The demo's recorder (progress, members, plans to the run folder), keeping in memory
    what the faults and the checks need: every progress record, join record, ack and the
    round formed now."""

    def __init__(self, settings: EtcdSettings, keys: JobKeys, layout: RunLayout, changes: Changes) -> None:
        super().__init__(settings, keys, layout.progress, layout.members, layout.root / "plans.jsonl")
        self.changes = changes
        self.progress: list[Progress] = []
        self.joins: list[SeenJoin] = []
        self.acks: list[SeenAck] = []
        self.round_state: RoundState | None = None
        self.live_joins: set[str] = set()
        """Nodes with a join record in etcd now."""
        self.view.progress_listeners.append(self.progress.append)

    def _apply(self, found: JobKey) -> None:
        super()._apply(found)
        record, now = found.record, time.time()
        if found.kind is KeyKind.JOIN:
            (self.live_joins.add if record is not None else self.live_joins.discard)(found.params["node"])
        if isinstance(record, RoundState):
            self.round_state = record
        elif isinstance(record, JoinRecord):
            state = self.round_state
            survivor = state is not None and record.round > state.round and record.node in state.nodes
            self.joins.append(SeenJoin(now, record.node, record.round, survivor))
        elif isinstance(record, CheckpointAck):
            self.acks.append(SeenAck(now, record))
        self.changes.notify()

    @property
    def world(self) -> list[str]:
        """Nodes of the round formed now (empty before the first)."""
        return list(self.round_state.nodes) if self.round_state is not None else []

    def reform_in_flight(self) -> bool:
        plan = self.view.plan
        return plan is not None and plan.phase != ReformPhase.DONE


# ---------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint as the watcher first saw it."""

    step: int
    committed_at: float
    """From its commit marker."""
    first_seen: float
    world_size: int


@dataclass(frozen=True)
class Finding:
    """An invariant violation seen at ``time`` (the campaign files it under the fault
    whose window holds that time)."""

    time: float
    invariant: int
    message: str


@dataclass
class CheckpointWatcher:
    """Scans the checkpoint folder: every commit ever seen, saves in flight, and committed
    checkpoints that vanish without retention explaining it (invariant 2)."""

    root: Path
    keep_last: int
    changes: Changes
    period: float = 0.2
    fast_period: float = 0.01
    committed: dict[int, Committed] = field(default_factory=dict)
    present: set[int] = field(default_factory=set)
    """Committed steps on disk at the last scan."""
    saving: set[int] = field(default_factory=set)
    """Step folders without a marker, newer than every committed one: saves in flight."""
    findings: list[Finding] = field(default_factory=list)
    fast: int = 0
    """Waiters that need saves seen within ``fast_period``."""

    async def run(self) -> None:
        while True:
            self.scan(list_steps(self.root))
            await asyncio.sleep(self.fast_period if self.fast else self.period)

    def scan(self, steps: list[tuple[int, bool]]) -> None:
        now = time.time()
        committed = {step for step, ok in steps if ok}
        for step in sorted(committed - self.present):
            if step not in self.committed:
                self._first_sight(step, now)
        for step in sorted(self.present - committed):
            newer = sorted(s for s in committed if s > step)
            if len(newer) < self.keep_last:
                self._find(
                    now, f"committed checkpoint step-{step} vanished; only {len(newer)} newer committed "
                    f"({newer}) remain and retention keeps {self.keep_last}",
                )  # fmt: skip
        newest = max(committed, default=-1)
        saving = {step for step, ok in steps if not ok and step > newest}
        changed = committed != self.present or saving != self.saving
        self.present, self.saving = committed, saving
        if changed:
            self.changes.notify()

    def _first_sight(self, step: int, now: float) -> None:
        folder = self.root / f"step-{step}"
        try:
            marker = json.loads((folder / "COMMITTED").read_text())
        except (OSError, ValueError) as exc:
            # Pruned between the listing and this read: not a problem of the checkpoint.
            if folder.exists():
                self._find(now, f"step-{step}: commit marker unreadable: {exc}")
            return
        committed_at, world_size = float(marker.get("committed_at", 0.0)), int(marker.get("world_size", 0))
        self.committed[step] = Committed(step, committed_at, now, world_size)
        if marker.get("step") != step:
            self._find(now, f"step-{step}: commit marker names step {marker.get('step')}")
        metadata = folder / ".metadata"
        if folder.exists() and not (metadata.is_file() and metadata.stat().st_size > 0):
            self._find(now, f"step-{step}: committed without a complete .metadata")

    def _find(self, now: float, message: str) -> None:
        log.warning("checkpoint invariant", message=message)
        self.findings.append(Finding(now, 2, message))

    def committed_before(self, step: int, moment: float) -> bool:
        """Whether ``step`` had a commit marker written before ``moment``."""
        seen = self.committed.get(step)
        return seen is not None and min(seen.committed_at, seen.first_seen) <= moment

    def newest_committed_before(self, moment: float) -> int | None:
        steps = [c.step for c in self.committed.values() if min(c.committed_at, c.first_seen) <= moment]
        return max(steps, default=None)


# ---------------------------------------------------------------- processes


def _start_time(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[19])


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:160]
    except OSError:
        return "?"


@dataclass
class ProcessLedger:
    """Every process this run started that the ledger has seen: each agent's tree, sampled,
    and each etcd incarnation. Only ever read; the leak check compares start times, so a
    reused pid is never mistaken for one of ours."""

    seen: dict[int, tuple[int, str]] = field(default_factory=dict)
    """pid -> (start time in clock ticks, command line)."""

    def add(self, pid: int | None) -> None:
        if pid is None or pid in self.seen:
            return
        started = _start_time(pid)
        if started is not None:
            self.seen[pid] = (started, _command(pid))

    def sample(self, cluster: LocalCluster, nodes: list[str]) -> None:
        for node in nodes:
            agent = cluster.agent_pid(node)
            if agent is None:
                continue
            for pid, started in process_tree(agent).items():
                if pid not in self.seen:
                    self.seen[pid] = (started, _command(pid))

    async def run(self, cluster: LocalCluster, nodes: list[str], period: float = 1.0) -> None:
        while True:
            self.sample(cluster, nodes)
            await asyncio.sleep(period)

    def alive(self) -> list[str]:
        """The ledger's processes still running (same pid, same start time)."""
        return [f"{pid} {cmd}" for pid, (started, cmd) in sorted(self.seen.items()) if _start_time(pid) == started]


def marked_processes(marker: str) -> list[str]:
    """Live processes whose environment carries this run's marker (read from /proc)."""
    needle = f"{RUN_MARKER_ENV}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0") and _start_time(int(entry)) is not None:
            found.append(f"{entry} {_command(int(entry))}")
    return found
