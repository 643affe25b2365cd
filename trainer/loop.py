"""The training loop: resume, train with a constant global batch, checkpoint, answer requests.

One ``TrainingRun`` per process. Each step ends at a boundary where all ranks agree
(one tiny all-reduce) on a pending checkpoint request, a stop, the timed save and an
announced in-place re-form; everything else at the boundary follows from that agreement.

Under ``regroup-run`` the process outlives its world: on a re-form it leaves the process
group (at the agreed boundary, or when a collective failed because a peer went away),
forms the next one through ``ElasticWorld``, rebuilds what depends on the world (batch
plan, FSDP2 sharding, optimizer, checkpointer) and restores the state, then trains on.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch
import torch.nn.functional as F
from opentelemetry import trace

from regroup.records import CheckpointAck, CheckpointRequest, Progress
from regroup.telemetry import context_from_traceparent
from trainer.batching import BatchPlan, plan_batches
from trainer.boundary import Boundary, agree
from trainer.app_state import AppState, TrainerState
from trainer.checkpoint import Checkpointer
from trainer.checkpoint_folders import checkpoint_id, folder_bytes, latest_committed, step_dir
from trainer.config import TrainConfig
from trainer.control import JobChannel, pending_generation
from trainer.data import batch, make_source
from trainer.distributed import Runtime, build_sharded_model, runtime_on_default_group
from trainer.model import count_parameters
from trainer.schedule import lr_at
from trainer.stopping import StopSignal, exit_code
from trainer.handoff import hand_off
from trainer.reshard import HeldState, hold_state, redistribute
from trainer.snapshot import Snapshots
from trainer.world_change import WorldChange
from rendezvous.inplace.world import Interrupted, Membership, ReformFailed

if TYPE_CHECKING:
    from rendezvous.inplace.world import ElasticWorld

log = structlog.get_logger("regroup.trainer")

# Poll period while holding at a boundary for the re-form (one tiny collective each).
_HOLD_POLL_S = 0.2
# How long rank 0 waits for etcd to take its progress before a commit or a re-form.
_RECORD_WAIT = timedelta(milliseconds=500)
# How long a rank at the agreed boundary waits for its own agent's announcement (which says
# whether its node is leaving): agents announce within one monitor interval of each other.
_ANNOUNCE_WAIT = timedelta(seconds=2)


@dataclass(frozen=True)
class RunInfo:
    """Facts about this incarnation, read from the environment at the edge."""

    restart_count: int = 0
    """torchrun's TORCHELASTIC_RESTART_COUNT."""
    started_at: float = 0.0
    """``time.perf_counter()`` when the process entered ``main`` (0: unknown)."""
    place: tuple[str, str] = ("", "")
    """(failure domain, node) this process runs in: a snapshot's copy goes to another place."""
    ranks_on_node: int = 1
    """Ranks of this job on this node (torchrun's LOCAL_WORLD_SIZE), for the memory check."""


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


