"""What a recorded run shows: re-forms, lost steps, continuity and goodput.

Pure functions over the files a run leaves (``progress.jsonl``, ``members.jsonl``,
``events.jsonl``, ``spans.jsonl``, ``run.json``), so the report, the test and the
benchmark read the same facts from the same records.

Everything comes from what any training script publishes through etcd (the ``progress``
record, read by ``regroup.progress_history``) and from the controller's spans and events,
never from a trainer's log text or config: a user's script (``regroup demo --script``) is
measured like the built-in trainer. Where a script leaves a field out, the analysis falls
back or says so (``RunData.reported``): a script that does not report ``resumed_from_step``
gets its resume points inferred from its steps (``infer_resume_points``).

The re-form table is the one ``regroup trace-report`` prints on the run's folder: both read
it through ``regroup.trace_report.RunRecords``'s rules (``reform_rows``, ``reform_label``).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from regroup.progress_history import (
    Incarnation,
    Interruption,
    ProgressSample,
    continuity_errors,
    incarnations,
    infer_resume_points,
    interruptions,
    read_jsonl,
    read_progress,
    resumed_from_memory,
    step_interval,
    training_stops,
    useful_training_time,
)
from regroup.reform_spans import Reform, decided_at
from regroup.telemetry import read_spans
from regroup.trace_report import FAULT_SOURCE, STOPPED, Origin, RunRecords, demo_start

__all__ = [  # the progress history's names, as the report, the benchmarks and the tests import them from here
    "STOPPED", "Incarnation", "Interruption", "ProgressSample", "continuity_errors", "incarnations",
    "infer_resume_points", "interruptions", "resumed_from_memory", "step_interval", "useful_training_time",
]  # fmt: skip


@dataclass(frozen=True)
class ScriptedEvent:
    """A scenario event as it happened (or a cluster/controller Event)."""

    time: float
    source: str
    """``scenario``, ``cluster`` or ``controller``."""
    reason: str
    message: str
    nodes: tuple[str, ...] = ()
    type: str = ""
    """``Normal`` or ``Warning`` ("" not recorded)."""
    at: float | None = None
    """A scenario event's scripted time (its YAML ``at``, seconds on the scenario's clock);
    None for other events, and for runs that did not record it."""

    def scripted_text(self, origin: float) -> str:
        """``20``: the event's time on the scenario's clock, as its YAML says; ``20 (played at
        35: the job settled first)`` when the run pushed it back (the script waits for each
        event's job to settle on a slow machine)."""
        played = self.time - origin
        if self.at is None or abs(played - self.at) < 1.0:
            return f"{played:.0f}"
        return f"{self.at:.0f} (played at {played:.0f}: the job settled first)"


@dataclass
class RunData:
    """Everything one run recorded."""

    root: Path
    meta: dict[str, Any]
    progress: list[ProgressSample]
    members: list[dict[str, Any]]
    events: list[ScriptedEvent]
    spans: list[dict[str, Any]]
    plans: list[dict[str, Any]]

    @property
    def mode(self) -> str:
        return str(self.meta.get("mode", "regroup"))

    @property
    def script(self) -> list[str] | None:
        """The user's training command the ranks ran (None: the built-in trainer)."""
        script = self.meta.get("script")
        return [str(a) for a in script] if script else None

    @property
    def reported(self) -> dict[str, bool]:
        """Which optional progress fields the trainer reported (a user's script may leave
        them out): ``loss``, ``resumed_from_step``, ``reform_mode``, ``resume_phases``. A
        field that only a resume would carry counts as reported while training never resumed."""
        progress = self.progress
        resumed = len(incarnations(progress)) > 1
        return {
            "loss": any(math.isfinite(p.loss) and p.loss > 0 for p in progress),
            "resumed_from_step": not any(p.resume_inferred for p in progress),
            "reform_mode": any(p.reform_mode for p in progress) or not resumed,
            "resume_phases": any(p.resume_phases for p in progress) or not resumed,
        }

    @property
    def started_at(self) -> float:
        return float(self.meta["started_at"])

    @property
    def ended_at(self) -> float:
        return float(self.meta["ended_at"])

    @property
    def origin(self) -> Origin:
        """Where the report's times count from: the job's start as the demo defines it (the
        scenario clock's start, once the job trained and settled), as ``regroup trace-report``
        counts on this run's spans."""
        return Origin(self.started_at, demo_start(self.mode))


def load_run(root: Path) -> RunData:
    """Read a run folder (raises FileNotFoundError naming ``run.json`` if it is not one)."""
    meta_path = root / "run.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path}: not a demo run folder (no run.json)")
    meta = json.loads(meta_path.read_text())
    progress = read_progress(root / "progress.jsonl", script=bool(meta.get("script")))
    events = [
        ScriptedEvent(
            time=float(e["time"]),
            source=str(e["source"]),
            reason=str(e["reason"]),
            message=str(e.get("message", "")),
            nodes=tuple(e.get("nodes", ())),
            type=str(e.get("type", "")),
            at=float(e["at"]) if e.get("at") is not None else None,
        )
        for e in read_jsonl(root / "events.jsonl")
    ]
    spans_path = root / "spans.jsonl"
    spans = read_spans(spans_path) if spans_path.exists() else []
    return RunData(root, meta, progress, read_jsonl(root / "members.jsonl"), events, spans, read_jsonl(root / "plans.jsonl"))


