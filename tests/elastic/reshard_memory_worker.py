"""One process of the in-memory reshard test: ``python -m tests.elastic.reshard_memory_worker
SPEC PROC``. SPEC is JSON: ``port`` of a TCPStore the test hosts, ``out`` folder and
``scenarios``: name -> the new rank of each of the three processes in the grown world.
Each scenario writes into ``out/<name>/`` (one process run serves all: imports are slow).

1. ``old``: processes 0 and 1 form a world of 2, train two steps, dump the full state
   (``old.pt``), hold their shards, and hand process 1's to process 0 as a leaving rank
   does (``handoff.hand_off``: process 0 dumps what it received, ``handed.pt``, process 1
   what it sent, ``donor.pt``); then they leave that process group.
2. ``grow``: all three form a world of 3; fresh model and optimizer (other weights, other
   lr), ``redistribute``, dump (``grown.pt``), train one step, dump (``grown-after.pt``).
   Then a reference: another fresh pair loads ``old.pt`` as a full state dict, trains the
   same step and dumps (``reference-after.pt``).
3. ``shrink``: old rank 0's holder and the newcomer form a world of 2 that lacks old
   rank 1; ``redistribute`` must raise. Each process writes ``proc-P.json``.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from regroup.trainer.config import ModelConfig
from regroup.trainer.model import Decoder
from regroup.elastic.memory.handoff import hand_off
from regroup.elastic.memory.reshard import HeldState, forget_old_meshes, hold_state, redistribute

# No width divides by 3 and most not by 2 either: chunks of 2 and 3 ranks are uneven.
CONFIG = ModelConfig(vocab_size=131, dim=28, n_layers=2, n_heads=2, ffn_hidden=37, seq_len=8)
GLOBAL_BATCH = 6
TIMEOUT = timedelta(seconds=60)
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def join(store: dist.Store, phase: str, rank: int, world_size: int) -> None:
    """Enter a new world, as an in-place re-form does (this process may have been in others)."""
    forget_old_meshes()
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(phase, store), rank=rank, world_size=world_size, timeout=TIMEOUT
    )


def build(seed: int, lr: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The trainer's decoder, FSDP2-sharded over the current world, and a fresh AdamW."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Decoder(CONFIG)
    model.init_weights(seed)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> float:
    """One step on this rank's share of a global batch fixed by ``step``; the global mean loss."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.seq_len + 1), generator=generator)
    mine = tokens.chunk(dist.get_world_size())[dist.get_rank()]
    logits = model(mine[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def dump(model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, **extra: Any) -> None:
    """The full, unsharded state (a collective), saved by rank 0."""
    model_state, optim_state = get_state_dict(model, optimizer, options=FULL)
    if dist.get_rank() == 0:
        torch.save({"model": model_state, "optim": optim_state, **extra}, path)


def _as_dict(held: HeldState) -> dict[str, Any]:
    return {
        "old_rank": held.old_rank, "old_world_size": held.old_world_size, "step": held.step,
        "tensors": {k: v.clone() for k, v in held.tensors.items()}, "sharded": sorted(held.sharded),
        "shapes": held.shapes, "values": held.values, "replicated": held.replicated,
    }  # fmt: skip


def scenario(store: dist.Store, name: str, grow_ranks: list[int], out: Path, proc: int) -> None:
    out.mkdir(exist_ok=True)
    result: dict[str, Any] = {"proc": proc}
    held: HeldState | None = None

    if proc < 2:
        join(store, f"{name}/old", proc, 2)
        model, optimizer = build(seed=0, lr=1e-2)
        for step in (1, 2):
            train_step(model, optimizer, step)
        for group in optimizer.param_groups:
            group["lr"] = 3e-3  # as the loop's schedule would: the lr must travel too
        dump(model, optimizer, out / "old.pt")
        held = hold_state(model, optimizer, old_rank=proc, old_world_size=2, step=2)
        kept = hand_off(held, leaving=proc == 1)
        if proc == 0:
            [received] = [h for h in kept if h.old_rank == 1]
            torch.save(_as_dict(received), out / "handed.pt")
        else:
            torch.save(_as_dict(held), out / "donor.pt")
        del model, optimizer
        dist.destroy_process_group()

    join(store, f"{name}/grow", grow_ranks[proc], 3)
    model, optimizer = build(seed=1, lr=1e-4)
    result["step"] = redistribute(model, optimizer, held, dist.group.WORLD)
    dump(model, optimizer, out / "grown.pt")
    result["grown_loss"] = train_step(model, optimizer, 3)
    dump(model, optimizer, out / "grown-after.pt")
    reference, reference_optimizer = build(seed=2, lr=1e-4)
    old = torch.load(out / "old.pt")
    set_state_dict(
        reference,
        reference_optimizer,
        model_state_dict=old["model"],
        optim_state_dict=old["optim"],
        options=StateDictOptions(full_state_dict=True),
    )
    result["reference_loss"] = train_step(reference, reference_optimizer, 3)
    dump(reference, reference_optimizer, out / "reference-after.pt")
    dist.destroy_process_group()

    if held is None or held.old_rank == 0:
        join(store, f"{name}/shrink", 0 if held is None else 1, 2)
        model, optimizer = build(seed=1, lr=1e-4)
        try:
            redistribute(model, optimizer, held, dist.group.WORLD)
        except ValueError as error:
            result["shrink_error"] = str(error)
        # Both ranks past the refusal before either tears its pairs down: gloo aborts a
        # process (std::terminate) whose group is destroyed while the peer's is going.
        dist.barrier()
        dist.destroy_process_group()
    (out / f"proc-{proc}.json").write_text(json.dumps(result))


def main(spec: dict[str, Any], proc: int) -> None:
    store = dist.TCPStore("127.0.0.1", spec["port"], is_master=False, timeout=TIMEOUT)
    for name, grow_ranks in spec["scenarios"].items():
        scenario(store, name, grow_ranks, Path(spec["out"]) / name, proc)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), int(sys.argv[2]))
