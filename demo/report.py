"""The run report: one self-contained HTML file (charts inlined as base64 PNG) and the
one-screen summary printed at the end of ``regroup demo``.

Given one run it shows that run; given a regroup run and a torchrun-c10d run of the same
scenario it shows them side by side. A run of a user's script shows the same, from the
progress records the script published; what the script did not report is named as such.
"""

from __future__ import annotations

import base64
import html
import io
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from regroup.demo.analysis import (
    EventRow,
    RunData,
    continuity_errors,
    cordoned_nodes,
    event_impacts,
    event_rows,
    goodput,
    incarnations,
    reform_label,
    reform_rows,
    run_interruptions,
    run_reforms,
    world_size_timeline,
)
from regroup.demo.strategy import Strategy, plans_by_trace, reform_strategy, strategy_counts
from regroup.demo.throughput import DEFAULT_WINDOW_S, EventThroughput, throughput_around_events
from regroup.trace_report import PHASES, Reform, format_table, table_rows

PHASE_COLOURS = {"detect": "#d62728", "checkpoint": "#1f77b4", "rendezvous": "#ff7f0e", "resume": "#2ca02c"}
RUN_COLOURS = {"regroup": "#1f77b4", "regroup-restart": "#ff7f0e", "torchrun-c10d": "#7f7f7f"}


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
    continuous: bool
    reclaim_lost_steps: int | None
    """Steps lost to the scripted planned leaves (spot reclaims, evictions, drains), from
    progress (None: the scenario has none)."""
    strategies: dict[str, int] = field(default_factory=dict)
    """Re-forms by strategy (replace, migrate, elastic); {} where the run recorded none."""


PLANNED_LEAVES = ("reclaim", "evict", "drain")
"""Scripted events that give notice: a reclaim taint, an eviction, a drain (its grace)."""


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
    )


def strategies_text(summary: RunSummary) -> str:
    """``migrate 1, replace 1, elastic 2``, or ``not recorded``."""
    return ", ".join(f"{name} {n}" for name, n in summary.strategies.items()) or "not recorded"


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


def _trainer_text(run: RunData) -> str:
    return "the built-in FSDP2 trainer" if run.script is None else shlex.join(run.script)


