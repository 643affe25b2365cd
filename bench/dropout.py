"""``python -m bench dropout``: does a resize change what dropout draws, and what does keying
it by sample cost?

The same script (``bench/_dropout_script.py``: upstream minGPT's model under DDP, a
``DataLoader`` over ``elastic.Sampler``) trains the same steps on 1, 2 and 4 ranks, once
with plain ``nn.Dropout`` (the anchor) and once with ``elastic.keyed_dropout``. A world size
is what a resize changes, so the table gives, for each, the largest difference of a step's
loss from the one-rank run's (relative), and the median step time of the one-rank run,
keyed over plain. ``--quick``: fewer steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(nproc: int, keyed: bool, steps: int) -> list[dict[str, float]]:
    """Each step's record from rank 0 of a run on ``nproc`` ranks."""
    # As a module from the repository root (bench/ holds a package named like the stdlib's platform).
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
            "bench._dropout_script", "--steps", str(steps)]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REGROUP_", "TORCHELASTIC_"))}
    env["OMP_NUM_THREADS"] = "1"
    argv += ["--keyed"] if keyed else []
    out = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return [json.loads(line)["bench_step"] for line in out.stdout.splitlines() if line.startswith('{"bench_step"')]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench dropout")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    steps = 10 if args.quick else args.steps
    rows = []
    for keyed in (False, True):
        runs = {n: run(n, keyed, steps) for n in (1, 2, 4)}
        alone = {r["step"]: r["loss"] for r in runs[1]}
        drift = {
            n: max(abs(r["loss"] - alone[r["step"]]) / alone[r["step"]] for r in records)
            for n, records in runs.items()
            if n > 1
        }
        median = statistics.median(r["step_s"] for r in runs[1][1:])
        rows.append(("keyed" if keyed else "plain (anchor)", drift[2], drift[4], median))
    print(f"steps {steps}, global batch 24, 2 layers x 128 wide, sequences of 64, dropout 0.1")
    print("| dropout | loss vs 1 rank, 2 ranks | 4 ranks | step, 1 rank (median) |")
    print("|---|---|---|---|")
    for name, two, four, median in rows:
        print(f"| {name} | {two:.1e} | {four:.1e} | {median * 1000:.1f} ms |")
    print(f"keyed / plain step time: {rows[1][3] / rows[0][3]:.2f}")
    return 0
