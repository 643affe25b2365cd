"""The copy of a checkpoint's state into host memory that an async save starts with."""

from __future__ import annotations

import copy
from concurrent.futures import Future
from typing import Any

import structlog
import torch
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.tensor import DTensor

log = structlog.get_logger("regroup.trainer.checkpoint")


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


class HostCopy:
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
