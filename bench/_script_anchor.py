"""The anchor of ``python -m bench script``: PyTorch's FSDP2 example as a user runs it without
regroup, under plain ``torchrun --standalone --nproc-per-node=W``.

The upstream example's model (``examples/fsdp2/upstream/model.py``, the same ``ModelArgs``),
its sharding (each block, then the root), its loss (the logits' sum), Adam at lr 1e-2 and
gradient clipping, in a plain loop: ``init_process_group``, no etcd, no agent of ours. Each step trains this rank's share
of a global batch of ``--global-batch`` samples, built the way ``examples/fsdp2/train.py``
builds them (the step's whole batch from a generator seeded with the step, then this rank's
slice of it), so the two variants do the same work.
Rank 0 prints one JSON line per step: ``{"step", "t" (time.time()), "cpu_s"
(time.process_time()), "loss", "pid"}``; every rank prints ``{"rank", "first_loss"}`` after
the first step, so the benchmark can check that both variants train the same thing.

``--all-reduce-loss``: also average the loss over the ranks every step, as a user who logs
the global loss does (one small all-reduce per step, the same size as the API's boundary).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "fsdp2" / "upstream"))
from model import ModelArgs, Transformer  # noqa: E402 - the upstream example's own model

VOCAB_SIZE = 1024
SEQ_LEN = 64


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--all-reduce-loss", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model_args = ModelArgs(n_layers=10, n_heads=4, vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN, dropout_p=0)
    with torch.device("meta"):
        model = Transformer(model_args)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.reset_parameters()
    for layer in model.layers:
        layer.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    per_rank = args.global_batch // world
    for step in range(args.steps):
        generator = torch.Generator().manual_seed(step)
        batch = torch.randint(0, VOCAB_SIZE, (args.global_batch, SEQ_LEN), generator=generator)
        x = batch[rank * per_rank : (rank + 1) * per_rank]
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        if step == 0:
            print(json.dumps({"rank": rank, "first_loss": float(loss)}), flush=True)
        if args.all_reduce_loss:
            total = loss.detach().reshape(1).double()
            dist.all_reduce(total)
            loss = total / world
        if rank == 0:
            now = {"step": step + 1, "t": time.time(), "cpu_s": time.process_time()}
            print(json.dumps({**now, "loss": float(loss), "pid": os.getpid()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
