"""A leaving rank hands its shards to a survivor before it goes (planned shrink, in memory).

At the agreed step boundary of a planned re-form every rank of the old world is still
there. Ranks whose node is leaving (its agent said so: the controller's expected
membership leaves it out) send their held state to a survivor over the old process
group; the survivors then hold every old rank's shards between them, and the new world
rebuilds its sharding from memory (``regroup.trainer.reshard.redistribute``) instead of reading
the checkpoint just written. Donors are spread over survivors round-robin.

A donor sends only its shards: the replicated entries (DDP's whole state, AdamW's
``step``) are the keeper's own already, at the same step. The shards travel as flat
buffers per dtype in messages of at most ``reshard.BUCKET_BYTES``: the hand-off is on a
planned re-form's critical path, a model's state has a few hundred tensors, each a round
trip of its own on gloo, and a donor makes no whole copy of its state to send it.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from regroup.trainer import reshard
from regroup.trainer.reshard import NONE, HeldState


def hand_off(held: HeldState, leaving: bool, group: dist.ProcessGroup | None = None) -> list[HeldState]:
    """Collective over the old world (every rank calls it at the same boundary). Returns the
    states this rank holds afterwards: its own unless it is leaving, plus those handed to it."""
    flags: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, bool(leaving), group=group)
    donors = [rank for rank, flag in enumerate(flags) if flag]
    keepers = [rank for rank, flag in enumerate(flags) if not flag]
    me = dist.get_rank(group)
    kept = [] if leaving else [held]
    if not donors or not keepers:
        return kept
    for i, donor in enumerate(donors):
        keeper = keepers[i % len(keepers)]
        if me == donor:
            _send(held, keeper, group)
        elif me == keeper:
            kept.append(_receive(donor, group))
    return kept


def _by_dtype(local: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[torch.dtype, list[str]]:
    """The sharded keys in sorted order, grouped by dtype: one buffer each."""
    groups: dict[torch.dtype, list[str]] = {}
    for key in sorted(local):
        groups.setdefault(local[key][1], []).append(key)
    return groups


def _messages(sizes: list[int], itemsize: int) -> list[tuple[int, int]]:
    """(start, end) element ranges of one dtype's flat buffer, at most ``BUCKET_BYTES`` each."""
    total, per = sum(sizes), max(1, reshard.BUCKET_BYTES // itemsize)
    return [(start, min(start + per, total)) for start in range(0, total, per)]


def _send(held: HeldState, dst: int, group: dist.ProcessGroup | None) -> None:
    local = {k: (tuple(held.tensors[k].shape), held.tensors[k].dtype) for k in held.sharded}
    meta = {
        "old_rank": held.old_rank,
        "old_world_size": held.old_world_size,
        "step": held.step,
        "local": local,
        "shapes": held.shapes,
        "values": held.values,
    }
    dist.send_object_list([meta], dst=dst, group=group)
    for dtype, keys in _by_dtype(local).items():
        parts = [held.tensors[k].reshape(-1) for k in keys]
        sizes = [p.numel() for p in parts]
        bounds = [0, *accumulate(sizes)][:-1]
        for start, end in _messages(sizes, dtype.itemsize):
            runs = [
                (part, max(start, lo) - lo, min(end, lo + part.numel()) - lo)
                for part, lo in zip(parts, bounds, strict=False)
                if max(start, lo) < min(end, lo + part.numel())
            ]
            if len(runs) == 1:  # inside one tensor: sent from its own memory
                part, a, b = runs[0]
                dist.send(part[a:b], dst=dst, group=group)
                continue
            message = torch.empty(end - start, dtype=dtype, device=parts[0].device)
            offset = 0
            for part, a, b in runs:
                message[offset : offset + b - a].copy_(part[a:b])
                offset += b - a
            dist.send(message, dst=dst, group=group)


def _receive(src: int, group: dist.ProcessGroup | None) -> HeldState:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    meta = box[0]
    device = _device()
    tensors: dict[str, torch.Tensor] = {}
    for dtype, keys in _by_dtype(meta["local"]).items():
        shapes = [meta["local"][k][0] for k in keys]
        sizes = [int(torch.Size(shape).numel()) for shape in shapes]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        for start, end in _messages(sizes, dtype.itemsize):
            dist.recv(flat[start:end], src=src, group=group)
        for key, shape, part in zip(keys, shapes, flat.split(sizes), strict=True):
            tensors[key] = part.view(shape)
    return HeldState(
        meta["old_rank"],
        meta["old_world_size"],
        meta["step"],
        tensors,
        frozenset(meta["local"]),
        meta["shapes"],
        meta["values"],
        NONE,
    )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
