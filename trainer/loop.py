"""The training loop: resume, train with a constant global batch, checkpoint, answer requests.

One ``TrainingRun`` per process. Each step ends at a boundary where all ranks agree
(one tiny all-reduce) on a pending checkpoint request, a stop, the timed save and an
announced in-place re-form; everything else at the boundary follows from that agreement.

Under ``regroup-run`` the process outlives its world: on a re-form it leaves the process
group (at the agreed boundary, or when a collective failed because a peer went away),
forms the next one through ``ElasticWorld``, rebuilds what depends on the world (batch
plan, FSDP2 sharding, optimizer, checkpointer) and restores the state, then trains on.

Its parts: ``regroup.trainer.progress`` (what rank 0 publishes), ``regroup.trainer.checkpoint_requests``
(requests, the hold at a boundary), ``regroup.trainer.inplace_reform`` (changing world in place).
"""

from __future__ import annotations

import json
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

from regroup.records import CheckpointRequest
from regroup.trainer.app_state import AppState, TrainerState
from regroup.trainer.batching import BatchPlan, plan_batches
from regroup.trainer.boundary import Boundary, agree
from regroup.trainer.checkpoint import Checkpointer
from regroup.trainer.checkpoint_folders import latest_committed
from regroup.trainer.checkpoint_requests import CheckpointRequests
from regroup.trainer.config import TrainConfig
from regroup.trainer.control import JobChannel, pending_generation
from regroup.trainer.data import batch, make_source
from regroup.trainer.distributed import Runtime, build_sharded_model
from regroup.trainer.inplace_reform import InPlaceReforms
from regroup.trainer.model import count_parameters
from regroup.trainer.progress import Counters, ProgressReports
from regroup.trainer.reshard import HeldState, redistribute
from regroup.trainer.schedule import lr_at
from regroup.trainer.snapshot import Snapshots
from regroup.trainer.stopping import StopSignal, exit_code
from regroup.trainer.world_change import WorldChange
from regroup.rendezvous.inplace.membership import Interrupted

if TYPE_CHECKING:
    from regroup.rendezvous.inplace.world import ElasticWorld

log = structlog.get_logger("regroup.trainer")


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


class TrainingRun(ProgressReports, CheckpointRequests, InPlaceReforms):
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

    def save(self, *, wait: bool) -> float:
        assert self.checkpointer is not None
        result = self.checkpointer.save(self.app, self.state.step, use_async=None)
        if wait:
            self.checkpointer.finish()
        self.counters.checkpoint_saves += 1
        self.counters.last_stall_s = result.stall_s
        self._last_save_time = time.monotonic()
        return result.stall_s

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

    def _periodic_due(self, decided: Boundary) -> bool:
        every = self.cfg.checkpoint.every_steps
        return decided.save_due or (every > 0 and self.state.step % every == 0)

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

