"""The run's tables (stdout and ``platform.md``) and its numbers (``platform.json``).

The first size of each etcd auth mode is the probe job alone: the anchor every latency ratio
of that mode divides by. A background job's cost is what its size adds to its mode's anchor,
divided by its jobs; with both modes, the per-job table sets auth off and on side by side
and divides on by off. Where it bends, per mode, is the first size whose etcd or controller
CPU per background job is more than ``BEND`` times that of the smallest loaded size, or
whose probe p50 is more than ``BEND`` times the probe's alone.
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


def _ratio_of(on: float | None, off: float | None) -> float | None:
    return on / off if on is not None and off and off > 0 else None


def _label(size: dict[str, Any]) -> str:
    return f"{size['jobs']} jobs, auth {size['auth']}"


def of_mode(sizes: Sequence[dict[str, Any]], mode: str) -> list[dict[str, Any]]:
    """The sizes of one auth mode, the probe alone first."""
    return [s for s in sizes if s["auth"] == mode]


def bend(sizes: Sequence[dict[str, Any]]) -> str:
    """Where the platform stops scaling linearly, by the rule in the module docstring (the
    sizes of one auth mode, the probe alone first)."""
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


PER_JOB = {
    "etcd CPU ms/s": _cpu_ms("etcd"),
    "controller CPU ms/s": _cpu_ms("controller"),
    "puts+deletes/s": _rate("etcd_mvcc_put_total", "etcd_mvcc_delete_total"),
    "watch events/s": _rate("etcd_debugging_mvcc_events_total"),
    "lease renewals/s": _rate("etcd_debugging_lease_renewed_total"),
}
"""What each background job adds, by column."""
SIDE_BY_SIDE = ("etcd CPU ms/s", "controller CPU ms/s")
"""With both auth modes, the columns shown off, on and on/off."""


def per_job(sizes: Sequence[dict[str, Any]]) -> dict[tuple[int, str], dict[str, float]]:
    """(jobs, auth) -> what each background job adds over its mode's probe alone, by ``PER_JOB`` column."""
    out = {}
    for mode in ("off", "on"):
        mine = of_mode(sizes, mode)
        if not mine or mine[0]["jobs"] != 0:
            continue
        alone = mine[0]
        for size in mine[1:]:
            out[(size["jobs"], mode)] = {name: _per_job(size, alone, f) for name, f in PER_JOB.items()}
    return out


def _per_job_lines(sizes: Sequence[dict[str, Any]]) -> list[str]:
    costs = per_job(sizes)
    both = {mode for _, mode in costs} == {"off", "on"}
    lines = ["", "## per background job (what each adds over the probe alone of its auth mode)", ""]
    if not both:
        lines += ["| jobs | auth | " + " | ".join(PER_JOB) + " |", "|---|---|" + "---|" * len(PER_JOB)]
        for (jobs, mode), cells in costs.items():
            lines.append(f"| {jobs} | {mode} | " + " | ".join(f"{c:.2f}" for c in cells.values()) + " |")
        return lines
    rest = [name for name in PER_JOB if name not in SIDE_BY_SIDE]
    head = "".join(f"| {name} off | on | on/off " for name in SIDE_BY_SIDE) + "".join(f"| {n} off / on " for n in rest)
    lines += [f"| jobs {head}|", "|---|" + "---|" * (3 * len(SIDE_BY_SIDE) + len(rest))]
    for jobs in sorted({jobs for jobs, _ in costs}):
        off, on = costs.get((jobs, "off")), costs.get((jobs, "on"))

        def cell(side: dict[str, float] | None, name: str) -> str:
            return "-" if side is None else f"{side[name]:.2f}"

        row = f"| {jobs} "
        for name in SIDE_BY_SIDE:
            ratio = _ratio_of(on[name] if on else None, off[name] if off else None)
            row += f"| {cell(off, name)} | {cell(on, name)} | {_x(ratio)} "
        row += "".join(f"| {cell(off, n)} / {cell(on, n)} " for n in rest)
        lines.append(row + "|")
    return lines


def _identities(end: dict[str, Any]) -> str:
    left = end.get("identities_left")
    if left is None:
        return "-"
    return f"{len(left['users'])} / {len(left['roles'])}"


