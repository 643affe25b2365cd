"""Where snapshots sit: one rank's shards laid out in a flat host buffer, which rank keeps
whose copy (its buddy, on another node and, where known, another failure domain), and where
the optimizer keeps each param-group setting a snapshot records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from regroup.elastic.memory.reshard import HeldState
from regroup.elastic.memory.reshard_plan import chunk_rows, flat_span

_ALIGN = 16
STAMP = torch.int64
"""Element type of a buffer's stamp: the step and the rank its copy holds."""


@dataclass(frozen=True)
class Entry:
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Layout:
    """Where each tensor of one rank's state sits in a flat byte buffer; the last bytes
    stamp the step and the rank, written after everything else is copied."""

    entries: tuple[Entry, ...]
    nbytes: int

    @staticmethod
    def of(shapes: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> Layout:
        entries, offset = [], 0
        for key, shape, dtype in shapes:
            entries.append(Entry(key, tuple(shape), dtype, offset))
            offset += -(-entries[-1].nbytes // _ALIGN) * _ALIGN
        return Layout(tuple(entries), offset + _ALIGN)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        return {e.key: buffer[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries}

    def stamp(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[self.nbytes - _ALIGN :].view(STAMP)


def layout_for(template: HeldState, rank: int, world_size: int) -> Layout:
    """The layout of ``rank``'s snapshot, derived from any rank's state: a ``Shard(0)`` key
    holds rows ``[rank * c, (rank + 1) * c)`` of its global shape, c = ceil(rows / world)
    (torch.chunk); a replicated key, the same on every rank, holds only ``rank``'s flat chunk
    (``reshard_plan.flat_span``), so the world keeps it once between its ranks."""
    shapes = []
    for key, tensor in sorted(template.tensors.items()):
        full = template.shapes[key]
        if key in template.sharded:
            rows = chunk_rows(full[0], world_size)
            shape: tuple[int, ...] = (max(0, min(rows, full[0] - rank * rows)), *full[1:])
        else:
            lo, hi = flat_span(math.prod(full), world_size, rank)
            shape = (hi - lo,)
        shapes.append((key, shape, tensor.dtype))
    return Layout.of(shapes)


def buddies(places: Sequence[tuple[str, str]]) -> list[int]:
    """``buddy[r]`` for each rank, given each rank's (failure domain, node): a rotation of the
    ranks ordered by place, the shift chosen so the fewest pairs share a node, then a
    domain. Every rank sends to one rank and receives from one."""
    n = len(places)
    order = sorted(range(n), key=lambda r: (places[r], r))
    per_node: dict[tuple[str, str], int] = {}
    per_domain: dict[str, int] = {}
    for place in places:
        per_node[place] = per_node.get(place, 0) + 1
        per_domain[place[0]] = per_domain.get(place[0], 0) + 1
    shifts = {s % n for s in (max(per_node.values()), max(per_domain.values()), *range(1, min(n, 33)))} - {0}

    def cost(shift: int) -> tuple[int, int, int]:
        pairs = [(places[order[i]], places[order[(i + shift) % n]]) for i in range(n)]
        return sum(a == b for a, b in pairs), sum(a[0] == b[0] for a, b in pairs), shift

    best = min(shifts, key=cost) if shifts else 0
    buddy = [0] * n
    for i, rank in enumerate(order):
        buddy[rank] = order[(i + best) % n]
    return buddy


def setting_keys(model: nn.Module, optimizer: torch.optim.Optimizer, values: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """Each param-group setting's flat key (``optim/param_groups.<fqn>.<name>``) -> (group
    index, name), so a snapshot reads the settings of its step straight from the optimizer."""
    _, optim_state = get_state_dict(model, optimizer)
    keys: dict[str, tuple[int, str]] = {}
    for index, group in enumerate(optim_state["param_groups"]):
        for fqn in group["params"]:
            for name in group:
                key = f"optim/param_groups.{fqn}.{name}"
                if name != "params" and key in values:
                    keys[key] = (index, name)
    return keys
