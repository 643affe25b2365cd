"""``regroup trace-report``: the re-form latency table from exported spans.

Reads an OTLP-JSON-lines spans file (``REGROUP_SPANS_FILE``, or ``spans.jsonl`` of a
``regroup demo`` run) and prints one row per re-form (``regroup.reform_spans``: the
controller's and the worlds the agents formed on their own): cause, world size before and
after (in nodes), planned or not, how the workers reached the new world (``in-place`` or
``restart``), lost steps, and the seconds spent detecting, checkpointing, re-forming the
rendezvous and resuming; with ``--resume-split``, also where the resume time went.

The cause column names what the controller's plan says started the re-form
(``regroup.reason``), more finely than ``regroup.cause``: a reclaim notice reads as the
drain, eviction, spot reclaim, scale-down ... that sent it (``regroup.reform_causes``), as
the controller's Events say it.

On a ``regroup demo`` run (its folder, or the ``spans.jsonl`` in it) the table is the one
the demo's report shows (``RunRecords``): the re-forms decided once the job had started,
each with its lost steps from the progress records (``regroup.progress_history``) and a
row for each stop of training no re-form accounts for (``STOPPED``), the agents' re-forms
started at the rank crashes the run injected, and an eviction of a node the run had
cordoned labelled the drain it is.

``at_s`` counts from one origin, said above the table: the job's start as ``regroup demo``
defines it (its scenario clock's start, once the job trained and settled: ``started_at``
of the run's ``run.json``) when the spans are a demo run's, else the job's first round
(``job_start``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from regroup.progress_history import Interruption, read_jsonl, read_progress, training_stops
from regroup.reform_causes import cause_label, cordoned_at
from regroup.reform_spans import (
    CRASH,
    PHASES,
    RESUME_PHASES,
    TRAINER_RESUME,
    Reform,
    all_reforms,
    decided_at,
    first_round,
    reforms_from_spans,
    resume_phases,
)
from regroup.telemetry import read_spans

__all__ = [  # what readers of re-forms import from here (regroup.reform_spans reads them)
    "CRASH", "PHASES", "TRAINER_RESUME", "Reform", "all_reforms", "cause_label", "reforms_from_spans", "resume_phases",
]  # fmt: skip

RUN_META = "run.json"
"""A ``regroup demo`` run's own record, beside its ``spans.jsonl``: ``started_at`` is the job's start."""
FAULT_SOURCE = "fault"
"""The ``source`` of a fault a ``regroup demo`` run injected (a rank crash), in its ``events.jsonl``."""
MATCH_S = 5.0
"""How far a re-form's first step in its new world (its trainers' resume) may be from the
first progress record after a stop for the two to be one."""
STOPPED = "stopped"
"""The cause of a row for a stop of training no re-form of the spans accounts for (one that
had not resumed by the end of the run, or a script that exports no spans of its own)."""


def with_lost_steps(reforms: list[Reform], stops: list[Interruption]) -> list[Reform]:
    """The ``reforms`` with their lost steps as the progress records count them (``stops``:
    the stops of training, ``regroup.progress_history.training_stops``), and a row for each
    stop no re-form accounts for, so the rows' lost steps add up to the stops'; in time order.

    A stop is the re-form's whose trainers' first step in the new world (their resume, or
    the trace's end) is nearest to the first progress after the stop, within ``MATCH_S``; a
    re-form that stopped no training lost nothing."""
    pairs = sorted(
        (abs((r.resumed_at or r.end) - stop.resumed_at), i, j)
        for i, r in enumerate(reforms)
        for j, stop in enumerate(stops)
        if stop.resumed
    )
    owner: dict[int, int] = {}
    taken: set[int] = set()
    for gap, i, j in pairs:
        if gap <= MATCH_S and i not in owner and j not in taken:
            owner[i] = j
            taken.add(j)
    rows = [dataclasses.replace(r, lost_steps=stops[owner[i]].lost_steps if i in owner else 0)
            for i, r in enumerate(reforms)]  # fmt: skip
    for j, stop in enumerate(stops):
        if j in taken:
            continue
        why = "resumed, no re-form in the spans" if stop.resumed else "training had not resumed by the run's end"
        rows.append(Reform(trace_id="", start=stop.stopped_at, end=stop.resumed_at, cause=STOPPED, planned=False,
                           world_before=-1, world_after=-1, lost_steps=stop.lost_steps, phases={}, reason=why,
                           asked=False))  # fmt: skip
    return sorted(rows, key=lambda r: r.start)


Mark = tuple[float, str, tuple[str, ...]]
"""(time, reason, nodes) of an Event of a run."""


def reform_label(reform: Reform, marks: Sequence[Mark] = ()) -> str:
    """The re-form's cause as the table shows it: as its plan says (``cause_label``), an
    eviction of a node the run's Events (``marks``) show cordoned when the re-form was
    decided (within a second) as the drain it is."""
    return cause_label(reform.cause, reform.reason, cordoned_at(marks, decided_at(reform) + 1.0))


@dataclass(frozen=True)
class Origin:
    """Where ``at_s`` counts from, and what that moment is."""

    at: float
    """Unix time."""
    what: str
    """``the job's start ...``: said above the table."""

    def note(self) -> str:
        return f"at_s: seconds since {self.what}"


DEMO_START = "the job's start (the demo's scenario clock: the job trained and settled; run.json started_at)"
"""The origin of a ``regroup demo`` run, in the demo's report and in ``regroup trace-report``."""
DEMO_START_UNSETTLED = "the job's start (the demo's scenario clock: its first training step; run.json started_at)"
"""The same for a run on plain torchrun (``torchrun-c10d``): its churn waits for no job to settle."""


def demo_start(mode: str) -> str:
    """What a ``regroup demo`` run's ``started_at`` is, for a run of ``mode``."""
    return DEMO_START_UNSETTLED if mode == "torchrun-c10d" else DEMO_START


@dataclass(frozen=True)
class RunRecords:
    """What a ``regroup demo`` run keeps beside its spans that its table reads."""

    origin: Origin
    """The job's start (``run.json``'s ``started_at``)."""
    stops: list[Interruption]
    """Its stops of training (``progress.jsonl``)."""
    faults: tuple[float, ...]
    """When it injected each fault (``events.jsonl``, ``FAULT_SOURCE``)."""
    marks: tuple[Mark, ...]
    """Its Events (``events.jsonl``), in time order."""

    def reforms(self, spans: list[dict[str, Any]]) -> list[Reform]:
        """The run's re-forms (``all_reforms``, the agents' started at the faults) decided
        once the job had started: its initial formation is not churn."""
        return [r for r in all_reforms(spans, self.faults) if decided_at(r) >= self.origin.at]

    def table(self, spans: list[dict[str, Any]]) -> list[Reform]:
        """The run's re-form table, as its report shows it: its re-forms with their lost
        steps, and its stops no re-form accounts for (``with_lost_steps``)."""
        return with_lost_steps(self.reforms(spans), self.stops)

    def label(self, reform: Reform) -> str:
        """The re-form's cause as the table shows it (``reform_label`` on the run's Events)."""
        return reform_label(reform, self.marks)


def run_records(path: Path | None) -> RunRecords | None:
    """The records of the ``regroup demo`` run whose folder is ``path`` (or holds the spans
    file ``path``); None when there is none (no ``run.json`` with a ``started_at``)."""
    if path is None:
        return None
    root = path if path.is_dir() else path.parent
    try:
        meta = json.loads((root / RUN_META).read_text())
        started, ended = float(meta["started_at"]), float(meta.get("ended_at") or 0.0)
        events = sorted(read_jsonl(root / "events.jsonl"), key=lambda e: float(e["time"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if started <= 0:
        return None
    progress = read_progress(root / "progress.jsonl", script=bool(meta.get("script")))
    return RunRecords(
        origin=Origin(started, demo_start(str(meta.get("mode", "")))),
        stops=training_stops(progress, ended, meta.get("latest_checkpoint_step")),
        faults=tuple(float(e["time"]) for e in events if e.get("source") == FAULT_SOURCE),
        marks=tuple((float(e["time"]), str(e.get("reason", "")), tuple(e.get("nodes") or ())) for e in events),
    )


def job_start(path: Path | None, spans: list[dict[str, Any]]) -> Origin | None:
    """The job's start: ``run.json``'s ``started_at`` beside the spans of a ``regroup demo``
    run (its folder or its ``spans.jsonl``), else the first rendezvous round the spans show
    formed, else the first re-form's start; None without any of them."""
    records = run_records(path)
    if records is not None:
        return records.origin
    first = first_round(spans)
    if first is not None:
        return Origin(first[1], f"the job's first rendezvous round formed (round {first[0]})")
    reforms = all_reforms(spans)
    return Origin(reforms[0].start, "the first re-form's start") if reforms else None


def _world(n: int) -> str:
    return "?" if n < 0 else str(n)


def table_rows(reforms: list[Reform], origin: float, resume_split: bool = False,
               labels: Sequence[str] | None = None) -> tuple[list[str], list[list[str]]]:  # fmt: skip
    """The table's header and its rows' cells (``format_table``; the demo's HTML report
    shows the same cells). ``labels``: each row's cause as shown (default ``Reform.label``)."""
    split = [p for p in RESUME_PHASES if any(p in r.resume_phases for r in reforms)] if resume_split else []
    columns = [*PHASES, *split]
    header = ["#", "at_s", "cause", "world", "planned", "mode", "lost", *(f"{p}_s" for p in columns), "total_s"]
    rows = []
    for i, r in enumerate(reforms, 1):
        seconds = {**r.phases, **r.resume_phases}
        rows.append(
            [
                str(i),
                f"{r.start - origin:.1f}",
                labels[i - 1] if labels is not None else r.label,
                f"{_world(r.world_before)}->{_world(r.world_after)}",
                "yes" if r.planned else "no",
                r.mode or "?",
                "?" if r.lost_steps < 0 else str(r.lost_steps),
                *(f"{seconds[p]:.2f}" if p in seconds else "-" for p in columns),
                f"{r.duration:.2f}",
            ]
        )
    return header, rows


def format_table(reforms: list[Reform], origin: Origin | float | None = None, resume_split: bool = False,
                 labels: Sequence[str] | None = None) -> str:  # fmt: skip
    """A fixed-width table, one re-form a row, with a p50/max footer; an ``Origin`` is said
    in a line above it (``at_s: seconds since ...``).

    With ``resume_split``, the resume sub-phases any re-form reported follow ``resume_s``.
    ``labels``: each row's cause as shown (default ``Reform.label``).
    """
    if not reforms:
        return "no regroup.reform spans found"
    note = origin.note() if isinstance(origin, Origin) else ""
    at = origin.at if isinstance(origin, Origin) else origin
    header, rows = table_rows(reforms, reforms[0].start if at is None else at, resume_split, labels)
    totals = [r.duration for r in reforms]
    blank = [""] * (len(header) - 4)
    known = [r.lost_steps for r in reforms if r.lost_steps >= 0]
    lost = str(sum(known)) + ("+?" if len(known) < len(reforms) else "")
    footer_sum = ["", "", "sum", "", "", "", lost, *[""] * (len(header) - 8), f"{sum(totals):.2f}"]
    footer = ["", "", "p50", *blank, f"{statistics.median(totals):.2f}"]
    footer_max = ["", "", "max", *blank, f"{max(totals):.2f}"]
    table = [header, *rows, footer_sum, footer, footer_max]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    left = {2, 5}  # cause and mode are words
    lines = [
        "  ".join(cell.ljust(w) if c in left else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 3, "  ".join("-" * w for w in widths))
    return "\n".join([note, *lines] if note else lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spans", type=Path, help="OTLP JSON-lines spans file, or a `regroup demo` run folder")
    parser.add_argument("--json", action="store_true", help="print the re-forms as JSON instead of a table")
    parser.add_argument("--resume-split", action="store_true", help="also show where each resume's time went")


class SpansFileError(ValueError):
    """A spans file is missing or unreadable; the message names it."""


def load_spans(path: Path) -> list[dict[str, Any]]:
    """The spans of an OTLP JSON-lines file, or of ``spans.jsonl`` in a ``regroup demo`` run
    folder; raises ``SpansFileError`` naming the file."""
    if path.is_dir():
        path = path / "spans.jsonl"
    if not path.is_file():
        raise SpansFileError(f"no spans file at {path}")
    try:
        return read_spans(path)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SpansFileError(f"{path} is not an OTLP JSON-lines spans file: {exc!r}") from None


def run(args: argparse.Namespace) -> int:
    try:
        spans = load_spans(args.spans)
    except SpansFileError as exc:
        print(f"regroup trace-report: {exc}", file=sys.stderr)
        return 2
    records = run_records(args.spans)
    if records is not None:
        reforms, origin = records.table(spans), records.origin
        labels = [records.label(r) for r in reforms]
    else:
        reforms, origin = all_reforms(spans), job_start(None, spans)
        labels = [r.label for r in reforms]
    if args.json:
        print(json.dumps([
            {**asdict(r), "label": label, "duration": r.duration,
             "at_s": None if origin is None else r.start - origin.at,
             "origin": None if origin is None else origin.what}
            for r, label in zip(reforms, labels)
        ], indent=2))  # fmt: skip
    else:
        print(format_table(reforms, origin=origin, resume_split=args.resume_split, labels=labels))
    return 0
