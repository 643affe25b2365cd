"""What a process holds: resident memory and its peak (Linux ``/proc``), and whether any
model or optimizer tensor keeps more memory alive than its own bytes."""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from regroup.elastic.memory.reshard_plan import chunk_rows


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss() -> int:
    """Bytes resident now."""
    return _status("VmRSS")


def peak() -> int:
    """The most bytes resident since the last ``reset_peak`` (or the start)."""
    return _status("VmHWM")


def reset_peak() -> None:
    """Start a new peak from what is resident now."""
    Path("/proc/self/clear_refs").write_text("5")


def _allowed(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The local tensor and the bytes its storage may hold: its own, or for an FSDP2 shard the
    padded chunk FSDP2 allocates (``ceil(rows / world)`` rows on every rank)."""
    if not isinstance(tensor, DTensor):
        return tensor, tensor.numel() * tensor.element_size()
    local = tensor.to_local()
    own = local.numel() * local.element_size()
    if not tensor.shape:
        return local, own
    rows = chunk_rows(tensor.shape[0], tensor.device_mesh.size())
    return local, max(own, rows * math.prod(tensor.shape[1:]) * local.element_size())


def storage_report(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Every parameter, buffer and optimizer state tensor: how many storages hold them, and
    the worst ratio of a tensor's storage to the bytes it may hold (1.0: nothing extra)."""
    named: list[tuple[str, torch.Tensor]] = [*model.named_parameters(), *model.named_buffers()]
    names = {id(p): n for n, p in model.named_parameters()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                named.append((f"optim/{names.get(id(param), '?')}.{key}", value))
    worst, worst_key, storages, tensor_bytes = 1.0, "", set(), 0
    for name, tensor in named:
        local, allowed = _allowed(tensor.detach())
        storage = local.untyped_storage()
        storages.add(storage.data_ptr())
        tensor_bytes += local.numel() * local.element_size()
        ratio = storage.nbytes() / max(1, allowed)
        if ratio > worst:
            worst, worst_key = ratio, name
    return {
        "tensors": len(named),
        "storages": len(storages),
        "tensor_bytes": tensor_bytes,
        "worst_ratio": round(worst, 4),
        "worst_key": worst_key,
    }


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes of this rank's model and optimizer state, as it holds them (local shards,
    replicated tensors whole)."""
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                total += local.numel() * local.element_size()
    return total


def share_bytes(model: nn.Module, optimizer: torch.optim.Optimizer, world_size: int) -> int:
    """This rank's share of the job's model + optimizer state: its shards, and its part of
    the replicated tensors (each kept once per job)."""
    total = 0.0
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    for tensor in tensors:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        nbytes = local.numel() * local.element_size()
        total += nbytes if isinstance(tensor, DTensor) else nbytes / world_size
    return int(total)


def live_tensor_bytes() -> int:
    """The bytes of every storage a live Python tensor of this process holds, each once."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            local = obj.to_local() if isinstance(obj, DTensor) else obj
            if local.device.type != "meta" and not local.is_sparse:
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
