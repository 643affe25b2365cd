"""What the demo knows of a run while it plays: the scenario, the cluster, the recorder, the
flaky nodes, the events so far (appended to the run's events file) and the live view's snapshot."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import timedelta

import structlog

from regroup.demo.live import LiveSnapshot, phase_of
from regroup.demo.local_cluster import ClusterEvent, LocalCluster
from regroup.demo.nodes import CONTROLLED, Mode, RunLayout, append_jsonl
from regroup.demo.recorder import JobRecorder
from regroup.demo.scenario import Scenario

log = structlog.get_logger("demo")


@dataclass
class FlakyNode:
    """A node whose rank crashes once the job trained ``crash_after_steps`` steps past
    the checkpoint it resumed from, every incarnation (0: as soon as the rank starts)."""

    node: str
    crash_after_steps: int
    last_crash: float = 0.0
    crashes: int = 0


@dataclass
class RunState:
    scenario: Scenario
    mode: Mode
    layout: RunLayout
    cluster: LocalCluster | None = None
    recorder: JobRecorder | None = None
    launched_at: float = 0.0
    trained_at: float = 0.0
    """When the job first trained."""
    started_at: float = 0.0
    """When the scenario's clock started (``regroup.demo.runner.start_clock``): once the job
    trained and settled, its spares waiting. Scenario times count from here."""
    delay: float = 0.0
    """Seconds the script was pushed back waiting for the job to settle (see ``regroup.demo.runner``)."""
    flaky: dict[str, FlakyNode] = field(default_factory=dict)
    dealt_with: dict[str, float] = field(default_factory=dict)
    """Flaky node -> when the run first saw it cordoned or gone."""
    recent: list[str] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)
    played: int = 0
    """How many of the scenario's events have been played so far."""
    job_over: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once an agent exits 0 (the cluster's ``Completed`` event): the job finished,
    whatever the scenario still had to play."""

    def record(
        self, source: str, reason: str, message: str, nodes: tuple[str, ...] = (), type_: str = "Normal",
        at: float | None = None,
    ) -> None:
        """Append an event to the run's events file (``at``: a scenario event's scripted time,
        seconds on the scenario's clock)."""
        now = time.time()
        body: dict[str, object] = {"time": now, "source": source, "reason": reason, "message": message,
                                   "nodes": list(nodes), "type": type_}  # fmt: skip
        if at is not None:
            body["at"] = at
        append_jsonl(self.layout.events, body)
        at = now - (self.started_at or self.launched_at or now)
        self.recent = (self.recent + [f"{at:5.1f}s  {source:<10} {reason}: {message}"])[-6:]
        log.info("event", source=source, reason=reason, message=message, nodes=list(nodes))

    def on_cluster_event(self, event: ClusterEvent) -> None:
        self.record(event.source, event.reason, event.message, (event.name.removesuffix("-worker"),), event.type)
        if event.reason == "Completed" and event.source == "cluster":
            self.job_over.set()

    def snapshot(self) -> LiveSnapshot:
        now = time.time()
        elapsed = now - self.started_at if self.started_at else 0.0
        if not self.started_at and self.trained_at:
            upcoming_text = f"waiting for the job to settle ({now - self.trained_at:.0f}s since its first step)"
        elif not self.started_at and self.launched_at:
            upcoming_text = f"waiting for the first training step ({now - self.launched_at:.0f}s since the agents started)"
        else:
            upcoming_text = None
        view = self.recorder.view if self.recorder else None
        progress = view.progress if view else None
        script_time = max(0.0, elapsed - self.delay)
        upcoming = self.scenario.next_event(timedelta(seconds=script_time))
        next_text = upcoming_text
        if upcoming is not None and upcoming_text is None:
            next_text = f"in {upcoming.at.total_seconds() - script_time:3.0f}s: {upcoming.describe()}"
        return LiveSnapshot(
            title=f"regroup demo · {self.scenario.name} · {self.mode} · {self.layout.root}",
            elapsed=elapsed,
            duration=self.scenario.duration.total_seconds(),
            step=progress.step if progress else None,
            # The record written at (re)start carries the checkpoint step and no loss yet.
            loss=progress.loss if progress and progress.step > progress.resumed_from_step else None,
            world_size=progress.world_size if progress else None,
            phase=phase_of(view, now) if view else "starting",
            next_event=next_text,
            nodes=tuple((n, self.node_state(n)) for n in self.scenario.nodes),
            recent=tuple(self.recent),
        )

    def node_state(self, name: str) -> str:
        cluster = self.cluster
        node = cluster.node(name) if cluster else None
        if node is None:
            return "gone" if name in self.gone else "-"
        if node.unschedulable:
            return "cordoned"
        notice = next((t for t in node.taints if t.time_added is not None), None)
        if self.mode in CONTROLLED:
            view = self.recorder.view if self.recorder else None
            if view is not None and name in view.spares(time.time(), self.scenario.job.max_nodes):
                state = "spare"
            else:
                state = "member" if view is not None and name in view.members else "joining"
        else:
            # Plain torchrun registers nothing in etcd: all there is to show is a live agent.
            state = "agent up" if cluster is not None and cluster.agent_pid(name) else "agent down"
        if notice is not None and notice.value.isdigit():
            state += f", reclaim in {max(0, int(notice.value) - int(time.time()))}s"
        if name in self.flaky:
            state += ", flaky"
        return state
