"""Which bytes of the held state go where when a world re-forms: a pure plan, no torch.

Every rank derives the same plan from the same gathered facts (what each new rank holds,
the new model's global shapes), so senders and receivers agree on every message without
telling each other. Sizes are in elements along a tensor's flat (row-major) order:

- a sharded entry (``Shard(0)`` of a DTensor) is cut into row chunks by ``torch.chunk``
  semantics; old rank ``q`` holds chunk ``q`` of the old world, new rank ``r`` needs chunk
  ``r`` of the new one;
- a replicated entry (a plain tensor: DDP's parameters and optimizer state, AdamW's
  ``step``) is needed whole by every new rank, and held either whole (a live state: every
  survivor has it), as the flat chunk ``q`` of the old world (a snapshot: the replicated
  state is split over the ranks like a sharded one, so a job keeps it once, not once per
  rank), or not at all (shards a leaving rank handed over: the keeper has its own).

A new rank fills what it holds itself by a local copy and receives the rest, point to point,
from one holder per piece; messages between two ranks are cut to a byte budget so that a
rank never holds more than about ``bucket`` bytes of messages at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

WHOLE, CHUNK, NONE = "whole", "chunk", "none"
"""How a held state holds the replicated entries: whole, this old rank's flat chunk, or not."""

MIN_MESSAGE_BYTES = 1 << 20
"""No message is cut smaller than this (or the bucket, if smaller) however many peers share the budget."""


class Info(NamedTuple):
    """What one held state is, as every rank learns it: which old rank's shards, of which
    world, at which step, and how it holds the replicated entries."""

    old_rank: int
    old_world_size: int
    step: int
    replicated: str = WHOLE
    apart: bool = False
    """Its tensors are not where the group's messages live (host snapshots of a CUDA job):
    a piece of it is copied into a buffer before it goes."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the state, as the planner sees it (the same on every rank)."""

    key: str
    shape: tuple[int, ...]
    """The global shape."""
    sharded: bool
    itemsize: int
    dtype: str
    """Messages carry one dtype each."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def chunk_rows(rows: int, world: int) -> int:
    """Rows per shard under torch.chunk semantics: ceil(n/W), the last shards short or empty."""
    return -(-rows // world)


def row_span(shape: tuple[int, ...], world: int, rank: int) -> tuple[int, int]:
    """Flat elements of ``rank``'s ``Shard(0)`` chunk of a tensor of ``shape``."""
    per, row = chunk_rows(shape[0], world), math.prod(shape[1:])
    start = min(rank * per, shape[0])
    return start * row, min(start + per, shape[0]) * row


