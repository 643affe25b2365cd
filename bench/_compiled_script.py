"""The user's script of ``python -m bench script --compile-reform``: the FSDP2 example's model
(``examples/fsdp2/upstream/model.py``) under ``elastic.in_place``, compiled
(``torch.compile(model)``) or not, built anew in every world as the API asks.

Every rank prints one JSON line per world, ``{"world": {"rank", "round", "world_size",
"step", "restore_s"}}`` (``restore_s``: building the model and the ``Run``, which restores the
state), and one per step, ``{"bench_step": {"rank", "round", "world_size", "step", "step_s",
"frames", "compile_s"}}``: the step's wall time from the batch to ``optimizer.step()`` done,
the frames Dynamo compiled during it (a first compile or a recompile: ``counters["frames"]``)
and the seconds it spent compiling them (Dynamo's ``_compile.compile_inner`` and the
backward's lazy compile).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

from regroup import elastic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "fsdp2" / "upstream"))
from model import ModelArgs, Transformer  # noqa: E402 - the upstream example's own model

VOCAB_SIZE = 1024
SEQ_LEN = 64
COMPILE_PHASES = ("_compile.compile_inner", "backward._backward_impl")


def compiled() -> tuple[int, float]:
    """Frames Dynamo compiled in this process so far, and the seconds it took."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(sum(compilation_time_metrics.get(phase, [])) for phase in COMPILE_PHASES)
    return int(counters["frames"]["ok"]), seconds


@elastic.in_place
def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    world = elastic.world()
    torch.manual_seed(0)
    model_args = ModelArgs(n_layers=args.layers, n_heads=4, vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LEN, dropout_p=0)
    with torch.device("meta"):
        model = Transformer(model_args)
    for layer in model.layers:
        fully_shard(layer, mesh=world.mesh)
    fully_shard(model, mesh=world.mesh)
    model.to_empty(device="cpu")
    model.reset_parameters()
    for layer in model.layers:
        layer.reset_parameters()
    if args.backend != "none":
        model = torch.compile(model, backend=args.backend)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    run = elastic.Run(model, optim, global_batch=args.global_batch, max_steps=args.steps, snapshot_every=1)
    where = {"rank": world.rank, "round": world.round, "world_size": world.world_size}
    restore_s = time.perf_counter() - started
    print(json.dumps({"world": {**where, "step": run.step, "restore_s": restore_s}}), flush=True)
    for step in run:
        t0, (frames, compile_s) = time.perf_counter(), compiled()
        generator = torch.Generator().manual_seed(step.index)
        batch = torch.randint(0, VOCAB_SIZE, (args.global_batch, SEQ_LEN), generator=generator)
        loss = model(batch[step.local]).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        step.report(loss)
        frames_after, compile_after = compiled()
        record = {"step": step.index + 1, "step_s": time.perf_counter() - t0, "frames": frames_after - frames}
        record["compile_s"] = compile_after - compile_s
        print(json.dumps({"bench_step": {**where, **record}}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="inductor", help="torch.compile backend; none: not compiled")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--global-batch", type=int, default=12)
    parser.add_argument("--steps", type=int, default=100_000)
    main(parser.parse_args())
