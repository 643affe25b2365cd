"""Where a ``Run`` starts in a new world (a part of ``regroup.elastic.Run``): the state
resharded from the survivors' memory when they hold it all at one agreed step, else the
newest committed checkpoint; the step every rank agrees it resumed from, and the run's seed."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.distributed as dist

from regroup.elastic.checkpoint.folders import latest_committed
from regroup.elastic.memory.reshard import HeldState, last_moved, redistribute
from regroup.elastic.randomness import set_seed

if TYPE_CHECKING:
    from torch import nn

    from regroup.elastic.checkpoint.app_state import AppState, TrainerState
    from regroup.elastic.checkpoint.checkpointer import Checkpointer
    from regroup.elastic.session import Session
    from regroup.elastic.state import State
    from regroup.elastic.world.batching import BatchPlan
    from regroup.elastic.world.control import JobChannel
    from regroup.elastic.world.runtime import Runtime
    from regroup.elastic.world.world_change import WorldChange

log = structlog.get_logger("regroup.trainer")


class Resuming:
    """Restoring the state for this world, and what the ranks agree on to do it."""

    session: Session
    rt: Runtime
    plan: BatchPlan
    state: TrainerState
    app: AppState
    user_state: State
    model: nn.Module
    optimizer: torch.optim.Optimizer
    checkpointer: Checkpointer | None
    channel: JobChannel | None
    change: WorldChange
    seed: int
    last_step: int
    resumed_from: int
    _give_back: bool
    _store_due: bool

    def resume(self, held: list[HeldState] | None = None) -> None:
        """Restore the state for this world. From memory when the survivors hold every old
        rank's shards at one agreed step (a grow, a planned shrink whose leavers handed theirs
        over, snapshots after a loss); else from the newest committed checkpoint (any world
        size). Every rank takes part, fresh or surviving, and all take the same path."""
        if self.checkpointer is not None:
            self.checkpointer.prepare()
        self.last_step = self._last_step_before()
        t0 = time.perf_counter()
        stored = latest_committed(self.checkpointer.root) if self.checkpointer is not None else None
        try:
            step = redistribute(
                self.model, self.optimizer, held or None, torch.distributed.group.WORLD, not_before=stored or 0
            )
            self._restore_carried(step)
        except ValueError as exc:
            if held:
                log.warning("state cannot be rebuilt in memory; loading the checkpoint", why=str(exc)[:300])
        else:
            self.session.held = []
            self._give_back = True  # the old world's state and snapshots are unreachable now
            self.change.add("reshard", time.perf_counter() - t0)
            # layout, received_bytes, sent_bytes: at the old size only replaced positions receive.
            moved = last_moved()
            self._resumed_at(step, "resharded in memory", **(moved.summary() if moved else {}))
            # An ack from memory, a grow or a loss rebuilt from snapshots: write it down soon.
            self._store_due = self.checkpointer is not None and (stored or 0) < step
            return
        if self.checkpointer is None:
            return
        t0 = time.perf_counter()
        step = self.checkpointer.load_latest(self.app)
        load_s = time.perf_counter() - t0
        if step is None:
            return
        self.session.held = []
        self._give_back = True
        self.change.add("load", load_s)
        self._resumed_at(step, "resumed", load_s=round(load_s, 3), plan=str(self.plan))

    def _last_step_before(self) -> int:
        """Collective: the newest step any rank completed in an earlier world, from what the
        ranks know: a survivor's own (in place), the record its node keeps of the steps its
        agent's workers completed (the restart path, where no process survives), and rank 0's
        reading of the progress record the world before left, both its step and the newest
        one before that world (a world that failed before it got past it does not lower it).
        -1 if none knows. The ranks agree on the run's seed in the same reduction (the highest)."""
        last = self.session.last_step
        if self.session.node_steps is not None:
            last = max(last, self.session.node_steps.read())
        previous = self.channel.progress_before() if self.channel is not None else None
        if previous is not None:
            last = max(last, previous.step, previous.last_step)
        if self.rt.world_size > 1:
            newest = torch.tensor([last, self.seed], dtype=torch.int64)
            dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=self.rt.control_group)
            last, self.seed = int(newest[0]), int(newest[1])
        set_seed(self.seed)
        return last

    def _resumed_at(self, step: int, event: str, **fields: Any) -> None:
        self.state.step, self.state.samples_seen = step, step * self.plan.global_batch
        if not self.change.mode and self.session.world.warm:
            # A standby or spare worker that waited for this world: no process was started for
            # it, and its start-up, long before, is no part of this re-form.
            self.change.mode = "in-place"
            self.change.phases.pop("startup", None)
        if not self.change.mode:
            self.change.mode = "restart"  # a process started for a world that had state
        self.resumed_from = step
        log.info(event, step=step, world_size=self.rt.world_size, **fields)

    def _keep_carried(self) -> None:
        self.session.keep_carried(self.state.step, self.user_state.carried_state())

    def _restore_carried(self, step: int) -> None:
        """Collective: the small state of ``step`` from the lowest rank that kept it (the
        shards came from memory, so some survivor did). ValueError on every rank if none."""
        if not self.user_state.carried():
            return
        mine = self.session.carried_at.get(step)
        kept: list[Any] = [None] * self.rt.world_size
        dist.all_gather_object(kept, mine is not None, group=self.rt.control_group)
        source = next((rank for rank, has in enumerate(kept) if has), None)
        if source is None:
            raise ValueError(f"no survivor kept the scheduler and extras of step {step}")
        payload: list[Any] = [mine]
        dist.broadcast_object_list(payload, group=self.rt.control_group, group_src=source)
        self.user_state.load_carried(payload[0])
