"""Carrying out a reshard plan (``regroup.elastic.memory.reshard_plan``) over a process group.

Each round posts every message of that round this rank sends or receives at once
(``batch_isend_irecv``) and waits for them; the pieces a rank holds itself are copied while
the first round's messages are on the wire. A message of one
contiguous run goes without a copy: sent from the held tensor's own memory, received
straight into the destination tensor; only messages of several small runs are packed and
unpacked, and a round's packed messages stay within the pair's budget.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import time

import torch
import torch.distributed as dist

from regroup.elastic.memory.reshard_plan import Message, Piece


@dataclass(frozen=True)
class Traffic:
    """What this rank moved."""

    received_from: dict[int, int]
    """Peer rank -> bytes received from it."""
    sent_to: dict[int, int]
    """Peer rank -> bytes sent to it."""
    copied: int
    """Bytes this rank copied from what it holds itself."""
    seconds: float
    """From the first local copy to the last message."""


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(f"reshard: a tensor of shape {tuple(tensor.shape)} is not contiguous")
    return tensor.view(-1)


def carry_out(
    pieces: Sequence[Piece],
    messages: Mapping[tuple[int, int], Sequence[Message]],
    sources: Sequence[Mapping[str, torch.Tensor]],
    dests: Mapping[str, torch.Tensor],
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> Traffic:
    """This rank's part of the plan. ``sources``: this rank's held states' tensors (by index,
    as the pieces name them); ``dests``: this rank's tensors to fill, by key (contiguous);
    ``device``: where the group's messages live (default: the destinations')."""
    started = time.perf_counter()
    me = dist.get_rank(group)
    flat_dests = {key: _flat(t) for key, t in dests.items()}
    flat_sources: dict[tuple[int, str], torch.Tensor] = {}

    def source(j: int, key: str) -> torch.Tensor:
        if (j, key) not in flat_sources:
            flat_sources[(j, key)] = _flat(sources[j][key])
        return flat_sources[(j, key)]

    copied = 0

    def copy_own() -> None:
        nonlocal copied
        for piece in pieces:
            if piece.src == me and piece.dst == me:
                src = source(piece.state, piece.key)[piece.src_offset : piece.src_offset + piece.numel]
                flat_dests[piece.key][piece.dst_offset : piece.dst_offset + piece.numel].copy_(src)
                copied += piece.numel * src.element_size()

    with torch.no_grad():
        mine = [m for (src, dst), msgs in sorted(messages.items()) if me in (src, dst) for m in msgs]
        if device is None:
            device = next(iter(flat_dests.values())).device if flat_dests else torch.device("cpu")
        received: dict[int, int] = {}
        sent: dict[int, int] = {}
        for round_ in range(max((m.round for m in mine), default=-1) + 1):
            ops: list[dist.P2POp] = []
            unpack: list[tuple[Message, torch.Tensor]] = []
            for message in (m for m in mine if m.round == round_):
                if message.src == me:
                    buffer = _outgoing(message, source, device)
                    ops.append(dist.P2POp(dist.isend, buffer, group=group, group_peer=message.dst))
                    sent[message.dst] = sent.get(message.dst, 0) + buffer.numel() * buffer.element_size()
                else:
                    buffer, direct = _incoming(message, flat_dests)
                    ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=message.src))
                    received[message.src] = received.get(message.src, 0) + buffer.numel() * buffer.element_size()
                    if not direct:
                        unpack.append((message, buffer))
            works = dist.batch_isend_irecv(ops) if ops else []
            if round_ == 0:
                copy_own()  # while the first round's messages are on the wire (other bytes of the destinations)
            for work in works:
                work.wait()
            for message, buffer in unpack:
                offset = 0
                for piece, start, numel in message.segments:
                    at = piece.dst_offset + start
                    flat_dests[piece.key][at : at + numel].copy_(buffer[offset : offset + numel])
                    offset += numel
        if not mine:
            copy_own()
    return Traffic(received, sent, copied, time.perf_counter() - started)


def _outgoing(message: Message, source: Callable[[int, str], torch.Tensor], device: torch.device) -> torch.Tensor:
    """The message's bytes: a view of the held tensor when it is one run on the group's
    device, else packed into a new buffer there."""
    runs = [(source(p.state, p.key), p.src_offset + start, numel) for p, start, numel in message.segments]
    if len(runs) == 1 and runs[0][0].device == device:
        tensor, at, numel = runs[0]
        return tensor[at : at + numel]
    packed = torch.empty(message.numel, dtype=runs[0][0].dtype, device=device)
    offset = 0
    for tensor, at, numel in runs:
        packed[offset : offset + numel].copy_(tensor[at : at + numel])
        offset += numel
    return packed


def _incoming(message: Message, dests: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """Where the message lands: straight in the destination when it is one run, else a buffer."""
    if len(message.segments) == 1:
        piece, start, numel = message.segments[0]
        at = piece.dst_offset + start
        return dests[piece.key][at : at + numel], True
    sample = dests[message.segments[0].piece.key]
    return torch.empty(message.numel, dtype=sample.dtype, device=sample.device), False