def run_interruptions(run: RunData) -> list[Interruption]:
    """``interruptions`` plus, when training was stopped at the end of the run, that stop,
    counted until the end and with the steps past the newest committed checkpoint lost."""
    return training_stops(run.progress, run.ended_at, run.meta.get("latest_checkpoint_step"))


def goodput(run: RunData) -> float:
    """Useful training time over the run's wall time (0..1)."""
    wall = run.ended_at - run.started_at
    # Progress carries the trainer's clock, the run's ends the recorder's: never above 1.
    return min(1.0, useful_training_time(run.progress, run.started_at) / wall) if wall > 0 else 0.0


def world_size_timeline(run: RunData) -> list[tuple[float, int]]:
    """(seconds since start, ranks training): the trainer's world size while progress flows,
    0 while training is stopped."""
    gap = max(2.0, 4 * step_interval(run.progress))
    points: list[tuple[float, int]] = [(0.0, 0)]
    last: ProgressSample | None = None
    for sample in run.progress:
        if sample.time < run.started_at:
            # Trained before the scenario's clock started (the job settling): the line starts with it.
            points[0] = (0.0, sample.world_size)
            last = sample
            continue
        if last is not None and sample.time - last.time > gap:
            points.append((max(0.0, last.time - run.started_at + 0.01), 0))
        points.append((sample.time - run.started_at, sample.world_size))
        last = sample
    if last is not None and run.ended_at - last.time > gap:
        points.append((max(0.0, last.time - run.started_at + 0.01), 0))
    points.append((run.ended_at - run.started_at, points[-1][1]))
    return points


@dataclass(frozen=True)
class EventImpact:
    """What one scripted event cost the job."""

    event: ScriptedEvent
    reforms: tuple[Reform, ...]
    """The re-forms that followed it (before the next scripted event): regroup's traces and
    the worlds the agents formed on their own."""
    interruptions: tuple[Interruption, ...]
    """Training stops that followed it (before the next scripted event)."""

    @property
    def lost_steps(self) -> int:
        return sum(i.lost_steps for i in self.interruptions)

    @property
    def downtime(self) -> float:
        return sum(i.downtime for i in self.interruptions)


def run_records(run: RunData) -> RunRecords:
    """The run as ``regroup trace-report`` reads it from its folder: its start, its stops of
    training, the faults it injected and its Events."""
    return RunRecords(
        origin=run.origin,
        stops=run_interruptions(run),
        faults=tuple(e.time for e in run.events if e.source == FAULT_SOURCE),
        marks=tuple(sorted(((e.time, e.reason, e.nodes) for e in run.events), key=lambda m: m[0])),
    )


def run_reforms(run: RunData) -> list[Reform]:
    """Every re-form decided once training had started (the job's initial formation is not
    churn): the controller's traces and the worlds the agents formed on their own after a
    crash (``regroup.reform_spans.all_reforms``), those started at the crash."""
    return run_records(run).reforms(run.spans)


def reform_rows(run: RunData) -> list[Reform]:
    """The re-form table's rows: every re-form (``run_reforms``) with its lost steps as the
    summary counts them (``run_interruptions``: the stop of training it ended), and a row
    for each stop no re-form accounts for, so the table's lost steps add up to the summary's
    (``regroup.trace_report.with_lost_steps``)."""
    return run_records(run).table(run.spans)


def _cause_index(times: list[float], moment: float, slack: float) -> int | None:
    """Index of the last event at or before ``moment`` (+ slack), or None."""
    index = None
    for i, t in enumerate(times):
        if t <= moment + slack:
            index = i
    return index


