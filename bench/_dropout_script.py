"""The user's script of ``python -m bench dropout``: upstream minGPT's model
(``examples/mingpt/upstream/model.py``, dropout 0.1 in the embedding and each block, none in
the attention's own weights) under DDP, trained from a ``DataLoader`` over ``elastic.Sampler``,
with its ``nn.Dropout`` layers keyed by sample (``--keyed``) or plain.

Rank 0 prints one JSON line per step, ``{"bench_step": {"world_size", "step", "loss",
"step_s"}}``: the step's loss (the ranks' mean) and its wall time from the batch to
``optimizer.step()`` done.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from regroup import elastic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "mingpt" / "upstream"))
from model import GPT, GPTConfig  # noqa: E402 - upstream's model

VOCAB = 64


class Tokens(Dataset):
    """Sample ``i``: a sequence drawn from ``i`` (its next-token targets are its shift)."""

    def __init__(self, size: int, block: int) -> None:
        self.size, self.block = size, block

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (self.block + 1,), generator=torch.Generator().manual_seed(index))
        return tokens[:-1], tokens[1:]


@elastic.in_place
def main(args: argparse.Namespace) -> None:
    world = elastic.world()
    torch.manual_seed(0)
    config = GPTConfig(n_layer=args.layers, n_head=4, n_embd=args.width, vocab_size=VOCAB, block_size=args.block,
                       attn_pdrop=0.0)  # fmt: skip
    model = GPT(config)
    if args.keyed:
        elastic.keyed_dropout(model)
    model = torch.nn.parallel.DistributedDataParallel(model) if world.world_size > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    dataset = Tokens(args.global_batch * args.steps, args.block)
    loader = DataLoader(dataset, batch_size=args.global_batch, sampler=elastic.Sampler(dataset, seed=1), num_workers=1)
    run = elastic.Run(model, optimizer, global_batch=args.global_batch, data=loader, epochs=1, snapshot_every=0)
    started = time.perf_counter()
    for source, targets in run.batches(loader):
        _, loss = model(source, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        if world.world_size > 1:
            torch.distributed.all_reduce(mean)
            mean /= world.world_size
        step_s = time.perf_counter() - started
        if world.rank == 0:
            record = {"world_size": world.world_size, "step": run.current.index + 1, "loss": mean.item(), "step_s": step_s}
            print(json.dumps({"bench_step": record}), flush=True)
        run.report(loss)
        started = time.perf_counter()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--keyed", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=24)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=128)
    main(parser.parse_args())
