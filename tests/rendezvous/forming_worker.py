"""A worker that forms its world through ``ElasticWorld`` and proves it with an all-reduce.

Prints one JSON line: the round it formed, its rank, the world size and the all-reduced
sum of ones (the world size when every rank took part)."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from rendezvous.inplace.world import ElasticWorld


def main() -> None:
    form_timeout = timedelta(seconds=float(os.environ.get("FORM_TIMEOUT_S", "120")))
    world = ElasticWorld.join(backend="gloo", timeout=timedelta(seconds=30), form_timeout=form_timeout)
    ones = torch.ones(1)
    dist.all_reduce(ones)
    print(json.dumps({"round": world.round, "rank": world.rank, "world_size": world.world_size,
                      "sum": int(ones.item()), "formed": world.formed}), flush=True)
    dist.destroy_process_group()
    world.close()


if __name__ == "__main__":
    main()
