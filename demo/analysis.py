"""What a recorded run shows: re-forms, lost steps, continuity and goodput.

Pure functions over the files a run leaves (``progress.jsonl``, ``members.jsonl``,
``events.jsonl``, ``spans.jsonl``, ``run.json``), so the report, the test and the
benchmark read the same facts from the same records.

Everything comes from what any training script publishes through etcd (the ``progress``
record) and from the controller's spans and events, never from a trainer's log text or
config: a user's script (``regroup demo --script``) is measured like the built-in trainer.
Where a script leaves a field out, the analysis falls back or says so (``RunData.reported``):
a script that does not report ``resumed_from_step`` gets its resume points inferred from
its steps (``infer_resume_points``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regroup.records import DETECT_PHASE
from regroup.telemetry import read_spans
from regroup.trace_report import Origin, Reform, all_reforms, demo_start


@dataclass(frozen=True)
class ProgressSample:
    """One ``progress`` record as the recorder saw it."""

    time: float
    step: int
    loss: float
    world_size: int
    resumed_from_step: int
    samples_seen: int = 0
    round: int = 0
    """Rendezvous round of the world this progress comes from (0: not reported)."""
    reform_mode: str = ""
    """``in-place`` or ``restart``: how this world came to be ("" unknown or first start)."""
    resume_phases: dict[str, float] = field(default_factory=dict, hash=False)
    """Seconds rank 0 spent resuming this world, by phase (empty: not reported)."""
    resume_inferred: bool = False
    """``resumed_from_step`` was not reported (a user's script) but inferred from the steps:
    a new world (round or size) then also starts a new incarnation."""
    last_step_before: int = -1
    """The trainers' own newest step before this world (``Progress.last_step``; -1: not
    reported): a step the recorder may not have seen (rank 0 publishes every interval)."""


@dataclass(frozen=True)
class Incarnation:
    """A stretch of training from one start (or resume) to the next."""

    resumed_from_step: int
    samples: tuple[ProgressSample, ...]

    @property
    def first_step(self) -> int:
        return self.samples[0].step

    @property
    def last_step(self) -> int:
        return self.samples[-1].step

    @property
    def start(self) -> float:
        return self.samples[0].time

    @property
    def end(self) -> float:
        return self.samples[-1].time


@dataclass(frozen=True)
class Interruption:
    """Training stopped between two incarnations."""

    stopped_at: float
    """Time of the last progress before the stop."""
    resumed_at: float
    """Time of the first progress after training resumed."""
    last_step: int
    resumed_from_step: int
    """For a stop that never resumed: the newest committed checkpoint, where it would resume."""
    resumed: bool = True
    """False when training had not resumed by the end of the run (``resumed_at`` is the end)."""

    @property
    def lost_steps(self) -> int:
        return max(0, self.last_step - self.resumed_from_step)

    @property
    def downtime(self) -> float:
        return self.resumed_at - self.stopped_at


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


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _repeat_key(p: ProgressSample) -> tuple[int, int, int, int]:
    """Equal for a record that repeats the previous one. The same step from another world
    (size or round) is that world's first step, not a repeat."""
    return (p.step, p.resumed_from_step, p.world_size, p.round)


def load_run(root: Path) -> RunData:
    """Read a run folder (raises FileNotFoundError naming ``run.json`` if it is not one)."""
    meta_path = root / "run.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path}: not a demo run folder (no run.json)")
    meta = json.loads(meta_path.read_text())
    progress = [
        ProgressSample(
            time=float(p.get("time") or p["seen"]),
            step=int(p["step"]),
            loss=float(p["loss"]),
            world_size=int(p["world_size"]),
            resumed_from_step=int(p.get("resumed_from_step", 0)),
            samples_seen=int(p.get("samples_seen", 0)),
            round=int(p.get("round", 0)),
            reform_mode=str(p.get("reform_mode", "")),
            resume_phases={str(k): float(v) for k, v in (p.get("resume_phases") or {}).items()},
            last_step_before=int(p.get("last_step", -1)),
        )
        for p in _jsonl(root / "progress.jsonl")
    ]
    progress.sort(key=lambda p: p.time)
    # Rank 0 publishes again when it holds or stops at a step; a repeat adds no training.
    progress = [p for i, p in enumerate(progress) if i == 0 or _repeat_key(p) != _repeat_key(progress[i - 1])]
    if meta.get("script") and not any(p.resumed_from_step for p in progress):
        progress = infer_resume_points(progress)
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
        for e in _jsonl(root / "events.jsonl")
    ]
    spans_path = root / "spans.jsonl"
    spans = read_spans(spans_path) if spans_path.exists() else []
    return RunData(root, meta, progress, _jsonl(root / "members.jsonl"), events, spans, _jsonl(root / "plans.jsonl"))


def _other_world(sample: ProgressSample, before: ProgressSample) -> bool:
    rounds = sample.round != before.round and sample.round > 0 and before.round > 0
    return sample.world_size != before.world_size or rounds


