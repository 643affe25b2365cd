"""The raw floor of each path's bytes, on the same machine in the same run: what a plain
``copy_`` of the same bytes, a plain gloo send/recv of the same bytes between the same
ranks, and a plain file write and read of the same bytes take. A path's rate over its
floor's is how close to the machine it runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def _timed_copy(nbytes: int) -> float:
    source = torch.ones(max(1, nbytes), dtype=torch.uint8)
    target = torch.empty_like(source)
    target.copy_(source)  # the first touch of the pages is no part of a copy into warm buffers
    started = time.perf_counter()
    target.copy_(source)
    return time.perf_counter() - started


def _exchange(
    sends: dict[int, int], receives: dict[int, int], *, copied: int = 0, fresh: bool = False,
    group: dist.ProcessGroup | None = None,
) -> float:
    """One message per peer each way, all at once, and ``copied`` bytes copied locally
    meanwhile, as a reshard's first round does: the seconds from the start (every rank in
    step) to this rank's last byte. ``fresh``: receive into memory never written (a
    hand-off's new buffers), else into memory written before (a reshard's new model, a
    snapshot's buffers), whose pages are already there."""
    buffers = {peer: torch.ones(n, dtype=torch.uint8) for peer, n in sends.items() if n}
    make = torch.empty if fresh else torch.zeros
    inbox = {peer: make(n, dtype=torch.uint8) for peer, n in receives.items() if n}
    local = (torch.ones(copied, dtype=torch.uint8), torch.zeros(copied, dtype=torch.uint8)) if copied else None
    dist.barrier(group=group)
    started = time.perf_counter()
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for peer, t in buffers.items()]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for peer, t in inbox.items()]
    works = dist.batch_isend_irecv(ops) if ops else []
    if local is not None:
        local[1].copy_(local[0])
    for work in works:
        work.wait()
    return time.perf_counter() - started


def _slowest(seconds: float, group: dist.ProcessGroup | None = None) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def snapshot(own: int, received: int, buddy: list[int], rank: int) -> dict[str, float]:
    """A snapshot's copy into host memory (``own`` bytes) and its exchange with the buddies
    (``own`` sent to this rank's buddy, ``received`` from the rank whose buddy it is)."""
    exchange = _exchange({buddy[rank]: own}, {buddy.index(rank): received})
    return {"floor_copy_s": _timed_copy(own), "floor_exchange_s": _slowest(exchange)}


def pairs(received_from: dict[int, int], sent_to: dict[int, int], copied: int) -> dict[str, float]:
    """A reshard's work, plainly: the same bytes between the same ranks as one message per
    pair, and the same bytes copied locally, meanwhile."""
    return {"floor_transfer_s": _slowest(_exchange(sent_to, received_from, copied=copied))}


def handoff(nbytes: int, donor: int, keeper: int, rank: int) -> dict[str, float]:
    """A hand-off's bytes from the donor to its keeper, as one plain message."""
    sends = {keeper: nbytes} if rank == donor else {}
    receives = {donor: nbytes} if rank == keeper else {}
    return {"floor_handoff_s": _slowest(_exchange(sends, receives, fresh=True))}


def files(nbytes: int, folder: Path, rank: int) -> dict[str, float]:
    """This rank's share of a checkpoint written to one file and read back, plainly."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank-{rank}.bin"
    data = torch.ones(max(1, nbytes), dtype=torch.uint8).numpy()
    dist.barrier()
    started = time.perf_counter()
    with open(path, "wb") as out:
        out.write(memoryview(data))
        out.flush()
        os.fsync(out.fileno())  # DCP's writer syncs its files too
    written = _slowest(time.perf_counter() - started)
    target = bytearray(len(data))
    dist.barrier()
    started = time.perf_counter()
    with open(path, "rb") as source:
        source.readinto(target)
    read = _slowest(time.perf_counter() - started)
    path.unlink()
    return {"floor_write_s": written, "floor_read_s": read}
