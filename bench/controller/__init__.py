"""``python -m bench controller [--quick]``: the controller under an event storm.

2,000 nodes, 10,000 worker pods, 200 jobs of 50 nodes. A seeded storm of reclaim taints,
taint removals, NotReady flips, pod deletions and re-creations, container restarts and
rank restarts (``storm``) is replayed on each path:

- ``direct``: events go straight into the model (what the controller itself can do);
- ``http``: events are written into the Kubernetes API stand-in, running in a process of
  its own as the API server does (``standin_process``), and reach the model through the
  real list+watch adapter over HTTP (``kube``);
- ``anchor``: the stand-in alone, read by a bare watch consumer that only decodes lines.
  The ratio ``http / anchor`` says how much of the HTTP path's ceiling is the stand-in.

``direct`` and ``http`` each run the storm twice: as fast as it is taken (throughput), and
offered at ``--rate`` events/s with every decision timed (latency, ``harness``). Each path
runs in its own process (the http latency run too) so peak RSS (``ru_maxrss``) is its own. Goals: >= 5,000 events/s,
p99 signal->decision <= 20 ms, <= 300 MB, on both paths.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from .report import run_paths
from .storm import Layout


def _one(args: argparse.Namespace) -> int:
    from regroup.telemetry import configure_logging

    # The storm makes the controller log thousands of cordons and re-forms; keep errors only.
    # Logging is configured once, as the controller configures it.
    configure_logging(os.environ.get("REGROUP_LOG_LEVEL", "error"), once=True)
    layout = Layout()
    if args.costs:
        from .costs import run_costs

        print(json.dumps(asyncio.run(run_costs(layout))))
        return 0
    if args.instructions:
        from .instructions import run_instructions

        print(json.dumps(run_instructions(300 if args.quick else 1000)))
        return 0
    if args.only == "direct":
        from .direct import run_direct

        result = asyncio.run(run_direct(layout, args.events, args.seed, args.workers, args.rate, args.chunk,
                                        args.paced_events))
    else:
        from .kube import run_anchor, run_http, run_http_paced

        if args.only == "http":
            result = asyncio.run(run_http(layout, args.http_events, args.seed, args.workers))
        elif args.only == "http-paced":
            result = asyncio.run(run_http_paced(layout, args.seed, args.workers, args.rate, args.http_paced_events))
        else:
            result = asyncio.run(run_anchor(layout, args.http_events, args.seed))
    print(json.dumps(result))
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench controller", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer events (under a minute)")
    parser.add_argument("--events", type=int, default=None, help="storm events fed directly (default 100000; quick 20000)")
    parser.add_argument("--http-events", type=int, default=None, help="storm events through the stand-in (default 20000; quick 4000)")
    parser.add_argument("--paced-events", type=int, default=None,
                        help="events of the direct paced latency run (default 50000; quick 10000)")
    parser.add_argument("--http-paced-events", type=int, default=None,
                        help="events of the http paced latency run (default 20000; quick 4000)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rate", type=float, default=5000.0, help="offered events/s of the paced latency runs (default 5000)")
    parser.add_argument("--chunk", type=int, default=500, help="events per delivery in the throughput run (a watch read)")
    parser.add_argument("--only", choices=("direct", "http", "http-paced", "anchor"), help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--costs", action="store_true", help="only print per-event CPU costs on one job (timeit)")
    parser.add_argument("--instructions", action="store_true",
                        help="only count the storm's instructions and cache misses per event (callgrind; minutes)")
    args = parser.parse_args(argv)
    args.events = args.events or (20_000 if args.quick else 100_000)
    args.http_events = args.http_events or (4_000 if args.quick else 20_000)
    args.paced_events = args.paced_events or (10_000 if args.quick else 50_000)
    args.http_paced_events = args.http_paced_events or (4_000 if args.quick else 20_000)
    if args.only or args.costs or args.instructions:
        return _one(args)
    return run_paths(args)
