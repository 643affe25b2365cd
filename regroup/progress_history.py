"""A job's training as its ``progress`` records tell it: incarnations, stops and lost steps.

Pure functions over the records rank 0 publishes through etcd (``progress``), as a run
keeps them (``progress.jsonl`` of a ``regroup demo`` run): what any training script
publishes, never a trainer's log text. ``regroup trace-report`` and the demo's report read
a run's lost steps from here alike.

Where a script leaves ``resumed_from_step`` out, its resume points are inferred from its
steps (``infer_resume_points``).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file ([] when there is none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _repeat_key(p: ProgressSample) -> tuple[int, int, int, int]:
    """Equal for a record that repeats the previous one. The same step from another world
    (size or round) is that world's first step, not a repeat."""
    return (p.step, p.resumed_from_step, p.world_size, p.round)


def read_progress(path: Path, script: bool = False) -> list[ProgressSample]:
    """The ``progress`` records of a JSON-lines file (``progress.jsonl`` of a run), in time
    order, a record that repeats the one before left out. ``script``: a user's script
    published them; where it reported no ``resumed_from_step``, its resume points are
    inferred (``infer_resume_points``)."""
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
        for p in read_jsonl(path)
    ]
    progress.sort(key=lambda p: p.time)
    # Rank 0 publishes again when it holds or stops at a step; a repeat adds no training.
    progress = [p for i, p in enumerate(progress) if i == 0 or _repeat_key(p) != _repeat_key(progress[i - 1])]
    if script and not any(p.resumed_from_step for p in progress):
        progress = infer_resume_points(progress)
    return progress


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


def training_stops(progress: list[ProgressSample], ended_at: float, checkpoint_step: int | None) -> list[Interruption]:
    """``interruptions`` plus, when training was stopped at the end of the run (``ended_at``),
    that stop, counted until the end and with the steps past the newest committed checkpoint
    (``checkpoint_step``; None: none known, nothing lost) lost."""
    stops = interruptions(progress)
    if not progress:
        return stops
    last = progress[-1]
    if ended_at - last.time > max(3.0, 4 * step_interval(progress)):
        stops.append(
            Interruption(
                stopped_at=last.time,
                resumed_at=ended_at,
                last_step=last.step,
                resumed_from_step=last.step if checkpoint_step is None else int(checkpoint_step),
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
