"""Records a job as etcd sees it: progress, membership, the controller's plan and status.

One watch on the job's key prefix (re-established from the last seen revision if it
breaks) keeps a live ``JobView`` for the terminal view and appends every progress
record, membership change and re-form plan to JSON-lines files for the report.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from regroup.etcd import EtcdSettings, EventKind, close_watch, connect, open_watch
from regroup.keys import JobKeys
from regroup.records import (
    CheckpointAck,
    CheckpointRequest,
    JobStatus,
    MemberRecord,
    Progress,
    RecordError,
    ReformPlan,
)

log = structlog.get_logger("demo.recorder")


@dataclass
class JobView:
    """The latest of everything, for the live view."""

    progress: Progress | None = None
    progress_seen_at: float = 0.0
    members: dict[str, MemberRecord] = field(default_factory=dict)
    plan: ReformPlan | None = None
    status: JobStatus | None = None
    checkpoint: CheckpointRequest | None = None
    acked_generations: set[int] = field(default_factory=set)
    progress_listeners: list[Any] = field(default_factory=list)


def _append(path: Path, body: dict[str, Any]) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(body, separators=(",", ":")) + "\n")


class JobRecorder:
    """Watches one job's keys until cancelled; see the module docstring."""

    def __init__(
        self, settings: EtcdSettings, keys: JobKeys, progress_file: Path, members_file: Path, plans_file: Path
    ) -> None:
        self.view = JobView()
        self._settings = settings
        self._keys = keys
        self._progress_file = progress_file
        self._members_file = members_file
        self._plans_file = plans_file
        self._last_plan: tuple[int, str] | None = None

    async def run(self) -> None:
        client = await connect(self._settings)
        try:
            snapshot = await client.get_prefix(self._keys.root.encode())
            for kv in snapshot:
                self._apply(kv.key.decode(), kv.value, deleted=False)
            revision = snapshot.header.revision
            while True:
                try:
                    watch = await open_watch(client, self._keys.root.encode(), start_revision=revision + 1)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - etcd down (restarting): try again
                    log.warning("cannot watch, retrying", revision=revision, error=repr(exc))
                    await asyncio.sleep(0.5)
                    continue
                try:
                    async for event in watch:
                        revision = max(revision, event.kv.mod_revision)
                        self._apply(event.kv.key.decode(), event.kv.value, deleted=event.kind == EventKind.DELETE)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - a broken watch is re-established
                    log.warning("watch broke, re-watching", revision=revision, error=repr(exc))
                    await asyncio.sleep(0.5)
                finally:
                    await asyncio.shield(close_watch(watch))
        finally:
            await client.close()

    def _apply(self, key: str, value: bytes, deleted: bool) -> None:
        parsed = JobKeys.parse(key, self._keys.prefix)
        if parsed is None:
            return
        rest = parsed[1]
        now = time.time()
        try:
            if rest == "progress" and not deleted:
                self._on_progress(Progress.from_json(value), now)
            elif rest.startswith("members/"):
                node = rest.removeprefix("members/")
                if deleted:
                    self.view.members.pop(node, None)
                else:
                    self.view.members[node] = MemberRecord.from_json(value)
                self._on_members(now)
            elif rest == "control/plan" and not deleted:
                self._on_plan(ReformPlan.from_json(value))
            elif rest == "control/status" and not deleted:
                self.view.status = JobStatus.from_json(value)
            elif rest == "control/checkpoint" and not deleted:
                self.view.checkpoint = CheckpointRequest.from_json(value)
            elif rest.startswith("acks/") and not deleted:
                self.view.acked_generations.add(CheckpointAck.from_json(value).generation)
        except RecordError as exc:
            log.warning("unreadable record", key=key, error=str(exc))

    def _on_progress(self, progress: Progress, now: float) -> None:
        self.view.progress = progress
        self.view.progress_seen_at = now
        body = asdict(progress)
        body.pop("extra", None)
        _append(self._progress_file, {"seen": now, **body})
        for listener in self.view.progress_listeners:
            listener(progress)

    def _on_members(self, now: float) -> None:
        members = self.view.members
        _append(
            self._members_file,
            {
                "t": now,
                "nodes": sorted(members),
                "restarts": {n: m.restart_count for n, m in sorted(members.items())},
                "rounds": {n: m.round for n, m in sorted(members.items())},
            },
        )

    def _on_plan(self, plan: ReformPlan) -> None:
        self.view.plan = plan
        key = (plan.generation, plan.phase)
        if key != self._last_plan:
            self._last_plan = key
            _append(self._plans_file, {"seen": time.time(), **asdict(plan)})
