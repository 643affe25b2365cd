"""Sharded, reshardable DCP checkpoints that count only once committed.

Layout: ``<dir>/step-N/`` holds DCP's shard files and ``.metadata``; ``COMMITTED`` is
written into it by rank 0 last, after every rank's shard is on disk (DCP's coordinator
writes ``.metadata`` only after gathering all ranks' write results, and rank 0's save
returns after that). A folder without the marker is never loaded and is removed at the
next start. Loading works at any world size: DCP reshards by the global tensor metadata.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

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


def _tensor_identity(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[Any, ...]:
    """Every parameter and buffer (object and memory) and the optimizer's state object of
    each parameter: what a kept ``get_state_dict`` result aliases."""
    with torch.no_grad():  # DTensor.to_local is then a plain attribute read
        tensors = tuple(
            (id(t), (t.to_local() if isinstance(t, DTensor) else t).data_ptr())
            for t in chain(model.parameters(), model.buffers())
        )
    groups = tuple(len(g["params"]) for g in optimizer.param_groups)
    optim = tuple((id(p), id(optimizer.state.get(p))) for g in optimizer.param_groups for p in g["params"])
    return tensors, groups, optim


@dataclass(frozen=True)
class _KeptState:
    """A ``get_state_dict`` result kept between saves. Its model tensors are detached views of
    the parameters' memory and its optimizer entries are the optimizer's own per-parameter
    state dicts, so in-place updates (the optimizer step) keep it current; only the param
    groups' settings (the learning rate) are read afresh at each save."""

    identity: tuple[Any, ...]
    model: dict[str, Any]
    optim_state: dict[str, Any]
    group_fqns: list[list[str]]
    """The parameters of each param group, as FQNs, in the optimizer's order."""
    keep_alive: tuple[Any, ...]
    """The objects ``identity`` names by ``id``, so no id is reused while this is kept."""