def flat_span(numel: int, world: int, rank: int) -> tuple[int, int]:
    """Flat elements ``[lo, hi)`` of ``rank``'s chunk of a replicated tensor split over ``world``."""
    per = -(-numel // world)
    return min(rank * per, numel), min((rank + 1) * per, numel)


def held_span(entry: Entry, info: Info) -> tuple[int, int]:
    """The flat elements of ``entry`` that a state described by ``info`` holds."""
    if entry.sharded:
        return row_span(entry.shape, info.old_world_size, info.old_rank)
    if info.replicated == WHOLE:
        return 0, entry.numel
    if info.replicated == CHUNK:
        return flat_span(entry.numel, info.old_world_size, info.old_rank)
    return 0, 0


def needed_span(entry: Entry, world: int, rank: int) -> tuple[int, int]:
    """The flat elements of ``entry`` that new rank ``rank`` of ``world`` keeps."""
    return row_span(entry.shape, world, rank) if entry.sharded else (0, entry.numel)


Source = tuple[int, int]
"""(new rank holding a state, index in that rank's list of held states)."""


def as_infos(entry: Sequence[Sequence[object]] | Sequence[object] | None) -> list[Info]:
    """One new rank's held states as ``Info``: None (a newcomer), one tuple or a list."""
    if entry is None:
        return []
    if entry and not isinstance(entry[0], Sequence):
        return [Info(*entry)]  # type: ignore[arg-type]
    return [Info(*item) for item in entry]  # type: ignore[arg-type, misc]


@dataclass(frozen=True)
class Choice:
    """Which held states rebuild the old world: the newest step at which the survivors
    between them hold every old rank's shards and the replicated entries, and who
    contributes each."""

    step: int
    old_world_size: int
    sources: dict[int, Source]
    """Old rank -> the lowest holder of its shards at ``step`` (any form)."""
    whole: list[Source] = field(default_factory=list)
    """Every state holding the replicated entries whole at ``step``, by new rank."""
    chunks: dict[int, Source] = field(default_factory=dict)
    """Old rank -> the lowest holder of its flat chunk of the replicated entries (snapshots)."""


def choose(infos: Sequence[Sequence[object] | None], sharded: bool = True) -> Choice | str:
    """Per new rank, what it holds (its own state, shards a leaving rank handed it, in-memory
    snapshots and buddy copies), or None for a newcomer. The newest step whose states cover
    the old ranks 0..W-1 wins: every old rank's shards (unless the state has no sharded
    entries: ``sharded`` False), and the replicated entries, whole somewhere or as every old
    rank's chunk; a rank held twice at that step is taken from the lowest new rank. A string
    says why none can."""
    present = [(new_rank, j, info) for new_rank, entry in enumerate(infos) for j, info in enumerate(as_infos(entry))]
    if not present:
        return "no rank holds state"
    sizes = {info.old_world_size for _, _, info in present}
    if len(sizes) > 1:
        return f"survivors disagree on the old world size: {sorted(sizes)}"
    (size,) = sizes
    for step in sorted({info.step for _, _, info in present}, reverse=True):
        sources: dict[int, Source] = {}
        chunks: dict[int, Source] = {}
        whole: list[Source] = []
        for new_rank, j, info in present:
            if info.step != step or not 0 <= info.old_rank < size:
                continue
            sources.setdefault(info.old_rank, (new_rank, j))
            if info.replicated == CHUNK:
                chunks.setdefault(info.old_rank, (new_rank, j))
            elif info.replicated == WHOLE:
                whole.append((new_rank, j))
        if (len(sources) == size or not sharded) and (whole or len(chunks) == size):
            return Choice(step, size, sources, whole, chunks)
    steps = sorted({info.step for _, _, info in present})
    return f"no step at which the old ranks 0..{size - 1} are all held (steps held: {steps})"


@dataclass(frozen=True)
class Piece:
    """A run of ``numel`` elements of one entry, from a held state of rank ``src`` (a local
    copy when ``src == dst``) into new rank ``dst``'s own tensor."""

    src: int
    dst: int
    key: str
    state: int
    """Index into ``src``'s held states."""
    src_offset: int
    """Flat element offset into the held tensor."""
    dst_offset: int
    """Flat element offset into ``dst``'s tensor."""
    numel: int


def _own(infos: list[list[Info]], rank: int, step: int, old_rank: int, chunk: bool) -> int | None:
    for j, info in enumerate(infos[rank] if rank < len(infos) else []):
        if info.step == step and info.old_rank == old_rank and (not chunk or info.replicated == CHUNK):
            return j
    return None


def plan_pieces(
    entries: Sequence[Entry],
    infos: Sequence[Sequence[object] | None],
    choice: Choice,
    world: int,
    prefer_own: bool = True,
) -> list[Piece]:
    """Every piece of every entry that each new rank of ``world`` needs, and from where: from
    its own held states where it holds them at the chosen step (``prefer_own``), else from
    the holder ``choice`` names (whole replicated entries: spread over their holders)."""
    held = [as_infos(entry) for entry in infos]
    pieces: list[Piece] = []
    whole = sorted(choice.whole)
    for rank in range(world):
        for entry in entries:
            lo, hi = needed_span(entry, world, rank)
            if lo >= hi:
                continue
            if not entry.sharded and whole:
                mine = [source for source in whole if source[0] == rank]
                others = [source for source in whole if source[0] != rank] or whole
                src, j = mine[0] if prefer_own and mine else others[rank % len(others)]
                pieces.append(Piece(src, rank, entry.key, j, lo, 0, hi - lo))
                continue
            table = choice.sources if entry.sharded else choice.chunks
            for old_rank in range(choice.old_world_size):
                form = WHOLE if entry.sharded else CHUNK
                have_lo, have_hi = held_span(entry, Info(old_rank, choice.old_world_size, choice.step, form))
                start, end = max(lo, have_lo), min(hi, have_hi)
                if start >= end:
                    continue
                own = _own(held, rank, choice.step, old_rank, not entry.sharded) if prefer_own else None
                src, j = (rank, own) if own is not None else table[old_rank]
                pieces.append(Piece(src, rank, entry.key, j, start - have_lo, start - lo, end - start))
    return pieces


class Segment(NamedTuple):
    """Part of a piece inside one message."""

    piece: Piece
    offset: int
    """Elements into the piece."""
    numel: int


@dataclass(frozen=True)
class Message:
    """One send from ``src`` to ``dst``: segments of one dtype, back to back. A message of
    one segment goes from the held tensor's memory straight into the destination's; one of
    several is packed by the sender and unpacked by the receiver."""

    src: int
    dst: int
    dtype: str
    segments: tuple[Segment, ...]
    round: int
    """Messages of one round are posted together; a rank's rounds run one after another."""

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.segments)


