"""Run each path in its own process and print the table and the goals."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

GOALS: dict[str, Callable[[dict[str, Any]], bool]] = {
    # As fast as it is fed (the throughput run), and keeping up when offered 5,000/s (the
    # paced run's achieved rate counts its drain, so "keeping up" allows 2% for it).
    "events_per_s>=5000": lambda r: r["events_per_s"] >= 5000 and r["paced_achieved_per_s"] >= 0.98 * r["paced_rate"],
    "p99_ms<=20": lambda r: r["p99_ms"] <= 20,
    "peak_rss_mb<=300": lambda r: r["peak_rss_mb"] <= 300,
}


def run_paths(args: argparse.Namespace) -> int:
    results = []
    for path in ("direct", "anchor", "http", "http-paced"):
        cmd = [sys.executable, "-m", "bench", "controller", "--only", path, "--events", str(args.events),
               "--http-events", str(args.http_events), "--seed", str(args.seed), "--workers", str(args.workers),
               "--rate", str(args.rate), "--chunk", str(args.chunk), "--paced-events", str(args.paced_events),
               "--http-paced-events", str(args.http_paced_events)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=timedelta(minutes=20).total_seconds(),
                             env={**os.environ, "REGROUP_LOG_LEVEL": "warning"})
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    direct, anchor, http, paced = results.pop(0), results.pop(0), results.pop(0), results.pop(0)
    http.update({**paced, "peak_rss_mb": max(http["peak_rss_mb"], paced["peak_rss_mb"])})
    results = [direct, anchor, http]
    report = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "layout": "2000 nodes, 10000 pods, 200 jobs x 50 nodes",
        "load_average": os.getloadavg(),
        "results": results,
        "http_vs_anchor": round(http["kube_events_per_s"] / anchor["kube_events_per_s"], 3),
        "goals": {name: {path["path"]: check(path) for path in (direct, http)} for name, check in GOALS.items()},
    }
    _print(results, report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _print(results: list[dict[str, Any]], report: dict[str, Any]) -> None:
    print(f"{'path':<24}{'events':>8}{'events/s':>11}{'ev/CPU-s':>10}{'decisions':>11}{'peak MB':>9}")
    for r in results:
        print(f"{r['path']:<24}{r['events']:>8}{r['events_per_s']:>11}{r.get('events_per_cpu_s', '-'):>10}"
              f"{r.get('decisions', '-'):>11}{r['peak_rss_mb']:>9}")
    print(f"{'paced (latency)':<24}{'offered/s':>10}{'achieved/s':>12}{'decisions':>11}{'CPU share':>11}"
          f"{'p50 ms':>9}{'p99 ms':>9}")
    for r in results:
        if "paced_rate" in r:
            print(f"{r['path']:<24}{r['paced_rate']:>10.0f}{r['paced_achieved_per_s']:>12}{r['paced_decisions']:>11}"
                  f"{r['paced_cpu_share']:>11}{r['p50_ms']:>9}{r['p99_ms']:>9}")
    print(f"http / anchor Kubernetes-event throughput: {report['http_vs_anchor']}  load average: "
          f"{', '.join(f'{x:.1f}' for x in report['load_average'])}")
    print(f"goals: {report['goals']}")
