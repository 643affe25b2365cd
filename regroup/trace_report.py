"""``regroup trace-report``: the re-form latency table from exported spans.

Reads an OTLP-JSON-lines spans file (``REGROUP_SPANS_FILE``, or ``spans.jsonl`` of a
``regroup demo`` run) and prints one row per ``regroup.reform`` trace: cause, world size
before and after, planned or not, lost steps, and the seconds spent detecting,
checkpointing, re-forming the rendezvous and resuming.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from regroup.telemetry import read_spans

REFORM_SPAN = "regroup.reform"
PHASES: tuple[str, ...] = ("detect", "checkpoint", "rendezvous", "resume")


@dataclass(frozen=True)
class Reform:
    """One ``regroup.reform`` trace."""

    trace_id: str
    start: float
    """Unix time the root span started."""
    end: float
    cause: str
    planned: bool
    world_before: int
    world_after: int
    lost_steps: int
    """-1 when the span does not say."""
    phases: dict[str, float]
    """Seconds spent in each child span present (detect, checkpoint, rendezvous, resume)."""
    attributes: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


def _int_attr(attrs: dict[str, Any], key: str, default: int) -> int:
    value = attrs.get(key)
    return default if value is None else int(value)


def reforms_from_spans(spans: list[dict[str, Any]]) -> list[Reform]:
    """Each ``regroup.reform`` root span with its phase children, in time order."""
    children: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        if span.get("parent_span_id"):
            children.setdefault(span["parent_span_id"], []).append(span)
    reforms = []
    for span in spans:
        if span["name"] != REFORM_SPAN:
            continue
        attrs = span["attributes"]
        phases: dict[str, float] = {}
        for child in children.get(span["span_id"], []):
            phase = child["name"].removeprefix("regroup.")
            if phase in PHASES:
                phases[phase] = phases.get(phase, 0.0) + (child["end_ns"] - child["start_ns"]) / 1e9
        reforms.append(
            Reform(
                trace_id=span["trace_id"],
                start=span["start_ns"] / 1e9,
                end=span["end_ns"] / 1e9,
                cause=str(attrs.get("regroup.cause", "")),
                planned=bool(attrs.get("regroup.planned", False)),
                world_before=_int_attr(attrs, "regroup.world_size.before", 0),
                world_after=_int_attr(attrs, "regroup.world_size.after", 0),
                lost_steps=_int_attr(attrs, "regroup.lost_steps", -1),
                phases=phases,
                attributes=dict(attrs),
            )
        )
    return sorted(reforms, key=lambda r: r.start)


def format_table(reforms: list[Reform], origin: float | None = None) -> str:
    """A fixed-width table, one re-form a row, with a p50/max footer."""
    if not reforms:
        return "no regroup.reform spans found"
    origin = reforms[0].start if origin is None else origin
    header = ["#", "at_s", "cause", "world", "planned", "lost", *(f"{p}_s" for p in PHASES), "total_s"]
    rows = []
    for i, r in enumerate(reforms, 1):
        rows.append(
            [
                str(i),
                f"{r.start - origin:.1f}",
                r.cause,
                f"{r.world_before}->{r.world_after}",
                "yes" if r.planned else "no",
                "?" if r.lost_steps < 0 else str(r.lost_steps),
                *(f"{r.phases[p]:.2f}" if p in r.phases else "-" for p in PHASES),
                f"{r.duration:.2f}",
            ]
        )
    totals = [r.duration for r in reforms]
    footer = ["", "", "p50", "", "", "", *("" for _ in PHASES), f"{statistics.median(totals):.2f}"]
    footer_max = ["", "", "max", "", "", "", *("" for _ in PHASES), f"{max(totals):.2f}"]
    table = [header, *rows, footer, footer_max]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if c != 2 else cell.ljust(w) for c, (cell, w) in enumerate(zip(row, widths))) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 2, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("spans", type=Path, help="OTLP JSON-lines spans file, or a `regroup demo` run folder")
    parser.add_argument("--json", action="store_true", help="print the re-forms as JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    path: Path = args.spans
    if path.is_dir():
        path = path / "spans.jsonl"
    if not path.is_file():
        print(f"regroup trace-report: no spans file at {path}", file=sys.stderr)
        return 2
    try:
        reforms = reforms_from_spans(read_spans(path))
    except (ValueError, KeyError) as exc:
        print(f"regroup trace-report: {path} is not an OTLP JSON-lines spans file: {exc!r}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{**asdict(r), "duration": r.duration} for r in reforms], indent=2))
    else:
        print(format_table(reforms))
    return 0