def _groups(progress: list[ProgressSample]) -> list[list[ProgressSample]]:
    result: list[list[ProgressSample]] = []
    for sample in progress:
        current = result[-1] if result else None
        if (
            current is None
            or sample.resumed_from_step != current[-1].resumed_from_step
            or sample.step < current[-1].step
            or (sample.resume_inferred and _other_world(sample, current[-1]))
        ):
            result.append([sample])
        else:
            result[-1].append(sample)
    return result


def incarnations(progress: list[ProgressSample]) -> list[Incarnation]:
    """Split progress into incarnations: a new one starts when the trainer resumed from a
    different checkpoint or its step went backwards (or, where the resume points were
    inferred, when a new world trained)."""
    return [Incarnation(group[0].resumed_from_step, tuple(group)) for group in _groups(progress)]


def infer_resume_points(progress: list[ProgressSample]) -> list[ProgressSample]:
    """``progress`` from a script that reports no ``resumed_from_step``, with one inferred
    for each incarnation: a new one starts where the step went backwards or a new world
    (round or size) trained, and resumed from the step before its first progress, or from
    the last step the run had recorded when that is older (a resume from memory is never
    counted as a skip). Lost steps are then the steps trained again; when the script
    publishes progress less often than every step, up to one publishing interval of them
    may be missed.

    Where every inferred point is 0 (training never resumed, or only ever started over from
    scratch) a reported 0 says the same: ``progress`` is returned as it is."""
    marked = [dataclasses.replace(p, resumed_from_step=0, resume_inferred=True) for p in progress]
    out: list[ProgressSample] = []
    previous: list[ProgressSample] | None = None
    for group in _groups(marked):
        resumed_from = 0 if previous is None else max(0, min(group[0].step - 1, previous[-1].step))
        out += [dataclasses.replace(p, resumed_from_step=resumed_from) for p in group]
        previous = group
    return out if any(p.resumed_from_step for p in out) else progress


def interruptions(progress: list[ProgressSample]) -> list[Interruption]:
    """Every stop of training, from one incarnation to the next. The last step before a
    stop is the newest the recorder saw, or the trainers' own count when newer (the
    controller's lost steps come from the same fact)."""
    parts = incarnations(progress)
    return [
        Interruption(
            stopped_at=before.end,
            resumed_at=after.start,
            last_step=max(before.last_step, after.samples[0].last_step_before),
            resumed_from_step=after.resumed_from_step,
        )
        for before, after in itertools.pairwise(parts)
    ]


def run_interruptions(run: RunData) -> list[Interruption]:
    """``interruptions`` plus, when training was stopped at the end of the run, that stop,
    counted until the end and with the steps past the newest committed checkpoint lost."""
    stops = interruptions(run.progress)
    if not run.progress:
        return stops
    last = run.progress[-1]
    if run.ended_at - last.time > max(3.0, 4 * step_interval(run.progress)):
        checkpoint = run.meta.get("latest_checkpoint_step")
        stops.append(
            Interruption(
                stopped_at=last.time,
                resumed_at=run.ended_at,
                last_step=last.step,
                resumed_from_step=last.step if checkpoint is None else int(checkpoint),
                resumed=False,
            )
        )
    return stops


def resumed_from_memory(part: Incarnation) -> bool:
    """The incarnation resumed from the survivors' memory, not from a checkpoint."""
    phases = part.samples[0].resume_phases
    return "reshard" in phases and "load" not in phases


def continuity_errors(progress: list[ProgressSample]) -> list[str]:
    """Why the loss curve is not continuous, or [] when it is.

    Continuous: within an incarnation, steps only go up; each resume starts from a step
    the run had reached and not from before the previous resume; no step of the final
    trajectory is missing (each incarnation picks up at or before where the last stopped).

    A resume from the survivors' memory (``reshard``, nothing loaded) may start past the
    last recorded step: that state is the step they trained last, in the world they just
    left, and only rank 0 publishes progress. When rank 0 is the rank that died, the steps
    it completed with the others after its last record die with it (not trained again,
    not skipped: just not recorded). A resume from a checkpoint must never start past it.
    """
    errors = []
    parts = incarnations(progress)
    for i, part in enumerate(parts):
        steps = [s.step for s in part.samples]
        if any(b < a for a, b in itertools.pairwise(steps)):
            errors.append(f"incarnation {i}: steps go backwards: {steps}")
        if part.first_step < part.resumed_from_step:
            errors.append(f"incarnation {i}: first step {part.first_step} before its checkpoint {part.resumed_from_step}")
        if i == 0:
            continue
        before = parts[i - 1]
        if part.resumed_from_step > before.last_step and not resumed_from_memory(part):
            errors.append(
                f"incarnation {i}: resumed from step {part.resumed_from_step}, "
                f"but the run had only reached {before.last_step} (steps skipped)"
            )
        if part.resumed_from_step < before.resumed_from_step:
            errors.append(
                f"incarnation {i}: resumed from step {part.resumed_from_step}, "
                f"older than the previous resume ({before.resumed_from_step})"
            )
    return errors


