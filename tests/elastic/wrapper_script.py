"""A user's script whose training function sits under a command-line wrapper, or catches
every exception of its loop: each process runs one variant, so one job under ``regroup-run``
re-forms all of them at once.

Its variant comes from ``WRAPPER_VARIANTS`` (``a=hydra-above,except;b=click``: node -> one
variant per local rank) by ``NODE_NAME`` and ``LOCAL_RANK``:

- ``hydra-above``: ``@elastic.in_place`` over ``@hydra.main`` (config ``train.yaml`` in
  ``WRAPPER_CONFIG_DIR``), which exits 1 on an exception;
- ``hydra-below``: ``@hydra.main`` over ``@elastic.in_place``;
- ``click``: ``@elastic.in_place`` over a click command (which exits 0 when it returns);
- ``typer``: ``typer.run`` of an ``in_place`` function;
- ``fire``: ``in_place`` over ``fire.Fire``;
- ``except``: no wrapper, but ``except Exception`` around each step (a failed step is skipped)
  and around the whole loop (training given up).

Each call of the training function writes one JSON line ``{"world": {...}}`` to stdout:
the variant, node, local rank, pid, round and world size, and the step the run resumed at.
The model is a small DDP regression, its data a function of the global sample id.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from regroup import elastic

STEPS = int(os.environ.get("WRAPPER_STEPS", "100000"))


def variant() -> str:
    table = dict(entry.split("=", 1) for entry in os.environ["WRAPPER_VARIANTS"].split(";"))
    return table[os.environ["NODE_NAME"]].split(",")[int(os.environ["LOCAL_RANK"])]


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, generator=torch.Generator().manual_seed(index))
    return x, x.sum(0, keepdim=True) * 0.5


def say(**fields: Any) -> None:
    """One JSON line in one write: the lines of the node's ranks share the agent's output."""
    os.write(1, (json.dumps({"world": fields}) + "\n").encode())


def build(name: str, steps: int) -> tuple[nn.Module, torch.optim.Optimizer, elastic.Run]:
    world = elastic.world()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sections = {"etcd": {"progress_interval": "100ms"}} if os.environ.get("REGROUP_ETCD_ENDPOINT") else {}
    run = elastic.Run(model, optimizer, global_batch=12, max_steps=steps, step_time_floor="50ms", **sections)
    say(variant=name, node=os.environ["NODE_NAME"], local_rank=world.local_rank, pid=os.getpid(),
        round=world.round, world_size=world.world_size, step=run.step)  # fmt: skip
    return model, optimizer, run


def one_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: elastic.Step) -> None:
    xs, ys = zip(*(sample(i) for i in step.ids))
    loss = nn.functional.mse_loss(model(torch.stack(xs)), torch.stack(ys))
    loss.backward()  # DDP's all-reduce: where a lost peer shows first
    optimizer.step()
    optimizer.zero_grad()
    step.report(loss)


def train(name: str, steps: int = STEPS) -> None:
    model, optimizer, run = build(name, steps)
    for step in run:
        one_step(model, optimizer, step)


def train_catching(name: str) -> None:
    model, optimizer, run = build(name, STEPS)
    try:
        for step in run:
            try:
                one_step(model, optimizer, step)
            except Exception as exc:  # the script's own handling: a failed step is skipped
                print(f"step {step.index} failed, skipped: {exc}", file=sys.stderr, flush=True)
                continue
    except Exception as exc:  # ... and a failed loop given up
        print(f"training given up: {exc}", file=sys.stderr, flush=True)


def hydra_main(function: Callable[[Any], None]) -> Callable[[], None]:
    import hydra

    return hydra.main(config_path=os.environ["WRAPPER_CONFIG_DIR"], config_name="train", version_base=None)(function)


def main() -> None:
    name = variant()
    if name == "hydra-above":
        elastic.in_place(hydra_main(lambda cfg: train(name, cfg.steps)))()
    elif name == "hydra-below":
        hydra_main(elastic.in_place(lambda cfg: train(name, cfg.steps)))()
    elif name == "click":
        import click

        @click.command()
        @click.option("--steps", default=STEPS)
        def command(steps: int) -> None:
            train(name, steps)

        elastic.in_place(command)()
    elif name == "typer":
        import typer

        @elastic.in_place
        def typed(steps: int = STEPS) -> None:
            train(name, steps)

        typer.run(typed)
    elif name == "fire":
        import fire

        elastic.in_place(lambda: fire.Fire(lambda steps=STEPS: train(name, steps)))()
    elif name == "except":
        elastic.in_place(train_catching)(name)
    else:
        raise SystemExit(f"unknown variant {name!r}")


if __name__ == "__main__":
    main()
