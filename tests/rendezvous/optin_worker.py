"""A user's own training script that opts in to in-place re-forms exactly as documented
(docs/trainer.md, "Opting in from your own training script"): ``ElasticWorld.join``, a
step, ``reform_due()`` -> ``Interrupted``, ``world.interrupted(exc)`` -> ``world.rejoin()``.

The "training step" is a gloo all-reduce of ones. Each step appends
``{"node", "pid", "round", "rank", "world_size", "step", "sum"}`` as one JSON line to
``<out>/steps-<node>-<local_rank>.jsonl``. The script runs until it is stopped (its agent
stops it, or ``rejoin`` says its node leaves the job). On ``LeavingJob`` it cleans up as a
script might (closing a tracker: ``CLEANUP_S``), then appends ``{"node", "pid", "left": true}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from regroup.rendezvous.inplace.membership import Interrupted, LeavingJob
from regroup.rendezvous.inplace.world import ElasticWorld
from regroup.telemetry import configure_logging

CLEANUP_S = 0.5
"""How long the script's clean-up after ``LeavingJob`` takes."""


def main() -> None:
    out = Path(sys.argv[1])
    node = os.environ.get("NODE_NAME", "node")
    configure_logging()  # the world's log events as JSON lines, for the test to read
    world = ElasticWorld.join(backend="gloo")
    step = 0
    with open(out / f"steps-{node}-{world.local_rank}.jsonl", "a", buffering=1) as steps:
        try:
            while True:
                try:
                    value = torch.ones(1)
                    dist.all_reduce(value)  # train_step(model, optimizer): any collectives
                    row = {"node": node, "pid": os.getpid(), "round": world.round, "rank": world.rank,
                           "world_size": world.world_size, "step": step, "sum": value.item()}  # fmt: skip
                    steps.write(json.dumps(row) + "\n")
                    step += 1
                    time.sleep(0.05)  # the pace of a real step; not a wait for anything
                    if world.reform_due():
                        raise Interrupted("re-form announced")
                except Exception as exc:
                    if not world.interrupted(exc):
                        raise
                    world.rejoin()
        except LeavingJob:
            time.sleep(CLEANUP_S)  # the script's own clean-up, which its agent lets finish
            steps.write(json.dumps({"node": node, "pid": os.getpid(), "left": True}) + "\n")
            raise


if __name__ == "__main__":
    main()
