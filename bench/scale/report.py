"""``bench scale``'s numbers: what one chain's processes recorded, summarized per path
(the slowest rank's time, the bytes moved, the rate beside its floor's, the worst rank's
peak memory), and the tables and chart of docs/benchmarks.md."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from regroup.elastic.memory.snapshot_cost import interval_for

REFORMS = ("replace", "shrink-loss", "grow", "migrate", "shrink-planned")
GB = 1e9


def _members(records: list[list[dict[str, Any]]], path: str) -> list[dict[str, Any]]:
    return [r for proc in records for r in proc if r["path"] == path and r["member"]]


def _ratio(floor_s: float, seconds: float) -> float | None:
    """The path's rate over its floor's (the same bytes): floor time / path time (None: no floor run)."""
    return round(floor_s / seconds, 3) if seconds > 0 and floor_s > 0 else None


def summarize(wrap: str, size: str, params: int, records: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """One chain's processes' records as one row of the report."""
    start = _members(records, "start")
    state = max(r["state_bytes"] for r in start)
    share = max(r["share_bytes"] for r in start)
    steady = {id(proc): proc[0]["peak_rss"] for proc in records}
    baseline = {id(proc): proc[0]["extra"]["baseline_rss"] for proc in records}
    quiet = statistics.median(r["extra"]["step_s"] for r in start)
    busy = statistics.median(r["extra"]["step_with_snapshot_s"] for r in start)
    cost = max(0.0, busy - quiet) / quiet
    copy_s = max(r["extra"]["snapshot_copy_s"] for r in start)
    exchange_s = max(r["extra"]["snapshot_exchange_s"] for r in start)
    snapshot_bytes = max(r["extra"]["snapshot_bytes"] for r in start)
    row: dict[str, Any] = {
        "wrap": wrap,
        "size": size,
        "params": params,
        "ranks": len(records),
        "state_bytes": state,
        "share_bytes": share,
        "job_state_bytes": sum(r["share_bytes"] for r in start),
        "step_s": round(quiet, 4),
        "snapshot": {
            "bytes": snapshot_bytes,
            "copy_s": round(copy_s, 4),
            "copy_ratio": _ratio(max(r["extra"].get("floor_copy_s", 0.0) for r in start), copy_s),
            "exchange_s": round(exchange_s, 4),
            "exchange_ratio": _ratio(max(r["extra"].get("floor_exchange_s", 0.0) for r in start), exchange_s),
            "cost_share": round(cost, 4),
            "auto_wanted": interval_for(cost, 10**6).wanted,
            "host_x_state": round(max(r["extra"]["snapshot_host_bytes"] for r in start) / state, 3),
        },
        "steady_peak_x_state": round(max(r["peak_rss"] for r in start) / state, 2),
        "steady_peak_above_process_x_state": round(
            max(proc[0]["peak_rss"] - baseline[id(proc)] for proc in records) / state, 2
        ),
        "paths": {},
    }
    for path in REFORMS:
        members = _members(records, path)
        moved = sum(r["received_bytes"] for r in members)
        transfer = max(r["transfer_s"] for r in members)
        floor = max(r["extra"].get("floor_transfer_s", 0.0) for r in members)
        peaks = [(r["peak_rss"], steady[id(proc)]) for proc in records for r in proc if r in members]
        entry = {
            "world": f"{members[0]['old_world']}->{members[0]['world']}",
            "moved_bytes": moved,
            "max_rank_bytes": max(r["received_bytes"] for r in members),
            "seconds": round(max(r["seconds"] for r in members), 4),
            "transfer_s": round(transfer, 4),
            "gbps": round(moved / transfer / GB, 3) if transfer > 0 else None,
            "floor_ratio": _ratio(floor, transfer) if moved else None,
            "peak_x_steady": round(max(p / s for p, s in peaks), 3),
            "peak_x_state": round(max(p for p, _ in peaks) / state, 2),
            "worst_storage_ratio": max(r["storage"]["worst_ratio"] for r in members),
        }
        if path in ("migrate", "shrink-planned"):
            handoff = max(r["extra"]["handoff_s"] for r in members)
            handed = max(
                (r["extra"].get("handoff_bytes", 0) for proc in records for r in proc if r["path"] == path), default=0
            )
            floor_handoff = max(r["extra"].get("floor_handoff_s", 0.0) for r in members)
            entry["handoff"] = {
                "bytes": handed,
                "seconds": round(handoff, 4),
                "floor_ratio": _ratio(floor_handoff, handoff) if handed else None,
            }
        row["paths"][path] = entry
    load = _members(records, "load")
    saved = max(load, key=lambda r: r["extra"].get("save_s", 0.0))["extra"]
    load_s = max(r["seconds"] for r in load)
    row["dcp"] = {
        "bytes": saved["checkpoint_bytes"],
        "save_s": round(saved["save_s"], 4),
        "save_ratio": _ratio(saved.get("floor_write_s", 0.0), saved["save_s"]),
        "load_s": round(load_s, 4),
        "load_ratio": _ratio(saved.get("floor_read_s", 0.0), load_s),
        "async_staged_s": round(saved["async_staged_s"], 4),
        "async_extra_x_state": round(saved["async_save_extra_rss"] / state, 2),
        "load_peak_x_steady": round(max(r["peak_rss"] for r in load) / max(steady.values()), 3),
        "worst_storage_ratio": max(r["storage"]["worst_ratio"] for r in load),
    }
    return row


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render(rows: list[dict[str, Any]], notes: list[str], machine: str) -> str:
    """The report's tables, as Markdown."""
    lines = [
        "| wrap | model | state per rank | job's state | step | snapshot copy (x floor) | exchange (x floor) "
        "| snapshot cost / step | auto wants | steady peak / state (above the process) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        snap = row["snapshot"]
        lines.append(
            f"| {row['wrap']} | {row['size']} ({row['params'] / 1e6:.0f}M) | {_mb(row['state_bytes'])} "
            f"| {_mb(row['job_state_bytes'])} | {row['step_s']:.2f} s | {snap['copy_s']:.3f} s ({_x(snap['copy_ratio'])}) "
            f"| {snap['exchange_s']:.3f} s ({_x(snap['exchange_ratio'])}) | {snap['cost_share']:.1%} "
            f"| every {snap['auto_wanted']} | {row['steady_peak_x_state']:.1f}x "
            f"({row['steady_peak_above_process_x_state']:.1f}x) |"
        )
    lines += [
        "",
        "| wrap | model | path | world | moved (all ranks) | transfer | GB/s | x floor | re-form total "
        "| peak / steady | peak / state | storage |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for path, p in row["paths"].items():
            lines.append(
                f"| {row['wrap']} | {row['size']} | {path} | {p['world']} | {_mb(p['moved_bytes'])} "
                f"| {p['transfer_s']:.3f} s | {p['gbps'] or 0:.2f} | {_x(p['floor_ratio'])} | {p['seconds']:.2f} s "
                f"| {p['peak_x_steady']:.2f} | {p['peak_x_state']:.1f}x | {p['worst_storage_ratio']:.2f} |"
            )
    lines += [
        "",
        "| wrap | model | hand-off at the boundary (migrate) | x floor | secured before the ack (planned shrink) "
        "| x floor | DCP save (sync) | x floor | DCP load | x floor | async staging | async extra memory / state |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        handoff = row["paths"]["migrate"].get("handoff", {})
        secured = row["paths"]["shrink-planned"].get("handoff", {})
        dcp = row["dcp"]
        lines.append(
            f"| {row['wrap']} | {row['size']} | {_mb(handoff.get('bytes', 0))} in {handoff.get('seconds', 0):.3f} s "
            f"| {_x(handoff.get('floor_ratio'))} | {_mb(secured.get('bytes', 0))} in {secured.get('seconds', 0):.3f} s "
            f"| {_x(secured.get('floor_ratio'))} | {_mb(dcp['bytes'])} in {dcp['save_s']:.2f} s | {_x(dcp['save_ratio'])} "
            f"| {dcp['load_s']:.2f} s | {_x(dcp['load_ratio'])} | {dcp['async_staged_s']:.2f} s "
            f"| {dcp['async_extra_x_state']:.2f}x |"
        )
    lines += ["", f"Machine: {machine}."]
    lines += [f"- {note}" for note in notes]
    return "\n".join(lines)


def chart(rows: list[dict[str, Any]], path: Path) -> None:
    """Each path's rate over its floor's, and its peak memory over the steady state's,
    against the job's state size; one line per wrapper and path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rates, peaks) = plt.subplots(1, 2, figsize=(11, 4.2))
    for wrap, style in (("fsdp", "-"), ("ddp", "--")):
        mine = sorted((r for r in rows if r["wrap"] == wrap), key=lambda r: r["job_state_bytes"])
        if not mine:
            continue
        sizes = [r["job_state_bytes"] / GB for r in mine]
        for reform in REFORMS:
            ratios = [r["paths"][reform]["floor_ratio"] for r in mine]
            label = f"{wrap} {reform}"
            if any(v is not None for v in ratios):
                rates.plot(sizes, [v or float("nan") for v in ratios], style, marker="o", label=label)
            peaks.plot(sizes, [r["paths"][reform]["peak_x_steady"] for r in mine], style, marker="o", label=label)
        rates.plot(sizes, [r["dcp"]["save_ratio"] or float("nan") for r in mine], style, marker="s", label=f"{wrap} DCP save")
    rates.axhline(0.5, color="grey", linewidth=0.8)
    ratios = [p["floor_ratio"] for r in rows for p in r["paths"].values() if p["floor_ratio"]]
    ratios += [r["dcp"]["save_ratio"] for r in rows if r["dcp"]["save_ratio"]]
    rates.set(xscale="log" if ratios else "linear", xlabel="job's model + optimizer state (GB)",
              ylabel="rate / raw floor's rate", ylim=(0, max([1.3, *ratios]) + 0.1))  # fmt: skip
    rates.set_title("Each path against the same bytes through the raw floor")
    peaks.axhline(1.5, color="grey", linewidth=0.8)
    peaks.set(xscale="log", xlabel="job's model + optimizer state (GB)", ylabel="peak RSS / steady peak", ylim=(0, 1.8))
    peaks.set_title("A re-form's peak memory against steady training")
    rates.legend(fontsize=6, ncol=2, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
