"""In-place re-forms (under ``regroup-run``), the leaving half: at an agreed boundary, or
when a collective failed because a peer went away, a run's world ends; it keeps what it can
of the state in memory (its shards, the leaving ranks' handed over, the snapshots) for the
next world, which ``regroup.elastic.session`` forms and the next run restores into.

The world ends with ``Reform``, a ``BaseException``: the script's ``except Exception`` and a
wrapper's (``@hydra.main``) let it through to ``in_place``. The run also tells the session
(``Session.ended``), so that a script that catches it anyway cannot turn the re-form into
an exit or a return."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

import structlog
import torch.distributed as dist

from regroup.rendezvous.inplace.membership import Reform, ReformFailed
from regroup.elastic.world.boundary import Boundary
from regroup.elastic.memory.handoff import hand_off, secure
from regroup.elastic.memory.reshard import HeldState, hold_state

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn

    from regroup.rendezvous.inplace.world import ElasticWorld
    from regroup.elastic.checkpoint.app_state import TrainerState
    from regroup.elastic.checkpoint.checkpointer import Checkpointer
    from regroup.elastic.world.runtime import Runtime
    from regroup.elastic.options import Options
    from regroup.elastic.session import Session
    from regroup.elastic.world.progress import Counters
    from regroup.elastic.memory.snapshot import Snapshots
    from regroup.elastic.world.stopping import StopSignal
    from regroup.records import CheckpointRequest

log = structlog.get_logger("regroup.trainer")

# How long a rank at the agreed boundary waits for its own agent's announcement (which says
# whether its node is leaving): agents announce within one monitor interval of each other.
_ANNOUNCE_WAIT = timedelta(seconds=2)


class InPlaceReforms:
    """Leaving a world in place (a part of ``regroup.elastic.Run``; ``_attach``,
    ``resume`` and ``_fault_step`` are the run's)."""

    cfg: Options
    session: Session
    rt: Runtime
    world: ElasticWorld | None
    stop: StopSignal
    state: TrainerState
    counters: Counters
    checkpointer: Checkpointer | None
    snapshots: Snapshots | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    _fault_step: Callable[[str], int | None]
    _secured: tuple[int, frozenset[int], list[HeldState]] | None = None
    """(step, ranks whose state staying ranks hold, what this rank received) of the last
    ``secure_leavers`` in this world."""

    def _reform_due(self) -> bool:
        """Whether this rank's agent announced a re-form (asked before each agreement).
        A world whose groups were aborted for one can agree on nothing more: it ends here
        (the script caught the failed collective of its step and went on)."""
        if self.world is None or not self.world.in_place:
            return False
        if self.world.aborted:
            raise self._end_world("the world's groups were aborted for a re-form", clean=False)
        return self.world.reform_due()

    def _leave_if_due(self, decided: Boundary) -> None:
        """An announced re-form, or a peer stopping while this rank was not asked to (its
        node is leaving the job), ends this world here, at a boundary every rank agreed on."""
        if self.world is None or not self.world.in_place:
            return
        if decided.reform or (decided.stop and not self.stop.requested):
            raise self._end_world("re-form at this step boundary" if decided.reform else "a peer is leaving")

    @contextmanager
    def _world_failures(self) -> Iterator[None]:
        """Around the step boundary: a collective of it that fails for a re-form (a peer
        gone, the groups aborted after an announcement) ends the world with ``Reform``, not
        with the backend's error, which the script's ``except Exception`` would catch."""
        try:
            yield
        except Exception as exc:
            if self.world is None or not self.world.in_place or not self.world.interrupted(exc):
                raise
            raise self._end_world(f"a collective of the step boundary failed: {exc}", clean=False) from exc

    def _end_world(self, why: str, clean: bool = True) -> Reform:
        """The ``Reform`` that ends this world (``clean``: at a boundary every rank agreed
        on), told to the session and to the agent before it is raised."""
        ended = Reform(why, clean=clean)
        self.session.ended = ended
        if self.world is not None:
            self.world.reform_begins(why)
        return ended

    def secure_leavers(self, request: CheckpointRequest | None) -> None:
        """Collective, at the boundary of a planned re-form's memory ack, before the ack:
        the ranks of the members the request names as leaving send the snapshots they hold
        of this step to staying ranks (``regroup.elastic.memory.handoff.secure``), so a rank
        lost between the ack and the re-form costs no step. Nothing without snapshots."""
        if self.world is None or not self.world.in_place or not self.cfg.reform.in_memory:
            return
        box = [list(request.leaving) if request is not None else []]
        dist.broadcast_object_list(box, src=0, group=self.rt.control_group)
        names = set(box[0])
        snapshots = self.snapshots
        if not names or snapshots is None or not snapshots.ready or self.rt.world_size == 1:
            return
        step = self.state.step
        done = secure(snapshots, step, leaving=bool(self.world.member) and self.world.member in names)
        self._secured = (step, done.ranks, done.received)
        if done.ranks and self.rt.rank == 0:
            log.info("leaving ranks secured their state", step=step, ranks=sorted(done.ranks), members=sorted(names))

    def leave_world(self, clean: bool) -> tuple[list[HeldState], bool]:
        """This run's world is ending: settle its checkpoint, keep what it can of the state in
        memory (its shards, the leaving ranks' handed over, the snapshots) and close what
        belongs to the world. Returns (states held, this node is leaving the job). ``clean``:
        every rank left at one agreed boundary, so the live state is consistent; otherwise
        only snapshots and committed checkpoints are."""
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
        refuse_at = self._fault_step("refuse_reform")
        if refuse_at is not None and self.state.step >= refuse_at:
            raise ReformFailed(f"injected: rank {self.rt.rank} refuses the re-form at step {self.state.step}")
        held, leaving = self._hold_in_memory(clean) if self.cfg.reform.in_memory else ([], False)
        if self.snapshots is not None:
            if not leaving and self.cfg.reform.in_memory:
                # The newest step the survivors hold whole wins: the live state after an agreed
                # boundary, else the snapshots (a node lost without notice, a failed hand-off)
                # and what leaving ranks secured before a planned re-form's ack.
                held += self.snapshots.held()
                if self._secured is not None:
                    held += self._secured[2]
            self.snapshots.close()
            self.snapshots = None
        self._secured = None
        return held, leaving

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
        secured = self._secured is not None and self._secured[0] == self.state.step and self.rt.rank in self._secured[1]
        try:
            return hand_off(own, leaving, secured=secured), leaving
        except Exception as exc:  # a peer went away during the hand-off
            log.warning("shard hand-off failed; the checkpoint will be used", why=str(exc)[:200])
            return ([] if leaving else [own]), leaving
