"""In-place re-forms (under ``regroup-run``): the process outlives its world. At an agreed
boundary, or when a collective failed because a peer went away, it leaves the process
group, keeps what it can of the state in memory (its shards, the leaving ranks' handed
over, the snapshots), forms the next world through ``ElasticWorld``, rebuilds what
depends on the world and restores the state into it."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING

import structlog

from regroup.rendezvous.inplace.membership import Interrupted, Membership, ReformFailed
from regroup.trainer.boundary import Boundary
from regroup.trainer.distributed import Runtime, runtime_on_default_group
from regroup.trainer.handoff import hand_off
from regroup.trainer.reshard import HeldState, hold_state
from regroup.trainer.world_change import WorldChange

if TYPE_CHECKING:
    from typing import Any

    import torch
    from torch import nn

    from regroup.rendezvous.inplace.world import ElasticWorld
    from regroup.trainer.app_state import TrainerState
    from regroup.trainer.checkpoint import Checkpointer
    from regroup.trainer.config import TrainConfig
    from regroup.trainer.progress import Counters
    from regroup.trainer.snapshot import Snapshots
    from regroup.trainer.stopping import StopSignal

log = structlog.get_logger("regroup.trainer")

# How long a rank at the agreed boundary waits for its own agent's announcement (which says
# whether its node is leaving): agents announce within one monitor interval of each other.
_ANNOUNCE_WAIT = timedelta(seconds=2)


class InPlaceReforms:
    """Changing world in place (a part of ``regroup.trainer.loop.TrainingRun``; ``_attach``,
    ``resume`` and ``_fault_step`` are the run's)."""

    cfg: TrainConfig
    rt: Runtime
    world: ElasticWorld | None
    stop: StopSignal
    state: TrainerState
    counters: Counters
    change: WorldChange
    checkpointer: Checkpointer | None
    snapshots: Snapshots | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    resumed_from: int
    _sample_log: Any

    def _reform_due(self) -> bool:
        return self.world is not None and self.world.reform_due()

    def _leave_if_due(self, decided: Boundary) -> None:
        """An announced re-form, or a peer stopping while this rank was not asked to (its
        node is leaving the job), ends this world here, at a boundary every rank agreed on."""
        if self.world is None or not self.world.in_place:
            return
        if decided.reform or (decided.stop and not self.stop.requested):
            raise Interrupted("re-form at this step boundary" if decided.reform else "a peer is leaving")

    def reform(self, clean: bool) -> bool:
        """Leave this world, form the next one, rebuild and restore; False if a stop came
        while waiting (the caller exits). ``clean``: every rank left at one agreed boundary,
        so the state in memory is consistent; otherwise only committed checkpoints are."""
        assert self.world is not None
        self.counters.state = "re-forming"
        if self.checkpointer is not None:
            if clean and self.checkpointer.in_flight_step is not None:
                try:
                    self.checkpointer.finish()
                except Exception as exc:  # a peer vanished mid-save: that save never commits
                    log.warning("in-flight checkpoint failed with the world", error=str(exc)[:200])
                    self.checkpointer.abandon()
            else:
                self.checkpointer.abandon()
        old_world, old_step = self.rt.world_size, self.state.step
        refuse_at = self._fault_step("refuse_reform")
        if refuse_at is not None and old_step >= refuse_at:
            raise ReformFailed(f"injected: rank {self.rt.rank} refuses the re-form at step {old_step}")
        held, leaving = self._hold_in_memory(clean) if self.cfg.reform.in_memory else ([], False)
        if self.snapshots is not None:
            if not leaving and self.cfg.reform.in_memory:
                # The newest step the survivors hold whole wins: the live state after an agreed
                # boundary, else the snapshots (a node lost without notice, a failed hand-off).
                held += self.snapshots.held()
            self.snapshots.close()
            self.snapshots = None
        if leaving:
            # This node is leaving the job: its shards are with a survivor; its agent stops it.
            self.world.leave()
            self.stop.wait(self.world.timeout.total_seconds())
            return False
        while True:
            self.change = WorldChange(mode="in-place")
            try:
                membership = self.world.rejoin(stop=lambda: self.stop.requested, timeout=self.cfg.reform.wait)
            except ReformFailed:
                if self.stop.requested:
                    return False
                raise
            try:
                runtime = self._restore_in(membership, held)
                break
            except Exception as exc:
                # The new world lost a member before it trained (its collectives failed): the
                # state held in memory is intact, so form the next world with it.
                if not self.world.interrupted(exc):
                    raise
                log.warning("the new world failed while restoring; forming the next one", round=membership.round,
                            why=str(exc)[:200])
        del held
        if not {"reshard", "load"} & set(self.change.phases) and self.state.step:
            # Nothing in memory or committed to restore: start over, as a restarted job would.
            self.state.step = self.state.samples_seen = 0
        log.info(
            "re-formed in place",
            round=membership.round,
            rank=runtime.rank,
            world_size=f"{old_world}->{runtime.world_size}",
            step=f"{old_step}->{self.state.step}",
            phases=self.change.phases,
        )
        return True

    def _restore_in(self, membership: Membership, held: list[HeldState]) -> Runtime:
        """Build this rank's part of the world just formed and restore the state into it."""
        assert self.world is not None
        started = time.perf_counter()
        structlog.contextvars.bind_contextvars(rank=membership.rank)
        runtime = runtime_on_default_group(self.rt.local_rank, self.rt.device, self.world.timeout)
        self.change.add("process_group", self.world.last_process_group_s + time.perf_counter() - started)
        self.change.traceparent = membership.traceparent
        if self._sample_log is not None:
            self._sample_log.close()
        self._attach(runtime, None)
        self.resumed_from = 0
        self.resume(held)
        return runtime

    def _hold_in_memory(self, clean: bool) -> tuple[list[HeldState], bool]:
        """At an agreed boundary: keep this rank's shards, and take part in the hand-off of
        leaving ranks' shards over the old world. Returns (states held, this rank is leaving).
        Any failure (a peer gone meanwhile) leaves the checkpoint to restore from."""
        if not clean or self.world is None:
            return [], False
        try:
            own = hold_state(self.model, self.optimizer, self.rt.rank, self.rt.world_size, self.state.step)
        except ValueError as exc:
            log.warning("cannot hold the state in memory", why=str(exc)[:200])
            return [], False
        note = self.world.announcement(_ANNOUNCE_WAIT)
        leaving = bool(note is not None and note.pending and note.leaving)
        try:
            return hand_off(own, leaving), leaving
        except Exception as exc:  # a peer went away during the hand-off
            log.warning("shard hand-off failed; the checkpoint will be used", why=str(exc)[:200])
            return ([] if leaving else [own]), leaving
