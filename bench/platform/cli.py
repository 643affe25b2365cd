"""The ``bench platform`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.platform.agent_specs import Timing
from bench.platform.profiles import py_spy
from bench.platform.report import render
from bench.platform.size_run import SizeSettings, run_size


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--jobs: comma-separated job counts, got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise argparse.ArgumentTypeError(f"--jobs: one or more counts of at least 1, got {text!r}")
    return sizes


def parse(argv: list[str]) -> argparse.Namespace:
    import bench.platform

    parser = argparse.ArgumentParser(prog="python -m bench platform", description=(bench.platform.__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 2 jobs of 4 agents, one probe cycle of each kind, 2 events per job per "
                             "minute, no profiles (about a minute)")  # fmt: skip
    parser.add_argument("--jobs", type=_sizes, default=[10, 50],
                        help="background job counts (default 10,50; 200 jobs of 16 agents need about 8 cores: "
                             "--jobs 10,50,200)")  # fmt: skip
    parser.add_argument("--agents", type=int, default=16, help="agents (nodes) per job, the probe's too (default 16)")
    parser.add_argument("--agents-per-host", type=int, default=256,
                        help="background agents per host process (default 256)")  # fmt: skip
    parser.add_argument("--churn", type=float, default=0.5, help="churn events per job per minute (default 0.5)")
    parser.add_argument("--probes", type=int, default=10, help="probe cycles of each kind (default 10)")
    parser.add_argument("--join-window", type=float, default=2.0, help="the jobs' join window, seconds (default 2)")
    parser.add_argument("--step-time", type=float, default=0.5,
                        help="the trainers' step time, seconds: a checkpoint request is acked at the next step "
                             "(default 0.5)")  # fmt: skip
    parser.add_argument("--progress-interval", type=float, default=5.0,
                        help="how often rank 0 writes progress, seconds (default 5, the trainer's)")  # fmt: skip
    parser.add_argument("--lease-ttl", type=float, default=5.0, help="the agents' lease TTL, seconds (default 5)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds between forming and the window (default 10)")
    parser.add_argument("--retention", type=float, default=10.0,
                        help="seconds the controller keeps an ended job's keys (its --retention; default 10)")  # fmt: skip
    parser.add_argument("--profile", type=int, default=20,
                        help="seconds of CPU profile of etcd, the controller and an agent host per size (0: none)")  # fmt: skip
    parser.add_argument("--auth", choices=AUTH_MODES, default="both",
                        help="etcd authentication: off (plain HTTP), on (TLS, client certificates, one etcd identity "
                             "per job, made by the controller) or both, each size off then on, each on a fresh "
                             "platform (default both)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the run folder (default: out)")
    parser.add_argument("--name", help="run folder name (default: platform-<time>)")
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.agents, args.probes, args.churn, args.warmup, args.profile = [2], 4, 1, 2.0, 2.0, 0
    if args.agents < 2:
        parser.error("--agents: at least 2 (a job trains on agents/2 to agents nodes)")
    for option, value in (("--probes", args.probes), ("--agents-per-host", args.agents_per_host)):
        if value < 1:
            parser.error(f"{option}: at least 1, got {value}")
    for option, value in (("--step-time", args.step_time), ("--progress-interval", args.progress_interval)):
        if value <= 0:
            parser.error(f"{option}: must be positive, got {value}")
    for option, value in (("--churn", args.churn), ("--join-window", args.join_window), ("--warmup", args.warmup),
                          ("--retention", args.retention), ("--profile", args.profile)):  # fmt: skip
        if value < 0:
            parser.error(f"{option}: must not be negative, got {value}")
    if not 2 <= args.lease_ttl <= 300:
        parser.error(f"--lease-ttl: between 2 and 300 seconds (the rendezvous' bounds), got {args.lease_ttl}")
    return args


AUTH_MODES = ("off", "on", "both")


def modes(auth: str) -> list[str]:
    """The modes ``--auth`` runs, in the order each size runs them."""
    return ["off", "on"] if auth == "both" else [auth]


def _settings(args: argparse.Namespace, jobs: int, root: Path, auth: bool = False) -> SizeSettings:
    return SizeSettings(
        jobs=jobs,
        agents=args.agents,
        hosts=math.ceil(jobs * args.agents / args.agents_per_host),
        churn_per_job_min=args.churn,
        probe_cycles=args.probes,
        timing=Timing(
            lease_ttl=timedelta(seconds=args.lease_ttl),
            step_time=timedelta(seconds=args.step_time),
            progress_interval=timedelta(seconds=args.progress_interval),
        ),
        join_window=timedelta(seconds=args.join_window),
        retention=timedelta(seconds=args.retention),
        warmup=timedelta(seconds=args.warmup),
        profile_s=args.profile,
        seed=args.seed,
        root=root,
        auth=auth,
    )


def _etcd_version() -> str:
    out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, check=False).stdout
    return out.splitlines()[0].removeprefix("etcd Version: ") if out else "?"


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Every size in one invocation, the probe alone first, each size in each ``--auth`` mode
    in turn (both modes see the machine as it is then); the results as ``platform.json``
    holds them. A mode that fails at a size runs no larger size; the other goes on."""
    sizes = []
    failed = []
    running = modes(args.auth)
    for jobs in [0, *args.jobs]:
        for mode in list(running):
            started = time.monotonic()
            label = f"{jobs} jobs, auth {mode}"
            folder = root / f"{f'j{jobs}' if jobs else 'alone'}-auth-{mode}"
            try:
                result = asyncio.run(run_size(_settings(args, jobs, folder, auth=mode == "on")))
            except Exception as exc:  # noqa: BLE001 - the sizes measured so far are still reported
                after = round(time.monotonic() - started, 1)
                failed.append({"jobs": jobs, "auth": mode, "after_s": after, "error": f"{type(exc).__name__}: {exc}"})
                print(f"  {label}: failed after {after:.0f} s: {failed[-1]['error']}", flush=True)
                running.remove(mode)
                continue
            result["wall_s"] = round(time.monotonic() - started, 1)
            sizes.append(result)
            print(f"  {label}: {result['wall_s']:.0f} s", flush=True)
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "cpus": os.cpu_count() or 1,
        "etcd_version": _etcd_version(),
        "agents_per_job": args.agents,
        "churn_per_job_min": args.churn,
        "probe_cycles": args.probes,
        "join_window_s": args.join_window,
        "step_time_s": args.step_time,
        "progress_interval_s": args.progress_interval,
        "lease_ttl_s": args.lease_ttl,
        "auth": args.auth,
        "py_spy": py_spy() is not None,
        "sizes": sizes,
        "failed": failed,
    }


def main(argv: list[str]) -> int:
    args = parse(argv)
    root = args.out / (args.name or f"platform-{time.strftime('%Y%m%d-%H%M%S')}")
    if (root / "platform.json").exists():
        print(f"bench platform: {root} already holds a run; pick another --name", file=sys.stderr)
        return 2
    root.mkdir(parents=True, exist_ok=True)
    from regroup.telemetry import configure_logging

    with open(root / "bench.log", "a") as log:
        configure_logging("error", stream=log)
        print(f"bench platform: the probe alone, then {args.jobs} jobs of {args.agents} agents, etcd auth "
              f"{' then '.join(modes(args.auth))} at each, in {root}", flush=True)  # fmt: skip
        results = run(args, root)
    if not results["sizes"]:
        errors = "; ".join(f"auth {f['auth']}: {f['error']}" for f in results["failed"])
        print(f"bench platform: not even the probe alone ran: {errors}", file=sys.stderr)
        return 1
    text = render(results)
    (root / "platform.md").write_text(text + "\n")
    (root / "platform.json").write_text(json.dumps(results, indent=2) + "\n")
    print(text)
    print(f"\nwrote {root / 'platform.md'} and {root / 'platform.json'}")
    return 1 if results["failed"] else 0
