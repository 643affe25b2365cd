"""The run's tables (stdout and ``platform.md``) and its numbers (``platform.json``).

The first size is the probe job alone: the anchor every latency ratio divides by. A
background job's cost is what its size adds to the anchor's, divided by its jobs. Where it
bends is the first size whose etcd or controller CPU per background job is more than
``BEND`` times that of the smallest loaded size, or whose probe p50 is more than ``BEND``
times the probe's alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from bench.platform.probe import KINDS

BEND = 1.5
"""A per-job cost this many times the smallest loaded size's, or a probe latency this many
times the probe's alone: linear no longer."""
HARNESS_SHARE = 0.5
"""Of the machine's cores, what the agent hosts may take before a size says the harness limits it."""


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _latency(size: dict[str, Any], kind: str) -> str:
    p = size["probe"][kind]
    failed = f", {p['failed']} failed" if p["failed"] else ""
    return f"{_s(p['p50_s'])} / {_s(p['p99_s'])} (n={p['n']}{failed})"


def _ratio(size: dict[str, Any], alone: dict[str, Any], kind: str) -> float | None:
    mine, base = size["probe"][kind]["p50_s"], alone["probe"][kind]["p50_s"]
    return mine / base if mine and base else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def _per_job(size: dict[str, Any], alone: dict[str, Any], value: Callable[[dict[str, Any]], float]) -> float:
    """What one background job adds to ``value`` over the anchor (``alone``)."""
    return (value(size) - value(alone)) / size["jobs"]


def _cpu_ms(name: str) -> Callable[[dict[str, Any]], float]:
    """A process' CPU in milliseconds per second."""
    return lambda size: 1000.0 * size["processes"][name]["cpu_cores"]


def _rate(*names: str) -> Callable[[dict[str, Any]], float]:
    return lambda size: sum(size["rates"][n] for n in names)


def bend(sizes: Sequence[dict[str, Any]]) -> str:
    """Where the platform stops scaling linearly, by the rule in the module docstring."""
    alone, loaded = sizes[0], [s for s in sizes[1:] if s["jobs"] > 0]
    if not loaded:
        return "no loaded size: nothing to compare"
    base = loaded[0]
    for size in loaded:
        why = []
        for name in ("etcd", "controller") if size is not base else ():
            ratio = _per_job(size, alone, _cpu_ms(name)) / max(_per_job(base, alone, _cpu_ms(name)), 1e-9)
            if ratio > BEND:
                why.append(f"{name} CPU per job {ratio:.1f}× that at {base['jobs']} jobs")
        for kind in KINDS:
            ratio = _ratio(size, alone, kind)
            if ratio is not None and ratio > BEND:
                why.append(f"probe {kind} p50 {ratio:.1f}× alone")
        if why:
            return f"bends at {size['jobs']} jobs: " + "; ".join(why)
    return f"linear up to {loaded[-1]['jobs']} jobs (per-job CPU within {BEND}× that at {base['jobs']} jobs, probe p50s within {BEND}× alone)"


