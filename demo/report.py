"""The run report: one self-contained HTML file (charts inlined as base64 PNG); the
one-screen summary printed at the end of ``regroup demo`` is ``regroup.demo.summary``'s.

Given one run it shows that run; given a regroup run and a torchrun-c10d run of the same
scenario it shows them side by side. A run of a user's script shows the same, from the
progress records the script published; what the script did not report is named as such.
"""

from __future__ import annotations

import html
from pathlib import Path

from regroup.demo.analysis import RunData, continuity_errors, reform_rows
from regroup.demo.report_charts import (
    MAX_X_LABELS,
    goodput_chart,
    loss_chart,
    per_event_chart,
    reform_latency_chart,
    reform_latency_figure,
    world_size_chart,
)
from regroup.demo.report_tables import events_table, impact_table, reform_table, summary_table, throughput_table
from regroup.demo.summary import (
    NOT_SETTLED_NOTE,
    RunSummary,
    not_reported,
    not_settled_lines,
    summarize,
    summary_text,
    trainer_text,
    worker_exit_lines,
)
from regroup.demo.throughput import DEFAULT_WINDOW_S

__all__ = [  # the summary's and the charts' names, as the demo, the benchmarks and the tests import them from here
    "MAX_X_LABELS", "RunSummary", "build_report", "not_reported", "reform_latency_figure", "summarize",
    "summary_text", "worker_exit_lines",
]  # fmt: skip


def _img(data: str | None, alt: str) -> str:
    if data is None:
        return f"<p><em>{html.escape(alt)}: no data</em></p>"
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def _not_settled_note(summaries: list[RunSummary]) -> str:
    """A warning above the summary for each time a run gave up waiting for its job to settle."""
    lines = [line for s in summaries for line in not_settled_lines(s)]
    if not lines:
        return ""
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return f'<div class="warning"><p><strong>{html.escape(NOT_SETTLED_NOTE.capitalize())}:</strong></p><ul>{items}</ul></div>'


STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;font-size:14px}
th{background:#f3f3f3}.wide{overflow-x:auto;max-width:100%}table.reforms td{font-size:13px;text-align:right}
pre{background:#f7f7f7;padding:1em;font-size:12px;white-space:pre-wrap;overflow-wrap:anywhere}
img{max-width:100%}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
.warning{border:2px solid #d62728;background:#fdecea;padding:0 1em;margin:1em 0}
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
            f"Each rank ran <code>{html.escape(trainer_text(first))}</code>. Times count from "
            f"{html.escape(first.origin.what)}, as <code>regroup trace-report</code> counts them on this run.</p>"
        ),
        _not_reported_note(runs),
        "<h2>Summary</h2>",
        _not_settled_note(summaries),
        summary_table(summaries),
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
                "(<code>crash</code>: from the rank crash the run injected, detected when the survivors began to "
                "join the next round; a spare's wait in that round is not the re-form's). "
                "<em>mode</em>: whether the workers survived the re-form (<code>in-place</code>) or were "
                "started again (<code>restart</code>); the columns after <code>resume_s</code> split the "
                "resume as the trainer's rank 0 measured it.</p>",
                _img(reform_latency_chart(run), "re-form latency"),
                *(
                    [f"<p><em>{html.escape(', '.join(missing))}: not reported by this script (shown as ? or -).</em></p>"]
                    if (missing := [m for m in not_reported(run) if m.startswith(("re-form", "resume split"))])
                    else []
                ),
                reform_table(run),
                *(f"<p><strong>{html.escape(line)}</strong></p>" for line in worker_exit_lines(reform_rows(run))),
            ]
    parts += [
        "<h2>Per scripted event</h2>",
        impact_table(runs),
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
            throughput_table(run),
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
        parts += [f"<h2>Events ({html.escape(run.mode)})</h2>", events_table(run)]
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
