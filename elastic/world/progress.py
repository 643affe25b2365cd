"""What rank 0 tells etcd about the run: the ``progress`` record, published every
``etcd.progress_interval``, at once after the first step in a new world, and before
anything could resume from the step reached; and the trainer's resume span."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from regroup.records import Progress
from regroup.telemetry import context_from_traceparent

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from regroup.rendezvous.inplace.world import ElasticWorld
    from regroup.elastic.checkpoint.app_state import TrainerState
    from regroup.elastic.checkpoint.checkpointer import Checkpointer
    from regroup.elastic.options import Options
    from regroup.elastic.world.control import JobChannel
    from regroup.elastic.world.runtime import Runtime
    from regroup.elastic.session import RunInfo
    from regroup.elastic.memory.snapshot import Snapshots
    from regroup.elastic.world.world_change import WorldChange

# How long rank 0 waits for etcd to take its progress before a commit or a re-form.
_RECORD_WAIT = timedelta(milliseconds=500)


@dataclass
class Counters:
    """What this process did; published in ``progress.extra`` so tests and dashboards see it."""

    checkpoint_saves: int = 0
    """Saves started (periodic, on request, at the end)."""
    requests_honoured: int = 0
    """Checkpoint requests saved for (and acked by rank 0)."""
    last_stall_s: float = 0.0
    """Time the loop was blocked by the latest save."""
    snapshot_stall_s: float = 0.0
    """Time the loop waited for in-memory snapshot copies, in total."""
    state: str = "starting"
    """starting, training, holding, stopped or finished."""


class ProgressReports:
    """The training run's progress publishing (a part of ``regroup.elastic.Run``)."""

    cfg: Options
    rt: Runtime
    info: RunInfo
    world: ElasticWorld | None
    state: TrainerState
    counters: Counters
    change: WorldChange
    channel: JobChannel | None
    checkpointer: Checkpointer | None
    snapshots: Snapshots | None
    tracer: Tracer
    last_loss: float
    tokens_per_s: float
    samples_per_s: float
    resumed_from: int
    last_step: int
    _last_progress_time: float

    def progress(self) -> Progress:
        """The ``progress`` record of this moment."""
        c = self.counters
        return Progress(
            step=self.state.step,
            loss=0.0 if math.isnan(self.last_loss) else self.last_loss,
            samples_seen=self.state.samples_seen,
            world_size=self.rt.world_size,
            time=time.time(),
            tokens_per_s=self.tokens_per_s,
            resumed_from_step=self.resumed_from,
            last_step=self.last_step,
            restart_count=self.info.restart_count,
            round=self.world.round if self.world is not None else 0,
            reform_mode=self.change.mode,
            resume_phases=dict(self.change.phases),
            extra={
                "state": c.state,
                # How often this record comes: a reader tells a stopped job from a quiet one.
                "progress_interval_s": self._progress_interval() if self.cfg.etcd else None,
                "samples_per_s": round(self.samples_per_s, 3),
                "checkpoint_saves": c.checkpoint_saves,
                "requests_honoured": c.requests_honoured,
                "last_checkpoint_stall_s": round(c.last_stall_s, 6),
                "last_committed_step": None if self.checkpointer is None else self.checkpointer.last_committed,
                **self._snapshot_progress(),
            },
        )

    def _snapshot_progress(self) -> dict[str, Any]:
        snapshots = self.snapshots
        if snapshots is None:
            return {}
        return {
            "snapshot_every": snapshots.every,
            "snapshot_max_every": snapshots.max_every,
            "snapshot_step": None if snapshots.committed is None else snapshots.committed.step,
            "snapshot_stall_s": round(self.counters.snapshot_stall_s, 6),
            "snapshot_host_bytes": snapshots.host_bytes,
        }

    def last_words(self) -> Progress:
        """Progress for a forced exit (the watchdog's): the last completed step."""
        self.counters.state = "stopped"
        return self.progress()

    def _record_reached(self) -> None:
        """Rank 0 publishes the step reached before anything can resume from it (a commit
        marker, leaving the world): no resume point is ever newer than the progress seen."""
        if self.channel is not None:
            self.channel.publish_progress(self.progress(), wait=True, timeout=_RECORD_WAIT)
            self._last_progress_time = time.monotonic()

    def publish(self, wait: bool = False) -> None:
        """Rank 0: publish the progress (``wait``: until etcd has taken it)."""
        if self.channel is not None:
            self.channel.publish_progress(self.progress(), wait=wait)
            self._last_progress_time = time.monotonic()

    def _progress_interval(self) -> float:
        return self.cfg.etcd.progress_interval.total_seconds() if self.cfg.etcd else float("inf")

    def _resumed(self, step_s: float) -> None:
        """After the first step in a new world: record it, publish at once, emit the span."""
        change = self.change
        change.add("first_step", step_s)
        change.first_step_done = True
        if self.rt.rank != 0:
            return
        self.publish()
        if not (self.resumed_from or change.mode):
            return  # the job's first start resumed nothing
        traceparent = change.traceparent
        if not traceparent and self.channel is not None and self.channel.latest_reform is not None:
            traceparent = self.channel.latest_reform.traceparent
        attributes: dict[str, Any] = {
            "regroup.resumed_from_step": self.resumed_from,
            "regroup.world_size": self.rt.world_size,
            "regroup.restart_count": self.info.restart_count,
            "regroup.reform.mode": change.mode or "start",
        }
        attributes.update({f"regroup.resume.{k}_s": v for k, v in change.phases.items()})
        if "load" in change.phases:
            attributes["regroup.load_duration_s"] = change.phases["load"]
        span = self.tracer.start_span(
            "regroup.trainer.resume",
            context=context_from_traceparent(traceparent),
            start_time=change.started_ns,
            attributes=attributes,
        )
        span.end()
