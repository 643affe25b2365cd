"""``Run`` and ``Step``: a user's training loop, elastic.

A ``Run`` takes the model and optimizer the script built for the current world (and any
other state to keep: an LR scheduler, extras), restores the newest state into them (from the
survivors' memory after an in-place re-form, else the newest committed checkpoint), and
hands out one ``Step`` per optimizer step. Asking for the next step is the step boundary
every rank agrees on (one small all-reduce): there the run answers the controller's
checkpoint request (save, commit, ack, hold), takes in-memory snapshots, publishes progress,
stops, or ends the world for a re-form, which ``regroup.elastic.session`` carries out
(the script's function is called again in the new world).

Its parts: ``regroup.elastic.step`` (one step), ``regroup.elastic.epochs`` (epochs and
loaders), ``regroup.elastic.resume`` (where a world starts), ``regroup.elastic.step_boundary``
(the agreed end of a step), ``regroup.elastic.world.progress`` (what rank 0 publishes),
``regroup.elastic.checkpoint.requests`` (requests, the hold) and
``regroup.elastic.world.inplace_reform`` (leaving a world with the state in memory).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch
from opentelemetry.trace import Tracer
from torch import nn

from regroup.elastic.checkpoint.app_state import AppState, TrainerState
from regroup.elastic.checkpoint.checkpointer import Checkpointer
from regroup.elastic.checkpoint.requests import CheckpointRequests
from regroup.elastic.data import Sampler, sampler_of
from regroup.elastic.epochs import Epochs
from regroup.elastic.memory.reshard import HeldState
from regroup.elastic.memory.snapshot import Snapshots
from regroup.elastic.memory.snapshot_cost import SnapshotMemoryError
from regroup.elastic.options import Options
from regroup.elastic.options import options as make_options
from regroup.elastic.randomness import enter_samples, seed_step
from regroup.elastic.resume import Resuming
from regroup.elastic.session import RunInfo, Session
from regroup.elastic.state import MisuseError, State, World
from regroup.elastic.step import Step
from regroup.elastic.step_boundary import StepBoundary
from regroup.elastic.world.batching import BatchPlan, plan_batches
from regroup.elastic.world.control import JobChannel
from regroup.elastic.world.inplace_reform import InPlaceReforms
from regroup.elastic.world.progress import Counters, ProgressReports
from regroup.elastic.world.stopping import StopSignal, exit_code
from regroup.elastic.world.world_change import WorldChange
from regroup.rendezvous.inplace.world import ElasticWorld

log = structlog.get_logger("regroup.trainer")


class Run(Epochs, Resuming, StepBoundary, ProgressReports, CheckpointRequests, InPlaceReforms):
    """The state of a user's training run in the current world, and its steps:
    ``for step in elastic.Run(model, optimizer, global_batch=..., max_steps=...):``.

    ``model`` and ``optimizer`` are sharded (FSDP2), replicated (DDP) or local; ``scheduler``
    and ``extras`` (name -> object with ``state_dict``/``load_state_dict``) are small state
    that is the same on every rank. Settings: ``global_batch`` and ``max_steps`` (required),
    ``checkpoint_dir`` (default: env ``REGROUP_CHECKPOINT_DIR``; none: no checkpoints),
    ``checkpoint_every`` (steps), ``max_micro_batch``, ``snapshot_every`` (``"auto"``, N, or
    0), ``snapshot_max_every`` (the most steps a node lost without notice may cost; default
    1), ``device``, ``log_every``, ``step_time_floor`` and any other trainer config section
    by name (``reform={...}``, ``etcd={...}``); or ``options=`` for all of them."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Any = None,
        extras: Mapping[str, Any] | None = None,
        global_batch: int | None = None,
        max_steps: int | None = None,
        data: Any = None,
        epochs: int | None = None,
        options: Options | None = None,
        env: Mapping[str, str] | None = None,
        **settings: Any,
    ) -> None:
        env = dict(os.environ) if env is None else dict(env)
        self.sampler: Sampler | None = None if data is None else sampler_of(data)
        """The loader's ``elastic.Sampler`` (``data=``): epochs are counted in its dataset."""
        if epochs is not None:
            if self.sampler is None:
                raise MisuseError("Run(epochs=...) counts epochs of a dataset: pass its loader as data=")
            batch = options.global_batch if options is not None else global_batch
            if batch is None or epochs < 1:
                raise MisuseError("Run(data=loader, epochs=N): N >= 1 and global_batch= are required")
            by_epochs = epochs * self.sampler.steps_per_epoch(batch)
            max_steps = by_epochs if max_steps is None else min(max_steps, by_epochs)
            if options is not None:
                options = replace(options, max_steps=min(options.max_steps, by_epochs))
        if self.sampler is not None and options is None and not settings.get("max_micro_batch"):
            # The loader's batch size is what one forward takes: the micro-batch's limit.
            settings["max_micro_batch"] = getattr(data, "batch_size", None) or 0
        if options is None:
            if global_batch is None or max_steps is None:
                raise MisuseError(
                    "Run(model, optimizer, global_batch=..., max_steps=...): both are required "
                    "(or epochs= with data=loader instead of max_steps)"
                )
            options = make_options(env, global_batch=global_batch, max_steps=max_steps, **settings)
        elif settings or global_batch is not None or max_steps is not None:
            raise MisuseError("Run(model, optimizer, options=...) takes no other settings: put them in the Options")
        user = State(model=model, optimizer=optimizer, scheduler=scheduler, extras=dict(extras or {}))
        session = Session.current()
        if session is None:
            session = Session.open(options, env)
        elif session.run is not None:
            raise MisuseError(
                "one Run per world: create it once in the function that builds the model "
                "(under @elastic.in_place it is called again after each re-form)"
            )
        else:
            session.adopt(options)
        self.session = session
        self._owns_session = not session.in_place
        """Outside ``in_place`` the run's end is the process's: it closes the session."""
        self.cfg = options
        self.user_state = user
        self.state = TrainerState()
        self.resumed_from = 0
        self.last_step = -1
        """The newest step completed before this world (``Progress.last_step``)."""
        self.last_loss = float("nan")
        self.tokens_per_s = 0.0
        self.samples_per_s = 0.0
        self.snapshots: Snapshots | None = None
        self.checkpointer: Checkpointer | None = None
        self._sample_log: Any = None
        self._iterating = False
        self._epoch: int | None = None
        """Inside ``run.epochs()``: the epoch being trained."""
        self._current: Step | None = None
        self._released = False
        self._give_back = False
        """A re-form freed the old world's state: give the memory back at the next boundary."""
        self.seed = options.seed if options.seed is not None else torch.initial_seed() & (2**63 - 1)
        """The run's seed (agreed by every rank when the state is restored)."""
        self._attach()
        session.run = self
        self.resume(session.held)
        self._attach_snapshots()

    # --- the session's, seen from the run -------------------------------------------------

    @property
    def world(self) -> ElasticWorld:
        return self.session.world

    @property
    def stop(self) -> StopSignal:
        return self.session.stop

    @property
    def channel(self) -> JobChannel | None:
        return self.session.channel

    @property
    def change(self) -> WorldChange:
        return self.session.change

    @property
    def counters(self) -> Counters:
        return self.session.counters

    @property
    def info(self) -> RunInfo:
        return self.session.info

    @property
    def tracer(self) -> Tracer:
        return self.session.tracer

    @property
    def world_info(self) -> World:
        """The world this run trains in."""
        return self.session.world_info

    @property
    def model(self) -> nn.Module:
        return self.user_state.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.user_state.optimizer

    @property
    def step(self) -> int:
        """Steps completed (the next step trains samples from ``step * global_batch``)."""
        return self.state.step

    @property
    def exit_code(self) -> int | None:
        """0 once ``max_steps`` is reached, 128+signal when stopped; None while running."""
        if self.session.exit_code is not None:
            return self.session.exit_code
        return 0 if self.counters.state == "finished" else None

    # --- the steps --------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        self._start("a Run is iterated once: `for step in run:`")
        try:
            while (step := self._next_step()) is not None:
                yield step
        finally:
            self._end_iteration()



    # --- one step at a time -----------------------------------------------------------------

    def _start(self, misuse: str) -> None:
        if self._iterating:
            raise MisuseError(misuse)
        self._iterating = True
        self._log_world()

    def _end_iteration(self) -> None:
        self._current = None
        if self._owns_session and not self._released:
            self.session.close()

    def _over(self) -> bool:
        return self.session.exit_code is not None or self.counters.state == "finished"

    def _finish_step(self) -> bool:
        """The step being trained is done on this rank: its boundary. False once the run ended."""
        step = self._current
        if step is not None:
            self._current = None
            enter_samples(None)
            with self._world_failures():  # a failure of it for a re-form ends the world with Reform
                self._complete(step)
        return not self._over()

    def _begin_step(self) -> Step:
        self._inject_faults()
        step = Step(self)
        self._current = step
        if self.cfg.rng == "step":
            seed_step(self.seed, step.index, self.rt.rank)
        enter_samples(step.ids)
        return step

    def _next_step(self) -> Step | None:
        """The boundary of the step just trained, then the next step (None: the run ended)."""
        if not self._finish_step():
            return None
        if self.state.step >= self.cfg.max_steps:
            self.finish()
            return None
        return self._begin_step()



    @property
    def current(self) -> Step:
        """The step being trained (inside ``for step in run:`` or ``run.batches(loader)``)."""
        if self._current is None:
            raise MisuseError("run.current is the step being trained: there is none outside the loop")
        return self._current

    def report(self, loss: float | torch.Tensor, tokens: int = 0) -> None:
        """``run.current.report(loss, tokens)``: this rank's loss for the step being trained."""
        self.current.report(loss, tokens)

    def _check_current(self, step: Step, what: str) -> None:
        if self._current is not step:
            raise MisuseError(f"{what} is for the step being trained, inside `for step in run:`")

    # --- building on the world ------------------------------------------------------------

    def _attach(self) -> None:
        """Everything of this run that depends on the world: the batch plan, the optimizer's
        hook, what a checkpoint holds, the snapshots, the checkpointer, the sample log."""
        cfg = self.cfg
        self.rt = runtime = self.session.rt
        if cfg.global_batch < 1 or cfg.max_steps < 1:
            raise MisuseError("Run: global_batch and max_steps must be >= 1")
        # Fails at start, before any work, when the global batch does not split.
        self.plan: BatchPlan = plan_batches(cfg.global_batch, runtime.world_size, runtime.rank, cfg.max_micro_batch)
        # Whatever copies the parameters in the background (an async save's staging, a
        # snapshot) is waited for just before the optimizer changes them.
        self._hook = self.optimizer.register_step_pre_hook(lambda *_: self._before_optimizer_step())
        self.app = AppState(self.model, self.optimizer, self.state, self.user_state.carried())
        die_at = self._fault_step("kill_during_save")
        self.checkpointer = (
            Checkpointer(cfg.checkpoint, runtime, die_at, before_commit=lambda _: self._record_reached())
            if cfg.checkpoint.dir
            else None
        )
        self._last_save_time = time.monotonic()
        self._store_due = False
        """Rank 0: the state this world resumed from memory is on no storage yet; save it
        at the next boundary (in the background)."""
        self._last_progress_time = 0.0
        self._sample_log = self._open_sample_log()

    def _attach_snapshots(self) -> None:
        """The snapshots of this world, once the state is restored (the old world's is no
        longer held, so host memory is measured without it). Only where an in-place re-form
        can happen (``in_place`` under regroup-run). When host memory cannot hold them, a
        run that starts from nothing fails with ``SnapshotMemoryError`` (its settings do not
        fit); one that has trained goes on without them and says so, rather than fail a
        re-formed world (a shrink makes every rank's share larger)."""
        every, runtime = self.cfg.snapshot.interval, self.rt
        if not (self.world.in_place and self.session.in_place) or every == 0 or runtime.world_size == 1:
            return
        try:
            self.snapshots = Snapshots(
                self.model, self.optimizer, runtime.rank, runtime.world_size, self.info.place, every,
                self.world.timeout, self.info.ranks_on_node, self.cfg.snapshot.max_every, self.state.step,
            )  # fmt: skip
        except SnapshotMemoryError as exc:
            if self.state.step == 0:
                raise
            log.warning("training on without in-memory snapshots in this world", step=self.state.step, why=str(exc))

    def release(self) -> None:
        """This run's world is over: its threads, buffers and files go. Idempotent."""
        if self._released:
            return
        self._released = True
        self._hook.remove()
        if self.snapshots is not None:
            self.snapshots.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        if self._sample_log is not None:
            self._sample_log.close()

    def _open_sample_log(self) -> Any:
        if not self.cfg.sample_log:
            return None
        folder = Path(self.cfg.sample_log)
        folder.mkdir(parents=True, exist_ok=True)
        return open(folder / f"samples-w{self.rt.world_size}-r{self.rt.rank}.jsonl", "a")  # noqa: SIM115 - kept open

    def _before_optimizer_step(self) -> None:
        step = self._current
        if step is not None and step.loaded and not step.last_micro:
            raise MisuseError(
                f"optimizer.step() after micro-batch {step.micro + 1} of {step.accumulation}: this rank's share of a "
                "step comes in micro-batches of the loader's batch_size; step the optimizer when run.current.last_micro"
            )
        if self.checkpointer is not None:
            self.counters.last_stall_s += self.checkpointer.wait_staged()
        if self.snapshots is not None:
            self.counters.snapshot_stall_s += self.snapshots.wait_copied()

    def _fault_step(self, kind: str) -> int | None:
        for fault in self.cfg.faults:
            if fault.kind == kind and fault.rank == self.rt.rank and fault.restart == self.info.restart_count:
                return fault.step
        return None

    def _inject_faults(self) -> None:
        upcoming = self.state.step + 1
        if self._fault_step("crash") == upcoming:
            log.warning("fault: crashing before step", step=upcoming)
            raise RuntimeError(f"injected crash at step {upcoming} on rank {self.rt.rank}")
        if self._fault_step("hang") == upcoming:
            log.warning("fault: hanging before step", step=upcoming)
            threading.Event().wait()

    # --- start and resume -----------------------------------------------------------------






    def leave_world(self, clean: bool) -> tuple[list[HeldState], bool]:
        if clean:
            self._keep_carried()
        return super().leave_world(clean)

    # --- the step boundary ----------------------------------------------------------------





    # --- ends -----------------------------------------------------------------------------

    def _log_world(self) -> None:
        self.counters.state = "training"
        if self.rt.rank == 0:
            log.info(
                "training",
                parameters=sum(p.numel() for p in self.model.parameters()),
                world_size=self.rt.world_size,
                micro_batch=self.plan.micro_batch,
                accumulation=self.plan.accumulation,
                start_step=self.state.step,
                max_steps=self.cfg.max_steps,
            )

    def stop_now(self) -> None:
        """Agreed stop: leave an unfinished save uncommitted, report; the process ends."""
        abandoned = self.checkpointer.abandon() if self.checkpointer is not None else None
        self.counters.state = "stopped"
        log.info("stopping", step=self.state.step, abandoned_checkpoint=abandoned)
        if self.channel is not None:
            # Bounded well inside the watchdog's grace: the agent is waiting for us to exit.
            self.channel.publish_progress(self.progress(), wait=True, timeout=timedelta(milliseconds=500))
        self.session.exit_code = exit_code(self.stop.signum or 15)

    def finish(self) -> None:
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
        if self.session.node_steps is not None:
            self.session.node_steps.forget()
        if self.channel is not None:
            self.channel.publish_progress(self.progress(), wait=True)
        log.info("finished", step=self.state.step, loss=self.last_loss)