def event_impacts(run: RunData, slack: float = 1.0) -> list[EventImpact]:
    """Attribute each re-form and interruption to the scripted event it followed.

    ``slack`` covers the last progress sample being a little older than the event that
    stopped training.
    """
    scripted = [e for e in run.events if e.source == "scenario"]
    times = [e.time for e in scripted]
    reforms: list[list[Reform]] = [[] for _ in scripted]
    stops: list[list[Interruption]] = [[] for _ in scripted]
    for reform in run_reforms(run):
        # Detection may begin before the event (a joiner seen earlier); the decision follows it.
        i = _cause_index(times, decided_at(reform), slack)
        if i is not None:
            reforms[i].append(reform)
    for stop in run_interruptions(run):
        i = _cause_index(times, stop.stopped_at, slack)
        if i is not None:
            stops[i].append(stop)
    return [EventImpact(e, tuple(r), tuple(s)) for e, r, s in zip(scripted, reforms, stops)]


def reform_label(run: RunData, reform: Reform) -> str:
    """The re-form's cause as the report shows it (``regroup.trace_report.reform_label``): as
    its plan says (drain, eviction, spot reclaim ...), and an eviction of a node the cluster
    had cordoned (``NodeNotSchedulable``, not lifted since) as the drain it is."""
    return run_records(run).label(reform)


@dataclass(frozen=True)
class EventRow:
    """One Event of the run as ``kubectl get events`` shows it: told on several objects at
    once (a job-level Event is told on each of the job's pods), or repeated, it is one row."""

    time: float
    """When it was first posted."""
    last: float
    """When it was last posted."""
    source: str
    type: str
    reason: str
    message: str
    nodes: tuple[str, ...]
    """Every object (node, or a pod's node) it was told on."""
    count: int
    """How many times it was posted on its objects (1: once)."""
    at: float | None = None
    """A scenario event's scripted time (``ScriptedEvent.at``)."""


COPIES_S = 1.0
"""Posts of one Event on several objects (the controller tells a job-level Event on each of
the job's pods, one after the other) land within this long of the first."""


def event_rows(run: RunData) -> list[EventRow]:
    """The run's Events, one row each: the copies of one Event told on several objects at
    once (same source, type, reason and message within ``COPIES_S``) are one, and one that
    repeats on the same objects (as Kubernetes counts an Event's series) is one row with
    its count and last time."""
    posts: list[tuple[tuple[str, str, str, str], float, set[str], float | None]] = []
    for e in run.events:
        key = (e.source, e.type, e.reason, e.message)
        last = next((p for p in reversed(posts) if p[0] == key), None)
        if last is not None and e.time - last[1] <= COPIES_S:
            last[2].update(e.nodes)
        else:
            posts.append((key, e.time, set(e.nodes), e.at))
    rows: dict[tuple[tuple[str, str, str, str], frozenset[str]], EventRow] = {}
    for key, at, nodes, scripted in posts:
        group = (key, frozenset(nodes))
        seen = rows.get(group)
        if seen is None:
            source, type_, reason, message = key
            rows[group] = EventRow(at, at, source, type_, reason, message, tuple(sorted(nodes)), 1, scripted)
        else:
            rows[group] = dataclasses.replace(seen, last=at, count=seen.count + 1)
    return sorted(rows.values(), key=lambda r: r.time)


def cordoned_nodes(run: RunData) -> list[str]:
    """The nodes the controller cordoned for a restart storm (its ``Cordoned`` Event; a
    drain's cordon is the cluster's ``NodeNotSchedulable``, not one of these)."""
    return sorted({n for e in run.events if e.reason == "Cordoned" for n in e.nodes})


# What ``python -m bench reform`` measures: from a scripted resize to training at the new
# size, whichever way the workers got there (in place, restarted, or plain torchrun).


def scripted_events(run: RunData) -> list[ScriptedEvent]:
    """The scenario's events as they were played (the order ``event_impacts`` uses)."""
    return [e for e in run.events if e.source == "scenario"]


NOT_SETTLED = "NotSettled"
"""The Event of a run that gave up waiting for its job to settle (before an event, or at
its end): what it measured after that is not one event's cost alone."""


def not_settled(run: RunData) -> list[ScriptedEvent]:
    """The run's ``NotSettled`` Events."""
    return [e for e in run.events if e.reason == NOT_SETTLED]