class TrainingRun:
    """One incarnation of the trainer on one rank: build, resume, train, checkpoint, stop."""

    def __init__(
        self,
        cfg: TrainConfig,
        runtime: Runtime,
        info: RunInfo,
        stop: StopSignal,
        channel: JobChannel | None,
        world: ElasticWorld | None = None,
        open_channel: Callable[[], JobChannel] | None = None,
    ) -> None:
        """``world``: the in-place membership (None: this process ends with its world).
        ``open_channel``: how a process that becomes rank 0 after a re-form opens its channel."""
        self.cfg = cfg
        self.info = info
        self.stop = stop
        self.world = world
        self._open_channel = open_channel
        self.tracer = trace.get_tracer("regroup.trainer")
        self.counters = Counters()
        self.source = make_source(cfg.data, cfg.model)
        self.state = TrainerState()
        self.resumed_from = 0
        self.last_loss = float("nan")
        self.tokens_per_s = 0.0
        self.change = WorldChange(mode="restart" if info.restart_count else "")
        """How the current world came to be, and what resuming in it cost."""
        self.channel: JobChannel | None = None
        self.snapshots: Snapshots | None = None
        self._attach(runtime, channel)

    def _attach(self, runtime: Runtime, channel: JobChannel | None) -> None:
        """Build everything that depends on the world: batch plan, sharded model, optimizer,
        checkpointer, the etcd channel (rank 0 only), the sample log."""
        cfg = self.cfg
        self.rt = runtime
        if runtime.rank == 0:
            self.channel = channel or self.channel or (self._open_channel() if self._open_channel else None)
        elif self.channel is not None:
            self.channel.close()
            self.channel = None
        # Fails at start, before any work, when the global batch does not split.
        self.plan: BatchPlan = plan_batches(
            cfg.batch.global_batch_size, runtime.world_size, runtime.rank, cfg.batch.max_micro_batch_size
        )
        torch.manual_seed(cfg.seed)
        self.model = build_sharded_model(cfg.model, cfg.seed, runtime)
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay
        )
        self.app = AppState(self.model, self.optimizer, self.state)
        if self.snapshots is not None:
            self.snapshots.close()
        every = cfg.snapshot.interval
        in_place = self.world is not None and self.world.in_place
        self.snapshots = (
            Snapshots(
                self.model, self.optimizer, runtime.rank, runtime.world_size, self.info.place, every,
                self.world.timeout if self.world is not None else None, self.info.ranks_on_node,
            )
            if in_place and every != 0 and runtime.world_size > 1
            else None
        )  # fmt: skip
        if getattr(self, "checkpointer", None) is not None:
            self.checkpointer.close()
        die_at = self._fault_step("kill_during_save")
        self.checkpointer = (
            Checkpointer(cfg.checkpoint, runtime, die_at, before_commit=lambda _: self._record_reached())
            if cfg.checkpoint.dir
            else None
        )
        self._last_save_time = time.monotonic()
        self._last_progress_time = 0.0
        self._sample_log = self._open_sample_log()

    # --- helpers ------------------------------------------------------------------

    def _fault_step(self, kind: str) -> int | None:
        for fault in self.cfg.faults:
            if fault.kind == kind and fault.rank == self.rt.rank and fault.restart == self.info.restart_count:
                return fault.step
        return None

    def _open_sample_log(self) -> Any:
        if not self.cfg.data.sample_log:
            return None
        folder = Path(self.cfg.data.sample_log)
        folder.mkdir(parents=True, exist_ok=True)
        return open(folder / f"samples-w{self.rt.world_size}-r{self.rt.rank}.jsonl", "a")

    def progress(self) -> Progress:
        c = self.counters
        return Progress(
            step=self.state.step,
            loss=0.0 if math.isnan(self.last_loss) else self.last_loss,
            samples_seen=self.state.samples_seen,
            world_size=self.rt.world_size,
            time=time.time(),
            tokens_per_s=self.tokens_per_s,
            resumed_from_step=self.resumed_from,
            restart_count=self.info.restart_count,
            round=self.world.round if self.world is not None else 0,
            reform_mode=self.change.mode,
            resume_phases=dict(self.change.phases),
            extra={
                "state": c.state,
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
        if self.channel is not None:
            self.channel.publish_progress(self.progress(), wait=wait)
            self._last_progress_time = time.monotonic()

    # --- start --------------------------------------------------------------------

    def resume(self, held: list[HeldState] | None = None) -> None:
        """Restore the state for this world. From memory when the survivors hold every old
        rank's shards at one agreed step (a grow, a planned shrink whose leavers handed theirs
        over); else from the newest committed checkpoint (any world size). Every rank takes
        part, fresh or surviving, and all take the same path."""
        if self.checkpointer is not None:
            self.checkpointer.prepare()
        t0 = time.perf_counter()
        stored = latest_committed(self.checkpointer.root) if self.checkpointer is not None else None
        try:
            step = redistribute(
                self.model, self.optimizer, held or None, torch.distributed.group.WORLD, not_before=stored or 0
            )
        except ValueError as exc:
            if held:
                log.warning("state cannot be rebuilt in memory; loading the checkpoint", why=str(exc)[:300])
        else:
            self.change.add("reshard", time.perf_counter() - t0)
            self.state.step, self.state.samples_seen = step, step * self.plan.global_batch
            self.state.lr = lr_at(max(step - 1, 0), self.cfg.optim, self.cfg.max_steps)
            if not self.change.mode:
                self.change.mode = "restart"  # a process started for a world that had state
            self.resumed_from = step
            log.info("resharded in memory", step=step, world_size=self.rt.world_size)
            return
        if self.checkpointer is None:
            return
        t0 = time.perf_counter()
        step = self.checkpointer.load_latest(self.app)
        load_s = time.perf_counter() - t0
        if step is None:
            return
        self.change.add("load", load_s)
        if not self.change.mode:
            self.change.mode = "restart"  # this process was started for a world that had state
        self.resumed_from = step
        log.info("resumed", step=step, world_size=self.rt.world_size, load_s=round(load_s, 3), plan=str(self.plan))

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

    # --- one step -----------------------------------------------------------------

    def train_step(self) -> float:
        """One optimizer step over this rank's share of the global batch; its mean loss."""
        step = self.state.step
        lr = lr_at(step, self.cfg.optim, self.cfg.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        tokens_per_rank = self.plan.per_rank * self.cfg.model.seq_len
        total = torch.zeros((), dtype=torch.float32, device=self.rt.device)
        for micro in range(self.plan.accumulation):
            ids = self.plan.micro_batch_ids(step, micro)
            inputs, targets = batch(self.source, ids)
            inputs, targets = inputs.to(self.rt.device), targets.to(self.rt.device)
            # Reduce gradients across ranks only on the last micro-batch.
            self.model.set_requires_gradient_sync(micro == self.plan.accumulation - 1)
            logits = self.model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum") / tokens_per_rank
            loss.backward()
            total += loss.detach()
        if self.cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        if self.checkpointer is not None:
            # A save staged in the background must finish copying before parameters change.
            self.counters.last_stall_s += self.checkpointer.wait_staged()
        if self.snapshots is not None:
            self.counters.snapshot_stall_s += self.snapshots.wait_copied()  # likewise
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step = step + 1
        self.state.samples_seen = self.state.step * self.plan.global_batch
        self.state.lr = lr
        if self._sample_log is not None:
            # The round and the time say which world trained this step and when: an audit can
            # then rebuild the kept trajectory, where a resumed world's steps replace the ones it redoes.
            record = {
                "step": step + 1,
                "ids": list(self.plan.step_ids(step)),
                "restart": self.info.restart_count,
                "round": self.world.round if self.world is not None else 0,
                "t": time.time(),
            }
            self._sample_log.write(json.dumps(record) + "\n")
            self._sample_log.flush()
        return float(total)

    # --- the boundary ---------------------------------------------------------------

    def boundary(self, local_loss: float, started: float = 0.0) -> tuple[Boundary, CheckpointRequest | None]:
        """``started``: ``time.perf_counter()`` when the step began (what snapshots cost is measured)."""
        request = None
        generation = 0
        save_due = False
        if self.rt.rank == 0:
            now = time.time()
            if self.channel is not None and self.checkpointer is not None:
                request = self.channel.request()
                generation = pending_generation(request, now, self.channel.answered)
            every = self.cfg.checkpoint.every.total_seconds()
            save_due = every > 0 and time.monotonic() - self._last_save_time >= every
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
        )
        self._leave_if_due(decided)
        if self.snapshots is not None and not decided.stop:
            self.snapshots.agreed(decided.snapshot_done, decided.snapshot_cost)
            if self.snapshots.due(self.state.step):
                self.snapshots.take(self.state.step)
            self.snapshots.settled()
        return decided, request if decided.generation else None

    def _reform_due(self) -> bool:
        return self.world is not None and self.world.reform_due()

    def _leave_if_due(self, decided: Boundary) -> None:
        """An announced re-form, or a peer stopping while this rank was not asked to (its
        node is leaving the job), ends this world here, at a boundary every rank agreed on."""
        if self.world is None or not self.world.in_place:
            return
        if decided.reform or (decided.stop and not self.stop.requested):
            raise Interrupted("re-form at this step boundary" if decided.reform else "a peer is leaving")

    def save(self, *, wait: bool) -> float:
        assert self.checkpointer is not None
        result = self.checkpointer.save(self.app, self.state.step, use_async=None)
        if wait:
            self.checkpointer.finish()
        self.counters.checkpoint_saves += 1
        self.counters.last_stall_s = result.stall_s
        self._last_save_time = time.monotonic()
        return result.stall_s

    def honour_request(self, generation: int, request: CheckpointRequest | None) -> None:
        """Save and commit a checkpoint at this boundary, then ack (rank 0)."""
        assert self.checkpointer is not None
        step = self.state.step
        started = time.perf_counter()
        parent = context_from_traceparent(request.traceparent if request is not None else "")
        span = self.tracer.start_span("regroup.trainer.checkpoint", context=parent) if self.rt.rank == 0 else None
        # Reuse a save of this very step (periodic or in flight) instead of writing it twice.
        if self.checkpointer.in_flight_step == step:
            self.checkpointer.finish()
        elif self.checkpointer.last_committed != step:
            self.save(wait=True)
        duration = time.perf_counter() - started
        self.counters.requests_honoured += 1
        if self.rt.rank == 0:
            assert span is not None
            size = folder_bytes(step_dir(self.checkpointer.root, step))
            span.set_attributes(
                {
                    "regroup.step": step,
                    "regroup.generation": generation,
                    "regroup.checkpoint.duration_s": duration,
                    "regroup.checkpoint.bytes": size,
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
                    ),
                    deadline=request.deadline if request is not None else time.time(),
                )
            log.info(
                "checkpoint request honoured",
                generation=generation,
                step=step,
                acked=acked,
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
                if self.counters.state == "holding":
                    log.info("checkpoint hold deadline passed; training on", step=self.state.step)
                    self.counters.state = "training"
                return False
            if self.counters.state != "holding":
                self.counters.state = "holding"
                log.info("holding for the re-form", step=self.state.step)
                self.publish()
            self.stop.wait(_HOLD_POLL_S)

    # --- exits ----------------------------------------------------------------------

    def stop_now(self) -> int:
        """Agreed stop: leave an unfinished save uncommitted, report, exit code."""
        abandoned = self.checkpointer.abandon() if self.checkpointer is not None else None
        self.counters.state = "stopped"
        log.info("stopping", step=self.state.step, abandoned_checkpoint=abandoned)
        if self.channel is not None:
            # Bounded well inside the watchdog's grace: the agent is waiting for us to exit.
            self.channel.publish_progress(self.progress(), wait=True, timeout=timedelta(milliseconds=500))
        return exit_code(self.stop.signum or 15)

    def run(self) -> int:
        """Train to ``max_steps`` or until stopped; the process exit code. Under an in-place
        agent, a re-form of the world is survived: leave, rejoin, restore, train on."""
        self.resume()
        while True:
            try:
                return self._train()
            except Exception as exc:
                if self.world is None or not self.world.interrupted(exc):
                    raise
                clean = isinstance(exc, Interrupted)
                log.info("leaving the world for a re-form", step=self.state.step, clean=clean, why=str(exc)[:200])
                self._record_reached()
                if not self.reform(clean):
                    return self.stop_now()

    def _train(self) -> int:
        self.counters.state = "training"
        if self.rt.rank == 0:
            log.info(
                "training",
                parameters=count_parameters(self.model),
                world_size=self.rt.world_size,
                micro_batch=self.plan.micro_batch,
                accumulation=self.plan.accumulation,
                start_step=self.state.step,
                max_steps=self.cfg.max_steps,
            )
        # Progress at this world's size is published after its first step (``_resumed``):
        # the controller reads it as "resumed", with the resume phases complete.
        crash_at = self._fault_step("crash")
        hang_at = self._fault_step("hang")
        tokens_per_step = self.plan.global_batch * self.cfg.model.seq_len
        while self.state.step < self.cfg.max_steps:
            if crash_at == self.state.step + 1:
                log.warning("fault: crashing before step", step=crash_at)
                raise RuntimeError(f"injected crash at step {crash_at} on rank {self.rt.rank}")
            if hang_at == self.state.step + 1:
                log.warning("fault: hanging before step", step=hang_at)
                threading.Event().wait()
            started = time.perf_counter()
            local_loss = self.train_step()
            compute_s = time.perf_counter() - started
            self.tokens_per_s = tokens_per_step / compute_s if compute_s > 0 else 0.0
            decided, request = self.boundary(local_loss, started)
            self.last_loss = decided.loss
            if not self.change.first_step_done:
                self._resumed(time.perf_counter() - started)
            if self.rt.rank == 0 and self.state.step % self.cfg.log_every == 0:
                log.info(
                    "step",
                    step=self.state.step,
                    loss=decided.loss,
                    lr=self.state.lr,
                    tokens_per_s=round(self.tokens_per_s, 1),
                )
            if decided.stop:
                return self.stop_now()
            if self.checkpointer is not None:
                self.checkpointer.poll()
                if decided.generation:
                    self.honour_request(decided.generation, request)
                    if self.hold(request):
                        return self.stop_now()
                elif self._periodic_due(decided) and self.state.step < self.cfg.max_steps:
                    self.save(wait=False)
            if self.rt.rank == 0 and time.monotonic() - self._last_progress_time >= self._progress_interval():
                self.publish()
            floor = self.cfg.step_time_floor.total_seconds()
            if floor:
                # Wakes early on a stop; the stop itself is agreed at the next boundary.
                self.stop.wait(floor - (time.perf_counter() - started))
        return self.finish()

    # --- in-place re-forms ---------------------------------------------------------------

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
        held, leaving = self._hold(clean) if self.cfg.reform.in_memory else ([], False)
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

    def _hold(self, clean: bool) -> tuple[list[HeldState], bool]:
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

    def _periodic_due(self, decided: Boundary) -> bool:
        every = self.cfg.checkpoint.every_steps
        return decided.save_due or (every > 0 and self.state.step % every == 0)

    def _progress_interval(self) -> float:
        return self.cfg.etcd.progress_interval.total_seconds() if self.cfg.etcd else float("inf")

    def finish(self) -> int:
        if self.checkpointer is not None:
            if self.cfg.checkpoint.at_end and self.checkpointer.last_committed != self.state.step:
                if self.checkpointer.in_flight_step == self.state.step:
                    self.checkpointer.finish()
                else:
                    self.save(wait=True)
            self.checkpointer.finish()
        # Nobody exits while a peer still waits on it in the last collective.
        torch.distributed.barrier(group=self.rt.control_group)
        self.counters.state = "finished"
        if self.channel is not None:
            self.channel.publish_progress(self.progress(), wait=True)
        log.info("finished", step=self.state.step, loss=self.last_loss)
        return 0
