"""``python -m bench rendezvous [--quick] [--sizes 8,64,256] [--window-sizes 1024] [--json PATH]``:
how fast N agents form and re-form a rendezvous, on etcd-v3, c10d and etcd-v2.

etcd-v3 (this package) against torch's own ``c10d`` and ``etcd-v2`` dynamic rendezvous,
in one run on one machine. N lightweight agents per backend are threads of this process
that drive the real handlers (``next_rendezvous`` etc.), each with its own backend state,
heartbeats or lease; the etcd-v3 agents share one etcd connection and watch per process.

Why threads, up to N = 1,024 on two cores: torch's handlers, and torchrun's use of ours,
are synchronous (``next_rendezvous`` blocks), so only a thread or a process per agent
drives them as torchrun does; an asyncio harness could drive our join loop but neither
anchor, and would skip the thread hand-off that torchrun pays. A process per agent costs
an interpreter and ``import torch`` each (about 0.3 GB and seconds of CPU): 1,024 of them
do not fit two cores and 24 GiB. Threads do, at a price that makes the numbers
pessimistic for the agents' CPU: every agent's Python work runs under one GIL, on one
core, where in production each agent has its own process and node. They are optimistic
for etcd's fan-out: the etcd-v3 agents share one watch, where N agents open N.

Measured, per backend and N:

- ``form``: all N agents call ``next_rendezvous`` at once (``--nnodes N:N``) until all
  have returned;
- ``leave``/``kill``: from one agent leaving gracefully / being killed until the N-1
  survivors, re-entering the rendezvous at that moment (as if their workers had
  failed at once), have all returned from ``next_rendezvous``;
- ``kill+lever`` (etcd-v3 only): as ``kill``, with the controller's expected membership
  (the survivors) and a re-form request written at the moment of the kill;
- ``join window`` (``bench.rendezvous.join_window``): 3N/4 agents wait in a round's join
  window while the other N/4 arrive spread over it; per agent, from the last arrival
  until it returned from ``next_rendezvous``, as p50/p99/max.

A killed agent stops refreshing its lease (etcd-v3) or its heartbeats (torch) and never
says goodbye. torch's dynamic rendezvous has no per-node leave (``shutdown()`` closes the
whole rendezvous, and torchrun skips it on SIGTERM), so for the anchors a graceful leave
is the same as a kill. All backends run with their defaults (torch: 30 s last call,
5 s heartbeats x3; etcd-v3: 5 s lease TTL) and a 30 s last call for every first round,
unless ``--quick``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import structlog

from bench.rendezvous.fleet import Fleet, Result, write_lever
from bench.rendezvous.join_window import WindowResult, measure_window, window_table
from regroup.demo.etcd_server import EtcdServer

BACKENDS = ("etcd-v3", "c10d", "etcd-v2")


def measure(
    backend: str, n: int, endpoints: dict[str, str], fast: bool, limit: float, scenarios: list[str]
) -> list[Result]:
    results: list[Result] = []
    tag = f"{backend.replace('-', '')}{n}{int(time.time() * 1000) % 100000}"
    fleet = Fleet(backend, n, f"form-{tag}", endpoints, (n, n), fast)
    try:
        seconds, note = fleet.rendezvous(list(range(n)), limit)
        results.append(Result(backend, n, "form", seconds, note))
    finally:
        fleet.close()
    for scenario in scenarios:
        if scenario == "kill+lever" and backend != "etcd-v3":
            continue
        fleet = Fleet(backend, n, f"{scenario.replace('+', '')}-{tag}", endpoints, (max(1, n // 2), n), fast)
        try:
            seconds, note = fleet.rendezvous(list(range(n)), limit)
            if seconds is None:
                results.append(Result(backend, n, scenario, None, f"first round failed: {note}"))
                continue
            victim = fleet.victim()
            survivors = [i for i in range(n) if i != victim]
            started = time.monotonic()
            if scenario == "leave":
                fleet.leave(victim)
            else:
                fleet.kill(victim)
            if scenario == "kill+lever":
                write_lever(fleet.endpoint, fleet.run_id, [fleet.nodes[i] for i in survivors], generation=1)
            seconds, note = fleet.rendezvous(survivors, limit)
            total = None if seconds is None else time.monotonic() - started
            results.append(Result(backend, n, scenario, total, note))
        finally:
            fleet.close()
    return results


def table(results: list[Result]) -> str:
    cells = {(r.backend, r.n, r.scenario): r for r in results}
    sizes = sorted({r.n for r in results})
    scenarios = [s for s in ("form", "leave", "kill", "kill+lever") if any(r.scenario == s for r in results)]
    lines = [
        "| scenario | N | " + " | ".join(BACKENDS) + " | c10d / etcd-v3 | etcd-v2 / etcd-v3 |",
        "|---|---|" + "---|" * (len(BACKENDS) + 2),
    ]
    for scenario in scenarios:
        for n in sizes:
            row = []
            for backend in BACKENDS:
                r = cells.get((backend, n, scenario))
                row.append(
                    "—"
                    if r is None
                    else (f"{r.seconds:.3f} s" if r.seconds is not None else r.note)
                    + (f" ({r.note})" if r and r.seconds is not None and r.note else "")
                )
            ours = cells.get(("etcd-v3", n, scenario))
            ratios = []
            for anchor in ("c10d", "etcd-v2"):
                base = cells.get((anchor, n, scenario if scenario != "kill+lever" else "kill"))
                if ours and ours.seconds and base and base.seconds:
                    ratios.append(f"{base.seconds / ours.seconds:.1f}×")
                else:
                    ratios.append("—")
            lines.append(f"| {scenario} | {n} | " + " | ".join(row) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench rendezvous", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true",
        help="N=8 only, kill scenarios only, shortened timeouts on every backend (torch: 2 s last call, "
        "1 s heartbeats x2; etcd-v3: 2 s lease, 0.5 s last call), and the join window at N=32 over 1 s: "
        "under a minute",
    )  # fmt: skip
    parser.add_argument("--sizes", default="8,64,256", help="agent counts (default 8,64,256; '' for none)")
    parser.add_argument(
        "--window-sizes", default="1024", help="agent counts of the join-window scenario (default 1024; '' for none)"
    )
    parser.add_argument("--window", type=float, default=10.0, help="the join-window arrivals' spread in seconds")
    parser.add_argument(
        "--window-backends", default="etcd-v3,c10d",
        help="backends of the join-window scenario (default etcd-v3,c10d: etcd-v2 takes minutes at 1,024)",
    )  # fmt: skip
    parser.add_argument("--anchor-max", type=int, default=256, help="largest N run for the torch anchors")
    parser.add_argument("--limit", type=float, default=120.0, help="give up on one measurement after this many seconds")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="which backends to run")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    sizes = [8] if args.quick else [int(s) for s in args.sizes.split(",") if s]
    window_sizes = [32] if args.quick else [int(s) for s in args.window_sizes.split(",") if s]
    window = 1.0 if args.quick else args.window
    scenarios = ["kill", "kill+lever"] if args.quick else ["leave", "kill", "kill+lever"]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workdir = Path(tempfile.mkdtemp(prefix="bench-rdzv-"))
    v3 = EtcdServer(data_dir=workdir / "v3").start()
    v2 = EtcdServer(data_dir=workdir / "v2", enable_v2=True).start()
    from torch.distributed import TCPStore

    # Port 0: the store binds a port of its own (``c10d_store.port``).
    c10d_store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600))
    endpoints = {"etcd-v3": v3.endpoint, "etcd-v2": v2.endpoint, "c10d": f"127.0.0.1:{c10d_store.port}"}
    results: list[Result] = []
    windows: list[WindowResult] = []
    try:
        for n in sizes:
            for backend in args.backends.split(","):
                if backend != "etcd-v3" and n > args.anchor_max:
                    results.append(Result(backend, n, "form", None, f"not run (N > --anchor-max {args.anchor_max})"))
                    continue
                started = time.monotonic()
                results += measure(backend, n, endpoints, args.quick, args.limit, scenarios)
                print(f"  {backend} N={n}: {time.monotonic() - started:.1f}s", flush=True)
        for n in window_sizes:
            for backend in args.window_backends.split(","):
                started = time.monotonic()
                windows.append(measure_window(backend, n, endpoints, window, args.limit, args.quick))
                print(f"  {backend} join window N={n}: {time.monotonic() - started:.1f}s", flush=True)
    finally:
        v3.kill()
        v2.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}")
    if results:
        print(table(results))
    if windows:
        print(window_table(windows))
    if args.json:
        rows = [r.__dict__ for r in results] + [{"scenario": "join window", **r.__dict__} for r in windows]
        args.json.write_text(json.dumps(rows, indent=2))
    return 0
