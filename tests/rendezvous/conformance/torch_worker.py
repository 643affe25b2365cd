"""The workers that need torch: a gloo process group, or torch's error-file recording.

- ``python torch_worker.py OUT sum``: form the gloo process group from what torchrun gave
  (``MASTER_ADDR``/``PORT``, ``RANK``, ``WORLD_SIZE``), all-reduce the ranks and write
  ``OUT/sum-<rank>.json`` with the result (exit 1 if it is not 0 + 1 + ... + world-1).
- ``python torch_worker.py OUT raise``: raise under torch's ``@record``, which writes the
  exception to the error file torchrun gave this worker.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import record

RAISED = "worker raised on purpose"


def dist_sum(out: Path) -> int:
    import torch
    import torch.distributed as dist

    (out / "pids").mkdir(parents=True, exist_ok=True)
    (out / "pids" / str(os.getpid())).write_text(str(os.getpid()))
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    expected = float(sum(range(world)))
    row = {"rank": rank, "world": world, "sum": value.item(), "master": os.environ["MASTER_PORT"]}
    (out / f"sum-{rank}.json").write_text(json.dumps(row))
    return 0 if value.item() == expected else 1


@record
def main() -> int:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    if mode == "sum":
        return dist_sum(out)
    if mode == "raise":
        raise RuntimeError(f"{RAISED} (rank {os.environ['RANK']})")
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
