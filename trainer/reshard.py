"""Growing the world in memory: survivors of a re-form keep their FSDP2 shards and send
them over the new process group, newcomers receive theirs; no checkpoint is read.

When the new world has the old one's size (a spare took a lost or leaving node's
position), new rank r's shards are exactly old rank r's: ranks that hold their own keep
them, and only the replaced positions receive theirs, point to point from one holder.
Any other change of size re-cuts every tensor from all-gathers.

The state is the one DCP checkpoints hold (``get_state_dict``: FQN keys, the optimizer's
state keyed by FQN), flattened into sorted string keys that every rank derives alike, so
a newcomer's fresh model and optimizer give the same keys as a survivor's held state.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_MODEL, _OPTIM = "model/", "optim/"


@dataclass(frozen=True)
class HeldState:
    """What one surviving rank holds before it leaves its old process group."""

    old_rank: int
    old_world_size: int
    step: int
    tensors: dict[str, torch.Tensor]
    """Flat key -> this rank's local shard (DTensor entries) or the whole value (plain
    tensors, e.g. AdamW's ``step``). Shards alias the old model's and optimizer's storage."""
    sharded: frozenset[str]
    """Keys whose value is the ``Shard(0)`` local shard of a DTensor on a 1-D mesh."""
    shapes: dict[str, tuple[int, ...]]
    """Global shape of every key in ``tensors``."""
    values: dict[str, Any]
    """Non-tensor entries: the optimizer's param-group settings (lr, betas, ...)."""


def flat_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    # For a fresh optimizer get_state_dict first creates the state (zeros, via a step at
    # lr=0), so newcomers get templates of the right shapes and placements.
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    flat = {_MODEL + k: v for k, v in model_state.items()} | {_OPTIM + k: v for k, v in optim_state.items()}
    return dict(sorted(flat.items()))


def split_state(flat: dict[str, Any]) -> HeldState:
    """The flat state as a HeldState whose tensors are still the DTensors (no rank yet)."""
    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    sharded = frozenset(k for k, v in tensors.items() if isinstance(v, DTensor))
    return HeldState(-1, -1, -1, tensors, sharded, shapes, {k: v for k, v in flat.items() if k not in tensors})


def _layout(state: HeldState) -> str:
    """A digest of what a state consists of, to compare every rank's in one small message."""
    parts = [(k, state.shapes[k], str(t.dtype), k in state.sharded) for k, t in sorted(state.tensors.items())]
    return hashlib.sha256(repr((parts, sorted(state.values))).encode()).hexdigest()


def forget_old_meshes() -> None:
    """Drop DTensor's sharding-propagation caches; call when this process leaves a world.

    DeviceMesh equality ignores which rank this process is, and the caches hand out specs
    holding the first equal mesh seen: without this, a model built in a later world of the
    same shape gets DTensors whose mesh reports this process's old coordinate (torch 2.13).
    """
    _clear_sharding_prop_cache()


def hold_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, old_rank: int, old_world_size: int, step: int
) -> HeldState:
    """Capture this rank's shards (call before tearing down the old process group); no
    communication. Do not step the old optimizer afterwards: the shards are not copied.
    Also calls ``forget_old_meshes``, so the next world's model gets fresh meshes."""
    state = split_state(flat_state(model, optimizer))
    tensors: dict[str, torch.Tensor] = {}
    for key, value in state.tensors.items():
        if not isinstance(value, DTensor):
            tensors[key] = value.detach().clone()
            continue
        if value.device_mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
            raise ValueError(f"{key}: held state must be Shard(0) on a 1-D mesh, not {value.placements}")
        if value.device_mesh.size() != old_world_size:
            raise ValueError(f"{key}: sharded over {value.device_mesh.size()} ranks, not {old_world_size=}")
        tensors[key] = value.to_local().detach()
    forget_old_meshes()
    return HeldState(old_rank, old_world_size, step, tensors, state.sharded, state.shapes, state.values)


