"""A leaving rank hands its shards to a survivor before it goes (planned shrink, in memory).

At the agreed step boundary of a planned re-form every rank of the old world is still
there. Ranks whose node is leaving (its agent said so: the controller's expected
membership leaves it out) send their held state to a survivor over the old process
group; the survivors then hold every old rank's shards between them, and the new world
rebuilds its sharding from memory (``regroup.trainer.reshard.redistribute``) instead of reading
the checkpoint just written. Donors are spread over survivors round-robin.
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


def _send(held: HeldState, dst: int, group: dist.ProcessGroup | None) -> None:
    sharded = sorted(held.sharded)
    meta = {
        "old_rank": held.old_rank,
        "old_world_size": held.old_world_size,
        "step": held.step,
        "local": {k: (tuple(held.tensors[k].shape), held.tensors[k].dtype) for k in sharded},
        "plain": {k: v.cpu() for k, v in held.tensors.items() if k not in held.sharded},
        "shapes": held.shapes,
        "values": held.values,
    }
    dist.send_object_list([meta], dst=dst, group=group)
    for key in sharded:
        dist.send(held.tensors[key].contiguous(), dst=dst, group=group)


def _receive(src: int, group: dist.ProcessGroup | None) -> HeldState:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    meta = box[0]
    device = _device()
    tensors: dict[str, torch.Tensor] = {}
    for key, (shape, dtype) in sorted(meta["local"].items()):
        buffer = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buffer, src=src, group=group)
        tensors[key] = buffer
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