def render(run: dict[str, Any]) -> str:
    sizes = run["sizes"]
    alones = {s["auth"]: s for s in sizes if s["jobs"] == 0}
    counts = {s["jobs"]: s["processes"]["agent_hosts"]["count"] for s in sizes if s["jobs"]}
    hosts = ", ".join(f"{jobs} jobs: {n}" for jobs, n in sorted(counts.items()))
    order = " then ".join(dict.fromkeys(s["auth"] for s in sizes))
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
        "etcd auth: off = plain HTTP, no users; on = TLS with --client-cert-auth, the controller's certificate "
        f"(--etcd-job-identities) and one certificate, user and role per job; each size ran {order}, each on a "
        "fresh platform",
        "",
        "## etcd",
        "",
        "| jobs | auth | agents | window | puts/s | deletes/s | txns/s | watch events/s | lease renewals/s | leases "
        "| watchers | keys | CPU (cores) | RSS (peak) | DB before → after compact+defrag |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        r, g, e, end = s["rates"], s["gauges"], s["processes"]["etcd"], s["end"]
        lines.append(
            f"| {s['jobs']} | {s['auth']} | {(s['jobs'] + 1) * s['agents_per_job']} | {s['window_s']:.0f} s "
            f"| {r['etcd_mvcc_put_total']:.1f} | {r['etcd_mvcc_delete_total']:.1f} | {r['etcd_mvcc_txn_total']:.1f} "
            f"| {r['etcd_debugging_mvcc_events_total']:.1f} | {r['etcd_debugging_lease_renewed_total']:.1f} "
            f"| {s['leases']} | {g['etcd_debugging_mvcc_watcher_total']:.0f} | {g['etcd_debugging_mvcc_keys_total']:.0f} "
            f"| {e['cpu_cores']:.3f} | {e['rss_mb']:.0f} MB ({e['peak_rss_mb']:.0f}) "
            f"| {end['db_bytes_before'] / 2**20:.1f} → {end['db_bytes_after'] / 2**20:.1f} MB |"
        )
    lines += ["", "gRPC calls (streams) started per second, by method:", ""]
    for s in sizes:
        calls = sorted(s["grpc_per_s"].items(), key=lambda kv: -kv[1])
        lines.append(f"- {_label(s)}: " + ", ".join(f"{m} {v:.1f}" for m, v in calls))
    lines += [
        "",
        "## controller and probe job (re-form latency p50 / p99; ratio = p50 / p50 alone, same auth)",
        "",
        "| jobs | auth | controller CPU (cores) | controller RSS (peak) | agent hosts CPU | bench CPU | load before "
        "| reclaim | × | loss | × | grow | × |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        p = s["processes"]
        c = p["controller"]
        host_cpu = p["agent_hosts"]["cpu_cores"] + p["probe_host"]["cpu_cores"]
        alone = alones.get(s["auth"], s)
        lines.append(
            f"| {s['jobs']} | {s['auth']} | {c['cpu_cores']:.3f} | {c['rss_mb']:.0f} MB ({c['peak_rss_mb']:.0f}) "
            f"| {host_cpu:.2f} | {p['bench']['cpu_cores']:.2f} | {s['load_before']:.1f} "
            + "".join(f"| {_latency(s, k)} | {_x(_ratio(s, alone, k))} " for k in KINDS)
            + "|"
        )
    lines += _per_job_lines(sizes)
    lines.append("")
    for mode in ("off", "on"):
        mine = of_mode(sizes, mode)
        if mine and mine[0]["jobs"] == 0:
            lines.append(f"Where it bends, auth {mode}: {bend(mine)}.")
    lines += [*_saturated(run), "", "## nothing left behind (after every job ended)", ""]
    lines += [
        "| jobs | auth | ended jobs | jobs with keys left | keys left | kinds of keys left | tombstones "
        "| leases start → end | job users / roles left | retention |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sizes:
        end = s["end"]
        kinds = ", ".join(f"{k} {n}" for k, n in end["key_kinds"].items()) or "none"
        retention = f"{end['retention_s']:g} s"
        lines.append(
            f"| {s['jobs']} | {s['auth']} | {end['ended_jobs']} | {end['jobs_with_keys']} | {end['keys_left']} "
            f"| {kinds} | {end['tombstones']} | {end['leases_start']} → {end['leases_end']} | {_identities(end)} "
            f"| {retention} |"
        )
    lines += _profile_lines(sizes)
    for f in run["failed"]:
        lines += ["", f"**{f['jobs']} jobs, auth {f['auth']} did not run to the end** (after {f['after_s']:.0f} s): "
                  f"{f['error']}; no larger size ran with auth {f['auth']}"]  # fmt: skip
    errors = [f"- {_label(s)}: {e}" for s in sizes for e in s["errors"][:5]]
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
            out.append(f"At {_label(s)} the agent hosts took {cores:.2f} of the {run['cpus']} cores: from there "
                       "this machine, not etcd or the controller, sets the pace.")  # fmt: skip
    return ["", *out] if out else []


def _profile_lines(sizes: Sequence[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for s in sizes:
        for name, profile in s["profiles"].items():
            if not profile["by_self"]:
                if profile.get("note"):
                    lines.append(f"- {_label(s)}, {name}: {profile['note']}")
                continue
            own = "; ".join(f"{h['function']} {100 * h['self_share']:.0f}%" for h in profile["by_self"][:6])
            under = "; ".join(f"{h['function']} {100 * h['total_share']:.0f}%" for h in profile["by_total"][:6])
            lines.append(f"- {_label(s)}, {name} ({profile['samples']} samples): in {own}. Under: {under}")
    return ["", "## profiles (share of the samples in a function; under it, in brackets)", "", *lines] if lines else []
