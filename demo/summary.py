"""A run's headline numbers (``RunSummary``) and the one-screen summary printed at the end
of ``regroup demo``; the HTML report (``regroup.demo.report``) shows the same numbers."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path

from regroup.demo.analysis import (
    RunData,
    ScriptedEvent,
    continuity_errors,
    cordoned_nodes,
    event_impacts,
    goodput,
    not_settled,
    reform_label,
    reform_rows,
    run_interruptions,
    run_reforms,
)
from regroup.demo.strategy import NOT_RECORDED, strategy_counts
from regroup.demo.throughput import throughput_around_events
from regroup.trace_report import Reform, format_table


@dataclass(frozen=True)
class RunSummary:
    """The headline numbers of one run."""

    mode: str
    wall_s: float
    final_step: int
    goodput: float
    lost_steps: int
    interruptions: int
    reforms: int
    """Every re-form: the controller's traces and the worlds the agents formed on their own."""
    cordoned: tuple[str, ...]
    """The nodes the controller cordoned for a restart storm (a drain's cordon is not one)."""
    continuous: bool
    reclaim_lost_steps: int | None
    """Steps lost to the scripted planned leaves (spot reclaims, evictions, drains), from
    progress (None: the scenario has none)."""
    strategies: dict[str, int] = field(default_factory=dict)
    """Re-forms by strategy (replace, migrate, elastic, and not recorded); {} where the run
    recorded none."""
    not_settled: tuple[str, ...] = ()
    """``NotSettled``: each time the run gave up waiting for its job to settle, when and why."""


PLANNED_LEAVES = ("reclaim", "evict", "drain")
"""Scripted events that give notice: a reclaim taint, an eviction, a drain (its grace)."""


def _not_settled_text(run: RunData, event: ScriptedEvent) -> str:
    return f"at {event.time - run.started_at:.0f} s: {event.message}"


def summarize(run: RunData) -> RunSummary:
    reforms = run_reforms(run)
    stops = run_interruptions(run)
    reclaims = [i for i in event_impacts(run) if i.event.reason in PLANNED_LEAVES]
    return RunSummary(
        mode=run.mode,
        wall_s=run.ended_at - run.started_at,
        final_step=max((p.step for p in run.progress), default=0),
        goodput=goodput(run),
        lost_steps=sum(s.lost_steps for s in stops),
        interruptions=len(stops),
        reforms=len(reforms),
        cordoned=tuple(cordoned_nodes(run)),
        continuous=not continuity_errors(run.progress),
        reclaim_lost_steps=sum(i.lost_steps for i in reclaims) if reclaims else None,
        strategies=strategy_counts(run),
        not_settled=tuple(_not_settled_text(run, e) for e in not_settled(run)),
    )


def strategies_text(summary: RunSummary) -> str:
    """``migrate 1, replace 1, elastic 2``, or ``not recorded``."""
    return ", ".join(f"{name} {n}" for name, n in summary.strategies.items()) or NOT_RECORDED


CORDONED = "cordoned for restart storms"
"""What the summary's cordoned nodes are: the controller's cordons of a node whose ranks kept
crashing, not a drain's."""

NOT_SETTLED_NOTE = (
    "the run gave up waiting for the job to settle; what it measured after that may not be the cost of one "
    "event alone"
)


def not_settled_lines(summary: RunSummary) -> list[str]:
    """``NOT SETTLED (regroup) at 375 s: gave up after ...``: a line for each time the run
    gave up waiting for the job to settle, to be seen before the numbers."""
    return [f"NOT SETTLED ({summary.mode}) {text}" for text in summary.not_settled]


NOT_REPORTED = {
    "loss": "loss",
    "resumed_from_step": "resume points (resumed_from_step)",
    "reform_mode": "re-form mode (reform_mode)",
    "resume_phases": "resume split (resume_phases)",
}


def not_reported(run: RunData) -> list[str]:
    """The progress fields a user's script did not report (always [] for the built-in trainer)."""
    if run.script is None:
        return []
    return [NOT_REPORTED[name] for name, seen in run.reported.items() if not seen]


def trainer_text(run: RunData) -> str:
    return "the built-in FSDP2 trainer" if run.script is None else shlex.join(run.script)


def worker_exit_lines(reforms: list[Reform]) -> list[str]:
    """``#2 n2: the worker exited during an in-place re-form (exit 1): ...``: a line for
    each re-form (numbered as in the table) during which workers exited instead of
    re-forming in place, with the likely cause."""
    return [f"#{i} {r.worker_exit}" for i, r in enumerate(reforms, 1) if r.worker_exit]


def ratio_text(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def throughput_line(run: RunData) -> str:
    """The terminal summary's one line of throughput ratios, one per scripted event."""
    items = throughput_around_events(run)
    parts = [f"{item.event.reason} {ratio_text(item.ratio)}" for item in items]
    return f"throughput after/before each event ({run.mode}): {', '.join(parts) or '-'}"


def summary_text(runs: list[RunData], report: Path) -> str:
    """The one-screen summary printed when the demo ends."""
    lines = ["", "regroup demo finished", ""]
    if runs and runs[0].script is not None:
        lines += [f"script: {trainer_text(runs[0])}", ""]
    summaries = [summarize(r) for r in runs]
    unsettled = [line for s in summaries for line in not_settled_lines(s)]
    if unsettled:
        lines += [*unsettled, f"  ({NOT_SETTLED_NOTE})", ""]
    width = max(len(s.mode) for s in summaries) + 2
    lines.append(f"{'':<36}" + "".join(f"{s.mode:>{width}}" for s in summaries))
    for name, fmt in (
        ("wall time (s)", lambda s: f"{s.wall_s:.0f}"),
        ("final step", lambda s: str(s.final_step)),
        ("goodput", lambda s: f"{s.goodput:.0%}"),
        ("steps lost, all events", lambda s: str(s.lost_steps)),
        ("steps lost on planned leaves", lambda s: "-" if s.reclaim_lost_steps is None else str(s.reclaim_lost_steps)),
        ("re-forms", lambda s: str(s.reforms)),
        ("re-form strategies", strategies_text),
        (CORDONED, lambda s: ",".join(s.cordoned) or "none"),
        ("loss curve continuous", lambda s: "yes" if s.continuous else "NO"),
        ("job settled at every wait", lambda s: "NO" if s.not_settled else "yes"),
    ):
        lines.append(f"  {name:<34}" + "".join(f"{fmt(s):>{width}}" for s in summaries))
    for run in runs:
        if run.spans:
            reforms = reform_rows(run)
            labels = [reform_label(run, r) for r in reforms]
            lines += ["", f"re-forms ({run.mode}):", format_table(reforms, origin=run.origin, labels=labels)]
            lines += worker_exit_lines(reforms)
    lines.append("")
    lines += [throughput_line(run) for run in runs]
    for run in runs:
        if missing := not_reported(run):
            lines.append(f"not reported by this script ({run.mode}): {', '.join(missing)}")
    lines += ["", f"report: {report}", ""]
    return "\n".join(lines)
