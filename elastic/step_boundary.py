"""The end of a ``Run``'s step (a part of ``regroup.elastic.Run``): the step counted, the
agreement of every rank at its boundary (one small all-reduce), and what it decides: a
checkpoint request honoured, a snapshot, a periodic save, progress, a stop or a re-form."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import structlog

from regroup.elastic.memory.host_memory import give_back
from regroup.elastic.state import MisuseError
from regroup.elastic.world.boundary import Boundary, agree
from regroup.elastic.world.control import pending_generation
from regroup.records import CheckpointRequest

if TYPE_CHECKING:
    import torch

    from regroup.elastic.checkpoint.app_state import AppState, TrainerState
    from regroup.elastic.checkpoint.checkpointer import Checkpointer
    from regroup.elastic.memory.snapshot import Snapshots
    from regroup.elastic.options import Options
    from regroup.elastic.session import Session
    from regroup.elastic.step import Step
    from regroup.elastic.world.batching import BatchPlan
    from regroup.elastic.world.control import JobChannel
    from regroup.elastic.world.progress import Counters
    from regroup.elastic.world.runtime import Runtime

log = structlog.get_logger("regroup.trainer")


class StepBoundary:
    """Counting a step done and acting on what every rank agreed at its boundary."""

    cfg: Options
    session: Session
    rt: Runtime
    plan: BatchPlan
    state: TrainerState
    app: AppState
    optimizer: torch.optim.Optimizer
    counters: Counters
    checkpointer: Checkpointer | None
    snapshots: Snapshots | None
    channel: JobChannel | None
    samples_per_s: float
    tokens_per_s: float
    last_loss: float
    _sample_log: Any
    _give_back: bool
    _store_due: bool
    _last_save_time: float

    def _complete(self, step: Step) -> None:
        """A step's work is done on this rank: count it, agree at the boundary, act on it."""
        done = step.index + 1
        if self.snapshots is not None:
            # The lost-step bound: a step counts once a snapshot at most max_every steps older is held.
            self.counters.snapshot_stall_s += self.snapshots.before_step_counts(done)
        compute_s = time.perf_counter() - step._started
        self.state.step = done
        self.state.samples_seen = done * self.plan.global_batch
        if self.session.node_steps is not None:
            self.session.node_steps.record(done)
        if compute_s > 0:
            self.samples_per_s = self.plan.global_batch / compute_s
            self.tokens_per_s = step._tokens * self.rt.world_size / compute_s
        local_loss = float("nan") if step._loss is None else step._loss
        if self._sample_log is not None:
            # The round and the time say which world trained this step and when: an audit can
            # then rebuild the kept trajectory, where a resumed world's steps replace the ones it redoes.
            record = {
                "step": done,
                "ids": list(self.plan.step_ids(step.index)),
                "loss": local_loss,
                "restart": self.info.restart_count,
                "round": self.world.round,
                "t": time.time(),
            }
            self._sample_log.write(json.dumps(record) + "\n")
            self._sample_log.flush()
        decided, request = self.boundary(local_loss, step._started)
        self.last_loss = decided.loss
        if not self.change.first_step_done:
            self._resumed(time.perf_counter() - step._started)
        if self._give_back:
            # Once the new world has trained and said so: off the re-form's critical path.
            self._give_back = False
            give_back()
        if self.rt.rank == 0 and done % self.cfg.log_every == 0:
            log.info(
                "step",
                step=done,
                loss=decided.loss,
                lr=self.optimizer.param_groups[0].get("lr"),
                samples_per_s=round(self.samples_per_s, 2),
                tokens_per_s=round(self.tokens_per_s, 1),
                cpu_s=round(time.process_time(), 4),
            )
        if decided.stop:
            self.stop_now()
            return
        if self.checkpointer is not None:
            self.checkpointer.poll()
            if decided.generation:
                self.honour_request(decided.generation, request)
                if self.hold(request):
                    self.stop_now()
                    return
            elif self._periodic_due(decided) and done < self.cfg.max_steps:
                self.save(wait=False)
        if self.rt.rank == 0 and time.monotonic() - self._last_progress_time >= self._progress_interval():
            self.publish()
        floor = self.cfg.step_time_floor.total_seconds()
        if floor:
            # Wakes early on a stop; the stop itself is agreed at the next boundary.
            self.stop.wait(floor - (time.perf_counter() - step._started))

    def boundary(self, local_loss: float, started: float = 0.0) -> tuple[Boundary, CheckpointRequest | None]:
        """The agreement of every rank at this step boundary, and what follows from it for
        snapshots. ``started``: ``time.perf_counter()`` when the step began."""
        request = None
        generation = 0
        save_due = False
        if self.rt.rank == 0:
            now = time.time()
            if self.channel is not None and self.checkpointer is not None:
                request = self.channel.request()
                generation = pending_generation(request, now, self.channel.answered, self.channel.reformed)
            every = self.cfg.checkpoint.every.total_seconds()
            save_due = self._store_due or (every > 0 and time.monotonic() - self._last_save_time >= every)
        decided = agree(
            self.rt.control_group,
            self.rt.world_size,
            generation=generation,
            stop=self.stop.requested,
            save_due=save_due,
            loss=local_loss,
            reform=self._reform_due(),
            snapshot_done=self.snapshots is None or self.snapshots.done(self.state.step),
            snapshot_cost=0.0 if self.snapshots is None else self.snapshots.observe(time.perf_counter() - started),
            step=self.state.step,
        )
        if not decided.same_step:
            raise MisuseError(
                f"the ranks reached this step boundary at different steps (this rank at {self.state.step}): "
                "every rank must train every step of `for step in run:`, none skipped or added"
            )
        self._leave_if_due(decided)
        if self.snapshots is not None and not decided.stop:
            self.snapshots.agreed(decided.snapshot_done, decided.snapshot_cost)
            if self.snapshots.due(self.state.step):
                self._keep_carried()
                self.snapshots.take(self.state.step)
            self.snapshots.settled()
        return decided, request if decided.generation else None

    def _periodic_due(self, decided: Boundary) -> bool:
        every = self.cfg.checkpoint.every_steps
        return decided.save_due or (every > 0 and self.state.step % every == 0)

    def save(self, *, wait: bool) -> float:
        assert self.checkpointer is not None
        result = self.checkpointer.save(self.app, self.state.step, use_async=None)
        if wait:
            self.checkpointer.finish()
        self.counters.checkpoint_saves += 1
        self.counters.last_stall_s = result.stall_s
        self._last_save_time = time.monotonic()
        self._store_due = False
        return result.stall_s
