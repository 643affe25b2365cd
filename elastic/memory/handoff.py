"""A leaving rank hands its shards to a survivor before it goes (planned shrink, in memory).

At the agreed step boundary of a planned re-form every rank of the old world is still
there. Ranks whose node is leaving (its agent said so: the controller's expected
membership leaves it out) send their held state to a survivor over the old process
group; the survivors then hold every old rank's shards between them, and the new world
rebuilds its sharding from memory (``regroup.elastic.memory.reshard.redistribute``) instead of reading
the checkpoint just written. Donors are spread over survivors round-robin.

A donor sends only its shards: the replicated entries (DDP's whole state, AdamW's
``step``) are the keeper's own already, at the same step. The shards move as the
reshard's do (``regroup.elastic.memory.reshard_plan``): a shard of 1 MB or more straight from the
donor's tensor into the keeper's buffer, smaller ones packed, within the same budget of
message bytes; the keeper holds them in one buffer per dtype.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from regroup.elastic.memory import reshard
from regroup.elastic.memory.reshard import NONE, HeldState
from regroup.elastic.memory.reshard_plan import Entry, Message, Piece, plan_messages
from regroup.elastic.memory.reshard_transfer import carry_out


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


def _plan(
    local: dict[str, tuple[tuple[int, ...], torch.dtype]], donor: int, keeper: int
) -> tuple[list[Piece], dict[tuple[int, int], list[Message]]]:
    """Every shard from the donor's held state into the keeper's, as the reshard's messages."""
    entries = [
        Entry(key, shape, True, torch.empty((), dtype=dtype).element_size(), str(dtype))
        for key, (shape, dtype) in sorted(local.items())
    ]
    pieces = [Piece(donor, keeper, e.key, 0, 0, 0, e.numel) for e in entries if e.numel]
    return pieces, plan_messages(pieces, entries, reshard.BUCKET_BYTES)


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
    dist.send_object_list([meta], group=group, group_dst=dst)
    pieces, messages = _plan(local, dist.get_rank(group), dst)
    device = next((t.device for t in held.tensors.values()), None)
    carry_out(pieces, messages, [held.tensors], {}, group, device)


def _receive(src: int, group: dist.ProcessGroup | None) -> HeldState:
    box: list[Any] = [None]
    dist.recv_object_list(box, group=group, group_src=src)
    meta = box[0]
    device = _device()
    tensors: dict[str, torch.Tensor] = {}
    for dtype, keys in _by_dtype(meta["local"]).items():
        shapes = [meta["local"][k][0] for k in keys]
        sizes = [int(torch.Size(shape).numel()) for shape in shapes]
        flat = torch.empty(sum(sizes), dtype=dtype, device=device)
        for key, shape, part in zip(keys, shapes, flat.split(sizes), strict=True):
            tensors[key] = part.view(shape)
    pieces, messages = _plan(meta["local"], src, dist.get_rank(group))
    carry_out(pieces, messages, [], tensors, group)
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
