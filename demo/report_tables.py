"""The run report's HTML tables: the summary, each scripted event's re-forms and cost, the
throughput around each event, the re-form table and the Events."""

from __future__ import annotations

import html

from regroup.demo.analysis import EventRow, RunData, event_impacts, event_rows, reform_label, reform_rows
from regroup.demo.strategy import Strategy, plans_by_trace
from regroup.demo.strategy import reform_strategy
from regroup.demo.summary import CORDONED, RunSummary, ratio_text, strategies_text
from regroup.demo.throughput import throughput_around_events
from regroup.trace_report import Reform, table_rows


def cause_text(run: RunData, reform: Reform, strategy: Strategy | None = None) -> str:
    """The re-form's cause (``reform_label``: drain, eviction, spot reclaim ...), with how the
    workers got through it and how the world was kept (replace, migrate or elastic, with the
    positions handed over) where the run says."""
    how = "; ".join(filter(None, [reform.mode, strategy.describe() if strategy else ""]))
    label = reform_label(run, reform)
    return f"{label} ({how})" if how else label


def summary_table(summaries: list[RunSummary]) -> str:
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
        (CORDONED, [", ".join(s.cordoned) or "none" for s in summaries]),
        ("loss curve continuous", ["yes" if s.continuous else "NO" for s in summaries]),
        ("job settled at every wait", ["NO" if s.not_settled else "yes" for s in summaries]),
    ]
    head = "".join(f"<th>{html.escape(s.mode)}</th>" for s in summaries)
    body = "".join(
        f"<tr><td>{html.escape(name)}</td>{''.join(f'<td>{html.escape(v)}</td>' for v in values)}</tr>"
        for name, values in rows
    )
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


def impact_table(runs: list[RunData]) -> str:
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
                f"{cause_text(run, r, reform_strategy(r, run_plans))} {r.duration:.1f}" for r in impact.reforms
            ) or "-"
            cells.append(f"<td>{html.escape(reforms)}</td><td>{impact.downtime:.1f}</td><td>{impact.lost_steps}</td>")
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return f"<table><tr><th>t (s)</th><th>event</th>{head}</tr>{''.join(rows)}</table>"


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.1f}"


def throughput_table(run: RunData) -> str:
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
            f"<td>{_rate_text(item.after.per_s if item.after else None)}</td><td>{ratio_text(item.ratio)}</td></tr>"
        )
    return (
        f"<table><tr><th>t (s)</th><th>event</th><th>strategy</th><th>ranks</th><th>{unit} before</th>"
        f"<th>{unit} after</th><th>after / before</th></tr>{''.join(rows)}</table>"
    )


def events_table(run: RunData) -> str:
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


def reform_table(run: RunData) -> str:
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