def _png(fig: plt.Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def _label(run: RunData) -> str:
    return run.mode


def world_size_chart(runs: list[RunData]) -> str:
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        points = world_size_timeline(run)
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", color=RUN_COLOURS.get(run.mode, "k"))
        top = max([p[1] for p in points] + [1])
        for event in run.events:
            at = event.time - run.started_at
            if event.source == "scenario":
                ax.axvline(at, color="#444", linestyle="--", linewidth=0.8)
                ax.text(at, top + 0.35, event.reason, rotation=0, fontsize=8, ha="left", va="bottom")
            elif event.reason == "RankCrashed":
                ax.plot([at], [0.2], marker="x", color="#d62728")
            elif event.reason == "Cordoned":
                ax.plot([at], [top], marker="v", color="#9467bd", markersize=9)
                ax.text(at, top - 0.5, "cordon", fontsize=8, color="#9467bd")
        ax.set_ylim(-0.2, top + 1)
        ax.set_ylabel("ranks training")
        ax.set_title(_label(run), fontsize=10, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the job's start (x: injected rank crash, v: cordon)")
    return _png(fig)


def loss_chart(runs: list[RunData]) -> str | None:
    """None when no run reported a loss (a script that publishes none)."""
    runs = [r for r in runs if r.reported["loss"]]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for run in runs:
        colour = RUN_COLOURS.get(run.mode, "k")
        labelled = False
        for i, part in enumerate(incarnations(run.progress)):
            # The record written at (re)start carries the checkpoint step and no loss yet.
            measured = [
                s for s in part.samples
                if math.isfinite(s.loss) and (s.step > part.resumed_from_step or s.step == 0 and s.loss > 0)
            ]  # fmt: skip
            if not measured:
                continue
            ax.plot(
                [s.step for s in measured], [s.loss for s in measured], color=colour, linewidth=1,
                label=None if labelled else _label(run),
            )  # fmt: skip
            labelled = True
            if i > 0:
                ax.plot([measured[0].step], [measured[0].loss], "o", color=colour, markersize=3)
    ax.set_xlabel("step (dots: first step after a resume)")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


def _cause(run: RunData, reform: Reform, strategy: Strategy | None = None) -> str:
    """The re-form's cause (``reform_label``: drain, eviction, spot reclaim ...), with how the
    workers got through it and how the world was kept (replace, migrate or elastic, with the
    positions handed over) where the run says."""
    how = "; ".join(filter(None, [reform.mode, strategy.describe() if strategy else ""]))
    label = reform_label(run, reform)
    return f"{label} ({how})" if how else label


def worker_exit_lines(reforms: list[Reform]) -> list[str]:
    """``#2 n2: the worker exited during an in-place re-form (exit 1): ...``: a line for
    each re-form (numbered as in the table) during which workers exited instead of
    re-forming in place, with the likely cause."""
    return [f"#{i} {r.worker_exit}" for i, r in enumerate(reforms, 1) if r.worker_exit]


MAX_X_LABELS = 16
"""The latency chart names at most this many bars (every k-th, the others by their number
in the table): more would not fit side by side at any angle."""


def _world_text(reform: Reform) -> str:
    return "->".join("?" if n < 0 else str(n) for n in (reform.world_before, reform.world_after))


def reform_latency_figure(run: RunData) -> plt.Figure | None:
    """Stacked phase bars, one per re-form (numbered as in the table), labelled with the
    cause, the world and the time, slanted so neighbours do not overlap; with more than
    ``MAX_X_LABELS`` bars only every k-th is named."""
    reforms = run_reforms(run)
    if not reforms:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.8))
    xs = list(range(len(reforms)))
    bottoms = [0.0] * len(reforms)
    for phase in PHASES:
        values = [r.phases.get(phase, 0.0) for r in reforms]
        ax.bar(xs, values, bottom=bottoms, color=PHASE_COLOURS[phase], label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    every = -(-len(reforms) // MAX_X_LABELS)
    named = xs[::every]
    labels = [
        f"#{i + 1} {reform_label(run, reforms[i])} {_world_text(reforms[i])} @{reforms[i].start - run.started_at:.0f}s"
        for i in named
    ]
    ax.set_xticks(named, labels, rotation=35, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_xlim(-0.6, len(reforms) - 0.4)
    ax.set_ylabel("seconds")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return fig


def reform_latency_chart(run: RunData) -> str | None:
    fig = reform_latency_figure(run)
    return None if fig is None else _png(fig)


def per_event_chart(runs: list[RunData], metric: str) -> str:
    """Grouped bars per scripted event: ``lost`` steps or training ``downtime`` seconds."""
    impacts = {run.mode: event_impacts(run) for run in runs}
    names = [f"{e.event.reason}\n{', '.join(e.event.nodes)}" for e in impacts[runs[0].mode]]
    fig, ax = plt.subplots(figsize=(10, 3.0))
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        values = [
            (imp.lost_steps if metric == "lost" else imp.downtime) for imp in impacts[run.mode]
        ]
        xs = [i + k * width for i in range(len(values))]
        bars = ax.bar(xs, values, width=width, color=RUN_COLOURS.get(run.mode, "k"), label=_label(run))
        ax.bar_label(bars, labels=[f"{v:.0f}" if metric == "lost" else f"{v:.1f}" for v in values], fontsize=8)
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(names))], names, fontsize=8)
    ax.set_ylabel("steps lost" if metric == "lost" else "seconds without training")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def goodput_chart(runs: list[RunData]) -> str:
    fig, ax = plt.subplots(figsize=(5, 2.4))
    values = [goodput(r) * 100 for r in runs]
    bars = ax.barh([_label(r) for r in runs], values, color=[RUN_COLOURS.get(r.mode, "k") for r in runs])
    ax.bar_label(bars, labels=[f"{v:.0f}%" for v in values])
    ax.set_xlim(0, 100)
    ax.set_xlabel("goodput: useful training time / wall time (%)")
    return _png(fig)