Info = tuple[int, int, int]
"""(old_rank, old_world_size, step) of one held state."""


def _as_list(entry: Info | list[Info] | None) -> list[Info]:
    if entry is None:
        return []
    return list(entry) if isinstance(entry, list) else [entry]


@dataclass(frozen=True)
class Choice:
    """Which held states rebuild the old world: the newest step at which the survivors
    between them hold every old rank's shards, and who contributes each."""

    step: int
    old_world_size: int
    sources: dict[int, tuple[int, int]]
    """Old rank -> (new rank holding it, index in that rank's list of held states)."""

    def mine(self, new_rank: int) -> list[int]:
        """Indices into ``new_rank``'s held states that it contributes, by old rank."""
        return [j for _, (holder, j) in sorted(self.sources.items()) if holder == new_rank]

    def slot(self, old_rank: int) -> tuple[int, int]:
        """(holding new rank, position among what it contributes) of ``old_rank``."""
        holder, j = self.sources[old_rank]
        return holder, self.mine(holder).index(j)


def choose(infos: list[Info | list[Info] | None]) -> Choice | str:
    """Per new rank, the (old_rank, old_world_size, step) of every state it holds (a list:
    its own, shards a leaving rank handed it, in-memory snapshots and buddy copies), or None
    for a newcomer. The newest step whose states cover the old ranks 0..W-1 wins; a rank
    held twice at that step is taken from the lowest new rank. A string says why none can."""
    present = [(new_rank, j, info) for new_rank, entry in enumerate(infos) for j, info in enumerate(_as_list(entry))]
    if not present:
        return "no rank holds state"
    sizes = {w for _, _, (_, w, _) in present}
    if len(sizes) > 1:
        return f"survivors disagree on the old world size: {sorted(sizes)}"
    (size,) = sizes
    for step in sorted({s for _, _, (_, _, s) in present}, reverse=True):
        sources: dict[int, tuple[int, int]] = {}
        for new_rank, j, (old_rank, _, s) in present:
            if s == step and 0 <= old_rank < size:
                sources.setdefault(old_rank, (new_rank, j))
        if len(sources) == size:
            return Choice(step, size, sources)
    steps = sorted({s for _, _, (_, _, s) in present})
    return f"no step at which the old ranks 0..{size - 1} are all held (steps held: {steps})"


def can_redistribute(infos: list[Info | list[Info] | None]) -> bool:
    """True iff ``choose`` finds a step at which the survivors hold the whole old world."""
    return isinstance(choose(infos), Choice)


@dataclass(frozen=True)
class Moved:
    """What one rank's latest ``redistribute`` moved, for the log event of its resume."""

    layout: str
    """``same``: the new world has the old one's size, so new rank r's shards are old rank
    r's; ``changed``: another size, every tensor re-cut."""
    received_bytes: int
    """Shard bytes this rank received from other ranks (the small entries not counted)."""
    sent_bytes: int
    """Shard bytes of this rank that reached other ranks."""


_last_moved: Moved | None = None


def last_moved() -> Moved | None:
    """What this process's latest ``redistribute`` moved; None before the first one."""
    return _last_moved


def redistribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    held: HeldState | list[HeldState] | None,
    group: dist.ProcessGroup,
    not_before: int = 0,
    *,
    regather: bool = False,
) -> int:
    """Collective over the new world (every rank calls it; newcomers pass ``held=None``).
    Fills the freshly built model and optimizer (FSDP2 on the new mesh, optimizer without
    state yet) from the survivors' shards and returns the step. A survivor may hold several
    old ranks' shards, at several steps (its own, those a leaving rank handed it, in-memory
    snapshots and its buddies' copies): the newest step held whole is taken (``choose``).
    Raises ValueError on every rank, with the same message, when the survivors cannot
    rebuild the old state, or only at a step older than ``not_before`` (the newest committed
    checkpoint, which is then the better place to resume from).

    At the old world's size only the ranks that do not hold their own old shards receive
    them (point to point); ``regather`` takes the all-gather path even then, to compare
    the two. ``last_moved`` says afterwards what this rank received and sent."""
    global _last_moved
    states = [] if held is None else (list(held) if isinstance(held, list) else [held])
    target = flat_state(model, optimizer)
    fresh = split_state(target)
    info = [(h.old_rank, h.old_world_size, h.step) for h in states]
    held_layout = _layout(states[0]) if states else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    # One small message carries everything checked, so every rank refuses alike or none does.
    message = (info, _stale_mesh(fresh, group), not_before, held_layout, _layout(fresh))
    dist.all_gather_object(gathered, message, group=group)
    infos = [entry[0] or None for entry in gathered]
    choice = choose(infos)
    if isinstance(choice, str):
        raise ValueError(f"cannot redistribute in memory: {choice} (per new rank: {infos})")
    newer = max(entry[2] for entry in gathered)
    if choice.step < newer:
        raise ValueError(f"cannot redistribute in memory: memory holds step {choice.step}, storage has {newer}")
    stale = [rank for rank, entry in enumerate(gathered) if entry[1]]
    if stale:
        raise ValueError(
            f"cannot redistribute in memory: new ranks {stale} see a mesh that is not the new world's "
            "(1-D over the group, coordinate = group rank); was forget_old_meshes called?"
        )
    if len({layout for entry in gathered for layout in entry[3:] if layout is not None}) > 1:
        raise ValueError("cannot redistribute in memory: the held state does not match the new model and optimizer")

    old_size, step = choice.old_world_size, choice.step
    me = dist.get_rank(group)
    mine = [states[j] for j in choice.mine(me)]
    # Every rank decides from the gathered message alone, so all take the same path.
    same = old_size == len(infos)
    with torch.no_grad():
        if same and not regather:
            received, sent = _fill_in_place(fresh, states, _in_place_sources(choice, infos), group)
        else:
            received = sent = 0
            slots = max(len(choice.mine(rank)) for rank in range(len(infos)))
            # Old rank -> its slot in the gathered buffer: holding new rank, position in what it sends.
            order = [holder * slots + position for holder, position in map(choice.slot, range(old_size))]
            for bucket in _buckets(fresh, old_size, slots):
                contributed = _regather_bucket(bucket, fresh, mine, slots, old_size, order, group)
                received += (len(infos) - 1) * contributed
                sent += (len(infos) - 1) * contributed
        # Small entries (AdamW's step, param-group settings) come whole from old rank 0.
        payload: list[Any] = [None]
        first = next((h for h in mine if h.old_rank == 0), None)
        if first is not None:
            payload = [({k: first.tensors[k].cpu() for k in fresh.tensors if k not in fresh.sharded}, first.values)]
        dist.broadcast_object_list(payload, group=group, group_src=choice.sources[0][0])
        plain, values = payload[0]
        target.update({k: v.to(fresh.tensors[k].device) for k, v in plain.items()})
        target.update(values)
    set_state_dict(
        model,
        optimizer,
        model_state_dict={k[len(_MODEL) :]: v for k, v in target.items() if k.startswith(_MODEL)},
        optim_state_dict={k[len(_OPTIM) :]: v for k, v in target.items() if k.startswith(_OPTIM)},
        options=_OPTIONS,
    )
    _last_moved = Moved("same" if same else "changed", received, sent)
    return step


def _stale_mesh(fresh: HeldState, group: dist.ProcessGroup) -> bool:
    """Whether a new DTensor's mesh disagrees with ``group`` (the new shard is cut by its coordinate)."""
    meshes = {id(t.device_mesh): t.device_mesh for t in fresh.tensors.values() if isinstance(t, DTensor)}
    expected = (dist.get_rank(group),)
    size = dist.get_world_size(group)
    return any(m.ndim != 1 or m.size() != size or m.get_coordinate() != expected for m in meshes.values())


