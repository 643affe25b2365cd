"""One size, end to end, on a fresh platform: etcd, the Kubernetes API stand-in, the
controller, the agent hosts; the jobs start and form, the churn and the probe run through
the measurement window, every job ends, and what they left behind is checked.

Processes: etcd (``--enable-pprof``), the controller (``regroup controller``, ``controller_process``), one agent
host for the probe job and ``hosts`` for the background jobs (round robin), and this one
(``bench``), which serves the Kubernetes API stand-in the controller watches and plays the
churn. With ``auth``, etcd serves TLS with client-certificate authentication on and every
process presents its own certificate (``etcd_auth``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench.platform.agent_host import AgentHost
from bench.platform.agent_specs import Timing
from bench.platform.churn import Churn
from bench.platform.controller_process import ControllerProcess
from bench.platform.etcd_auth import PlatformAuth, bootstrap
from bench.platform.jobs import NAMESPACE, Job, Jobs, News
from bench.platform.leftovers import check_leftovers
from bench.platform.observe import COUNTERS, GAUGES, EtcdGateway, Usage, usage
from bench.platform.probe import run_probe
from bench.platform.profiles import record_profiles
from kubeapi.server import FakeKubeAPI
from regroup.demo.etcd_server import EtcdServer

PROBE = "probe"
FORM_TIMEOUT_S = 120.0
"""How long the first worlds of every job may take to form, plus a second per job."""
FINISH_TIMEOUT = timedelta(seconds=120)


@dataclass(frozen=True)
class SizeSettings:
    """One size of the benchmark and how it is played."""

    jobs: int
    """Background jobs (0: the probe job alone, the anchor)."""
    agents: int
    """Nodes (agents) per job, the probe's too; each job trains on ``agents // 2`` to ``agents``."""
    hosts: int
    """Agent host processes of the background jobs."""
    churn_per_job_min: float
    probe_cycles: int
    """Probe cycles of each kind that takes a node away."""
    timing: Timing
    join_window: timedelta
    retention: timedelta
    warmup: timedelta
    profile_s: int
    """Seconds of CPU profile of etcd, the controller and an agent host (0: none)."""
    seed: int
    root: Path
    auth: bool = False
    """etcd with TLS and authentication on, one etcd identity per job (``etcd_auth``)."""


@dataclass
class Snapshot:
    at: float
    metrics: dict[str, float]
    usage: dict[str, Usage]


def _usage(pids: list[int]) -> Usage:
    each = [usage(pid) for pid in pids]
    return Usage(sum(u.cpu_s for u in each), sum(u.rss_mb for u in each), sum(u.peak_rss_mb for u in each))


