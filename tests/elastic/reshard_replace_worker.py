"""One process of the same-size reshard test: ``python -m tests.elastic.reshard_replace_worker
SPEC PROC``. SPEC is JSON: ``port`` of a TCPStore the test hosts, ``out`` folder, ``bucket_bytes``.

1. ``old``: four processes form a world of 4, train two steps, dump the full state
   (``old.pt``) and each its own shards (``old-P.pt``). Old rank 2's shards then reach
   process 0 the way a buddy copy does (``handoff.hand_off``), and so do old rank 1's, so
   process 0 holds old ranks 0, 1 and 2 and process 1 still holds its own. Process 2
   drops its state: its node is lost, and it comes back as the fresh replacement.
2. ``replace``: the same four positions form a world of 4 (process 2 with nothing held);
   fresh model and optimizer (other weights, other lr), ``redistribute`` with messages of
   at most ``bucket_bytes``: each process dumps its shards (``replace-P.pt``) and rank 0 the
   full state (``replace.pt``).
3. ``remote``: in the same world, another fresh pair rebuilt from the same held states with
   every piece from the holder ``choose`` picked, even where a rank holds its own
   (``prefer_own=False``: ``remote-P.pt``, ``remote.pt``).

Each process writes ``proc-P.json``: the step and what each rebuild moved (``last_moved``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from regroup.elastic.memory import reshard
from regroup.elastic.memory.handoff import hand_off
from regroup.elastic.memory.reshard import HeldState, flat_state, hold_state, last_moved, redistribute, split_state
from tests.elastic.reshard_memory_worker import CONFIG, TIMEOUT, build, dump, join

WORLD = 4


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """One step on this rank's share of a global batch (two rows a rank) fixed by ``step``."""
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, CONFIG.vocab_size, (2 * WORLD, CONFIG.seq_len + 1), generator=generator)
    mine = tokens.chunk(WORLD)[dist.get_rank()]
    logits = model(mine[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), mine[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def held_dict(held: HeldState) -> dict[str, Any]:
    """A held state's shards, plain tensors and values, as saved for the test."""
    tensors = {k: v.clone() for k, v in held.tensors.items()}
    return {"tensors": tensors, "sharded": sorted(held.sharded), "values": held.values}


def own_shards(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's state in the held-state form: local shards of the sharded entries."""
    state = split_state(flat_state(model, optimizer))
    tensors = {k: (v.to_local() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.tensors.items()}
    return {"tensors": tensors, "sharded": sorted(state.sharded), "values": state.values}


def rebuild(
    held: list[HeldState] | None, out: Path, name: str, proc: int, seed: int, prefer_own: bool
) -> dict[str, Any]:
    model, optimizer = build(seed=seed, lr=1e-4)
    step = redistribute(model, optimizer, held, dist.group.WORLD, prefer_own=prefer_own)
    torch.save(own_shards(model, optimizer), out / f"{name}-{proc}.pt")
    dump(model, optimizer, out / f"{name}.pt")
    moved = last_moved()
    assert moved is not None
    return {"step": step, **dataclasses.asdict(moved)}


def main(spec: dict[str, Any], proc: int) -> None:
    store = dist.TCPStore("127.0.0.1", spec["port"], is_master=False, timeout=TIMEOUT)
    out = Path(spec["out"])
    reshard.BUCKET_BYTES = spec["bucket_bytes"]

    join(store, "old", proc, WORLD)
    model, optimizer = build(seed=0, lr=1e-2)
    for step in (1, 2):
        train_step(model, optimizer, step)
    for group in optimizer.param_groups:
        group["lr"] = 3e-3  # as the loop's schedule would: the lr must travel too
    dump(model, optimizer, out / "old.pt")
    own = hold_state(model, optimizer, old_rank=proc, old_world_size=WORLD, step=2)
    torch.save(held_dict(own), out / f"old-{proc}.pt")
    held: list[HeldState] | None = [own]
    # The donor keeps its own state: these are copies, as a snapshot's buddy holds them.
    for donor in (2, 1):
        held += [h for h in hand_off(own, leaving=proc == donor) if h is not own]
    if proc == 2:
        held = None  # lost with its node; the process comes back as a fresh replacement
    del model, optimizer
    dist.destroy_process_group()

    join(store, "replace", proc, WORLD)
    result = {
        "held": [(h.old_rank, h.step) for h in held or []],
        "replace": rebuild(held, out, "replace", proc, seed=1, prefer_own=True),
        "remote": rebuild(held, out, "remote", proc, seed=2, prefer_own=False),
    }
    dist.barrier()
    dist.destroy_process_group()
    (out / f"proc-{proc}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), int(sys.argv[2]))
