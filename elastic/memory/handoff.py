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

Before that boundary, when the controller's checkpoint request names the members the
re-form leaves out and the ack comes from memory, the leaving ranks *secure* what they
hold (``secure``): their snapshots of the acked step, their own and the copy of their
sender's, go to staying ranks until every old rank's state at that step is held by two
staying ranks (by every staying rank when fewer). A rank lost after the ack then costs no
step: without it, a leaving rank's shards and the copy it kept of its sender were only on
ranks the failure took or that leave, and the survivors went back to storage. A keeper
receives at most ``ceil(2 * leaving / staying) + 1`` snapshot shares (ranks; one when one
rank leaves and two or more stay), in host memory, and keeps them until the re-form
(``securing_load``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from regroup.elastic.memory import reshard
from regroup.elastic.memory.reshard import CHUNK, NONE, HeldState
from regroup.elastic.memory.reshard_plan import Entry, Message, Piece, plan_messages
from regroup.elastic.memory.reshard_transfer import carry_out

if TYPE_CHECKING:
    from regroup.elastic.memory.snapshot import Snapshots


def hand_off(
    held: HeldState, leaving: bool, group: dist.ProcessGroup | None = None, secured: bool = False
) -> list[HeldState]:
    """Collective over the old world (every rank calls it at the same boundary). Returns the
    states this rank holds afterwards: its own unless it is leaving, plus those handed to it.
    ``secured``: this leaving rank's state at this step is with staying ranks already
    (``secure`` before the ack): it sends nothing."""
    flags: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, (bool(leaving), bool(leaving and secured)), group=group)
    donors = [rank for rank, (out, done) in enumerate(flags) if out and not done]
    keepers = [rank for rank, (out, _) in enumerate(flags) if not out]
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


Move = tuple[int, int, int]
"""(donor, old rank, keeper): the donor sends the snapshot it holds of that old rank."""


def plan_securing(leaving: Sequence[bool], buddy: Sequence[int]) -> list[Move]:
    """What the leaving ranks send before a planned re-form's ack, given which ranks leave
    and each rank's snapshot buddy: each leaving rank holds its own snapshot and its
    sender's copy; every old rank's state ends up held by ``min(2, staying)`` staying ranks.
    Keepers are the staying ranks that hold the least so far (then the lowest rank). Pure:
    every rank computes the same moves."""
    n = len(leaving)
    staying = [r for r in range(n) if not leaving[r]]
    if not staying or len(staying) == n:
        return []
    want = min(2, len(staying))
    holders = {r: {h for h in (r, buddy[r]) if not leaving[h]} for r in range(n)}
    sender = {buddy[r]: r for r in range(n)}
    load = dict.fromkeys(staying, 0)
    moves: list[Move] = []
    for donor in (r for r in range(n) if leaving[r]):
        for owner in dict.fromkeys((donor, sender[donor])):
            while len(holders[owner]) < want:
                keeper = min((k for k in staying if k not in holders[owner]), key=lambda k: (load[k], k))
                moves.append((donor, owner, keeper))
                holders[owner].add(keeper)
                load[keeper] += 1
    return moves


def securing_load(leaving: int, staying: int) -> int:
    """The most snapshot shares one keeper receives when ``leaving`` ranks secure their
    state with ``staying`` ranks: the ``2 * leaving`` moves at most spread evenly, and one
    more where a state may not go to a rank that holds it already (the bound
    ``plan_securing`` keeps)."""
    return math.ceil(2 * leaving / staying) + 1 if leaving and staying else 0


@dataclass(frozen=True)
class Secured:
    """What ``secure`` did on this rank."""

    received: list[HeldState]
    """The snapshot states leaving ranks sent to this rank."""
    ranks: frozenset[int]
    """The ranks whose state staying ranks now hold: the leaving ones (none if all or none leave)."""
    sent_bytes: int
    """What this rank sent."""


def secure(snapshots: Snapshots, step: int, leaving: bool) -> Secured:
    """Collective over the world, at a planned re-form's ack (the boundary of ``step``): the
    generation of ``step`` complete on every rank (``Snapshots.complete_at``), the leaving
    ranks send the snapshots they hold of it (their own and their sender's copy) as
    ``plan_securing`` says, over the snapshots' group."""
    snapshots.complete_at(step)
    held = {h.old_rank: h for h in snapshots.held() if h.step == step}
    group = snapshots.group
    flags: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, bool(leaving), group=group)
    me = dist.get_rank(group)
    received, sent = [], 0
    for donor, owner, keeper in plan_securing(flags, snapshots.buddy):
        if me == donor:
            _send(held[owner], keeper, group, whole=True)
            sent += sum(t.numel() * t.element_size() for t in held[owner].tensors.values())
        elif me == keeper:
            received.append(_receive(donor, group))
    ranks = frozenset(r for r, flag in enumerate(flags) if flag) if len(set(flags)) > 1 else frozenset()
    return Secured(received, ranks, sent)


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


def _send(held: HeldState, dst: int, group: dist.ProcessGroup | None, whole: bool = False) -> None:
    """``whole``: every tensor of ``held`` (a snapshot: its shards and its chunk of the
    replicated entries); else its shards only (the keeper's own replicated entries are the same)."""
    keys = held.tensors if whole else held.sharded
    local = {k: (tuple(held.tensors[k].shape), held.tensors[k].dtype) for k in keys}
    meta = {
        "old_rank": held.old_rank,
        "old_world_size": held.old_world_size,
        "step": held.step,
        "local": local,
        "sharded": sorted(held.sharded),
        "replicated": held.replicated if whole else NONE,
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
    # A snapshot stays in host memory, as the snapshots do; shards for the next world go
    # where its model is.
    device = torch.device("cpu") if meta["replicated"] == CHUNK else _device()
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
        frozenset(meta["sharded"]),
        meta["shapes"],
        meta["values"],
        meta["replicated"],
    )


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
