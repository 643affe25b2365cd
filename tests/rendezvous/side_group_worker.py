"""One rank of a two-rank gloo world that creates a side group (``formation.side_group``).

``JOIN_SIDE=0``: this rank never creates it (as a peer that died after the world formed); it
stays (hosting the store) until the other rank has tried.
Prints one JSON line: whether the side group formed, the seconds it took, and (when it
formed) the sum of an all-reduce on it."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from regroup.rendezvous.inplace.formation import side_group


def main() -> None:
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(minutes=10))
    if os.environ.get("JOIN_SIDE", "1") == "0":
        store.wait(["tried"])
        return
    started = time.monotonic()
    try:
        group = side_group(timedelta(minutes=10), connect=timedelta(seconds=float(os.environ["CONNECT_S"])))
    except (RuntimeError, dist.DistError) as exc:
        print(json.dumps({"formed": False, "seconds": time.monotonic() - started, "error": str(exc)[:200]}), flush=True)
        store.set("tried", "1")
        return
    ones = torch.ones(1)
    dist.all_reduce(ones, group=group)
    print(json.dumps({"formed": True, "seconds": time.monotonic() - started, "sum": int(ones.item())}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
