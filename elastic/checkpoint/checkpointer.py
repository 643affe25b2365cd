"""Sharded, reshardable DCP checkpoints that count only once committed.

Layout: ``<dir>/step-N/`` holds DCP's shard files and ``.metadata``; ``COMMITTED`` is
written into it by rank 0 last, after every rank's shard is on disk (DCP's coordinator
writes ``.metadata`` only after gathering all ranks' write results, and rank 0's save
returns after that). A folder without the marker is never loaded and is removed at the
next start. Loading works at any world size: DCP reshards by the global tensor metadata.

The ``Checkpointer`` saves (sync, or async on a writer thread after a copy to host memory,
``regroup.elastic.checkpoint.host_copy``), commits, prunes and loads; the folders and their marker are
``regroup.elastic.checkpoint.folders``, the state saved is ``regroup.elastic.checkpoint.app_state``.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from regroup.elastic.checkpoint.app_state import AppState
from regroup.elastic.checkpoint.folders import (
    COMMIT_MARKER,
    checkpoint_id,
    latest_committed,
    prune,
    remove_uncommitted,
    step_dir,
    write_commit_marker,
)
from regroup.elastic.settings import CheckpointConfig
from regroup.elastic.world.runtime import Runtime
from regroup.elastic.checkpoint.host_copy import HostCopy

log = structlog.get_logger("regroup.trainer.checkpoint")


class _DieAfterWrite(dcp.FileSystemWriter):
    """Injected fault: this rank is killed (SIGKILL) right after writing its shard,
    before the save can be committed."""

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        future = super().write_data(plan, planner)
        future.wait()
        log.warning("fault: killing this rank in the middle of a checkpoint save")
        os.kill(os.getpid(), signal.SIGKILL)
        return future


@dataclass
class _InFlight:
    step: int
    future: Future[Any]
    """Done when every shard of this rank is written (rank 0: and ``.metadata``)."""
    staged: Future[None]
    """Done when the state is copied to host memory; the live state may change after."""


@dataclass(frozen=True)
class SaveResult:
    """What one save cost the training loop."""

    step: int
    stall_s: float
    """Time the training loop was blocked by the call (for an async save: taking the state's
    references and handing them to the writer thread; the copy to host memory runs on while
    the next step computes, see ``wait_staged``)."""


@dataclass(frozen=True)
class _Staging:
    """The copy to host memory that an async save starts with, on the writer thread."""

    host: HostCopy
    ready: torch.cuda.Event | None
    done: Future[None]


def _abandoned_save_ended(step: int, host: HostCopy | None) -> Callable[[Future[Any]], None]:
    def ended(future: Future[Any]) -> None:
        if host is not None:
            host.close()
        error = future.exception()
        log.info("abandoned checkpoint save ended", step=step, error=None if error is None else repr(error))

    return ended


class Checkpointer:
    """Saves, commits, prunes and loads ``step-N`` checkpoints for one rank."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        runtime: Runtime,
        die_during_save_at: int | None = None,
        on_commit: Callable[[int], None] | None = None,
        before_commit: Callable[[int], None] | None = None,
    ) -> None:
        if cfg.dir is None:
            raise ValueError("checkpoint.dir: required to save checkpoints")
        self.cfg = cfg
        self.root = Path(cfg.dir)
        self.runtime = runtime
        self.saves = 0
        """Saves started by this process: the test of "no work when nothing is pending"."""
        self.last_committed: int | None = None
        self._die_at = die_during_save_at
        self._on_commit = on_commit
        self._before_commit = before_commit
        self._in_flight: _InFlight | None = None
        self._host: HostCopy | None = None
        self._writer: ThreadPoolExecutor | None = None

    def _host_copy(self) -> HostCopy:
        """One host copy for the whole run: its buffers are allocated at the first save and
        refilled at every later one. The copy overlaps the next step's forward and backward."""
        if self._host is None:
            self._host = HostCopy(self.runtime.is_cuda)
        return self._host

    def _writer_thread(self) -> ThreadPoolExecutor:
        """One thread for the whole run that does all of an async save after the call: the
        copy, clearing the folder, the barrier, DCP's planning and writes. The call only
        queues the work, so the loop pays no thread start, and it is back in the next step
        before the thread's first copy competes with it for the interpreter."""
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="regroup-checkpoint")
        return self._writer

    def _retire_writer(self) -> None:
        # Not waited for: an abandoned save may be blocked in a collective of a broken world
        # until its timeout; a later save gets a fresh thread.
        if self._writer is not None:
            self._writer.shutdown(wait=False)
            self._writer = None

    def close(self) -> None:
        """Release the writer thread and the host buffers (the world this checkpointer
        served is gone)."""
        self._retire_writer()
        if self._host is not None:
            self._host.close()
            self._host = None

    def prepare(self) -> None:
        """At start, rank 0 removes torn folders left by earlier incarnations."""
        if self.runtime.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            removed = remove_uncommitted(self.root)
            if removed:
                log.info("removed uncommitted checkpoints", steps=removed)
        self.last_committed = latest_committed(self.root)

    def load_latest(self, app: AppState) -> int | None:
        """Load the newest committed checkpoint into ``app``; its step, or None."""
        step = latest_committed(self.root)
        if step is None:
            return None
        dcp.load({"app": app}, checkpoint_id=str(step_dir(self.root, step)))
        if app.trainer.step != step:
            raise RuntimeError(f"checkpoint {step_dir(self.root, step)} holds step {app.trainer.step}")
        self.last_committed = step
        return step

    @property
    def in_flight_step(self) -> int | None:
        return None if self._in_flight is None else self._in_flight.step

    def save(self, app: AppState, step: int, *, use_async: bool | None = None) -> SaveResult:
        """Start saving ``step`` (waiting first for a previous async save to commit).

        Async: the call takes the state's references (no copy) and queues the rest on the
        writer thread; ``wait_staged`` before the state changes, ``poll``/``finish`` to commit."""
        self.finish()
        use_async = self.cfg.async_save if use_async is None else use_async
        path = step_dir(self.root, step)
        writer_cls = _DieAfterWrite if self._die_at == step else dcp.FileSystemWriter
        writer = writer_cls(str(path))
        host = self._host_copy() if use_async else None  # made on this thread (CUDA)
        self.saves += 1
        started = time.perf_counter()
        # What dcp.save would take from the Stateful, taken here: the live state must be read
        # before the next step runs, and on this thread (FSDP swaps parameters in forward).
        state = {"app": app.state_dict()}
        if host is not None:
            staged: Future[None] = Future()
            job = _Staging(host, host.mark(), staged)
            future = self._writer_thread().submit(self._write, path, state, writer, job)
            self._in_flight = _InFlight(step, future, staged)
            return SaveResult(step, time.perf_counter() - started)
        self._write(path, state, writer)
        self._commit(step)
        return SaveResult(step, time.perf_counter() - started)

    def _write(
        self,
        path: Path,
        state: dict[str, Any],
        writer: dcp.FileSystemWriter,
        staging: _Staging | None = None,
    ) -> None:
        """Write one save into ``path``; async (on the writer thread): copy the state into
        host memory first and then resolve ``staging.done``."""
        if staging is not None:
            try:
                state = staging.host.copy(state, staging.ready)
            except BaseException as exc:
                staging.done.set_exception(exc)
                raise
            staging.done.set_result(None)
        if self.runtime.rank == 0 and path.exists():
            # A leftover of the same step: marker first, so it can never look complete.
            (path / COMMIT_MARKER).unlink(missing_ok=True)
            shutil.rmtree(path)
        # Nobody writes into the folder before rank 0 has cleared it. The checkpoint group:
        # only one thread at a time saves, so its collectives stay in the same order on all ranks.
        dist.barrier(group=self.runtime.checkpoint_group)
        dcp.save(state, storage_writer=writer, process_group=self.runtime.checkpoint_group)

    def wait_staged(self) -> float:
        """Block until the in-flight save has copied the state (call before anything
        changes it: the optimizer step); the seconds waited."""
        if self._in_flight is None or self._in_flight.staged.done():
            return 0.0
        started = time.perf_counter()
        self._in_flight.staged.result()
        return time.perf_counter() - started

    def poll(self) -> int | None:
        """Commit the in-flight async save if it finished; the committed step, or None."""
        if self._in_flight is None or not self._in_flight.future.done():
            return None
        return self.finish()

    def finish(self) -> int | None:
        """Wait for the in-flight save (if any) and commit it; the committed step, or None."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        in_flight.future.result()  # a failed save (a peer died) raises here
        self._commit(in_flight.step)
        return in_flight.step

    def abandon(self) -> int | None:
        """On a stop: an in-flight save that already finished is committed, one that has
        not is left without its marker (never loaded). Returns the abandoned step."""
        in_flight = self._in_flight
        if in_flight is None:
            return None
        if in_flight.future.done() and in_flight.future.exception() is None:
            self.finish()
            return None
        self._in_flight = None
        if not in_flight.future.done():
            # It may still be copying into the host buffers: a later save gets new ones.
            self._retire_writer()
            host, self._host = self._host, None
            in_flight.future.add_done_callback(_abandoned_save_ended(in_flight.step, host))
        return in_flight.step

    def _commit(self, step: int) -> None:
        if self.runtime.rank == 0:
            if self._before_commit is not None:
                self._before_commit(step)
            write_commit_marker(step_dir(self.root, step), step, self.runtime.world_size)
            pruned = prune(self.root, self.cfg.keep_last)
            log.info("checkpoint committed", step=step, checkpoint_id=checkpoint_id(step), pruned=pruned)
        self.last_committed = step
        if self._on_commit is not None:
            self._on_commit(step)
