"""A user's script whose training keeps state beyond the model's and optimizer's tensors,
as the API's tests run it: a compiled model (``torch.compile(model)``, whose state dict
keys carry ``_orig_mod.``, or ``model.compile()`` in place), mixed precision with a
``GradScaler`` registered as an extra, gradient clipping and a step-based LR schedule
(``scheduler=``). Data by global sample id, as in ``api_script.py``.

Rank 0 prints one JSON line ``{"restored": ...}`` per world (the step, lr, betas, the
scaler's state and AdamW's step count just after the run restored them) and one line
``{"trained": ...}`` per step: the loss (the mean over ranks), the gradients' norm before
clipping, whether the scaler skipped the optimizer step, the same settings, the compiled
frames so far and the world's round. On ``--poison`` steps rank 0 writes an infinity into
its own gradient shard after the backward: the scaler must then skip ``optimizer.step()``
on every rank.

``python tests/elastic/compiled_script.py --wrap fsdp --compile wrap --amp --clip 1 --poison 7``
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from regroup import elastic


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8, generator=torch.Generator().manual_seed(index))
    return x, x.sum(0, keepdim=True) * 0.5


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--wrap", choices=["fsdp", "ddp", "plain"], default="fsdp")
    parser.add_argument("--compile", choices=["none", "wrap", "method"], default="wrap",
                        help="torch.compile(model) (an OptimizedModule), model.compile() in place, or none")
    parser.add_argument("--backend", default="aot_eager", help="torch.compile backend")
    parser.add_argument("--amp", action="store_true", help="bfloat16 autocast and a GradScaler registered as an extra")
    parser.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ to this (0: no clipping)")
    parser.add_argument("--schedule", choices=["onecycle", "cosine", "lambda"], default="onecycle")
    parser.add_argument("--poison", type=int, default=0, help="every N steps (index %% N == 3) poison a gradient")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--max-micro-batch", type=int, default=0)
    parser.add_argument("--floor", default="0s", help="step_time_floor: pad each step to this long")
    parser.add_argument("--progress-interval", default="", help="etcd progress interval (under regroup-run)")
    parser.add_argument("--storage-at", type=int, default=0,
                        help="a world of this size leaves through storage (reform.in_memory off)")
    return parser.parse_args(argv)  # fmt: skip


def build(args: argparse.Namespace, mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    if args.wrap == "fsdp":
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif args.wrap == "ddp":
        model = DistributedDataParallel(model)
    if args.compile == "wrap":
        model = torch.compile(model, backend=args.backend)
    elif args.compile == "method":
        model.compile(backend=args.backend)
    return model


def scaler_for(args: argparse.Namespace) -> torch.amp.GradScaler:
    """Grows its scale after 3 good steps and quarters it on a skipped one (a poisoned step
    every 7: the scale stays bounded)."""
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3, backoff_factor=0.25, enabled=args.amp)


def schedule(args: argparse.Namespace, optimizer: torch.optim.Optimizer) -> Any:
    if args.schedule == "onecycle":  # also cycles AdamW's betas
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=args.steps)
    if args.schedule == "cosine":  # recursive: each lr is computed from the optimizer's last
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps, eta_min=1e-3)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))


def poisoned(args: argparse.Namespace, index: int) -> bool:
    return bool(args.poison) and index % args.poison == 3


def poison(model: nn.Module) -> None:
    """An infinity in this rank's own part of the first gradient (its shard under FSDP2)."""
    grad = next(model.parameters()).grad
    assert grad is not None
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    local.view(-1)[0] = float("inf")


def train_step(
    args: argparse.Namespace, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
    scaler: torch.amp.GradScaler, micro_batches: Iterable[range], accumulation: int, poison_here: bool,
) -> dict[str, Any]:
    """One optimizer step over ``accumulation`` micro-batches (global sample ids, taken one
    at a time: ``step.micro_batches()`` reduces gradients on the last): autocast, the scaled
    backward, clipping of the unscaled gradients, the scaler's step and update, the
    schedule. This rank's loss, the gradients' total norm and whether the scaler skipped."""
    total = 0.0
    for ids in micro_batches:
        xs, ys = zip(*(sample(i) for i in ids))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
            out = model(torch.stack(xs))
        loss = nn.functional.mse_loss(out.float(), torch.stack(ys)) / accumulation
        scaler.scale(loss).backward()
        total += float(loss.detach())
    if poison_here:
        poison(model)
    scaler.unscale_(optimizer)  # a no-op when disabled
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip) if args.clip else None
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()  # every rank: a collective
    scale = scaler.get_scale() if args.amp else 0.0
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    scheduler.step()
    skipped = bool(args.amp and scaler.get_scale() < scale)
    return {"loss": total, "norm": None if norm is None else float(norm), "skipped": skipped}


def settings(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> dict[str, Any]:
    group = optimizer.param_groups[0]
    first = optimizer.state.get(group["params"][0], {})
    scaler_state = scaler.state_dict()
    return {
        "lr": group["lr"],
        "betas": list(group["betas"]),
        "scale": scaler_state.get("scale"),
        "tracker": scaler_state.get("_growth_tracker"),
        "adam_step": int(first["step"]) if "step" in first else None,
    }


def compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


@elastic.in_place
def main(args: argparse.Namespace) -> None:
    world = elastic.world()
    model = build(args, world.mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = schedule(args, optimizer)
    scaler = scaler_for(args)
    sections: dict[str, Any] = {"etcd": {"progress_interval": args.progress_interval}} if args.progress_interval else {}
    if args.storage_at == world.world_size:
        sections["reform"] = {"in_memory": False}
    run = elastic.Run(
        model, optimizer, scheduler=scheduler, extras={"scaler": scaler}, global_batch=args.global_batch,
        max_steps=args.steps, max_micro_batch=args.max_micro_batch, step_time_floor=args.floor, **sections,
    )  # fmt: skip
    if world.rank == 0:
        restored = {"world_size": world.world_size, "round": world.round, "step": run.step}
        print(json.dumps({"restored": {**restored, **settings(optimizer, scaler)}}), flush=True)
    for step in run:
        poison_here = poisoned(args, step.index) and world.rank == 0
        done = train_step(
            args, model, optimizer, scheduler, scaler, step.micro_batches(), step.accumulation, poison_here
        )
        step.report(done["loss"])
        mean = torch.tensor([done["loss"]], dtype=torch.float64)
        dist.all_reduce(mean)  # the step's loss over the world, as a script that logs it would
        if world.rank == 0:
            trained = {
                **done, "step": step.index + 1, "loss": mean.item() / world.world_size, "round": world.round,
                "world_size": world.world_size, "frames": compiled_frames(), **settings(optimizer, scaler),
            }  # fmt: skip
            print(json.dumps({"trained": trained}), flush=True)


if __name__ == "__main__":
    main(parse())