BUCKET_BYTES = 64 << 20
"""Upper bound on one rank's contribution to one all-gather (its padded old chunks), and
on one point-to-point message of shards."""


def chunk_rows(rows: int, world: int) -> int:
    """Rows per shard under torch.chunk semantics: ceil(n/W), the last shards short or empty."""
    return -(-rows // world)


def _row(tensor: torch.Tensor) -> int:
    """Elements in one row (along dim 0) of ``tensor``, from its shape: indexing a DTensor
    (``tensor[0]``) would gather it from every rank, one collective per tensor."""
    return math.prod(tensor.shape[1:])


def _buckets(fresh: HeldState, old_size: int, slots: int) -> list[list[str]]:
    """Sharded keys in sorted order, grouped by dtype and device into buckets of at most
    ``BUCKET_BYTES`` per rank, so a few collectives move the whole state."""
    buckets: list[list[str]] = []
    current: list[str] = []
    size, kind = 0, None
    for key in sorted(fresh.sharded):
        dest = fresh.tensors[key]
        row = _row(dest)
        nbytes = slots * chunk_rows(dest.shape[0], old_size) * row * dest.element_size()
        this = (dest.dtype, dest.device.type)
        if current and (this != kind or size + nbytes > BUCKET_BYTES):
            buckets.append(current)
            current, size = [], 0
        current.append(key)
        size, kind = size + nbytes, this
    if current:
        buckets.append(current)
    return buckets


def _regather_bucket(
    keys: list[str],
    fresh: HeldState,
    held: list[HeldState],
    slots: int,
    old_size: int,
    order: list[int],
    group: dist.ProcessGroup,
) -> int:
    """Rebuild the full tensors of ``keys`` from the old shards (one all-gather of every
    rank's padded old chunks) and copy this rank's new shard of each into the new model.
    Returns the bytes this rank contributed."""
    dests = [fresh.tensors[k] for k in keys]
    widths = [chunk_rows(d.shape[0], old_size) * _row(d) for d in dests]
    span = sum(widths)  # elements of one old rank's padded chunks of every key
    sample = dests[0].to_local()
    mine = torch.zeros(slots * span, dtype=sample.dtype, device=sample.device)
    for j, state in enumerate(held):
        offset = j * span
        for key, width in zip(keys, widths):
            shard = state.tensors[key].reshape(-1)
            mine[offset : offset + shard.numel()].copy_(shard)
            offset += width
    world = dist.get_world_size(group)
    gathered = mine.new_empty(world * slots * span)
    dist.all_gather_single(gathered, mine, group=group)
    contributed = mine.numel() * mine.element_size()
    del mine
    me = dist.get_rank(group)
    offset = 0
    for dest, width in zip(dests, widths):
        rows = dest.shape[0]
        # Padding sits only after each old shard's rows: old-rank order, then the first n rows.
        parts = [gathered[i * span + offset : i * span + offset + width] for i in order]
        full = torch.cat(parts).view(-1, *dest.shape[1:])[:rows]
        local = dest.to_local()
        start = me * chunk_rows(rows, world)  # the new mesh's coordinate is the group rank
        local.copy_(full[start : start + local.shape[0]])
        offset += width
    return contributed


def _in_place_sources(choice: Choice, infos: list[Info | list[Info] | None]) -> dict[int, tuple[int, int]]:
    """Old rank -> (new rank, index in its held states) that fills new rank ``old rank``
    when the world keeps its size: the rank itself when it holds its own old rank at the
    chosen step (nothing moves), else the holder ``choose`` picked."""
    sources = dict(choice.sources)
    for rank, entry in enumerate(infos):
        for j, (old_rank, _, step) in enumerate(_as_list(entry)):
            if old_rank == rank and step == choice.step:
                sources[rank] = (rank, j)
                break
    return sources


def _shard_numel(shape: tuple[int, ...], world: int, rank: int) -> int:
    """Elements of ``rank``'s ``Shard(0)`` chunk of a tensor of ``shape`` (torch.chunk cuts)."""
    per = chunk_rows(shape[0], world)
    return max(0, min(per, shape[0] - rank * per)) * math.prod(shape[1:])


def _messages(fresh: HeldState, world: int, rank: int) -> list[list[tuple[str, int]]]:
    """``rank``'s shards as messages: (key, elements) in sorted key order, grouped by dtype
    and device, at most ``BUCKET_BYTES`` each (a bigger tensor goes alone). Sender and
    receiver derive the same cut from the global shapes."""
    messages: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    size, kind = 0, None
    for key in sorted(fresh.sharded):
        dest = fresh.tensors[key]
        numel = _shard_numel(fresh.shapes[key], world, rank)
        if numel == 0:
            continue
        nbytes = numel * dest.element_size()
        this = (dest.dtype, dest.device.type)
        if current and (this != kind or size + nbytes > BUCKET_BYTES):
            messages.append(current)
            current, size = [], 0
        current.append((key, numel))
        size, kind = size + nbytes, this
    if current:
        messages.append(current)
    return messages


def _fill_in_place(
    fresh: HeldState, held: list[HeldState], sources: dict[int, tuple[int, int]], group: dist.ProcessGroup
) -> tuple[int, int]:
    """Fill this rank's new shards with old rank ``me``'s (same world size, so the same
    cuts): copied from its own held state, or received from the one rank ``sources``
    names, while this rank sends the old ranks it is the source of to their positions.
    Round i carries message i of every transfer at once (``batch_isend_irecv``), so a
    rank holds one message per transfer at a time. Returns (received, sent) bytes."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    dests = {key: fresh.tensors[key].to_local() for key in fresh.sharded}
    holder, index = sources[me]
    if holder == me:
        own = held[index]
        for key, local in dests.items():
            local.copy_(own.tensors[key])
    outgoing = [(rank, held[j]) for rank, (source, j) in sorted(sources.items()) if source == me and rank != me]
    plans = {rank: _messages(fresh, world, rank) for rank, _ in outgoing}
    if holder != me:
        plans[me] = _messages(fresh, world, me)
    received = sent = 0
    for round_ in range(max((len(plan) for plan in plans.values()), default=0)):
        ops: list[dist.P2POp] = []
        for rank, state in outgoing:
            if round_ < len(plans[rank]):
                message = _pack(plans[rank][round_], state, fresh)
                ops.append(dist.P2POp(dist.isend, message, group=group, group_peer=rank))
                sent += message.numel() * message.element_size()
        inbox: torch.Tensor | None = None
        if holder != me and round_ < len(plans[me]):
            inbox = _empty(plans[me][round_], fresh)
            ops.append(dist.P2POp(dist.irecv, inbox, group=group, group_peer=holder))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if inbox is not None:
            received += inbox.numel() * inbox.element_size()
            offset = 0
            for key, numel in plans[me][round_]:
                local = dests[key]
                local.copy_(inbox[offset : offset + numel].view_as(local))
                offset += numel
    return received, sent


def _empty(message: list[tuple[str, int]], fresh: HeldState) -> torch.Tensor:
    """A flat buffer for ``message``, of its keys' dtype on the new model's device."""
    sample = fresh.tensors[message[0][0]]
    return torch.empty(sum(numel for _, numel in message), dtype=sample.dtype, device=sample.device)


def _pack(message: list[tuple[str, int]], state: HeldState, fresh: HeldState) -> torch.Tensor:
    """``message``'s shards of a held state, one after the other in one flat buffer."""
    flat = _empty(message, fresh)
    offset = 0
    for key, numel in message:
        flat[offset : offset + numel].copy_(state.tensors[key].reshape(-1))
        offset += numel
    return flat
