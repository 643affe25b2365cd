"""``Run`` and ``Step``: a user's training loop, elastic.

A ``Run`` takes the model and optimizer the script built for the current world (and any
other state to keep: an LR scheduler, extras), restores the newest state into them (from the
survivors' memory after an in-place re-form, else the newest committed checkpoint), and
hands out one ``Step`` per optimizer step. Asking for the next step is the step boundary
every rank agrees on (one small all-reduce): there the run answers the controller's
checkpoint request (save, commit, ack, hold), takes in-memory snapshots, publishes progress,
stops, or ends the world for a re-form, which ``regroup.trainer.elastic.session`` carries out
(the script's function is called again in the new world).

Its parts: ``regroup.trainer.progress`` (what rank 0 publishes),
``regroup.trainer.checkpoint_requests`` (requests, the hold) and
``regroup.trainer.inplace_reform`` (leaving a world with the state in memory).
"""

from __future__ import annotations

import json
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
import torch.distributed as dist
from opentelemetry.trace import Tracer
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from regroup.records import CheckpointRequest
from regroup.rendezvous.inplace.world import ElasticWorld
from regroup.trainer.app_state import AppState, TrainerState
from regroup.trainer.batching import BatchPlan, plan_batches
from regroup.trainer.boundary import Boundary, agree
from regroup.trainer.checkpoint import Checkpointer
from regroup.trainer.checkpoint_folders import latest_committed
from regroup.trainer.checkpoint_requests import CheckpointRequests
from regroup.trainer.control import JobChannel, pending_generation
from regroup.trainer.elastic.data import Sampler, Span, fit_batches, sampler_of
from regroup.trainer.elastic.options import Options, options as make_options
from regroup.trainer.elastic.randomness import enter_samples, seed_step, set_seed
from regroup.trainer.elastic.session import RunInfo, Session
from regroup.trainer.elastic.state import MisuseError, State, World
from regroup.trainer.host_memory import give_back
from regroup.trainer.inplace_reform import InPlaceReforms
from regroup.trainer.progress import Counters, ProgressReports
from regroup.trainer.reshard import HeldState, last_moved, redistribute
from regroup.trainer.snapshot import Snapshots
from regroup.trainer.snapshot_cost import SnapshotMemoryError
from regroup.trainer.stopping import StopSignal, exit_code
from regroup.trainer.world_change import WorldChange

log = structlog.get_logger("regroup.trainer")


def _set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Reduce gradients across ranks only on a step's last micro-batch (FSDP2, DDP; also
    under ``torch.compile(model)``, whose ``_orig_mod`` is the wrapped model)."""
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    elif isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = sync


class Step:
    """One optimizer step of the run: which samples this rank trains on, and its loss."""

    def __init__(self, run: Run) -> None:
        self._run = run
        self.index = run.state.step
        """The step being trained, counted from 0 (it completes as step ``index + 1``)."""
        self.world: World = run.world_info
        self._plan = run.plan
        self._loss: float | None = None
        self._tokens = 0
        self.micro = 0
        """With a loader (``run.batches``): the micro-batch being trained, from 0."""
        self.loaded = False
        """Its batches come from ``run.batches(loader)``."""
        self._started = time.perf_counter()

    @property
    def epoch(self) -> int:
        """The epoch this step is in (with ``Run(data=..., epochs=...)``; else 0)."""
        return self._run.epoch_of(self.index)

    @property
    def last_micro(self) -> bool:
        """With a loader: this is the step's last micro-batch (step the optimizer after it)."""
        return self.micro == self._plan.accumulation - 1

    @property
    def accumulation(self) -> int:
        """Micro-batches this rank runs in this step: divide each micro-batch's mean loss by it."""
        return self._plan.accumulation

    @property
    def micro_batch(self) -> int:
        """Samples per micro-batch on this rank."""
        return self._plan.micro_batch

    @property
    def ids(self) -> range:
        """Global sample ids this rank trains on in this step (all its micro-batches): step
        ``s`` trains the global samples ``[s*G, (s+1)*G)`` at any world size."""
        return self._plan.step_ids(self.index)

    @property
    def local(self) -> slice:
        """This rank's share of the step's global batch, as a slice of it (``batch[step.local]``)."""
        start = self._plan.rank * self._plan.per_rank
        return slice(start, start + self._plan.per_rank)

    def micro_batches(self) -> Iterator[range]:
        """This rank's global sample ids, micro-batch by micro-batch; gradients are reduced
        across ranks on the last micro-batch only (FSDP2 and DDP models)."""
        self._run._check_current(self, "step.micro_batches()")
        model, count = self._run.model, self._plan.accumulation
        try:
            for micro in range(count):
                _set_gradient_sync(model, micro == count - 1)
                ids = self._plan.micro_batch_ids(self.index, micro)
                enter_samples(ids)
                yield ids
        finally:
            _set_gradient_sync(model, True)

    def report(self, loss: float | torch.Tensor, tokens: int = 0) -> None:
        """This rank's loss for the step (its mean over its samples); ``tokens``: tokens this
        rank trained on in the step, for the tokens/s in progress (0: samples/s only)."""
        self._run._check_current(self, "step.report()")
        self._loss = float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
        self._tokens = tokens


