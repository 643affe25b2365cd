"""A user's script on the public API, as the API's tests run it: a small regression model
(FSDP2, DDP or plain) with keyed dropout, an LR scheduler and a registered counter, data by
global sample id (or, with ``--loader``, from a ``DataLoader`` over ``elastic.Sampler`` in
epochs: the same samples, as the data set is ``DATASET`` samples and unshuffled).
Rank 0 prints one JSON line ``{"restored": ...}`` per world (what it restored, and the
worst ratio of a tensor's storage to its own bytes) and ``{"final": ...}`` with what the
run ended with.

``python tests/elastic/api_script.py --wrap fsdp --steps 8 [--misuse KIND]``
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from bench.scale.memory import storage_report
from regroup import elastic


class Counter:
    """Extras: a plain object whose state is saved, snapshotted and carried like the model's."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])


DATASET = 36
"""Samples in the data set: three steps of the default global batch an epoch."""


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, generator=torch.Generator().manual_seed(index % DATASET))
    return x, x.sum(0, keepdim=True) * 0.5


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return DATASET

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return sample(index)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=["fsdp", "ddp", "plain"], default="fsdp")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--max-micro-batch", type=int, default=0)
    parser.add_argument("--floor", default="0s", help="step_time_floor: pad each step to this long")
    parser.add_argument("--progress-interval", default="", help="etcd progress interval (under regroup-run)")
    parser.add_argument("--loader", action="store_true", help="a DataLoader in epochs, not step.micro_batches()")
    parser.add_argument("--dropout", type=float, default=0.2, help="keyed dropout's p")
    parser.add_argument("--misuse", choices=["none", "init", "two-runs", "stale-step"], default="none")
    return parser.parse_args()


@elastic.in_place
def main(args: argparse.Namespace) -> None:
    world = elastic.world()
    torch.manual_seed(0)
    model: nn.Module = elastic.keyed_dropout(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(args.dropout), nn.Linear(32, 1)))
    if args.wrap == "fsdp":
        fully_shard(model[0], mesh=world.mesh)
        fully_shard(model, mesh=world.mesh)
    elif args.wrap == "ddp":
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    counter = Counter()
    sections = {"etcd": {"progress_interval": args.progress_interval}} if args.progress_interval else {}
    settings = dict(global_batch=args.global_batch, max_steps=args.steps, max_micro_batch=args.max_micro_batch)
    loader = None
    if args.loader:
        dataset = Samples()
        sampler = elastic.Sampler(dataset, shuffle=False)
        loader = torch.utils.data.DataLoader(
            dataset, batch_size=args.max_micro_batch or args.global_batch, sampler=sampler, num_workers=1
        )
        settings = dict(global_batch=args.global_batch, max_steps=args.steps, data=loader, epochs=args.steps)
    run = elastic.Run(
        model, optimizer, scheduler=scheduler, extras={"counter": counter}, step_time_floor=args.floor,
        log_every=1, **settings, **sections,  # the tests read every step's loss from the log
    )  # fmt: skip
    if world.rank == 0:
        # What the run restored: every tensor's storage holds its own bytes and no more.
        restored = {"world_size": world.world_size, "step": run.step, **storage_report(model, optimizer)}
        print(json.dumps({"restored": restored}), flush=True)
    if args.misuse == "two-runs":
        elastic.Run(model, optimizer, **settings)
    if loader is not None:
        total = 0.0
        for _epoch in run.epochs():
            for xs, ys in run.batches(loader):
                loss = nn.functional.mse_loss(model(xs), ys) / run.current.accumulation
                loss.backward()
                total += float(loss)
                if run.current.last_micro:
                    optimizer.step()
                    optimizer.zero_grad()
                    scheduler.step()
                    counter.steps += 1
                    run.report(total)
                    total = 0.0
    previous = None
    for step in [] if loader is not None else run:
        if args.misuse == "stale-step" and previous is not None:
            list(previous.micro_batches())
        previous = step
        total = 0.0
        for ids in step.micro_batches():
            xs, ys = zip(*(sample(i) for i in ids))
            loss = nn.functional.mse_loss(model(torch.stack(xs)), torch.stack(ys)) / step.accumulation
            loss.backward()
            total += float(loss)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        counter.steps += 1
        step.report(total)
    if world.rank == 0:
        final = {"step": run.step, "lr": optimizer.param_groups[0]["lr"], "counter": counter.steps}
        print(json.dumps({"final": final}), flush=True)


if __name__ == "__main__":
    arguments = parse()
    if arguments.misuse == "init":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    main(arguments)