def _img(data: str | None, alt: str) -> str:
    if data is None:
        return f"<p><em>{html.escape(alt)}: no data</em></p>"
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _summary_rows(summaries: list[RunSummary]) -> str:
    rows = [
        ("wall time", [f"{s.wall_s:.0f} s" for s in summaries]),
        ("final step", [str(s.final_step) for s in summaries]),
        ("goodput", [f"{s.goodput:.0%}" for s in summaries]),
        ("steps lost (all events)", [str(s.lost_steps) for s in summaries]),
        ("training interruptions", [str(s.interruptions) for s in summaries]),
        ("re-forms", [str(s.reforms) for s in summaries]),
        ("re-form strategies", [strategies_text(s) for s in summaries]),
        (
            "steps lost on planned leaves",
            ["-" if s.reclaim_lost_steps is None else str(s.reclaim_lost_steps) for s in summaries],
        ),
        ("cordoned nodes", [", ".join(s.cordoned) or "none" for s in summaries]),
        ("loss curve continuous", ["yes" if s.continuous else "NO" for s in summaries]),
    ]
    head = "".join(f"<th>{html.escape(s.mode)}</th>" for s in summaries)
    body = "".join(
        f"<tr><td>{html.escape(name)}</td>{''.join(f'<td>{html.escape(v)}</td>' for v in values)}</tr>"
        for name, values in rows
    )
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


def _impact_table(runs: list[RunData]) -> str:
    """One row per scripted event: each run's re-forms, seconds without training and lost steps."""
    impacts = [event_impacts(run) for run in runs]
    plans = [plans_by_trace(run) for run in runs]
    head = "".join(
        f"<th>{html.escape(r.mode)}: re-forms (total s)</th><th>{html.escape(r.mode)}: s without training</th>"
        f"<th>{html.escape(r.mode)}: steps lost</th>"
        for r in runs
    )
    rows = []
    for i, first in enumerate(impacts[0]):
        cells = [f"<td>{html.escape(first.event.scripted_text(runs[0].started_at))}</td>"
                 f"<td>{html.escape(first.event.message)}</td>"]
        for run, per_run, run_plans in zip(runs, impacts, plans):
            impact = per_run[i] if i < len(per_run) else None
            if impact is None:
                cells.append("<td>-</td><td>-</td><td>-</td>")
                continue
            reforms = ", ".join(
                f"{_cause(run, r, reform_strategy(r, run_plans))} {r.duration:.1f}" for r in impact.reforms
            ) or "-"
            cells.append(f"<td>{html.escape(reforms)}</td><td>{impact.downtime:.1f}</td><td>{impact.lost_steps}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr><th>t (s)</th><th>event</th>{head}</tr>{''.join(rows)}</table>"


def _ratio_text(item: EventThroughput) -> str:
    return "-" if item.ratio is None else f"{item.ratio:.2f}"


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


def _throughput_table(run: RunData) -> str:
    """One row per scripted event: the re-forms' strategies, the ranks and the throughput
    before and after it, and their ratio."""
    impacts = event_impacts(run)
    plans = plans_by_trace(run)
    items = throughput_around_events(run)
    unit = items[0].unit if items else "samples/s"
    rows = []
    for i, item in enumerate(items):
        reforms = impacts[i].reforms if i < len(impacts) else ()
        strategies = [reform_strategy(r, plans) for r in reforms]
        strategy = ", ".join(s.describe() for s in strategies if s is not None) or "-"
        ranks = f"{item.before.ranks if item.before else '-'} -> {item.after.ranks if item.after else '-'}"
        rows.append(
            f"<tr><td>{html.escape(item.event.scripted_text(run.started_at))}</td>"
            f"<td>{html.escape(item.event.message)}</td>"
            f"<td>{html.escape(strategy)}</td><td>{html.escape(ranks)}</td>"
            f"<td>{_rate_text(item.before.per_s if item.before else None)}</td>"
            f"<td>{_rate_text(item.after.per_s if item.after else None)}</td><td>{_ratio_text(item)}</td></tr>"
        )
    return (
        f"<table><tr><th>t (s)</th><th>event</th><th>strategy</th><th>ranks</th><th>{unit} before</th>"
        f"<th>{unit} after</th><th>after / before</th></tr>{''.join(rows)}</table>"
    )


def throughput_line(run: RunData) -> str:
    """The terminal summary's one line of throughput ratios, one per scripted event."""
    items = throughput_around_events(run)
    parts = [f"{item.event.reason} {_ratio_text(item)}" for item in items]
    return f"throughput after/before each event ({run.mode}): {', '.join(parts) or '-'}"


def _events_table(run: RunData) -> str:
    """One row per Event (``event_rows``): the objects it was told on, and how many times
    it was posted when it repeated."""

    def when(row: EventRow) -> str:
        played = row.time - run.started_at
        late = row.at is not None and abs(played - row.at) >= 1.0
        return f"{played:.1f} (scripted at {row.at:.0f})" if late else f"{played:.1f}"

    def count(row: EventRow) -> str:
        return "1" if row.count == 1 else f"{row.count} (last at {row.last - run.started_at:.1f})"

    rows = event_rows(run)
    if not rows:
        return "<p><em>no events</em></p>"
    body = "".join(
        f"<tr><td>{html.escape(when(e))}</td><td>{html.escape(e.source)}</td>"
        f"<td>{html.escape(e.reason)}</td><td>{html.escape(e.message)}</td>"
        f"<td>{html.escape(', '.join(e.nodes))}</td><td>{html.escape(count(e))}</td></tr>"
        for e in rows
    )
    return (
        "<table><tr><th>t (s)</th><th>source</th><th>reason</th><th>message</th><th>on</th><th>count</th></tr>"
        f"{body}</table>"
    )


def _reform_table(run: RunData) -> str:
    """The re-form table (``reform_rows``, as ``regroup trace-report`` prints it) as an HTML
    table: its cells wrap where the page is narrow, nothing is cut."""
    rows = reform_rows(run)
    if not rows:
        return "<p><em>no re-form</em></p>"
    header, cells = table_rows(rows, run.started_at, resume_split=True, labels=[reform_label(run, r) for r in rows])
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in cells)
    lost = sum(r.lost_steps for r in rows)
    return (
        f'<div class="wide"><table class="reforms"><tr>{head}</tr>{body}</table></div>'
        f"<p>{html.escape(run.origin.note())}. Steps lost in all: {lost}, as the summary counts them "
        "(each re-form's from the progress records: the steps trained again after it).</p>"
    )


STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:14px}
th{background:#f3f3f3}.wide{overflow-x:auto;max-width:100%}table.reforms td{font-size:13px;text-align:right}
pre{background:#f7f7f7;padding:1em;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}
img{max-width:100%}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
"""


def build_report(runs: list[RunData], path: Path) -> Path:
    """Write the HTML report for one run, or for a regroup run beside its baseline."""
    summaries = [summarize(r) for r in runs]
    first = runs[0]
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>regroup demo report</title><style>{STYLE}</style></head><body>",
        f"<h1>regroup demo: {html.escape(str(first.meta.get('scenario', '')))}</h1>",
        (
            f"<p>{len(first.meta.get('nodes', []))} local nodes, job min {first.meta.get('min_nodes')} / max "
            f"{first.meta.get('max_nodes')} nodes, {first.meta.get('nproc_per_node')} rank(s) per node, CPU (gloo). "
            f"Each rank ran <code>{html.escape(_trainer_text(first))}</code>. Times count from "
            f"{html.escape(first.origin.what)}, as <code>regroup trace-report</code> counts them on this run.</p>"
        ),
        _not_reported_note(runs),
        "<h2>Summary</h2>",
        _summary_rows(summaries),
        "<h2>World size over time, with the scripted events</h2>",
        _img(world_size_chart(runs), "world size"),
        "<h2>Loss vs step, across re-forms</h2>",
        (
            "<p><em>Loss: not reported by this script.</em></p>"
            if any(r.script for r in runs) and not any(r.reported["loss"] for r in runs)
            else _img(loss_chart(runs), "loss")
        ),
    ]
    for run in runs:
        if run.spans:
            parts += [
                f"<h2>Re-form latency per event ({html.escape(run.mode)}, from the spans)</h2>",
                "<p>Every re-form decided after training started (the job's initial formation is left out): "
                "the controller's, and the worlds the agents formed on their own after a rank crashed "
                "(<code>crash</code>, read from the trainers' resume). "
                "<em>mode</em>: whether the workers survived the re-form (<code>in-place</code>) or were "
                "started again (<code>restart</code>); the columns after <code>resume_s</code> split the "
                "resume as the trainer's rank 0 measured it.</p>",
                _img(reform_latency_chart(run), "re-form latency"),
                *(
                    [f"<p><em>{html.escape(', '.join(missing))}: not reported by this script (shown as ? or -).</em></p>"]
                    if (missing := [m for m in not_reported(run) if m.startswith(("re-form", "resume split"))])
                    else []
                ),
                _reform_table(run),
                *(f"<p><strong>{html.escape(line)}</strong></p>" for line in worker_exit_lines(reform_rows(run))),
            ]
    parts += [
        "<h2>Per scripted event</h2>",
        _impact_table(runs),
    ]
    for run in runs:
        parts += [
            f"<h2>Throughput before and after each scripted event ({html.escape(run.mode)})</h2>",
            f"<p>Per step, from the progress records: over up to {DEFAULT_WINDOW_S:.0f} s of training just before "
            f"the event, and the first {DEFAULT_WINDOW_S:.0f} s of the first world formed after it (the re-form "
            "itself left out). The global batch is constant: a node replaced by a spare (<code>replace</code>, "
            "<code>migrate</code>) keeps the throughput; a shrink (<code>elastic</code>) loses the leaving ranks' "
            "share where each rank's own device bounds a step, and keeps it where something else does (the "
            "built-in trainer pads each step to its <code>step_time_floor</code> on the demo's CPU nodes, which "
            "share their cores).</p>",
            _throughput_table(run),
        ]
    parts += [
        "<h2>Training downtime per scripted event</h2>",
        "<p>From the last progress before training stopped to the first progress after it resumed.</p>",
        _img(per_event_chart(runs, "downtime"), "downtime per event"),
        "<h2>Lost steps per scripted event</h2>",
        "<p>Steps trained but rolled back: the step reached minus the checkpoint step resumed from.</p>",
        *(
            ["<p><em>Resume points: not reported by this script; inferred from its steps (the step before the "
             "first progress of each new world). Steps trained after its last progress record before a stop are "
             "not seen.</em></p>"]
            if any(not r.reported["resumed_from_step"] for r in runs)
            else []
        ),
        _img(per_event_chart(runs, "lost"), "lost steps per event"),
        "<h2>Goodput</h2>",
        _img(goodput_chart(runs), "goodput"),
    ]
    for run in runs:
        errors = continuity_errors(run.progress)
        parts += [f"<h2>Events ({html.escape(run.mode)})</h2>", _events_table(run)]
        if errors:
            parts.append("<p><strong>Loss curve not continuous:</strong></p><pre>" + html.escape("\n".join(errors)) + "</pre>")
        parts.append(f"<p>Run folder: <code>{html.escape(str(run.root))}</code></p>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
    return path


def _not_reported_note(runs: list[RunData]) -> str:
    notes = [
        f"<li>{html.escape(r.mode)}: {html.escape(', '.join(missing))}</li>" for r in runs if (missing := not_reported(r))
    ]
    if not notes:
        return ""
    return "<p>Not reported by this script (the report shows what it can without them):</p><ul>" + "".join(notes) + "</ul>"


def summary_text(runs: list[RunData], report: Path) -> str:
    """The one-screen summary printed when the demo ends."""
    lines = ["", "regroup demo finished", ""]
    if runs and runs[0].script is not None:
        lines += [f"script: {_trainer_text(runs[0])}", ""]
    summaries = [summarize(r) for r in runs]
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
        ("cordoned", lambda s: ",".join(s.cordoned) or "none"),
        ("loss curve continuous", lambda s: "yes" if s.continuous else "NO"),
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
