"""A leaving rank hands its shards to a survivor before it goes (planned shrink, in memory).

At the agreed step boundary of a planned re-form every rank of the old world is still
there. Ranks whose node is leaving (its agent said so: the controller's expected
membership leaves it out) send their held state to a survivor over the old process
group; the survivors then hold every old rank's shards between them, and the new world
rebuilds its sharding from memory (``regroup.trainer.reshard.redistribute``) instead of reading
the checkpoint just written. Donors are spread over survivors round-robin.

A donor's shards travel as one flat buffer per dtype, not one message per tensor: the
hand-off is on a planned re-form's critical path, and a model's state has a few hundred
tensors, each a round trip of its own on gloo.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from regroup.trainer.reshard import HeldState


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


def _send(held: HeldState, dst: int, group: dist.ProcessGroup | None) -> None:
    local = {k: (tuple(held.tensors[k].shape), held.tensors[k].dtype) for k in held.sharded}
    meta = {
        "old_rank": held.old_rank,
        "old_world_size": held.old_world_size,
        "step": held.step,
        "local": local,
        "plain": {k: v.cpu() for k, v in held.tensors.items() if k not in held.sharded},
        "shapes": held.shapes,
        "values": held.values,
    }
    dist.send_object_list([meta], dst=dst, group=group)
    for keys in _by_dtype(local).values():
        flat = torch.cat([held.tensors[k].reshape(-1) for k in keys])
        dist.send(flat, dst=dst, group=group)


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
        dist.recv(flat, src=src, group=group)
        for key, shape, part in zip(keys, shapes, flat.split(sizes)):
            tensors[key] = part.view(shape)
    tensors.update({k: v.to(device) for k, v in meta["plain"].items()})
    return HeldState(
        meta["old_rank"],
        meta["old_world_size"],
        meta["step"],
        tensors,
        frozenset(meta["local"]),
        meta["shapes"],
        meta["values"],
    )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
