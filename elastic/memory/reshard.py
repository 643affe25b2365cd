"""Re-forming the world in memory: survivors keep their shards, newcomers receive theirs,
and every rank of the new world fills its freshly built model and optimizer; no checkpoint
is read.

The state is the one DCP checkpoints hold (``get_state_dict``: FQN keys, the optimizer's
state keyed by FQN), flattened into sorted string keys that every rank derives alike, so
a newcomer's fresh model and optimizer give the same keys as a survivor's held state.
Sharded entries (FSDP2's DTensors) are cut by rows; replicated ones (plain tensors: DDP's
whole state, AdamW's ``step``) are the same on every rank. Which bytes go where is
``regroup.elastic.memory.reshard_plan``; every tensor travels as its own bytes over point-to-point
messages of bounded size (``regroup.elastic.memory.reshard_transfer``), and lands in the new
model's and optimizer's own tensors, so nothing of the held state outlives the re-form.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from regroup.elastic.memory.reshard_plan import (
    CHUNK,
    NONE,
    WHOLE,
    Choice,
    Entry,
    Info,
    as_infos,
    choose,
    chunk_rows,
    plan_messages,
    plan_pieces,
)
from regroup.elastic.memory.reshard_transfer import carry_out

__all__ = [
    "BUCKET_BYTES", "CHUNK", "NONE", "WHOLE", "Choice", "HeldState", "Info", "Moved", "can_redistribute", "choose",
    "chunk_rows", "flat_state", "forget_old_meshes", "hold_state", "last_moved", "redistribute", "split_state",
]  # fmt: skip

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_MODEL, _OPTIM = "model/", "optim/"

BUCKET_BYTES = 64 << 20
"""About the most bytes of messages a rank holds at once while the state moves, each way."""


@dataclass(frozen=True)
class HeldState:
    """What one rank holds of one old rank's state, at one step, for the next world."""

    old_rank: int
    old_world_size: int
    step: int
    tensors: dict[str, torch.Tensor]
    """Flat key -> this old rank's local shard (sharded entries) or the replicated value,
    whole or as its flat chunk (``replicated``). A live state aliases the old model's and
    optimizer's memory; a snapshot's, the snapshot buffers."""
    sharded: frozenset[str]
    """Keys whose value is the ``Shard(0)`` local shard of a DTensor on a 1-D mesh."""
    shapes: dict[str, tuple[int, ...]]
    """Global shape of every tensor entry."""
    values: dict[str, Any]
    """Non-tensor entries: the optimizer's param-group settings (lr, betas, ...)."""
    replicated: str = WHOLE
    """How the replicated entries are held: ``whole`` (a live state), ``chunk`` (a snapshot:
    the old rank's flat chunk, 1-D) or ``none`` (shards a leaving rank handed over)."""

    @property
    def info(self) -> Info:
        return Info(self.old_rank, self.old_world_size, self.step, self.replicated)


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
    """A digest of what a state consists of, to compare every rank's in one small message:
    every tensor's key and global shape, and the shards' dtypes (a state may lack the
    replicated tensors, which its holder has whole)."""
    parts = [
        (k, shape, str(state.tensors[k].dtype) if k in state.sharded else "", k in state.sharded)
        for k, shape in sorted(state.shapes.items())
    ]
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
    """Capture this rank's state (call before tearing down the old process group); no
    communication and no copy: the held tensors alias the old model's and optimizer's, so
    do not step the old optimizer afterwards. Also calls ``forget_old_meshes``, so the next
    world's model gets fresh meshes."""
    state = split_state(flat_state(model, optimizer))
    tensors: dict[str, torch.Tensor] = {}
    for key, value in state.tensors.items():
        if not isinstance(value, DTensor):
            tensors[key] = value.detach()
            continue
        if value.device_mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
            raise ValueError(f"{key}: held state must be Shard(0) on a 1-D mesh, not {value.placements}")
        if value.device_mesh.size() != old_world_size:
            raise ValueError(f"{key}: sharded over {value.device_mesh.size()} ranks, not {old_world_size=}")
        tensors[key] = value.to_local().detach()
    forget_old_meshes()
    return HeldState(old_rank, old_world_size, step, tensors, state.sharded, state.shapes, state.values)


def can_redistribute(infos: list[Any]) -> bool:
    """True iff ``choose`` finds a step at which the survivors hold the whole old world."""
    return isinstance(choose(infos), Choice)


@dataclass(frozen=True)
class Moved:
    """What one rank's latest ``redistribute`` moved, for the log event of its resume."""

    layout: str
    """``same``: the new world has the old one's size, so new rank r's shards are old rank
    r's; ``changed``: another size, every tensor re-cut."""
    received_bytes: int
    """Bytes this rank received from other ranks (shards and replicated entries)."""
    sent_bytes: int
    """Bytes of this rank's held states that reached other ranks."""
    transfer_s: float = 0.0
    """Seconds the copies and messages took (the rest of ``redistribute``: gathering what
    every rank holds, building the new optimizer's state, loading it)."""
    received_from: dict[int, int] = field(default_factory=dict)
    """Peer rank -> bytes received from it."""
    sent_to: dict[int, int] = field(default_factory=dict)
    """Peer rank -> bytes sent to it."""
    copied_bytes: int = 0
    """Bytes this rank copied from what it held itself."""

    def summary(self) -> dict[str, Any]:
        """The fields of the resume's log event."""
        return {"layout": self.layout, "received_bytes": self.received_bytes, "sent_bytes": self.sent_bytes}