class Run(ProgressReports, CheckpointRequests, InPlaceReforms):
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

    def epochs(self) -> Iterator[int]:
        """The epochs left to train, from the one the run is in (``Run(data=loader,
        epochs=N)``); train each with ``run.batches(loader)``."""
        per_epoch = self._steps_per_epoch("run.epochs()")
        self._start("run.epochs() is iterated once, around `run.batches(loader)`")
        try:
            while self._finish_step() and self.state.step < self.cfg.max_steps:
                epoch = self.state.step // per_epoch
                self._epoch = epoch
                yield epoch
                if self.state.step < min((epoch + 1) * per_epoch, self.cfg.max_steps) and not self._over():
                    raise MisuseError(
                        f"epoch {epoch} ended at step {self.state.step}, before its last step: "
                        "train every batch of `run.batches(loader)` on every rank"
                    )
            self._next_step()  # the end: the last save and the final barrier
        finally:
            self._epoch = None
            self._end_iteration()

    def batches(self, loader: Any) -> Iterator[Any]:
        """``for batch in run.batches(loader):`` this rank's batches from a loader that
        draws from an ``elastic.Sampler``, one per micro-batch (``run.current``: its
        ``Step``; ``run.report(loss)``; with micro-batches, step the optimizer after the
        one where ``run.current.last_micro``). Inside ``run.epochs()``: the rest of that
        epoch; alone: every step left. Asking for a step's first batch is its boundary, as
        in ``for step in run:``."""
        sampler = sampler_of(loader)
        if self.sampler is not None and sampler is not self.sampler:
            raise MisuseError("run.batches(loader): the loader draws from another Sampler than Run(data=...)'s")
        per_epoch = sampler.steps_per_epoch(self.plan.global_batch)
        alone = self._epoch is None
        if alone:
            self._start("run.batches(loader) outside run.epochs() is iterated once")
        try:
            while self._finish_step() and self.state.step < self.cfg.max_steps:
                epoch = self.state.step // per_epoch if alone else self._epoch
                end = min((epoch + 1) * per_epoch, self.cfg.max_steps)
                if self.state.step >= end:
                    return
                sampler.cover(Span(self.plan, self.state.step, end, per_epoch))
                fit_batches(loader, self.plan.micro_batch)
                batches = iter(loader)
                try:
                    while self._finish_step() and self.state.step < end:
                        step = self._begin_step()
                        count = self.plan.accumulation
                        ids = sampler.batches(Span(self.plan, step.index, step.index + 1, per_epoch))
                        step.loaded = True
                        for micro, (_, sample_ids) in enumerate(ids):
                            step.micro = micro
                            _set_gradient_sync(self.model, micro == count - 1)
                            enter_samples(sample_ids)
                            yield next(batches)
                        _set_gradient_sync(self.model, True)
                finally:
                    sampler.cover(None)
                if not alone:
                    return
            if alone:
                self._next_step()  # the end: the last save and the final barrier
        finally:
            if alone:
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

    def _steps_per_epoch(self, what: str) -> int:
        if self.sampler is None:
            raise MisuseError(f"{what} needs Run(data=loader, epochs=N): the loader's elastic.Sampler counts them")
        return self.sampler.steps_per_epoch(self.plan.global_batch)

    def epoch_of(self, step: int) -> int:
        """The epoch step ``step`` is in (0 without ``data=``)."""
        return step // self.sampler.steps_per_epoch(self.plan.global_batch) if self.sampler is not None else 0

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
                self.world.timeout, self.info.ranks_on_node, self.cfg.snapshot.max_every,
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
        """Collective: the newest step any rank completed in an earlier world (a survivor's
        own, or rank 0's reading of the progress record the world before left); -1 if none.
        The ranks agree on the run's seed in the same reduction (the highest)."""
        last = self.session.last_step
        previous = self.channel.previous_progress if self.channel is not None else None
        if previous is not None:
            last = max(last, previous.step)
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

    def leave_world(self, clean: bool) -> tuple[list[HeldState], bool]:
        if clean:
            self._keep_carried()
        return super().leave_world(clean)

    # --- the step boundary ----------------------------------------------------------------

    def _complete(self, step: Step) -> None:
        """A step's work is done on this rank: count it, agree at the boundary, act on it."""
        done = step.index + 1
        if self.snapshots is not None:
            # The lost-step bound: a step counts once a snapshot at most max_every steps older is held.
            self.counters.snapshot_stall_s += self.snapshots.before_step_counts(done)
        compute_s = time.perf_counter() - step._started
        self.state.step = done
        self.state.samples_seen = done * self.plan.global_batch
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
        if self.channel is not None:
            self.channel.publish_progress(self.progress(), wait=True)
        log.info("finished", step=self.state.step, loss=self.last_loss)
