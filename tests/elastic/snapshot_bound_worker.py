"""One rank of the lost-step-bound test: ``python -m tests.elastic.snapshot_bound_worker SPEC RANK``.

SPEC is JSON: ``port`` of a TCPStore the test hosts, ``world_size``, ``slow_rank``, whose
snapshot exchange starts ``delay_s`` late (a loaded node), and the ``out`` folder. Every
rank trains a step, takes the snapshot of step 1 at its boundary, trains step 2 and asks
whether step 2 may count (``Snapshots.before_step_counts``). It writes ``out/rank-R.json``:
when step 2 was let count (unix time), how long that waited, whether this rank then held
its sender's copy, and (the slow rank) when its exchange began.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from regroup.trainer.config import ModelConfig
from regroup.trainer.sharding import build_sharded_model
from regroup.elastic.memory.snapshot import Generation, Snapshots

CONFIG = ModelConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, seq_len=8)
TIMEOUT = timedelta(seconds=60)


def main(spec: dict[str, Any], rank: int) -> None:
    world_size, slow = spec["world_size"], spec["slow_rank"]
    store = dist.TCPStore("127.0.0.1", spec["port"], is_master=False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    model = build_sharded_model(CONFIG, 0, mesh, torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(CONFIG.vocab_size, (2, CONFIG.seq_len), generator=torch.Generator().manual_seed(rank))

    def forward_backward() -> None:
        model(tokens).float().logsumexp(-1).mean().backward()

    forward_backward()
    optimizer.step()  # step 1; AdamW's state exists: the snapshots can be laid out
    optimizer.zero_grad()
    snaps = Snapshots(model, optimizer, rank, world_size, ("", f"node-{rank}"), 1, TIMEOUT, max_every=1)
    while not snaps.ready:  # the boundaries of step 1, until every rank has its buffers
        done = torch.tensor([int(snaps.done(1))])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        snaps.agreed(bool(done.item()), 0.0)
    record: dict[str, Any] = {"rank": rank, "buddy": snaps.buddy}
    if rank == slow:
        swap = snaps._swap

        def late(generation: Generation) -> Exception | None:
            time.sleep(spec["delay_s"])  # the injected fault: this node runs the exchange late
            record["exchange_began"] = time.time()
            return swap(generation)

        snaps._swap = late  # type: ignore[method-assign]
    assert snaps.due(1)
    snaps.take(1)
    snaps.settled()
    forward_backward()  # step 2: its collectives need every rank, not the slow exchange
    snaps.wait_copied()
    optimizer.step()
    record["waited_s"] = snaps.before_step_counts(2)
    record["counted_at"] = time.time()
    generation = snaps.in_flight
    assert generation is not None and generation.exchanged is not None
    record["held_sender_copy"] = generation.received
    generation.exchanged.result()  # the exchange has ended (the late one's start is recorded)
    Path(spec["out"], f"rank-{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    snaps.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), int(sys.argv[2]))
