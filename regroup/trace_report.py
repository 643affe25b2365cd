"""``regroup trace-report``: the re-form latency table from exported spans.

Reads an OTLP-JSON-lines spans file (``REGROUP_SPANS_FILE``, or ``spans.jsonl`` of a
``regroup demo`` run) and prints one row per re-form: cause, world size before and after
(in nodes), planned or not, how the workers reached the new world (``in-place`` or
``restart``), lost steps, and the seconds spent detecting, checkpointing, re-forming the
rendezvous and resuming; with ``--resume-split``, also where the resume time went.

Every re-form the job went through is a row: each ``regroup.reform`` trace (the
controller's), and each new world the agents formed on their own, without the controller
(a rank crashed: the survivors re-formed around it). The trainers' ``regroup.trainer.resume``
span tells those apart: a resume joins the trace of the re-form that asked for it, so the
first resume in a re-form's trace is that re-form's own, and any other is a re-form of the
agents' own (cause ``crash``), its nodes read off the agents' ``regroup.rendezvous.join``
spans of the round it formed.

The cause column names what the controller's plan says started the re-form
(``regroup.reason``), more finely than ``regroup.cause``: a reclaim notice reads as the
drain, eviction, spot reclaim, scale-down ... that sent it (``cause_label``).

``at_s`` counts from one origin, said above the table: the job's start as ``regroup demo``
defines it (its scenario clock's start, once the job trained and settled: ``started_at``
of the run's ``run.json``) when the spans are a demo run's, else the job's first round
(``job_start``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from regroup.records import TRACED_PHASES, Progress, ReformCause, ReformPhase
from regroup.telemetry import read_spans

REFORM_SPAN = "regroup.reform"
TRAINER_RESUME = "regroup.trainer.resume"
"""Rank 0's span of each new world the trainers reached (after its first step)."""
JOIN_SPAN = "regroup.rendezvous.join"
"""An agent's span of joining a rendezvous round (``regroup.round``, ``regroup.node``)."""
CRASH = "crash"
"""The cause of a re-form the agents made without the controller (a rank or worker crashed)."""
WORKER_EXIT_ATTR = "regroup.worker_exit"
"""The root span's line on workers that exited during the re-form instead of re-forming in place."""
PHASES: tuple[str, ...] = TRACED_PHASES
RESUME_PHASES: tuple[str, ...] = Progress.RESUME_PHASES
_RESUME_ATTR = "regroup.resume."
RUN_META = "run.json"
"""A ``regroup demo`` run's own record, beside its ``spans.jsonl``: ``started_at`` is the job's start."""


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
    reason: str = ""
    """Why it started, as the controller's plan says (``regroup.reason``), or which nodes
    left and joined a world the agents formed on their own."""
    asked: bool = True
    """The controller asked for it (a ``regroup.reform`` trace); False: the agents re-formed
    on their own (``CRASH``), read from the trainers' resume."""
    resumed_at: float = 0.0
    """Unix time the trainers' own resume in this re-form ended (their first step in the new
    world, ``regroup.trainer.resume``); 0 when they exported none."""

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def label(self) -> str:
        """The cause as the table shows it (``cause_label``)."""
        return cause_label(self.cause, self.reason)


