"""Sharded, reshardable DCP checkpoints that count only once committed.

Layout: ``<dir>/step-N/`` holds DCP's shard files and ``.metadata``; ``COMMITTED`` is
written into it by rank 0 last, after every rank's shard is on disk (DCP's coordinator
writes ``.metadata`` only after gathering all ranks' write results, and rank 0's save
returns after that). A folder without the marker is never loaded and is removed at the
next start. Loading works at any world size: DCP reshards by the global tensor metadata.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from trainer.config import CheckpointConfig
from trainer.distributed import Runtime

log = structlog.get_logger("regroup.trainer.checkpoint")

COMMIT_MARKER = "COMMITTED"
_PREFIX = "step-"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{_PREFIX}{step}"


def checkpoint_id(step: int) -> str:
    """The id acks and logs use for a checkpoint: its folder name."""
    return f"{_PREFIX}{step}"


def _parse_step(name: str) -> int | None:
    if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
        return int(name[len(_PREFIX) :])
    return None


def is_committed(path: Path) -> bool:
    return (path / COMMIT_MARKER).is_file()


def list_steps(root: Path) -> list[tuple[int, bool]]:
    """(step, committed) of every ``step-N`` folder, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        step = _parse_step(child.name)
        if step is not None and child.is_dir():
            found.append((step, is_committed(child)))
    return sorted(found)


def latest_committed(root: Path) -> int | None:
    committed = [step for step, ok in list_steps(root) if ok]
    return committed[-1] if committed else None


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_commit_marker(path: Path, step: int, world_size: int) -> None:
    """Write the marker atomically (temp file, fsync, rename, fsync the folder)."""
    body = json.dumps({"step": step, "world_size": world_size, "committed_at": time.time()}).encode()
    tmp = path / f".{COMMIT_MARKER}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path / COMMIT_MARKER)
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_uncommitted(root: Path) -> list[int]:
    """Delete every folder without a commit marker (torn saves of earlier runs)."""
    removed = []
    for step, committed in list_steps(root):
        if not committed:
            shutil.rmtree(step_dir(root, step), ignore_errors=True)
            removed.append(step)
    return removed


def prune(root: Path, keep_last: int) -> list[int]:
    """Delete committed checkpoints beyond the newest ``keep_last``, and uncommitted
    folders older than the newest committed one (failed saves)."""
    steps = list_steps(root)
    committed = [s for s, ok in steps if ok]
    newest = committed[-1] if committed else None
    doomed = committed[:-keep_last] if len(committed) > keep_last else []
    doomed += [s for s, ok in steps if not ok and newest is not None and s < newest]
    for step in doomed:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return sorted(doomed)


class TrainerState(Stateful):
    """Position of the run: the step, samples seen, and the RNG, saved with the model."""

    def __init__(self) -> None:
        self.step = 0
        self.samples_seen = 0
        self.lr = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen, "lr": self.lr, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.samples_seen = int(state["samples_seen"])
        self.lr = float(state["lr"])
        torch.set_rng_state(state["rng"])


class AppState(Stateful):
    """Model + optimizer (sharded DTensors) + trainer state, as one DCP state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, trainer: TrainerState) -> None:
        self.model = model
        self.optimizer = optimizer
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        # get_state_dict also creates optimizer state templates, which loading needs.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state, "trainer": self.trainer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.trainer.load_state_dict(state["trainer"])


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
    staged: Future[Any]
    """Done when the state is copied to host memory; the live state may change after."""


@dataclass(frozen=True)
class SaveResult:
    """What one save cost the training loop."""

    step: int
    stall_s: float
    """Time the training loop was blocked by the call (for an async save: planning; the
    copy to host memory runs on while the next step computes, see ``wait_staged``)."""


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
        self._stager: DefaultStager | None = None

    def _staging(self) -> DefaultStager:
        """One stager for the whole run: it keeps its host buffers and copies into them on
        every save, so staging after the first save is a memcpy with no allocation. The copy
        runs in the stager's thread, overlapping the next step's forward and backward."""
        if self._stager is None:
            cuda = self.runtime.is_cuda
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
                )
            )
        return self._stager

    def close(self) -> None:
        """Release the stager's thread and buffers (the world this checkpointer served is gone)."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

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
        """Start saving ``step`` (waiting first for a previous async save to commit)."""
        self.finish()
        use_async = self.cfg.async_save if use_async is None else use_async
        path = step_dir(self.root, step)
        if self.runtime.rank == 0 and path.exists():
            # A leftover of the same step: marker first, so it can never look complete.
            (path / COMMIT_MARKER).unlink(missing_ok=True)
            shutil.rmtree(path)
        # Nobody writes into the folder before rank 0 has cleared it (one tiny collective per save).
        dist.barrier(group=self.runtime.control_group)
        writer_cls = _DieAfterWrite if self._die_at == step else dcp.FileSystemWriter
        writer = writer_cls(str(path))
        self.saves += 1
        started = time.perf_counter()
        state = {"app": app}
        if use_async:
            response = dcp.async_save(
                state,
                storage_writer=writer,
                process_group=self.runtime.checkpoint_group,
                async_stager=self._staging(),
            )
            assert isinstance(response, AsyncSaveResponse)
            self._in_flight = _InFlight(step, response.upload_completion, response.staging_completion)
            return SaveResult(step, time.perf_counter() - started)
        dcp.save(state, storage_writer=writer, process_group=self.runtime.checkpoint_group)
        self._commit(step)
        return SaveResult(step, time.perf_counter() - started)

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
