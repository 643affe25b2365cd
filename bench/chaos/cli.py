"""The ``bench chaos`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

from bench.chaos.plan import KINDS

QUICK_FAULTS = len(KINDS)
"""``--quick``: each kind once."""


def _indices(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",") if part.strip())


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        bad = unknown[0] if unknown else "(none)"
        raise argparse.ArgumentTypeError(f"unknown kind {bad}; known: {', '.join(KINDS)}")
    return kinds


def parse(argv: list[str]) -> argparse.Namespace:
    import bench.chaos

    summary = (bench.chaos.__doc__ or "").split("\n\n")[1]
    parser = argparse.ArgumentParser(prog="python -m bench chaos", description=summary)
    parser.add_argument("--seed", type=int, default=1, help="seeds the plan of faults (default: 1)")
    parser.add_argument("--faults", type=int, default=200, help="faults to play (default: 200)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_FAULTS} faults, each kind once")
    parser.add_argument("--only", type=_indices, default=(), metavar="I[,J]", help="play only these faults of the plan")
    parser.add_argument("--kinds", type=_kinds, default=KINDS, metavar="K[,K]", help="draw from these kinds only")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the run folder (default: out)")
    parser.add_argument("--name", help="run folder name (default: chaos-<seed>-<time>)")
    args = parser.parse_args(argv)
    if args.quick:
        args.faults = QUICK_FAULTS
    if any(i >= args.faults or i < 0 for i in args.only):
        parser.error(f"--only: indices must be within the plan of {args.faults} faults")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    from bench.chaos.campaign import CampaignSettings, run_campaign
    from bench.chaos.report import render, to_json
    from regroup.demo.main import cancelled_by_sigterm, exit_codes
    from regroup.telemetry import configure_logging, configure_tracing

    root = args.out / (args.name or f"chaos-{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}")
    if (root / "chaos.json").exists():
        print(f"bench chaos: {root} already holds a campaign; pick another --name", file=sys.stderr)
        return 2
    (root / "logs").mkdir(parents=True, exist_ok=True)
    settings = CampaignSettings(seed=args.seed, faults=args.faults, root=root, kinds=args.kinds, only=args.only)
    print(f"bench chaos: seed {args.seed}, {len(args.only) or args.faults} faults, in {root}", flush=True)
    load_before = os.getloadavg()[0]
    with open(root / "logs" / "chaos.log", "a") as log_stream:
        configure_logging(stream=log_stream)
        provider = configure_tracing("regroup-controller", spans_file=str(root / "spans.jsonl"))
        try:
            with exit_codes("bench chaos", root / "logs"):
                result = asyncio.run(cancelled_by_sigterm(run_campaign(settings)))
        finally:
            provider.shutdown()
    load = (load_before, os.getloadavg()[0])
    text = render(result, load)
    print(text)
    (root / "chaos.md").write_text(text + "\n")
    (root / "chaos.json").write_text(json.dumps(to_json(result, load), indent=2) + "\n")
    print(f"\nwrote {root / 'chaos.md'} and {root / 'chaos.json'}")
    return 1 if result.violations() else 0
