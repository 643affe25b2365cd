"""A controller's checkpoint request, on the trainer's side: save and commit at the agreed
step boundary, ack (rank 0), and with ``hold`` wait there for the re-form that follows
until the request's deadline (zero lost steps on a planned resize).

In place, with ``reform.in_memory`` and ``reform.ack_from_memory``, the ack comes at the
boundary without a save: the live state is what the re-form hands over and reshards, so
the disk write would only delay it. The next world writes the step to storage in the
background once it has resumed (``Run.resume`` in ``regroup.elastic.run``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog
import torch
import torch.distributed as dist

from regroup.records import CheckpointAck, CheckpointRequest
from regroup.telemetry import context_from_traceparent
from regroup.elastic.world.boundary import agree
from regroup.elastic.checkpoint.folders import checkpoint_id, folder_bytes, step_dir

if TYPE_CHECKING:
    from collections.abc import Callable

    from opentelemetry.trace import Tracer

    from regroup.rendezvous.inplace.world import ElasticWorld
    from regroup.elastic.checkpoint.app_state import TrainerState
    from regroup.elastic.checkpoint.checkpointer import Checkpointer
    from regroup.elastic.world.control import JobChannel
    from regroup.elastic.world.runtime import Runtime
    from regroup.elastic.options import Options
    from regroup.elastic.session import Session
    from regroup.elastic.world.progress import Counters
    from regroup.elastic.world.stopping import StopSignal

log = structlog.get_logger("regroup.trainer")

# Poll period while holding at a boundary for the re-form (one tiny collective each): the
# re-form's announcement waits up to this long to be noticed.
_HOLD_POLL_S = 0.05


class CheckpointRequests:
    """Answering checkpoint requests (a part of ``regroup.elastic.Run``; ``save`` is the
    run's, ``publish`` is ``regroup.elastic.world.progress``'s, ``_reform_due`` and ``_leave_if_due`` are
    ``regroup.elastic.world.inplace_reform``'s)."""

    rt: Runtime
    stop: StopSignal
    state: TrainerState
    counters: Counters
    channel: JobChannel | None
    checkpointer: Checkpointer | None
    tracer: Tracer
    cfg: Options
    world: ElasticWorld | None
    session: Session
    secure_leavers: Callable[[CheckpointRequest | None], None]
    _secured: object

    def acks_from_memory(self) -> bool:
        """Whether a request is answered from memory (the module docstring): the re-form
        happens in this process (``in_place`` under ``regroup-run``) and hands the state over
        in memory."""
        reform = self.cfg.reform
        in_place = self.world is not None and self.world.outlives_reforms and self.session.in_place
        return in_place and reform.in_memory and reform.ack_from_memory

    def _every_rank(self, mine: bool) -> bool:
        """Collective: ``mine`` holds on every rank (a rank whose process restarts on the
        re-form loses its memory, so then the state must be on storage)."""
        if self.rt.world_size == 1:
            return mine
        flag = torch.tensor([int(mine)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.rt.control_group)
        return bool(flag.item())

    def honour_request(self, generation: int, request: CheckpointRequest | None) -> None:
        """Save and commit a checkpoint at this boundary (unless ``acks_from_memory``), then
        ack (rank 0)."""
        assert self.checkpointer is not None
        step = self.state.step
        started = time.perf_counter()
        parent = context_from_traceparent(request.traceparent if request is not None else "")
        span = self.tracer.start_span("regroup.trainer.checkpoint", context=parent) if self.rt.rank == 0 else None
        stored = not self._every_rank(self.acks_from_memory()) or self.checkpointer.last_committed == step
        if stored:
            # Reuse a save of this very step (periodic or in flight) instead of writing it twice.
            if self.checkpointer.in_flight_step == step:
                self.checkpointer.finish()
            elif self.checkpointer.last_committed != step:
                self.save(wait=True)
        else:
            # The ack says the re-form's state is safe: with the leaving ranks' snapshots on
            # staying ranks, a rank lost before the re-form costs no step either.
            self.secure_leavers(request)
        duration = time.perf_counter() - started
        self.counters.requests_honoured += 1
        if self.rt.rank == 0:
            assert span is not None
            size = folder_bytes(step_dir(self.checkpointer.root, step)) if stored else 0
            span.set_attributes(
                {
                    "regroup.step": step,
                    "regroup.generation": generation,
                    "regroup.checkpoint.duration_s": duration,
                    "regroup.checkpoint.bytes": size,
                    "regroup.checkpoint.stored": stored,
                    "regroup.world_size": self.rt.world_size,
                }
            )
            span.end()
            acked = False
            if self.channel is not None:
                acked = self.channel.ack(
                    CheckpointAck(
                        generation=generation,
                        step=step,
                        checkpoint_id=checkpoint_id(step),
                        duration_s=duration,
                        world_size=self.rt.world_size,
                        acked_at=time.time(),
                        stored=stored,
                    ),
                    deadline=request.deadline if request is not None else time.time(),
                )
            log.info(
                "checkpoint request honoured",
                generation=generation,
                step=step,
                acked=acked,
                stored=stored,
                duration_s=round(duration, 3),
            )

    def hold(self, request: CheckpointRequest | None) -> bool:
        """With ``hold``, wait at this boundary for the re-form (SIGTERM) until the request's
        deadline. Every rank enters; only rank 0 knows the request, so each round is agreed.
        True if a stop came; False when there is no hold (or its deadline passed)."""
        while True:
            holding = request is not None and request.hold and time.time() < request.deadline
            decided = agree(
                self.rt.control_group,
                self.rt.world_size,
                generation=int(holding),
                stop=self.stop.requested,
                save_due=False,
                loss=0.0,
                reform=self._reform_due(),
            )
            self._leave_if_due(decided)
            if decided.stop:
                return True
            if not decided.generation:
                self._secured = None  # the step it secured is left behind
                if self.counters.state == "holding":
                    log.info("checkpoint hold deadline passed; training on", step=self.state.step)
                    self.counters.state = "training"
                return False
            if self.counters.state != "holding":
                self.counters.state = "holding"
                log.info("holding for the re-form", step=self.state.step)
                self.publish()
            self.stop.wait(_HOLD_POLL_S)