@dataclass
class Platform:
    """The processes of one size, and the jobs on them."""

    settings: SizeSettings
    etcd: EtcdServer
    api: FakeKubeAPI
    controller: ControllerProcess
    probe_host: AgentHost
    hosts: list[AgentHost]
    jobs: Jobs
    news: News
    gateway: EtcdGateway
    counter: int = 0

    def pids(self) -> dict[str, list[int]]:
        assert self.etcd.pid is not None
        return {
            "etcd": [self.etcd.pid],
            "controller": [self.controller.pid],
            "agent_hosts": [h.pid for h in self.hosts],
            "probe_host": [self.probe_host.pid],
            "bench": [os.getpid()],
        }

    def snapshot(self) -> Snapshot:
        return Snapshot(time.monotonic(), self.gateway.metrics(), {n: _usage(p) for n, p in self.pids().items()})

    def background(self) -> list[Job]:
        return [j for j in self.jobs.all.values() if j.name != PROBE and not j.ended]

    def start_job(self) -> Job:
        self.counter += 1
        s = self.settings
        return self.jobs.start(job_name(self.counter), self.hosts[self.counter % len(self.hosts)], s.agents, s.agents // 2)

    def formed(self) -> bool:
        """Every job has formed a world at full size."""
        full = self.settings.agents
        return all((w := self.news.world(j)) is not None and w.world_size == full for j in self.jobs.all)


def job_name(counter: int) -> str:
    """The name of the ``counter``-th background job started."""
    return f"job-{counter:04d}"


async def run_size(s: SizeSettings) -> dict[str, Any]:
    """Play one size; returns its results (``report`` shapes them)."""
    s.root.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    auth = await asyncio.to_thread(PlatformAuth.make, s.root / "pki") if s.auth else None
    etcd = EtcdServer(data_dir=s.root / "etcd-data", log_path=s.root / "etcd.log", extra_args=("--enable-pprof",),
                      tls=auth.tls if auth else None)  # fmt: skip
    api = FakeKubeAPI(history_limit=1_000_000)
    news = News()
    async with contextlib.AsyncExitStack() as stack:
        await asyncio.to_thread(etcd.start)
        stack.push_async_callback(asyncio.to_thread, etcd.stop)
        gateway = EtcdGateway(etcd.url, auth.gateway_access() if auth else None)
        if auth is not None:
            await bootstrap(etcd, auth, gateway, s.root / "bootstrap.log")
            first = [PROBE, *map(job_name, range(1, s.jobs + 1))]
            # Their certificates now, off the loop; a job the churn starts later gets its own then (milliseconds).
            await asyncio.to_thread(lambda: [auth.job(NAMESPACE, name) for name in first])
        await api.start()
        stack.push_async_callback(api.stop)
        controller = ControllerProcess(api.write_kubeconfig(s.root / "kubeconfig"), etcd.endpoint, s.retention,
                                       s.root / "controller.log", auth.controller_flags() if auth else ())  # fmt: skip
        stack.push_async_callback(controller.stop)
        hosts = [AgentHost(f"agents-{i}", etcd.endpoint, s.timing, news.take) for i in range(s.hosts + 1)]
        for host in hosts:
            stack.push_async_callback(host.stop)
        # The controller and the hosts start together: each spends seconds importing.
        await asyncio.gather(controller.start(), *(h.start() for h in hosts))
        leases_start = gateway.leases()
        annotations = {
            "regroup.dev/min-nodes": str(s.agents // 2),
            "regroup.dev/max-nodes": str(s.agents),
            "regroup.dev/join-window": f"{s.join_window.total_seconds():g}s",
        }
        jobs = Jobs(api, annotations, auth.job if auth else None)
        platform = Platform(s, etcd, api, controller, hosts[0], hosts[1:], jobs, news, gateway)
        started = time.monotonic()
        probe = platform.jobs.start(PROBE, platform.probe_host, s.agents, s.agents // 2)
        for _ in range(s.jobs):
            platform.start_job()
        if not await news.until(platform.formed, FORM_TIMEOUT_S + s.jobs):
            unformed = [j for j in platform.jobs.all if news.world(j) is None][:10]
            raise TimeoutError(f"not every job formed its first world (e.g. {unformed}); agent errors: {news.errors[:5]}")
        form_s = time.monotonic() - started
        await asyncio.sleep(s.warmup.total_seconds())
        window = await _measure(platform, probe)
        end = await _end(platform, leases_start)
    shutil.rmtree(s.root / "etcd-data", ignore_errors=True)  # the numbers are taken; the database is not kept
    return {"jobs": s.jobs, "auth": "on" if s.auth else "off", "agents_per_job": s.agents, "load_before": load,
            "form_s": round(form_s, 2), **window, "end": end, "errors": news.errors}  # fmt: skip


async def _measure(platform: Platform, probe: Job) -> dict[str, Any]:
    """The window: churn and the probe together (and the profiles, when asked); rates and
    CPU from the counters at both ends."""
    s = platform.settings
    replace_after = s.timing.lease_ttl + timedelta(seconds=1)
    churn = Churn(platform.jobs, platform.news, platform.background, platform.start_job, s.churn_per_job_min,
                  replace_after, s.seed)  # fmt: skip
    first = platform.snapshot()
    churning = asyncio.create_task(churn.run())
    profiling = None
    if s.profile_s:
        busiest = platform.hosts[0] if s.jobs else platform.probe_host
        pythons = {"controller": platform.controller.pid, "agent_host": busiest.pid}
        profiling = asyncio.create_task(record_profiles(platform.gateway.cpu_profile, pythons, s.profile_s, s.root))
    timeout = 60.0 + 2 * s.join_window.total_seconds()
    probed = await run_probe(platform.jobs, platform.news, probe, s.probe_cycles, s.seed, timeout)
    profiles = await profiling if profiling is not None else {}
    last = platform.snapshot()
    leases = platform.gateway.leases()
    churning.cancel()
    await asyncio.gather(churning, return_exceptions=True)
    await churn.settle()
    seconds = last.at - first.at
    processes = {
        name: {
            "cpu_cores": (last.usage[name].cpu_s - first.usage[name].cpu_s) / seconds,
            "rss_mb": last.usage[name].rss_mb,
            "peak_rss_mb": last.usage[name].peak_rss_mb,
            "count": len(pids),
        }
        for name, pids in platform.pids().items()
    }
    return {
        "window_s": round(seconds, 1),
        "rates": {name: (last.metrics[name] - first.metrics[name]) / seconds for name in COUNTERS},
        "grpc_per_s": {
            name.removeprefix("grpc:"): round((value - first.metrics.get(name, 0.0)) / seconds, 2)
            for name, value in sorted(last.metrics.items())
            if name.startswith("grpc:") and value > first.metrics.get(name, 0.0)
        },
        "gauges": {name: last.metrics[name] for name in GAUGES},
        "leases": leases,
        "processes": processes,
        "probe": probed.summary(),
        "probe_samples": probed.samples,
        "churn": {"events": dict(churn.counts), "skipped": churn.skipped, "rate_per_job_min": s.churn_per_job_min},
        "profiles": profiles,
    }


async def _end(platform: Platform, leases_start: int) -> dict[str, Any]:
    """Every job ends, then ``check_leftovers``."""
    s = platform.settings
    jobs = platform.jobs
    live = [j for j in jobs.all.values() if not j.ended]
    finished = await asyncio.gather(*(jobs.finish(j, platform.news, FINISH_TIMEOUT) for j in live))
    left = await check_leftovers(platform.gateway, NAMESPACE, list(jobs.all), leases_start, s.timing.lease_ttl,
                                 s.retention, identities=s.auth)  # fmt: skip
    (s.root / "leftovers.json").write_text(json.dumps(left.pop("keys_by_job"), indent=1) + "\n")
    return {**left, "not_finished_in_time": finished.count(False), "retention_s": s.retention.total_seconds()}
