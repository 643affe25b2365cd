"""``python -m bench script``'s command line: its flags, the settings they make, the run
folder, and what it prints and writes."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from bench.script.report import print_report
from bench.script.rounds import measure
from bench.script.runs import script_args
from bench.script.variants import REPO, SCRIPT, WORLD, Settings


def main(argv: list[str]) -> int:
    description = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]
    parser = argparse.ArgumentParser(prog="python -m bench script", description=description)
    parser.add_argument("--quick", action="store_true", help="1 round of 12 steps each (a couple of minutes)")
    parser.add_argument("--rounds", type=int, default=4, help="pairs (without, with), run alternately")
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps of each run left out")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step, all ranks together")
    parser.add_argument(
        "--also-without-snapshots", action="store_true",
        help="a third variant in each round: the example with snapshot_every=0 (where the overhead goes)",
    )  # fmt: skip
    parser.add_argument(
        "--also-synced-anchor", action="store_true",
        help="a second anchor in each round: the plain loop all-reducing its loss every step",
    )  # fmt: skip
    parser.add_argument(
        "--max-others", type=float,
        help="run a round again (up to 3 times) when other processes kept more than this many cores busy",
    )  # fmt: skip
    parser.add_argument("--profile", help="also profile one round of each under cProfile; profiles go to this folder")
    parser.add_argument(
        "--profile-clock", choices=("cpu", "wall"), default="cpu",
        help="what --profile measures: the main thread's CPU time, or wall time",
    )  # fmt: skip
    parser.add_argument("--keep", help="keep the runs' logs in this folder (default: a temp dir, removed)")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument(
        "--compile-reform", action="store_true",
        help="instead: a loss and a grow re-formed in place, torch.compile against uncompiled (recompiles, first step)",
    )  # fmt: skip
    parser.add_argument("--compile-backend", default="inductor", help="--compile-reform: the torch.compile backend")
    parser.add_argument("--compile-layers", type=int, default=10, help="--compile-reform: the model's blocks")
    args = parser.parse_args(argv)
    if args.compile_reform:
        from bench._compile_reform import main as compile_reform

        return compile_reform(args)
    rounds, steps, warmup = (1, 12, 4) if args.quick else (args.rounds, args.steps, args.warmup)
    if args.global_batch % WORLD:
        parser.error(f"--global-batch must divide by {WORLD}")
    if "elastic.in_place" not in SCRIPT.read_text():
        print(f"warning: {SCRIPT.relative_to(REPO)} does not use elastic.in_place", file=sys.stderr)
    settings = Settings(args.global_batch, steps, warmup, script_args(args.global_batch, steps))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="regroup-bench-script-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        profile = Path(args.profile) if args.profile else None
        result = measure(
            settings, rounds, root, profile, args.also_without_snapshots, args.profile_clock, args.max_others,
            synced=args.also_synced_anchor,
        )
        if args.profile and result["profile"]:
            shutil.copytree(root / "profiles", args.profile, dirs_exist_ok=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print_report(result, settings, rounds, args.profile_clock)
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings.__dict__, **result}, indent=2, default=str))
    return 0