def render(run: dict[str, Any]) -> str:
    sizes = run["sizes"]
    alone = sizes[0]
    hosts = ", ".join(f"{s['jobs']} jobs: {s['processes']['agent_hosts']['count']}" for s in sizes[1:])
    lines = [
        f"# bench platform: jobs of {run['agents_per_job']} agents, churn {run['churn_per_job_min']:g} events "
        "per job per minute",
        "",
        f"machine: {run['machine']}; etcd {run['etcd_version']}; py-spy {'yes' if run['py_spy'] else 'not installed'}",
        f"jobs: step {run['step_time_s']:g} s, progress every {run['progress_interval_s']:g} s, lease TTL "
        f"{run['lease_ttl_s']:g} s, join window {run['join_window_s']:g} s; agent host processes ({hosts}) and one "
        "for the probe",
        f"rows: the probe job alone (the anchor), then J background jobs beside it; window = the probe's "
        f"{run['probe_cycles']} reclaim + {run['probe_cycles']} loss cycles, each followed by a grow",
        "",
        "## etcd",
        "",
        "| jobs | agents | window | puts/s | deletes/s | txns/s | watch events/s | lease renewals/s | leases | watchers "
        "| keys | CPU (cores) | RSS (peak) | DB before → after compact+defrag |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        r, g, e, end = s["rates"], s["gauges"], s["processes"]["etcd"], s["end"]
        lines.append(
            f"| {s['jobs']} | {(s['jobs'] + 1) * s['agents_per_job']} | {s['window_s']:.0f} s "
            f"| {r['etcd_mvcc_put_total']:.1f} | {r['etcd_mvcc_delete_total']:.1f} | {r['etcd_mvcc_txn_total']:.1f} "
            f"| {r['etcd_debugging_mvcc_events_total']:.1f} | {r['etcd_debugging_lease_renewed_total']:.1f} "
            f"| {s['leases']} | {g['etcd_debugging_mvcc_watcher_total']:.0f} | {g['etcd_debugging_mvcc_keys_total']:.0f} "
            f"| {e['cpu_cores']:.3f} | {e['rss_mb']:.0f} MB ({e['peak_rss_mb']:.0f}) "
            f"| {end['db_bytes_before'] / 2**20:.1f} → {end['db_bytes_after'] / 2**20:.1f} MB |"
        )
    lines += ["", "gRPC calls (streams) started per second, by method:", ""]
    for s in sizes:
        calls = sorted(s["grpc_per_s"].items(), key=lambda kv: -kv[1])
        lines.append(f"- {s['jobs']} jobs: " + ", ".join(f"{m} {v:.1f}" for m, v in calls))
    lines += [
        "",
        "## controller and probe job (re-form latency p50 / p99; ratio = p50 / p50 alone)",
        "",
        "| jobs | controller CPU (cores) | controller RSS (peak) | agent hosts CPU | bench CPU | load before "
        "| reclaim | × | loss | × | grow | × |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        p = s["processes"]
        c = p["controller"]
        host_cpu = p["agent_hosts"]["cpu_cores"] + p["probe_host"]["cpu_cores"]
        lines.append(
            f"| {s['jobs']} | {c['cpu_cores']:.3f} | {c['rss_mb']:.0f} MB ({c['peak_rss_mb']:.0f}) | {host_cpu:.2f} "
            f"| {p['bench']['cpu_cores']:.2f} | {s['load_before']:.1f} "
            + "".join(f"| {_latency(s, k)} | {_x(_ratio(s, alone, k))} " for k in KINDS)
            + "|"
        )
    lines += [
        "",
        "## per background job (what each adds over the probe alone)",
        "",
        "| jobs | etcd CPU ms/s | controller CPU ms/s | puts+deletes/s | watch events/s | lease renewals/s |",
        "|---|---|---|---|---|---|",
    ]
    for s in sizes[1:]:
        cells = [
            _per_job(s, alone, f)
            for f in (_cpu_ms("etcd"), _cpu_ms("controller"), _rate("etcd_mvcc_put_total", "etcd_mvcc_delete_total"),
                      _rate("etcd_debugging_mvcc_events_total"), _rate("etcd_debugging_lease_renewed_total"))
        ]  # fmt: skip
        lines.append(f"| {s['jobs']} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    lines += ["", f"Where it bends: {bend(sizes)}.", *_saturated(run), "", "## nothing left behind (after every job ended)", ""]
    lines += [
        "| jobs | ended jobs | jobs with keys left | keys left | kinds of keys left | tombstones | leases start → end | retention |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        end = s["end"]
        kinds = ", ".join(f"{k} {n}" for k, n in end["key_kinds"].items()) or "none"
        retention = f"{end['retention_s']:g} s"
        lines.append(
            f"| {s['jobs']} | {end['ended_jobs']} | {end['jobs_with_keys']} | {end['keys_left']} | {kinds} "
            f"| {end['tombstones']} | {end['leases_start']} → {end['leases_end']} | {retention} |"
        )
    lines += _profile_lines(sizes)
    if run["failed"]:
        f = run["failed"]
        lines += ["", f"**{f['jobs']} jobs did not run to the end** (after {f['after_s']:.0f} s): {f['error']}"]
    errors = [f"- {s['jobs']} jobs: {e}" for s in sizes for e in s["errors"][:5]]
    if errors:
        lines += ["", "Agent errors (first five per size):", *errors]
    return "\n".join(lines)


def _saturated(run: dict[str, Any]) -> list[str]:
    """A size whose agent hosts took more than ``HARNESS_SHARE`` of the machine is limited by
    the harness, not by etcd or the controller: say so beside the verdict."""
    out = []
    for s in run["sizes"]:
        p = s["processes"]
        cores = p["agent_hosts"]["cpu_cores"] + p["probe_host"]["cpu_cores"]
        if cores > HARNESS_SHARE * run["cpus"]:
            out.append(f"At {s['jobs']} jobs the agent hosts took {cores:.2f} of the {run['cpus']} cores: from there "
                       "this machine, not etcd or the controller, sets the pace.")  # fmt: skip
    return ["", *out] if out else []


def _profile_lines(sizes: Sequence[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for s in sizes:
        for name, profile in s["profiles"].items():
            if not profile["by_self"]:
                if profile.get("note"):
                    lines.append(f"- {s['jobs']} jobs, {name}: {profile['note']}")
                continue
            if not lines:
                lines = ["", "## profiles (share of the samples in a function; under it, in brackets)", ""]
            own = "; ".join(f"{h['function']} {100 * h['self_share']:.0f}%" for h in profile["by_self"][:6])
            under = "; ".join(f"{h['function']} {100 * h['total_share']:.0f}%" for h in profile["by_total"][:6])
            lines.append(f"- {s['jobs']} jobs, {name} ({profile['samples']} samples): in {own}. Under: {under}")
    return lines
