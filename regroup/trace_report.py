"""``regroup trace-report``: the re-form latency table from exported spans.

Reads an OTLP-JSON-lines spans file (``REGROUP_SPANS_FILE``, or ``spans.jsonl`` of a
``regroup demo`` run) and prints one row per ``regroup.reform`` trace: cause, world size
before and after, planned or not, how the workers reached the new world (``in-place`` or
``restart``), lost steps, and the seconds spent detecting, checkpointing, re-forming the
rendezvous and resuming; with ``--resume-split``, also where the resume time went.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from regroup.records import TRACED_PHASES, Progress, ReformPhase
from regroup.telemetry import read_spans

REFORM_SPAN = "regroup.reform"
WORKER_EXIT_ATTR = "regroup.worker_exit"
"""The root span's line on workers that exited during the re-form instead of re-forming in place."""
PHASES: tuple[str, ...] = TRACED_PHASES
RESUME_PHASES: tuple[str, ...] = Progress.RESUME_PHASES
_RESUME_ATTR = "regroup.resume."


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
    mode: str = ""
    """``in-place`` or ``restart``: how the workers reached the new world ("" unknown)."""
    resume_phases: dict[str, float] = field(default_factory=dict)
    """Seconds of the resume phase by sub-phase (``RESUME_PHASES``), as the trainer reported them."""
    attributes: dict[str, Any] = field(default_factory=dict)
    worker_exit: str = ""
    """Which nodes' workers exited during the re-form instead of re-forming in place, and the
    likely cause ("" if none did)."""

    @property
    def duration(self) -> float:
        return self.end - self.start


def _int_attr(attrs: dict[str, Any], key: str, default: int) -> int:
    value = attrs.get(key)
    return default if value is None else int(value)


def resume_phases(attrs: dict[str, Any]) -> dict[str, float]:
    """The ``regroup.resume.<phase>_s`` attributes of a resume span (the controller's
    ``regroup.resume`` or the trainer's ``regroup.trainer.resume``), in ``RESUME_PHASES`` order."""
    found = {
        key.removeprefix(_RESUME_ATTR).removesuffix("_s"): float(value)
        for key, value in attrs.items()
        if key.startswith(_RESUME_ATTR) and key.endswith("_s")
    }
    rank = {name: i for i, name in enumerate(RESUME_PHASES)}
    return dict(sorted(found.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


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
        resume_split: dict[str, float] = {}
        for child in children.get(span["span_id"], []):
            phase = child["name"].removeprefix("regroup.")
            if phase in PHASES:
                phases[phase] = phases.get(phase, 0.0) + (child["end_ns"] - child["start_ns"]) / 1e9
            if phase == ReformPhase.RESUME:
                resume_split.update(resume_phases(child["attributes"]))
        reforms.append(
            Reform(
                trace_id=span["trace_id"],
                start=span["start_ns"] / 1e9,
                end=span["end_ns"] / 1e9,
                cause=str(attrs.get("regroup.cause", "")),
                planned=bool(attrs.get("regroup.planned", False)),
                world_before=_int_attr(attrs, "regroup.node_count.before", 0),
                world_after=_int_attr(attrs, "regroup.node_count.after", 0),
                lost_steps=_int_attr(attrs, "regroup.lost_steps", -1),
                phases=phases,
                mode=str(attrs.get("regroup.reform.mode", "")),
                resume_phases=resume_split,
                attributes=dict(attrs),
                worker_exit=str(attrs.get(WORKER_EXIT_ATTR, "")),
            )
        )
    return sorted(reforms, key=lambda r: r.start)


def format_table(reforms: list[Reform], origin: float | None = None, resume_split: bool = False) -> str:
    """A fixed-width table, one re-form a row, with a p50/max footer.

    With ``resume_split``, the resume sub-phases any re-form reported follow ``resume_s``.
    """
    if not reforms:
        return "no regroup.reform spans found"
    origin = reforms[0].start if origin is None else origin
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
                r.cause,
                f"{r.world_before}->{r.world_after}",
                "yes" if r.planned else "no",
                r.mode or "?",
                "?" if r.lost_steps < 0 else str(r.lost_steps),
                *(f"{seconds[p]:.2f}" if p in seconds else "-" for p in columns),
                f"{r.duration:.2f}",
            ]
        )
    totals = [r.duration for r in reforms]
    blank = [""] * (len(header) - 4)
    footer = ["", "", "p50", *blank, f"{statistics.median(totals):.2f}"]
    footer_max = ["", "", "max", *blank, f"{max(totals):.2f}"]
    table = [header, *rows, footer, footer_max]
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    left = {2, 5}  # cause and mode are words
    lines = [
        "  ".join(cell.ljust(w) if c in left else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 2, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
        reforms = reforms_from_spans(load_spans(args.spans))
    except SpansFileError as exc:
        print(f"regroup trace-report: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([{**asdict(r), "duration": r.duration} for r in reforms], indent=2))
    else:
        print(format_table(reforms, resume_split=args.resume_split))
    return 0
