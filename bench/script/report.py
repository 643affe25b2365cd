"""What ``bench script`` prints: the run's conditions (load, same training, other
processes), the markdown tables of the variants compared and, with ``--profile``, rank 0's
functions and threads."""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from bench.script.logs import same_training
from bench.script.summary import METRICS
from bench.script.variants import VARIANTS, WORLD, Settings


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f} ms"


def table(
    summary: Mapping[str, Mapping[str, Any]],
    label: str = "with the API (regroup-run, etcd)",
    base: str = "without (plain torchrun)",
) -> list[str]:
    """The markdown table of ``compare``'s result."""
    lines = [
        f"| per step | {base} | {label} | with − without | with / without | per-round ratios |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in METRICS:
        if key not in summary:
            continue
        s = summary[key]
        ratio = f"{s['ratio']:.3f}" if s["ratio"] is not None else "n/a"
        spread = f"{s['ratio_range'][0]:.3f} – {s['ratio_range'][1]:.3f}" if s["ratio_range"] else "n/a"
        lines.append(
            f"| {label} | {_ms(s['without'])} ({_ms(s['without_range'][0])} – {_ms(s['without_range'][1])}) "
            f"| {_ms(s['with'])} ({_ms(s['with_range'][0])} – {_ms(s['with_range'][1])}) "
            f"| {s['delta'] * 1e3:+.1f} ms | {ratio} | {spread} |"
        )
    return lines


def print_report(result: Mapping[str, Any], settings: Settings, rounds: int, profile_clock: str) -> None:
    """Print ``measure``'s result: what the runs ran under, then the tables."""
    print(
        f"FSDP2 example, {WORLD} ranks (1 per node), global batch {settings.global_batch}, "
        f"{settings.steps} steps per run, first {settings.warmup} dropped, {rounds} rounds (without, with) "
        f"alternated; load average {result['loadavg']['start']} at the start, {result['loadavg'].get('end')} "
        f"at the end; {result['rounds_redone']} rounds run again"
    )
    losses = {r[v]["first_loss"] for r in result["rounds"] for v in r} - {None}
    reference = next(iter(losses), None)
    mismatched = [loss for loss in losses if not same_training(reference, loss)]
    if mismatched:
        print(f"warning: the first step's loss differs between runs ({sorted(losses)}): not the same training")
    elif reference is not None:
        unread = sum(r[v]["first_loss"] is None for r in result["rounds"] for v in r)
        print(
            f"same training: the first step's loss is {reference:.6g} in every run"
            + (f" ({unread} runs' could not be read)" if unread else "")
        )
    exits = [f for r in result["rounds"] for v in r for f in r[v].get("failed_after_training", [])]
    if exits:
        print(f"{len(exits)} runs had a process fail after its last step (kept: every step was logged): {exits}")
    busy = [r[v]["others_cores"] for r in result["rounds"] for v in r if "others_cores" in r[v]]
    if busy:
        print(
            f"other processes kept {statistics.median(busy):.2f} cores busy during the measured windows "
            f"(median over runs; max {max(busy):.2f})"
        )
    print("\n".join(table(result["summary"])))
    if "summary_synced" in result:
        print("\nAgainst the plain loop that all-reduces its loss every step:")
        print("\n".join(table(result["summary_synced"], base="without, loss all-reduced (torchrun)")))
        print("\nThat loop against the plain one (what one small all-reduce per step does here):")
        print(
            "\n".join(
                table(result["summary_synced_vs_plain"], "without, loss all-reduced (torchrun)", "without (torchrun)")
            )
        )
    if "summary_no_snapshots" in result:
        print("\nThe same example without snapshots (snapshot_every=0), against the same anchor runs:")
        print("\n".join(table(result["summary_no_snapshots"], "with the API, no snapshots")))
    if result["profile"]:
        for variant in VARIANTS:
            prof = result["profile"][variant]
            print(
                f"\ncProfile ({profile_clock} time), rank 0's main thread, {variant} the API "
                f"({prof['summary']['step_s'] * 1e3:.1f} ms/step under the profiler):"
            )
            print("| function | cumulative ms/step | own ms/step | calls/step |\n|---|---|---|---|")
            for name, cum, own, calls in prof["rows"]:
                print(f"| {name} | {cum:.2f} | {own:.2f} | {calls} |")
        print("\nRank 0's threads, CPU ms per step (profiled runs; the main thread is slowed by the profiler):")
        threads = {v: result["profile"][v]["threads_cpu_per_step"] for v in VARIANTS}
        names = list(dict.fromkeys([*threads["with"], *threads["without"]]))
        print("| thread | without | with |\n|---|---|---|")
        for name in names:
            cells = [threads[v].get(name) for v in VARIANTS]
            print(f"| {name} | " + " | ".join("-" if c is None else f"{c * 1e3:.2f}" for c in cells) + " |")
