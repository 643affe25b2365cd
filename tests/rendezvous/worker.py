"""A tiny elastic worker for the rendezvous tests: a gloo all_reduce loop.

Each step appends ``{"node", "rank", "world", "step", "restart", "sum", "master", "t"}`` as one JSON line
to ``<out>/steps-<node>-<local_rank>.jsonl``; the process id goes to ``<out>/pids/``, so a
test can kill a whole node (torchrun detaches its workers from its process group). The loop
ends with exit 0 once ``<out>/STOP`` exists; SIGTERM (torchrun stopping its workers) ends it
at once.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> int:
    out = Path(sys.argv[1])
    node = os.environ.get("NODE_NAME", "node")
    local_rank = int(os.environ["LOCAL_RANK"])
    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / f"{node}-{os.getpid()}").write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # A fresh MASTER_PORT per round: it names the round the step belongs to.
    master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    with open(out / f"steps-{node}-{local_rank}.jsonl", "a", buffering=1) as log:
        step = 0
        while True:
            # Everyone agrees to stop at one step, so no rank waits in a collective alone.
            stop = torch.tensor([1.0 if (out / "STOP").exists() else 0.0])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item() > 0:
                break
            value = torch.ones(1)
            dist.all_reduce(value)
            row = {
                "node": node, "rank": rank, "world": world, "step": step, "restart": restart, "sum": value.item(),
                "master": master, "t": time.time(),
            }  # fmt: skip
            log.write(json.dumps(row) + "\n")
            step += 1
            time.sleep(0.05)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