_NOTICE_LABELS: tuple[tuple[str, str], ...] = (
    # What announced a planned leave (``regroup.controller.signals``), as the plan's reason
    # names it: "reclaim notice on n2 (<signal>, <source>)".
    ("spec.unschedulable", "drain"),  # a cordon (kubectl drain, cordon)
    ("node.kubernetes.io/unschedulable", "drain"),
    ("(EvictionByEvictionAPI)", "eviction"),  # the pod's DisruptionTarget reason
    ("(PreemptionByScheduler)", "preemption"),
    ("(DeletionByTaintManager)", "taint eviction"),
    ("(TerminationByKubelet)", "kubelet eviction"),
    ("(DeletionByPodGC)", "pod GC"),
    ("aws-node-termination-handler/spot-itn", "spot reclaim"),
    ("aws-node-termination-handler/rebalance-recommendation", "rebalance"),
    ("aws-node-termination-handler/scheduled-maintenance", "maintenance"),
    ("aws-node-termination-handler/asg-lifecycle-termination", "scale-in"),
    ("karpenter.sh/disrupt", "karpenter disruption"),  # v1 disrupted, v1beta1 disruption
    ("ToBeDeletedByClusterAutoscaler", "scale-down"),
    ("cloud.google.com/impending-node-termination", "preemption"),
    ("remediator.kubernetes.azure.com/unschedulable", "node repair"),
    (" deleted (", "pod deletion"),  # "pod n2-worker deleted (30 s grace)"
    (" deleted,", "pod deletion"),  # "pod n2-worker deleted, Kubernetes)" (no grace known)
    (" leaving,", "agent leaving"),  # "agent on n2 leaving, regroup agent)"
)
"""The words a planned leave's notice reads as, by what its reason names (first match by
position in the reason; several notices read as several words)."""


def cause_label(cause: str, reason: str) -> str:
    """What started a re-form, as finely as its plan's ``reason`` says: a reclaim notice
    reads as the ``drain``, ``eviction``, ``spot reclaim``, ``scale-down`` ... that sent it
    (``reclaim`` when the reason names none of them, e.g. a taint of
    ``regroup.dev/reclaim-taints``), a shrink to a lowered max as ``scale``; any other cause
    as it is (``node-lost``, ``grow``, ``restart-storm``, ``crash``)."""
    if cause == ReformCause.RECLAIM:
        found = sorted((at, label) for key, label in _NOTICE_LABELS if (at := reason.find(key)) >= 0)
        labels = list(dict.fromkeys(label for _, label in found))
        return "+".join(labels) if labels else cause
    if cause == ReformCause.MANUAL and "exceed max" in reason:
        return "scale"
    return cause


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


def _trainer_resumes(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trainers' resumes into a new world, oldest first (not a job's first start from an
    older checkpoint: no re-form, ``regroup.reform.mode`` ``start``)."""
    found = [s for s in spans if s["name"] == TRAINER_RESUME and s["attributes"].get("regroup.reform.mode") != "start"]
    return sorted(found, key=lambda s: s["start_ns"])


def reforms_from_spans(spans: list[dict[str, Any]]) -> list[Reform]:
    """Each ``regroup.reform`` root span with its phase children, in time order (the
    controller's re-forms only: ``all_reforms`` adds those the agents made on their own)."""
    own_resume: dict[str, float] = {}
    for resume in _trainer_resumes(spans):
        own_resume.setdefault(resume["trace_id"], resume["end_ns"] / 1e9)
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
                reason=str(attrs.get("regroup.reason", "")),
                resumed_at=own_resume.get(span["trace_id"], 0.0),
            )
        )
    return sorted(reforms, key=lambda r: r.start)


@dataclass(frozen=True)
class _Round:
    nodes: frozenset[str]
    formed_at: float
    """When its last agent finished joining (the round formed), unix time."""


def _rounds(spans: list[dict[str, Any]]) -> dict[int, _Round]:
    """Rendezvous round -> its nodes and when it formed, from the agents' join spans."""
    nodes: dict[int, set[str]] = {}
    formed: dict[int, float] = {}
    for span in spans:
        attrs = span["attributes"]
        if span["name"] != JOIN_SPAN or attrs.get("regroup.round") is None:
            continue
        number = int(attrs["regroup.round"])
        nodes.setdefault(number, set()).add(str(attrs.get("regroup.node", "")))
        formed[number] = max(formed.get(number, 0.0), span["end_ns"] / 1e9)
    return {n: _Round(frozenset(nodes[n]), formed[n]) for n in nodes}


