"""What ``bench reform`` measures in a recorded run, and the tables it prints: each metric
beside its goal and its ratio to the reference mode, and every new world with how it was
reached and where its resume time went."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from regroup.demo.analysis import RunData, event_impacts, goodput, scripted_events
from regroup.demo.resizes import reform_latencies, training_at, world_changes
from regroup.demo.strategy import round_strategies
from regroup.records import Progress


@dataclass(frozen=True)
class Metric:
    """One row of the table."""

    key: str
    label: str
    unit: str
    """``s``, ``steps`` or ``%``."""
    goal: float | None = None
    """At most this (``s``) or at least this (``%``)."""


METRICS: tuple[Metric, ...] = (
    Metric("reclaim_s", "planned reclaim: taint -> training at {reclaim_ranks}", "s", 1.5),
    Metric("reclaim_lost_steps", "planned reclaim: steps lost", "steps"),
    Metric("migrate_s", "planned reclaim, a spare waiting: taint -> first step on the spare, at {migrate_ranks}", "s", 1.0),
    Metric("migrate_lost_steps", "planned reclaim, a spare waiting: steps lost", "steps"),
    Metric("loss_s", "abrupt loss: kill -> training at {loss_ranks}", "s", 1.5),
    Metric("loss_lost_steps", "abrupt loss: steps lost", "steps"),
    Metric("replace_s", "abrupt loss, a spare waiting: kill -> first step at the same size, {replace_ranks}", "s", 1.5),
    Metric("replace_lost_steps", "abrupt loss, a spare waiting: steps lost", "steps"),
    Metric("silent_s", "silent death (nothing written to the API): kill -> training at {silent_ranks}", "s", 2.0),
    Metric("silent_lost_steps", "silent death: steps lost", "steps"),
    Metric("grow_s", "grow: join window closed -> training at {grow_ranks}", "s", 2.0),
    Metric("grow_lost_steps", "grow: steps lost", "steps"),
    Metric("evict_s", "eviction: evicted -> training at {evict_ranks}", "s", 1.5),
    Metric("evict_lost_steps", "eviction: steps lost", "steps"),
    Metric("drain_s", "drain: cordon and eviction -> training at {drain_ranks}", "s", 1.5),
    Metric("drain_lost_steps", "drain: steps lost", "steps"),
    Metric("flaky_s", "flaky node: seconds without training", "s", 10.0),
    Metric("flaky_lost_steps", "flaky node: steps lost", "steps"),
    Metric("goodput", "goodput (useful training time / wall time)", "%", 0.90),
)
_EVENT_KEYS = {
    "reclaim": "reclaim", "evict": "evict", "drain": "drain", "lose": "loss", "vanish": "silent", "restore": "grow",
    "uncordon": "grow",
}  # fmt: skip
_SAME_SIZE_KEYS = {"reclaim": "migrate", "lose": "replace"}
"""A reclaim or a loss the script answers at the same size (a spare waited): its own rows,
measured to the first step of the new round at that size (the first step on the spare)."""
_RANK_KEYS = tuple(
    f"{key}_ranks" for key in ("reclaim", "migrate", "loss", "replace", "silent", "grow", "evict", "drain")
)
_SPARE_KEYS = tuple(f"{key}_{what}" for key in _SAME_SIZE_KEYS.values() for what in ("s", "lost_steps"))


def measure(run: RunData, join_window: float) -> dict[str, Any]:
    """The metrics of one recorded run, keyed as ``METRICS``. A key is absent for an event
    the run did not play; None means the new size never came (latencies) or the job was
    not training (flaky, with ``flaky_note``)."""
    out: dict[str, Any] = {"mode": run.meta.get("mode_label", run.mode), "run": str(run.root), "goodput": goodput(run)}
    latencies = reform_latencies(run, join_window)
    for latency in latencies:
        key = _EVENT_KEYS[latency.event.reason]
        if latency.ranks_after == latency.ranks_before:
            key = _SAME_SIZE_KEYS.get(latency.event.reason, key)
        if f"{key}_s" in out:
            continue  # a scenario with two of a kind: the table shows the first, the events list all
        out[f"{key}_s"] = latency.seconds
        out[f"{key}_lost_steps"] = latency.lost_steps
        out[f"{key}_ranks"] = f"{latency.ranks_after} ranks (from {latency.ranks_before})"
        out[f"{key}_from"] = latency.start_from
    # Each event's stand-still is looked for until the next scripted event of any kind (a
    # flaky node's crashes after a restore are not the restore's).
    scripted = sorted(e.time for e in scripted_events(run))
    ends = [next((t for t in scripted if t > lat.event.time), run.ended_at) for lat in latencies]
    out["events"] = [
        {
            "event": latency.event.reason,
            "nodes": list(latency.event.nodes),
            "at_s": round(latency.event.time - run.started_at, 2),
            "ranks_before": latency.ranks_before,
            "ranks_after": latency.ranks_after,
            "measured_from": latency.start_from,
            "measured_from_s": round(latency.start - run.started_at, 2),
            "seconds": None if latency.seconds is None else round(latency.seconds, 3),
            "lost_steps": latency.lost_steps,
            "longest_gap_s": longest_gap(run, latency.event.time, end),
        }
        for latency, end in zip(latencies, ends)
    ]
    flaky = next((i for i in event_impacts(run) if i.event.reason == "flaky"), None)
    if flaky is not None:
        trained = training_at(run, flaky.event.time)
        out["flaky_s"] = flaky.downtime if trained else None
        out["flaky_lost_steps"] = flaky.lost_steps if trained else None
        if not trained:
            out["flaky_note"] = "not training when the node turned flaky"
    strategies = round_strategies(run)
    out["world_changes"] = [
        {
            "at_s": round(change.at - run.started_at, 2),
            "round": change.round,
            "ranks": f"{change.ranks_before}->{change.ranks_after}",
            "cause": change.cause,
            "planned": change.planned,
            "mode": change.mode,
            "plan_mode": change.plan_mode,
            "strategy": strategies[change.round].describe() if change.round in strategies else "",
            "resume_phases": change.resume_phases,
        }
        for change in world_changes(run)
    ]
    return out


def longest_gap(run: RunData, start: float, end: float) -> float | None:
    """The longest time between two progress records from ``start`` to ``end`` (the
    record just before ``start`` included, ``end`` counted as one): how long training stood
    still at most around an event, a stop that lasted until ``end`` included. Records come
    every ``etcd.progress_interval``, so that is its resolution."""
    times = [p.time for p in run.progress if p.time < end]
    before = [t for t in times if t <= start]
    times = before[-1:] + [t for t in times if t > start] + [end]
    if len(times) < 2:
        return None
    return round(max(b - a for a, b in zip(times, times[1:])), 3)


def event_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: every scripted event of every mode, with the seconds to the new size,
    the steps lost and the longest stand-still until the next event."""
    rows = [
        "| mode | event | t (s) | measured from | to the new size | steps lost | longest gap between steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for e in result["events"]:
            seconds = "never" if e["seconds"] is None else _seconds(e["seconds"])
            gap = "-" if e.get("longest_gap_s") is None else _seconds(e["longest_gap_s"])
            rows.append(
                f"| {result['mode']} | {e['event']} {', '.join(e['nodes'])} | {e['at_s']} | {e['measured_from']} "
                f"| {seconds} ({e['ranks_before']}->{e['ranks_after']} ranks) | {e['lost_steps']} | {gap} |"
            )
    return rows


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if abs(value) < 10 else f"{value:.1f} s"


def format_value(metric: Metric, value: float | None, missing: str = "never") -> str:
    if value is None:
        return missing
    if metric.unit == "s":
        return _seconds(value)
    if metric.unit == "%":
        return f"{value:.0%}"
    return str(int(value))


def versus(metric: Metric, ours: float | None, theirs: float | None, missing: str = "never") -> str:
    """``theirs`` with its ratio to ``ours``: ``8.9 s (6.8x)``, ``never (-)``."""
    text = format_value(metric, theirs, missing)
    if theirs is None or ours is None or ours == 0:
        return f"{text} (-)"
    return f"{text} ({theirs / ours:.1f}x)" if metric.unit != "%" else f"{text} ({theirs / ours:.2f}x)"


def goal_met(metric: Metric, value: float | None) -> str:
    if metric.goal is None:
        return ""
    if value is None:
        return "**no**"
    met = value >= metric.goal if metric.unit == "%" else value <= metric.goal
    return "yes" if met else "**no**"


def _goal_text(metric: Metric) -> str:
    if metric.goal is None:
        return ""
    return f">= {metric.goal:.0%}" if metric.unit == "%" else f"<= {metric.goal:g} s"


def metric_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: one per metric, one column per mode; the first mode is the reference."""
    ours = results[0]
    modes = [r["mode"] for r in results]
    head = f"| metric | goal | {ours['mode']} |" + "".join(f" {m} (x {ours['mode']}) |" for m in modes[1:])
    rows = [head + f" {ours['mode']} meets the goal? |", "|---" * (len(results) + 3) + "|"]
    footnotes: list[str] = []
    for metric in METRICS:
        if all(metric.key not in r for r in results):
            continue
        label = metric.label.format(**{k: _ranks(results, k) for k in _RANK_KEYS})
        cells = [format_value(metric, ours.get(metric.key), _absent(ours, metric))]
        for other in results[1:]:
            cells.append(versus(metric, ours.get(metric.key), other.get(metric.key), _absent(other, metric)))
        ranks_key = f"{metric.key.removesuffix('_s')}_ranks"
        if metric.unit == "s" and ranks_key in ours:
            # A mode that went through other sizes than the label's says which.
            for i, result in enumerate(results[1:], 1):
                if ranks_key in result and result[ranks_key] != ours[ranks_key]:
                    cells[i] += f", at {result[ranks_key]}"
        if metric.key == "grow_s":
            for i, result in enumerate(results):
                mark = _grow_mark(result)
                if mark is not None:
                    cells[i] += f" {mark[0]}"
                    if mark[1] not in footnotes:
                        footnotes.append(mark[1])
        met = goal_met(metric, ours.get(metric.key)) if metric.key in ours else ""
        rows.append(f"| {label} | {_goal_text(metric)} | {' | '.join(cells)} | {met} |")
    return rows + ([""] + footnotes if footnotes else [])


def _ranks(results: Sequence[dict[str, Any]], key: str) -> str:
    """The sizes a row's label names: the reference's, else the first mode's that played it
    (a spare's rows, where the reference kept none)."""
    return str(next((r[key] for r in results if key in r), "?"))


def _grow_mark(result: dict[str, Any]) -> tuple[str, str] | None:
    """The mark and footnote of a grow measured from elsewhere than a grow plan's decision."""
    grow_from = str(result.get("grow_from", ""))
    if grow_from.endswith(" + join window"):
        return "†", "† no grow plan (no controller): measured from the restore + the scenario's join window."
    if grow_from == "launch":
        note = "‡ torchft has no grow plan (a fresh replica joins the next quorum): measured from its launch"
        return "‡", note + " at the restore."
    return None


def notes(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown list items: what a mode's numbers need to be read with (its ``*_note`` keys)
    and the events it could not play."""
    lines = []
    for result in results:
        for key in sorted(k for k in result if k.endswith("_note")):
            lines.append(f"- {result['mode']}: {key.removesuffix('_note')}: {result[key]}")
        for item in result.get("not_played", []):
            lines.append(f"- {result['mode']}: not played: {item}")
    return lines


def _absent(result: dict[str, Any], metric: Metric) -> str:
    """What a run shows for a metric it has no value for."""
    if metric.key not in result:
        if metric.key in _SPARE_KEYS:
            return "no spare"
        event, _, what = metric.key.partition("_")
        spare_key = {"reclaim": "migrate", "loss": "replace"}.get(event)
        return "a spare took over" if spare_key and f"{spare_key}_{what}" in result else "not played"
    return "not training" if metric.key.startswith("flaky") else "never"


def world_change_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: every new world of every mode, with how it was reached and the resume split.

    ``workers`` is the trainer's word; where the controller's plan recorded another mode,
    the plan's follows in brackets. The cause carries the plan's strategy where it recorded
    one (``replace``, ``migrate`` or ``elastic``, with the positions handed over).
    """
    rows = ["| mode | t (s) | round | cause | ranks | workers | resume split (s) |", "|---|---|---|---|---|---|---|"]
    for result in results:
        for change in result["world_changes"]:
            phases = change["resume_phases"]
            split = ", ".join(f"{p} {phases[p]:.2f}" for p in _ordered(phases))
            total = f" = {sum(phases.values()):.2f}" if phases else ""
            cause = change["cause"] or "(no plan)"
            how = ", ".join(filter(None, ["planned" if change["cause"] and change["planned"] else "",
                                          change.get("strategy", "")]))  # fmt: skip
            if how:
                cause += f" ({how})"
            workers = change["mode"] or "?"
            if change["cause"] and change["plan_mode"] != change["mode"]:
                workers += f" (plan: {change['plan_mode'] or 'none'})"
            rows.append(
                f"| {result['mode']} | {change['at_s']:.1f} | {change['round'] or '-'} | {cause} | {change['ranks']} "
                f"| {workers} | {split or '-'}{total} |"
            )
    return rows


def _ordered(phases: dict[str, float]) -> list[str]:
    rank = {name: i for i, name in enumerate(Progress.RESUME_PHASES)}
    return sorted(phases, key=lambda p: (rank.get(p, len(rank)), p))


def mode_counts(results: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for result in results:
        changes = result["world_changes"]
        counts: dict[str, int] = {}
        for change in changes:
            mode = change["mode"] or "not reported"
            counts[mode] = counts.get(mode, 0) + 1
        detail = ", ".join(f"{n} {mode}" for mode, n in sorted(counts.items()))
        counted = f"- {result['mode']}: {len(changes)} new worlds after the first"
        lines.append(counted + (f": {detail}" if detail else ""))
    return lines


def render(results: Sequence[dict[str, Any]], header: Sequence[str]) -> str:
    return "\n".join(
        [
            *header,
            "",
            *metric_table(results),
            "",
            *(["Notes:", "", *notes(results), ""] if notes(results) else []),
            "Every scripted event (the table above shows the first of a kind):",
            "",
            *event_table(results),
            "",
            "New worlds, as the trainer's rank 0 reported them (cause: the controller's plan for that round):",
            "",
            *world_change_table(results),
            "",
            *mode_counts(results),
        ]
    )