_last_moved: Moved | None = None


def last_moved() -> Moved | None:
    """What this process's latest ``redistribute`` moved; None before the first one."""
    return _last_moved


def _entries(fresh: HeldState) -> list[Entry]:
    return [
        Entry(key, fresh.shapes[key], key in fresh.sharded, tensor.element_size(), str(tensor.dtype))
        for key, tensor in sorted(fresh.tensors.items())
    ]


def redistribute(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    held: HeldState | list[HeldState] | None,
    group: dist.ProcessGroup,
    not_before: int = 0,
    *,
    prefer_own: bool = True,
) -> int:
    """Collective over the new world (every rank calls it; newcomers pass ``held=None``).
    Fills the freshly built model and optimizer (FSDP2 on the new mesh, DDP or one rank;
    optimizer without state yet) from the survivors' held states and returns the step. A
    survivor may hold several old ranks' states, at several steps (its own, those a leaving
    rank handed it, in-memory snapshots and its buddies' copies): the newest step held
    whole is taken (``choose``). Raises ValueError on every rank, with the same message,
    when the survivors cannot rebuild the old state, or only at a step older than
    ``not_before`` (the newest committed checkpoint, which is then the better place to
    resume from).

    A rank copies what it holds itself and receives the rest point to point (at the old
    world's size, a survivor holding its own old shards receives nothing);
    ``prefer_own=False`` takes every remote piece from its chosen holder even then, to
    compare. ``last_moved`` says afterwards what this rank received and sent."""
    global _last_moved
    states = [] if held is None else (list(held) if isinstance(held, list) else [held])
    target = flat_state(model, optimizer)
    fresh = split_state(target)
    # Where the messages live: the new model's device. Host snapshots of a CUDA job are apart.
    device = next((t.device for t in fresh.tensors.values()), torch.device("cpu"))
    info = [tuple(h.info._replace(apart=any(t.device != device for t in h.tensors.values()))) for h in states]
    held_layout = _layout(states[0]) if states else None
    gathered: list[Any] = [None] * dist.get_world_size(group)
    # One small message carries everything checked, so every rank refuses alike or none does.
    message = (info, _stale_mesh(fresh, group), not_before, held_layout, _layout(fresh))
    dist.all_gather_object(gathered, message, group=group)
    infos = [entry[0] or None for entry in gathered]
    choice = choose(infos, sharded=bool(fresh.sharded))
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

    world = len(infos)
    entries = _entries(fresh)
    # Every rank plans from the gathered message alone, so all agree on every message.
    pieces = plan_pieces(entries, infos, choice, world, prefer_own=prefer_own)
    apart = frozenset((rank, j) for rank, held in enumerate(infos) for j, i in enumerate(as_infos(held)) if i.apart)
    messages = plan_messages(pieces, entries, BUCKET_BYTES, apart=apart)
    me = dist.get_rank(group)
    dests = {key: (t.to_local() if isinstance(t, DTensor) else t) for key, t in fresh.tensors.items()}
    traffic = carry_out(
        [p for p in pieces if me in (p.src, p.dst)], messages, [h.tensors for h in states], dests, group
    )
    # Param-group settings (lr, betas: no tensors) come from the lowest rank holding the chosen step.
    holders = sorted({src for src, _ in [*choice.sources.values(), *choice.whole, *choice.chunks.values()]})
    payload: list[Any] = [None]
    if me == holders[0]:
        payload = [next(h.values for h in states if h.step == choice.step)]
    dist.broadcast_object_list(payload, group=group, group_src=holders[0])
    target.update(payload[0])
    # The filled tensors are the new model's and optimizer's own: loading them back is a
    # copy onto itself for parameters and keeps the optimizer's state objects as they are.
    set_state_dict(
        model,
        optimizer,
        model_state_dict={k[len(_MODEL) :]: v for k, v in target.items() if k.startswith(_MODEL)},
        optim_state_dict={k[len(_OPTIM) :]: v for k, v in target.items() if k.startswith(_OPTIM)},
        options=_OPTIONS,
    )
    _last_moved = Moved(
        "same" if choice.old_world_size == world else "changed",
        sum(traffic.received_from.values()),
        sum(traffic.sent_to.values()),
        traffic.seconds,
        traffic.received_from,
        traffic.sent_to,
        traffic.copied,
    )
    return choice.step


def _stale_mesh(fresh: HeldState, group: dist.ProcessGroup) -> bool:
    """Whether a new DTensor's mesh disagrees with ``group`` (the new shard is cut by its coordinate)."""
    meshes = {id(t.device_mesh): t.device_mesh for t in fresh.tensors.values() if isinstance(t, DTensor)}
    expected = (dist.get_rank(group),)
    size = dist.get_world_size(group)
    return any(m.ndim != 1 or m.size() != size or m.get_coordinate() != expected for m in meshes.values())