def agent_reforms(spans: list[dict[str, Any]], traced: list[Reform] | None = None) -> list[Reform]:
    """The new worlds the agents formed on their own (cause ``CRASH``), in time order: each
    trainer resume that is not the first in a ``regroup.reform`` trace (``traced``, read from
    ``spans`` unless given). One starts at the first sign of it (the resume's start, or its
    end less the resume phases the trainer reported), not before the last world's first
    step; its world is the round that formed meanwhile (the agents' join spans), its lost
    steps unknown (-1: the spans do not say)."""
    traced = reforms_from_spans(spans) if traced is None else traced
    asked = {r.trace_id for r in traced}
    rounds = _rounds(spans)
    owned: set[str] = set()
    found: list[Reform] = []
    previous_end = float("-inf")
    for resume in _trainer_resumes(spans):
        trace_id, attrs = resume["trace_id"], resume["attributes"]
        start, end = resume["start_ns"] / 1e9, resume["end_ns"] / 1e9
        if trace_id in asked and trace_id not in owned:
            owned.add(trace_id)
            previous_end = end
            continue
        split = resume_phases(attrs)
        start = max(previous_end, min(start, end - sum(split.values())))
        previous_end = end
        formed = [(n, r) for n, r in rounds.items() if start - 1.0 <= r.formed_at <= end]
        number, world = max(formed, key=lambda item: item[0]) if formed else (0, None)
        before = rounds.get(number - 1)
        phases = {"resume": end - start}
        if world is not None and start <= world.formed_at:
            phases = {"rendezvous": world.formed_at - start, "resume": end - world.formed_at}
        found.append(
            Reform(
                trace_id=trace_id,
                start=start,
                end=end,
                cause=CRASH,
                planned=False,
                world_before=len(before.nodes) if before is not None else -1,
                world_after=len(world.nodes) if world is not None else -1,
                lost_steps=-1,
                phases=phases,
                mode=str(attrs.get("regroup.reform.mode", "")),
                resume_phases=split,
                attributes=dict(attrs),
                reason=_moves(before, world),
                asked=False,
                resumed_at=end,
            )
        )
    return found


def _moves(before: _Round | None, after: _Round | None) -> str:
    """``n1 left; n5 joined``: how a world the agents formed on their own differs from the last."""
    if before is None or after is None:
        return "the agents re-formed on their own"
    moves = [f"{', '.join(sorted(nodes))} {verb}" for nodes, verb in
             ((before.nodes - after.nodes, "left"), (after.nodes - before.nodes, "joined")) if nodes]  # fmt: skip
    return "; ".join(moves) or "the same nodes re-formed"


def all_reforms(spans: list[dict[str, Any]]) -> list[Reform]:
    """Every re-form the spans record, in time order: the controller's traces and the worlds
    the agents formed on their own (``agent_reforms``)."""
    traced = reforms_from_spans(spans)
    return sorted([*traced, *agent_reforms(spans, traced)], key=lambda r: r.start)


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


def job_start(path: Path | None, spans: list[dict[str, Any]]) -> Origin | None:
    """The job's start: ``run.json``'s ``started_at`` beside the spans of a ``regroup demo``
    run (its folder or its ``spans.jsonl``), else the first rendezvous round the spans show
    formed, else the first re-form's start; None without any of them."""
    if path is not None:
        meta = (path if path.is_dir() else path.parent) / RUN_META
        try:
            run = json.loads(meta.read_text()) if meta.is_file() else {}
            started, mode = run.get("started_at"), str(run.get("mode", ""))
        except (OSError, ValueError, AttributeError):
            started, mode = None, ""
        if isinstance(started, int | float) and started > 0:
            return Origin(float(started), demo_start(mode))
    rounds = _rounds(spans)
    if rounds:
        return Origin(rounds[min(rounds)].formed_at, f"the job's first rendezvous round formed (round {min(rounds)})")
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
    reforms = all_reforms(spans)
    origin = job_start(args.spans, spans)
    if args.json:
        print(json.dumps([
            {**asdict(r), "label": r.label, "duration": r.duration,
             "at_s": None if origin is None else r.start - origin.at,
             "origin": None if origin is None else origin.what}
            for r in reforms
        ], indent=2))  # fmt: skip
    else:
        print(format_table(reforms, origin=origin, resume_split=args.resume_split))
    return 0
