"""``python -m bench scale``: every path that moves training state, at the sizes users train.

``python -m bench scale [--quick] [--sizes 1M,25M,125M] [--wraps fsdp,ddp] [--ranks 4]
[--out DIR] [--json PATH] [--chart PATH]``

For each wrapper (FSDP2, DDP) and model size (the trainer's Llama-style decoder, from about
1M to 350M parameters: 15 MB to 4.4 GB of model + AdamW state; what fits this machine) it runs ``--ranks``
processes on gloo through the chain of ``bench.scale.chain``: in-memory snapshots, a node
replaced at the same size, a loss that shrinks the world, a grow, a planned leave migrated
to a spare (its shards handed over), a planned shrink (the leaving rank's snapshots secured
before its ack), a DCP save and a load. For each path and size it reports the time, the bytes moved and the rate, beside the same bytes through the
raw floor in the same run (a plain ``copy_``, plain gloo sends of the same bytes between
the same ranks, a plain file write and read), and the peak resident memory of the worst
rank over its state, in steady training with snapshots and during each re-form. A size
whose estimated memory does not fit this machine is left out, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.scale.report import render, summarize

SIZES: dict[str, dict[str, int]] = {
    "1M": {"vocab_size": 1000, "dim": 192, "n_layers": 2, "n_heads": 4, "seq_len": 64},
    "8M": {"vocab_size": 4000, "dim": 320, "n_layers": 4, "n_heads": 5, "seq_len": 64},
    "25M": {"vocab_size": 8000, "dim": 512, "n_layers": 6, "n_heads": 8, "seq_len": 64},
    "80M": {"vocab_size": 16000, "dim": 640, "n_layers": 12, "n_heads": 10, "seq_len": 64},
    "125M": {"vocab_size": 32000, "dim": 768, "n_layers": 12, "n_heads": 12, "seq_len": 64},
    "350M": {"vocab_size": 32000, "dim": 1024, "n_layers": 24, "n_heads": 16, "seq_len": 64},
}
"""Decoder configurations by their (rounded) parameter count."""
DEFAULT_SIZES = {"fsdp": "1M,25M,80M,125M,350M", "ddp": "1M,8M,25M,80M,125M"}
BASELINE_BYTES = 500 << 20
"""A rank's process before any state: the interpreter, torch, gloo."""


def parameters(model: dict[str, int]) -> int:
    """Parameters of the decoder ``model`` describes (built on the meta device: no memory)."""
    import torch

    from regroup.trainer.config import ModelConfig
    from regroup.trainer.model import Decoder

    with torch.device("meta"):
        return sum(p.numel() for p in Decoder(ModelConfig(**model)).parameters())


STEADY_FACTOR = {"fsdp": 10.0, "ddp": 4.0}
"""A rank's resident memory above its process, in its state, at the peak of steady training
with snapshots, as this benchmark measured it on CPU (FSDP2 11.4x at 125M: the step's own
memory and what glibc keeps of it, beside 5x of state and snapshots; DDP 2.9x at 80M); a
re-form's peak stays below it. Rounded down: ranks do not all peak at once."""


def estimate(wrap: str, params: int, ranks: int) -> int:
    """Host memory the run needs, all ranks on this machine: each rank's process and its
    steady peak (``STEADY_FACTOR`` times its state: 12 bytes a parameter, over the ranks
    with FSDP2)."""
    state = 12 * params if wrap == "ddp" else 12 * params // ranks
    return int(ranks * (BASELINE_BYTES + STEADY_FACTOR[wrap] * state))


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench scale", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the 1M and 25M sizes, FSDP2 only (a few minutes)")
    parser.add_argument("--sizes", help=f"comma-separated, of {', '.join(SIZES)} (default: per wrapper)")
    parser.add_argument("--wraps", default="fsdp,ddp", help="fsdp, ddp or both")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3, help="steps per block of steady training")
    parser.add_argument("--rounds", type=int, default=3, help="blocks with and without snapshots, in turn")
    parser.add_argument("--out", help="folder for the run's logs and records (default: a temporary one)")
    parser.add_argument("--json", help="also write the summary as JSON here")
    parser.add_argument("--chart", help="also draw the chart (PNG) here")
    args = parser.parse_args(argv)
    from bench.scale.launch import ChainFailed, run_chain

    wraps = ["fsdp"] if args.quick else [w.strip() for w in args.wraps.split(",") if w.strip()]
    out = Path(args.out or tempfile.mkdtemp(prefix="bench-scale-"))
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for wrap in wraps:
        names = "1M,25M" if args.quick else (args.sizes or DEFAULT_SIZES[wrap])
        for name in [n.strip() for n in names.split(",") if n.strip()]:
            if name not in SIZES:
                print(f"bench scale: --sizes: unknown size {name!r} (known: {', '.join(SIZES)})", file=sys.stderr)
                return 2
            params = parameters(SIZES[name])
            needed, free = estimate(wrap, params, args.ranks), available()
            if needed > 0.85 * free:
                notes.append(
                    f"{wrap} {name}: left out: needs about {needed / 2**30:.1f} GiB at its peak "
                    f"({args.ranks} ranks), this machine has {free / 2**30:.1f} GiB available"
                )
                print(f"bench scale: {notes[-1]}", flush=True)
                continue
            print(f"bench scale: {wrap} {name} ({params / 1e6:.0f}M parameters) ...", flush=True)
            folder = out / f"{wrap}-{name}"
            spec = {
                "wrap": wrap, "model": SIZES[name], "checkpoint_dir": str(folder / "checkpoints"),
                "steady_steps": args.steps, "steady_rounds": 1 if args.quick else args.rounds, "floors": True,
                "batch": 2,
            }  # fmt: skip
            try:
                records = run_chain(spec, args.ranks, folder, timeout=7200)
            except ChainFailed as exc:
                notes.append(f"{wrap} {name}: failed: {str(exc).splitlines()[0]}")
                print(f"bench scale: {exc}", file=sys.stderr, flush=True)
                continue
            rows.append(summarize(wrap, name, params, records))
            (out / "summary.json").write_text(json.dumps({"rows": rows, "notes": notes}, indent=1))
    machine = f"{os.cpu_count()} cores, {available() / 2**30:.0f} GiB available at the end"
    print(render(rows, notes, machine))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": notes}, indent=1))
    if args.chart and rows:
        from bench.scale.report import chart

        chart(rows, Path(args.chart))
    return 0 if rows else 1
