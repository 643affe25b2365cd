"""A worker that forms its worlds through ``ElasticWorld`` and proves each with an all-reduce.

It joins, then re-forms whenever its agent (the test, writing ``world.json``) announces a
newer world, until it has formed round ``FINAL_ROUND``. For each world it formed it
prints one JSON line: the round, its rank, the world size and the all-reduced sum of
ones (the world size when every rank took part)."""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from regroup.rendezvous.inplace.world import ElasticWorld


def _prove(world: ElasticWorld) -> None:
    ones = torch.ones(1)
    dist.all_reduce(ones)
    print(json.dumps({"round": world.round, "rank": world.rank, "world_size": world.world_size,
                      "sum": int(ones.item()), "formed": world.formed}), flush=True)


def main() -> None:
    form_timeout = timedelta(seconds=float(os.environ.get("FORM_TIMEOUT_S", "120")))
    final = int(os.environ.get("FINAL_ROUND", "0"))
    world = ElasticWorld.join(backend="gloo", timeout=timedelta(seconds=30), form_timeout=form_timeout)
    _prove(world)
    while world.round < final:
        while not world.reform_due():
            time.sleep(0.02)
        world.rejoin(timeout=timedelta(seconds=60))
        _prove(world)
    dist.destroy_process_group()
    world.close()


if __name__ == "__main__":
    main()