def step_interval(progress: list[ProgressSample]) -> float:
    """Median seconds per step while training (0 when unknown)."""
    rates = []
    for part in incarnations(progress):
        for a, b in itertools.pairwise(part.samples):
            if b.step > a.step and b.time > a.time:
                rates.append((b.time - a.time) / (b.step - a.step))
    return statistics.median(rates) if rates else 0.0


def useful_training_time(progress: list[ProgressSample], since: float = 0.0) -> float:
    """Seconds spent computing steps that the final trajectory kept, from ``since`` on.

    A stretch between two progress samples of one incarnation counts in proportion to its
    steps that were not lost, i.e. not rolled back by a later resume from an older checkpoint;
    a stretch that began before ``since`` counts from there.
    """
    parts = incarnations(progress)
    total = 0.0
    for i, part in enumerate(parts):
        # Steps beyond the next incarnation's resume point were redone: they do not count.
        keep_until = parts[i + 1].resumed_from_step if i + 1 < len(parts) else part.last_step
        for a, b in itertools.pairwise(part.samples):
            if b.step <= a.step:
                continue
            kept = max(0, min(b.step, keep_until) - a.step)
            total += max(0.0, b.time - max(a.time, since)) * kept / (b.step - a.step)
    return total


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


def run_reforms(run: RunData) -> list[Reform]:
    """Every re-form decided once training had started (the job's initial formation is not
    churn): the controller's traces and the worlds the agents formed on their own after a
    crash (``regroup.trace_report.all_reforms``)."""
    return [r for r in all_reforms(run.spans) if r.start + r.phases.get(DETECT_PHASE, 0.0) >= run.started_at]


MATCH_S = 5.0
"""How far a re-form's first step in its new world (its trainers' resume) may be from the
first progress record after a stop for the two to be one."""

STOPPED = "stopped"
"""The cause of a row for a stop of training no re-form of the spans accounts for (one that
had not resumed by the end of the run, or a script that exports no spans of its own)."""


def reform_rows(run: RunData) -> list[Reform]:
    """The re-form table's rows: every re-form (``run_reforms``) with its lost steps as the
    summary counts them (``run_interruptions``: the stop of training it ended), and a row
    for each stop no re-form accounts for, so the table's lost steps add up to the summary's.

    A stop is the re-form's whose trainers' first step in the new world (their resume, or
    the trace's end) is nearest to the first progress after the stop, within ``MATCH_S``; a
    re-form that stopped no training lost nothing."""
    reforms = run_reforms(run)
    stops = run_interruptions(run)
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
        decided = reform.start + reform.phases.get(DETECT_PHASE, 0.0)
        i = _cause_index(times, decided, slack)
        if i is not None:
            reforms[i].append(reform)
    for stop in run_interruptions(run):
        i = _cause_index(times, stop.stopped_at, slack)
        if i is not None:
            stops[i].append(stop)
    return [EventImpact(e, tuple(r), tuple(s)) for e, r, s in zip(scripted, reforms, stops)]


_EVICTIONS = ("eviction", "pod deletion")
CORDON, UNCORDON = "NodeNotSchedulable", "NodeSchedulable"
"""The cluster's Events of a node's cordon (a drain's first half) and of its end."""


def _notice_nodes(reason: str) -> list[str]:
    """The nodes a reclaim plan's reason names: ``reclaim notice on n2 (...), n3 (...)``."""
    return re.findall(r"(?:^reclaim notice on |\), )([^\s,()]+) \(", reason)


def reform_label(run: RunData, reform: Reform) -> str:
    """The re-form's cause as the report shows it: as its plan says (``Reform.label``: drain,
    eviction, spot reclaim ...), and an eviction of a node the cluster had cordoned
    (``NodeNotSchedulable``, not lifted since) as the drain it is: a drain cordons the node,
    then evicts its pods, and the plan names the notice that ends first, the eviction's."""
    label = reform.label
    if label not in _EVICTIONS:
        return label
    decided = reform.start + reform.phases.get(DETECT_PHASE, 0.0) + 1.0
    for node in _notice_nodes(reform.reason):
        marks = [e.reason for e in run.events if e.reason in (CORDON, UNCORDON) and node in e.nodes
                 and e.time <= decided]  # fmt: skip
        if marks and marks[-1] == CORDON:
            return "drain"
    return label


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
    return sorted({n for e in run.events if e.reason == "Cordoned" for n in e.nodes})


# What ``python -m bench reform`` measures: from a scripted resize to training at the new
# size, whichever way the workers got there (in place, restarted, or plain torchrun).


def scripted_events(run: RunData) -> list[ScriptedEvent]:
    """The scenario's events as they were played (the order ``event_impacts`` uses)."""
    return [e for e in run.events if e.source == "scenario"]


