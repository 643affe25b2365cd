"""Records a job as etcd sees it: progress, membership, rounds, the controller's plan and status.

A reflector of the job's key prefix keeps a live ``JobView`` for the terminal view (and
the script's settle checks: who waits to join, who is a spare) and appends every progress
record, membership change, formed round and re-form plan to JSON-lines files for the
report. When etcd restarts, the reflector lists the keys again; only what changed since is
recorded, as a watch would have delivered it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from regroup.demo.nodes import append_jsonl
from regroup.etcd import Deleted, EtcdSettings, Listed, Put, Reflector, ReflectorEvent, connect
from regroup.keys import JobKey, JobKeys, KeyKind, decode
from regroup.records import (
    CheckpointAck,
    CheckpointRequest,
    Exclusions,
    JobStatus,
    JoinRecord,
    MemberRecord,
    Progress,
    RecordError,
    ReformPlan,
    RoundState,
)

log = structlog.get_logger("regroup.demo.recorder")


@dataclass
class JobView:
    """The latest of everything, for the live view."""

    progress: Progress | None = None
    progress_seen_at: float = 0.0
    progress_arrivals: deque[float] = field(default_factory=lambda: deque(maxlen=21))
    """When the last progress records were seen, oldest first: the job's publishing pace."""
    members: dict[str, MemberRecord] = field(default_factory=dict)
    plan: ReformPlan | None = None
    status: JobStatus | None = None
    checkpoint: CheckpointRequest | None = None
    acked_generations: set[int] = field(default_factory=set)
    progress_listeners: list[Any] = field(default_factory=list)
    round_state: RoundState | None = None
    """The last round formed (``rdzv/state``): its nodes in rank order."""
    joins: dict[str, JoinRecord] = field(default_factory=dict)
    """Node -> its agent's live request to join a round (``rdzv/joins/<node>``)."""
    excluded: frozenset[str] = frozenset()
    """Nodes the controller keeps out of the job (a reclaim notice, a cordon)."""

    def waiting(self, now: float) -> list[str]:
        """The nodes waiting outside the round formed last: a live join record, not in that
        round, not on probation and not excluded."""
        in_round = set(self.round_state.nodes) if self.round_state is not None else set()
        return sorted(
            node
            for node, join in self.joins.items()
            if node not in in_round and join.not_before <= now and node not in self.excluded
        )

    def spares(self, now: float, max_nodes: int) -> list[str]:
        """The job's warm spares: the nodes waiting while its round is at ``max_nodes``
        (below it, a waiting node is a joiner the job grows by)."""
        at_max = self.round_state is not None and len(self.round_state.nodes) >= max_nodes
        return self.waiting(now) if at_max else []


class JobRecorder:
    """Watches one job's keys until cancelled; see the module docstring."""

    def __init__(
        self,
        settings: EtcdSettings,
        keys: JobKeys,
        progress_file: Path,
        members_file: Path,
        plans_file: Path,
        rounds_file: Path | None = None,
    ) -> None:
        self.view = JobView()
        self._settings = settings
        self._keys = keys
        self._progress_file = progress_file
        self._members_file = members_file
        self._plans_file = plans_file
        self._rounds_file = rounds_file
        self._last_plan: tuple[int, str] | None = None
        self._revisions: dict[str, int] = {}
        """Key -> mod_revision of every key applied so far (a listing applies only what differs)."""

    async def run(self) -> None:
        client = await connect(self._settings)
        try:
            reflector = Reflector(client, self._keys.root, self._on_event, name=f"recorder-{self._keys.job}")
            await reflector.list()
            await reflector.run()
        finally:
            await client.close()

    def _on_event(self, event: ReflectorEvent) -> None:
        if not isinstance(event, Listed):
            self._changed(event)
            return
        # The first listing, or one after etcd restarted: apply what is new to this recorder.
        listed = {item.key for item in event.items}
        for key in [k for k in self._revisions if k not in listed]:
            self._changed(Deleted(key, event.revision))
        for item in event.items:
            if self._revisions.get(item.key) != item.revision:
                self._changed(item)

    def _changed(self, event: Put | Deleted) -> None:
        if isinstance(event, Put):
            self._revisions[event.key] = event.revision
        else:
            self._revisions.pop(event.key, None)
        try:
            found = decode(event.key, event.value if isinstance(event, Put) else None, self._keys.prefix)
        except RecordError as exc:
            log.warning("unreadable record", key=event.key, error=str(exc))
            return
        if found is not None:
            self._apply(found)

    def _apply(self, found: JobKey) -> None:
        """One key of the job changed (``found.record`` is None once deleted)."""
        now, record = time.time(), found.record
        if found.kind is KeyKind.MEMBER:
            if isinstance(record, MemberRecord):
                self.view.members[found.params["node"]] = record
            else:
                self.view.members.pop(found.params["node"], None)
            self._on_members(now)
        elif found.kind is KeyKind.JOIN:
            if isinstance(record, JoinRecord):
                self.view.joins[found.params["node"]] = record
            else:
                self.view.joins.pop(found.params["node"], None)
        elif found.kind is KeyKind.EXCLUDED:
            self.view.excluded = frozenset(record.nodes) if isinstance(record, Exclusions) else frozenset()
        elif isinstance(record, RoundState):
            self._on_round(record, now)
        elif isinstance(record, Progress):
            self._on_progress(record, now)
        elif isinstance(record, ReformPlan):
            self._on_plan(record)
        elif isinstance(record, JobStatus):
            self.view.status = record
        elif isinstance(record, CheckpointRequest):
            self.view.checkpoint = record
        elif isinstance(record, CheckpointAck):
            self.view.acked_generations.add(record.generation)

    def _on_progress(self, progress: Progress, now: float) -> None:
        self.view.progress = progress
        self.view.progress_seen_at = now
        self.view.progress_arrivals.append(now)
        body = asdict(progress)
        body.pop("extra", None)
        append_jsonl(self._progress_file, {"seen": now, **body})
        for listener in self.view.progress_listeners:
            listener(progress)

    def _on_members(self, now: float) -> None:
        members = self.view.members
        append_jsonl(
            self._members_file,
            {
                "t": now,
                "nodes": sorted(members),
                "restarts": {n: m.restart_count for n, m in sorted(members.items())},
                "rounds": {n: m.round for n, m in sorted(members.items())},
            },
        )

    def _on_round(self, state: RoundState, now: float) -> None:
        before = self.view.round_state
        self.view.round_state = state
        if self._rounds_file is not None and (before is None or before.round != state.round) and state.round:
            append_jsonl(
                self._rounds_file,
                {"seen": now, "round": state.round, "nodes": list(state.nodes), "formed_at": state.formed_at,
                 "reason": state.reason},
            )  # fmt: skip

    def _on_plan(self, plan: ReformPlan) -> None:
        self.view.plan = plan
        key = (plan.generation, plan.phase)
        if key != self._last_plan:
            self._last_plan = key
            append_jsonl(self._plans_file, {"seen": time.time(), **asdict(plan)})
