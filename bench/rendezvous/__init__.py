"""``python -m bench rendezvous [--quick] [--sizes 8,64,256] [--json PATH]``

etcd-v3 (this package) against torch's own ``c10d`` and ``etcd-v2`` dynamic rendezvous,
in one run on one machine. N lightweight agents per backend are threads of this process
that drive the real handlers (``next_rendezvous`` etc.), each with its own backend state,
heartbeats or lease; the etcd-v3 agents share one etcd connection and watch per process.

Measured, per backend and N:

- ``form``: all N agents call ``next_rendezvous`` at once (``--nnodes N:N``) until all
  have returned;
- ``leave``/``kill``: from one agent leaving gracefully / being killed until the N-1
  survivors, re-entering the rendezvous at that moment (as if their workers had
  failed at once), have all returned from ``next_rendezvous``;
- ``kill+lever`` (etcd-v3 only): as ``kill``, with the controller's expected membership
  (the survivors) and a re-form request written at the moment of the kill.

A killed agent stops refreshing its lease (etcd-v3) or its heartbeats (torch) and never
says goodbye. torch's dynamic rendezvous has no per-node leave (``shutdown()`` closes the
whole rendezvous, and torchrun skips it on SIGTERM), so for the anchors a graceful leave
is the same as a kill. All backends run with their defaults (torch: 30 s last call,
5 s heartbeats x3; etcd-v3: 5 s lease TTL) and a 30 s last call for every first round,
unless ``--quick``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog

from regroup.etcd import EtcdSettings, connect
from demo.etcd_server import EtcdServer, free_port
from regroup.keys import JobKeys
from regroup.records import ExpectedMembership, ReformCause, ReformRequest
from rendezvous.connection import Shared
from rendezvous.handler import EtcdV3RendezvousHandler
from rendezvous.settings import parse_settings

BACKENDS = ("etcd-v3", "c10d", "etcd-v2")


@dataclass
class Result:
    backend: str
    n: int
    scenario: str
    seconds: float | None
    note: str = ""


class Fleet:
    """N agents of one backend, as threads driving real handlers."""

    def __init__(
        self, backend: str, n: int, run_id: str, endpoints: dict[str, str], nnodes: tuple[int, int], fast: bool
    ) -> None:
        self.backend = backend
        self.run_id = run_id
        self.endpoint = endpoints[backend]
        self.pool = ThreadPoolExecutor(max_workers=n)
        self.shared: Shared | None = None
        self.nodes = [f"node{i:03d}" for i in range(n)]
        self.handlers = [self._make(node, nnodes, fast) for node in self.nodes]
        self.ranks: dict[int, int] = {}

    def _make(self, node: str, nnodes: tuple[int, int], fast: bool) -> Any:
        if self.backend == "etcd-v3":
            # A first round of N agents must not close before all have joined (a slow machine can
            # take longer than the 5 s default); 30 s is torch's default last call.
            conf = {"join_timeout": "300", "last_call_timeout": "30"}
            if fast:
                conf |= {"lease_ttl": "2", "last_call_timeout": "0.5"}
            settings = parse_settings(
                endpoint=self.endpoint, run_id=self.run_id, min_nodes=nnodes[0], max_nodes=nnodes[1],
                conf=conf, env={"NODE_NAME": node}, local_addr="127.0.0.1",
            )  # fmt: skip
            if self.shared is None:
                self.shared = Shared.open(settings)
            return EtcdV3RendezvousHandler(settings, shared=self.shared)
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

        conf: dict[str, Any] = {"join_timeout": "300"}
        if fast:
            conf |= {"last_call_timeout": "2", "keep_alive_interval": "1", "keep_alive_max_attempt": "2"}
        if self.backend == "c10d":
            conf["is_host"] = False
        params = RendezvousParameters(
            backend=self.backend, endpoint=self.endpoint, run_id=self.run_id,
            min_nodes=nnodes[0], max_nodes=nnodes[1], local_addr="127.0.0.1", **conf,
        )  # fmt: skip
        return get_rendezvous_handler(params)

    def rendezvous(self, indices: list[int], limit: float) -> tuple[float | None, str]:
        """All ``indices`` call ``next_rendezvous`` at once; seconds until the last returns."""
        started = time.monotonic()
        futures = {self.pool.submit(self.handlers[i].next_rendezvous): i for i in indices}
        done, pending = wait(futures, timeout=limit)
        elapsed = time.monotonic() - started
        if pending:
            return None, f"> {limit:.0f}s ({len(pending)} of {len(indices)} not done)"
        sizes = set()
        for future in done:
            info = future.result()
            sizes.add(info.world_size)
            self.ranks[futures[future]] = info.rank
        if sizes != {len(indices)}:
            return elapsed, f"world sizes {sorted(sizes)}"
        return elapsed, ""

    def victim(self) -> int:
        """The highest rank: killing the agent that hosts the round's store is another story."""
        return max(self.ranks, key=lambda i: self.ranks[i])

    def kill(self, i: int) -> None:
        handler = self.handlers[i]
        if self.backend == "etcd-v3":
            keys = handler._keys
            keeper, keys._keeper = keys._keeper, None
            handler._shared.loop.run(keeper.stop(revoke=False))
            handler._shut = True
        else:
            handler._stop_heartbeats()

    def leave(self, i: int) -> None:
        if self.backend == "etcd-v3":
            self.handlers[i].shutdown()
        else:
            self.kill(i)

    def close(self) -> None:
        for handler in self.handlers:
            try:
                if self.backend == "etcd-v3":
                    handler.shutdown()
                else:
                    handler._stop_heartbeats()
            except Exception as exc:  # noqa: BLE001 - best effort teardown of a benchmark fleet
                print(f"  teardown of a {self.backend} agent failed: {exc}", flush=True)
        if self.shared is not None:
            self.shared.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def write_lever(endpoint: str, job: str, nodes: list[str], generation: int) -> None:
    keys = JobKeys("default", job)

    async def write() -> None:
        client = await connect(EtcdSettings.from_endpoint_string(endpoint))
        try:
            await client.put(keys.expected.encode(), ExpectedMembership(generation=generation, nodes=nodes).to_json())
            request = ReformRequest(generation=generation, cause=ReformCause.NODE_LOST.value)
            await client.put(keys.reform.encode(), request.to_json())
        finally:
            await client.close()

    asyncio.run(write())


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
        "1 s heartbeats x2; etcd-v3: 2 s lease, 0.5 s last call): under a minute",
    )  # fmt: skip
    parser.add_argument("--sizes", default="8,64,256", help="agent counts (default 8,64,256)")
    parser.add_argument("--anchor-max", type=int, default=256, help="largest N run for the torch anchors")
    parser.add_argument("--limit", type=float, default=120.0, help="give up on one measurement after this many seconds")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="which backends to run")
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)
    sizes = [8] if args.quick else [int(s) for s in args.sizes.split(",")]
    scenarios = ["kill", "kill+lever"] if args.quick else ["leave", "kill", "kill+lever"]
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    workdir = Path(tempfile.mkdtemp(prefix="bench-rdzv-"))
    v3 = EtcdServer(data_dir=workdir / "v3").start()
    v2 = EtcdServer(data_dir=workdir / "v2", enable_v2=True).start()
    from torch.distributed import TCPStore

    c10d_store = TCPStore(
        "127.0.0.1", free_port(), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
    )
    endpoints = {"etcd-v3": v3.endpoint, "etcd-v2": v2.endpoint, "c10d": f"127.0.0.1:{c10d_store.port}"}
    results: list[Result] = []
    try:
        for n in sizes:
            for backend in args.backends.split(","):
                if backend != "etcd-v3" and n > args.anchor_max:
                    results.append(Result(backend, n, "form", None, f"not run (N > --anchor-max {args.anchor_max})"))
                    continue
                started = time.monotonic()
                results += measure(backend, n, endpoints, args.quick, args.limit, scenarios)
                print(f"  {backend} N={n}: {time.monotonic() - started:.1f}s", flush=True)
    finally:
        v3.kill()
        v2.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}")
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0