class AppState(Stateful):
    """Model + optimizer (sharded DTensors) + trainer state, as one DCP state."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, trainer: TrainerState) -> None:
        self.model = model
        self.optimizer = optimizer
        self.trainer = trainer
        self._kept: _KeptState | None = None

    def state_dict(self) -> dict[str, Any]:
        """The state as DCP saves it: references to the live tensors, no copy. Building it
        with ``get_state_dict`` costs milliseconds of Python on the training thread (FQN
        maps, module traversal), so the result is reused while no parameter, buffer or
        optimizer state object has been replaced (a load, a re-pad, a new optimizer)."""
        kept = self._kept
        if kept is None or kept.identity != _tensor_identity(self.model, self.optimizer):
            kept = self._keep()
        groups = [
            {**group, "params": list(fqns)}
            for group, fqns in zip(self.optimizer.state_dict()["param_groups"], kept.group_fqns, strict=True)
        ]
        optim = {"state": dict(kept.optim_state), "param_groups": groups}
        return {"model": dict(kept.model), "optim": optim, "trainer": self.trainer.state_dict()}

    def _keep(self) -> _KeptState:
        # get_state_dict also creates optimizer state templates, which loading needs; the
        # identity is taken after it, once that state exists.
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        identity = _tensor_identity(self.model, self.optimizer)
        keep_alive = (
            *chain(self.model.parameters(), self.model.buffers()),
            *(self.optimizer.state.get(p) for g in self.optimizer.param_groups for p in g["params"]),
        )
        self._kept = _KeptState(
            identity=identity,
            model=model_state,
            optim_state=optim_state["state"],
            group_fqns=[list(group["params"]) for group in optim_state["param_groups"]],
            keep_alive=keep_alive,
        )
        return self._kept

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._kept = None
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.trainer.load_state_dict(state["trainer"])
        self._kept = None  # the optimizer's state objects were replaced


class _DieAfterWrite(dcp.FileSystemWriter):
    """Injected fault: this rank is killed (SIGKILL) right after writing its shard,
    before the save can be committed."""

    def write_data(self, plan: Any, planner: Any) -> Future[Any]:
        future = super().write_data(plan, planner)
        future.wait()
        log.warning("fault: killing this rank in the middle of a checkpoint save")
        os.kill(os.getpid(), signal.SIGKILL)
        return future


class _Reshaped(Exception):
    """The state no longer has the structure of the last host copy."""


def _host_twin(live: Any, host: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """``live`` with each tensor replaced by its twin in ``host`` (the last host copy), the
    (host, live) local tensors to copy collected in ``pairs``; any other value is taken as
    it is now. Raises ``_Reshaped`` where a key, a shape, a dtype or a layout differs."""
    if isinstance(live, torch.Tensor):
        if type(host) is not type(live) or host.shape != live.shape or host.dtype != live.dtype:
            raise _Reshaped
        if isinstance(live, DTensor):
            if host.placements != live.placements or host.device_mesh != live.device_mesh:
                raise _Reshaped
            host_local, live_local = host.to_local(), live.to_local()
        else:
            host_local, live_local = host, live
        if host_local.shape != live_local.shape:
            raise _Reshaped
        pairs.append((host_local, live_local))
        return host
    if isinstance(live, dict):
        if not isinstance(host, dict) or host.keys() != live.keys():
            raise _Reshaped
        return {key: _host_twin(value, host[key], pairs) for key, value in live.items()}
    if type(live) in (list, tuple):
        if type(host) is not type(live) or len(host) != len(live):
            raise _Reshaped
        return type(live)(_host_twin(value, twin, pairs) for value, twin in zip(live, host, strict=True))
    return copy.deepcopy(live)  # settings and counters: small, and must not change under the write


class _HostCopy:
    """Copies the state into host memory for an async save. The first copy goes through
    DCP's stager, which allocates the buffers (pinned on CUDA) and rebuilds every DTensor in
    Python; later copies refill those buffers, tensor by tensor, while the state keeps its
    structure: a walk of the state plus copies that release the interpreter, so the step
    that overlaps them loses little to this thread. Made on the training thread (a CUDA
    stager makes its stream there); used by one thread at a time."""

    def __init__(self, cuda: bool) -> None:
        self._stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=cuda
            )
        )
        self._stream = torch.cuda.Stream() if cuda else None
        self._last: dict[str, Any] | None = None

    def mark(self) -> torch.cuda.Event | None:
        """On the training thread at a save: the point of the device's work the copy follows."""
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def copy(self, state: dict[str, Any], ready: torch.cuda.Event | None) -> dict[str, Any]:
        """A copy of ``state`` in host memory (on the writer thread)."""
        if ready is not None:
            ready.synchronize()
        if self._last is not None:
            pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
            try:
                with torch.no_grad():
                    staged = _host_twin(state, self._last, pairs)
            except _Reshaped:
                log.info("checkpoint state changed structure: staging into new host buffers")
            else:
                self._refill(pairs)
                return staged
        copied = self._stager.stage(state)
        self._last = copied.result() if isinstance(copied, Future) else copied
        return self._last

    def _refill(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self._stream is None:
            for host, live in pairs:
                host.copy_(live)
            return
        with torch.cuda.stream(self._stream):
            for host, live in pairs:
                host.copy_(live, non_blocking=True)
        self._stream.synchronize()

    def close(self) -> None:
        self._last = None
        self._stager.close()


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

    host: _HostCopy
    ready: torch.cuda.Event | None
    done: Future[None]


def _abandoned_save_ended(step: int, host: _HostCopy | None) -> Callable[[Future[Any]], None]:
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
        self._host: _HostCopy | None = None
        self._writer: ThreadPoolExecutor | None = None

    def _host_copy(self) -> _HostCopy:
        """One host copy for the whole run: its buffers are allocated at the first save and
        refilled at every later one. The copy overlaps the next step's forward and backward."""
        if self._host is None:
            self._host = _HostCopy(self.runtime.is_cuda)
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