def plan_messages(
    pieces: Sequence[Piece],
    entries: Sequence[Entry],
    bucket: int,
    direct: int = MIN_MESSAGE_BYTES,
    apart: frozenset[tuple[int, int]] = frozenset(),
) -> dict[tuple[int, int], list[Message]]:
    """The pieces that cross ranks, as messages per (src, dst) pair in the order they are
    sent. A piece of at least ``direct`` bytes travels alone and whole, from the held
    tensor's memory into the destination's (no buffer, so nothing to bound); smaller ones
    are packed together into messages of at most the pair's budget: ``bucket`` shared among
    the pairs either end takes part in (never below ``direct``, or the bucket where that is
    smaller). A pair's packed messages are spread over rounds, one budget's worth a round,
    so a rank holds about ``bucket`` bytes of packed messages at once each way; its whole
    pieces all go in the first round. A piece from a state in ``apart`` ((rank, index) of
    a state not on the group's device) is always packed: it needs a buffer on the way."""
    by_key = {entry.key: (i, entry) for i, entry in enumerate(entries)}
    pairs: dict[tuple[int, int], list[Piece]] = {}
    for piece in pieces:
        if piece.src != piece.dst:
            pairs.setdefault((piece.src, piece.dst), []).append(piece)
    partners: dict[int, int] = {}
    for src, dst in pairs:
        partners[src] = partners.get(src, 0) + 1
        partners[dst] = partners.get(dst, 0) + 1
    floor = min(bucket, direct)
    messages: dict[tuple[int, int], list[Message]] = {}
    for (src, dst), mine in sorted(pairs.items()):
        budget = max(floor, bucket // max(partners[src], partners[dst]))
        out: list[Message] = []
        packed: list[Segment] = []
        used, dtype, round_ = 0, "", 0
        for piece in sorted(mine, key=lambda p: (by_key[p.key][1].dtype, by_key[p.key][0])):
            entry = by_key[piece.key][1]
            nbytes = piece.numel * entry.itemsize
            if nbytes >= floor and (piece.src, piece.state) not in apart:
                out.append(Message(src, dst, entry.dtype, (Segment(piece, 0, piece.numel),), 0))
                continue
            if packed and (entry.dtype != dtype or used + nbytes > budget):
                out.append(Message(src, dst, dtype, tuple(packed), round_))
                packed, used, round_ = [], 0, round_ + 1
            packed.append(Segment(piece, 0, piece.numel))
            used, dtype = used + nbytes, entry.dtype
        if packed:
            out.append(Message(src, dst, dtype, tuple(packed), round_))
        messages[(src, dst)] = out
    return messages
