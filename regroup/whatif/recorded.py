"""What a job's own re-forms cost it, read from the spans it exported.

Every new world the trainers reached is one ``Stall``: training stopped, then ran again at
the trainers' first step in the new world. Where the trainers exported their half of the
trace (``regroup.trainer.resume``, ``regroup.trainer.checkpoint``: any script on the public
API does), each of their resumes is one stall, and it ends with that resume span. It starts:

- for a planned re-form (``regroup.planned``: the controller asked for a checkpoint first),
  when the trainers stopped at the agreed step to save: the start of the trainer's
  checkpoint span in the same trace (training goes on while the controller gathers a join
  window or waits for the checkpoint request to be seen);
- for an unplanned one, at the first sign of it: the earliest of the controller's
  ``regroup.reform`` start, the trainer's own resume start and the resume's end less the
  seconds the trainer reported resuming (on the restart path, the new process's startup
  comes before its span begins). A re-form without a resume of its own since the last
  world (one superseded by the next) starts the stall it belongs to, so its time counts.

A trainer's resume joins the trace of the re-form that asked for it; one that no re-form
asked for (the agents re-formed a crashed rank's world on their own) joins the latest
re-form's trace as a second resume. The first resume in a trace is that re-form's own; a
later one is an unplanned re-form of cause ``crash``.

Without trainer spans (a script off the public API, under plain torchrun), each
``regroup.reform`` trace is one stall, from its start (after its detect phase when planned)
to its end.
"""

from __future__ import annotations

import enum
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from regroup.records import DETECT_PHASE, Progress
from regroup.trace_report import CRASH, TRAINER_RESUME, Reform, reforms_from_spans, resume_phases

TRAINER_CHECKPOINT = "regroup.trainer.checkpoint"
RESTART_MODE = "restart"


class StallKind(enum.StrEnum):
    """What a re-form was, as far as its cost goes."""

    PLANNED_SHRINK = "planned-shrink"
    """The controller checkpointed first, the world got smaller (a reclaim with notice)."""
    UNPLANNED = "unplanned"
    """No checkpoint first: a node lost, a rank crashed, a restart storm's cordon."""
    GROW = "grow"
    """Nodes joined (a replacement, a returning node)."""


@dataclass(frozen=True)
class Stall:
    """Training stopped by one re-form, until the trainers' first step in the new world."""

    start: float
    """Unix time training stopped."""
    end: float
    """Unix time of the first step in the new world."""
    kind: StallKind
    cause: str
    """``regroup.cause`` of the re-form, or ``crash``."""
    mode: str
    """``in-place`` or ``restart``: how the workers reached the new world ("" unknown)."""
    lost_steps: int
    """Steps trained again (-1: no re-form counted them)."""
    resume_phases: dict[str, float] = field(default_factory=dict)
    """Seconds of the resume by phase (``Progress.RESUME_PHASES``), as the trainer reported them."""
    checkpoint: float = 0.0
    """Seconds the trainers spent saving before it (planned re-forms)."""
    resumed_from_step: int = -1
    """The step the new world started from (-1: not recorded)."""

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


@dataclass(frozen=True)
class _TrainerSpan:
    trace_id: str
    start: float
    end: float
    attributes: dict[str, Any]


def _trainer_spans(spans: Iterable[dict[str, Any]], name: str) -> list[_TrainerSpan]:
    found = [
        _TrainerSpan(s["trace_id"], s["start_ns"] / 1e9, s["end_ns"] / 1e9, s["attributes"])
        for s in spans
        if s["name"] == name
    ]
    return sorted(found, key=lambda s: s.start)


def _kind(reform: Reform) -> StallKind:
    if not reform.planned:
        return StallKind.UNPLANNED
    return StallKind.GROW if reform.world_after > reform.world_before else StallKind.PLANNED_SHRINK


def _churn(reforms: list[Reform]) -> list[Reform]:
    """The re-forms of a running job (the first formation, from no node, is not churn)."""
    return [r for r in reforms if r.world_before > 0]


def _stall_from_reform(reform: Reform) -> Stall:
    start = reform.start + (reform.phases.get(DETECT_PHASE, 0.0) if reform.planned else 0.0)
    return Stall(
        start=start,
        end=reform.end,
        kind=_kind(reform),
        cause=reform.cause,
        mode=reform.mode,
        lost_steps=reform.lost_steps,
        resume_phases=dict(reform.resume_phases),
        checkpoint=reform.phases.get("checkpoint", 0.0),
    )


def stalls_from_spans(spans: list[dict[str, Any]]) -> list[Stall]:
    """Every stall of training the spans record, in time order (the module docstring)."""
    reforms = _churn(reforms_from_spans(spans))
    resumes = _trainer_spans(spans, TRAINER_RESUME)
    if not resumes:
        return [_stall_from_reform(r) for r in reforms]
    checkpoints = _trainer_spans(spans, TRAINER_CHECKPOINT)
    by_trace = {r.trace_id: r for r in reforms}
    owned: set[str] = set()
    stalls: list[Stall] = []
    previous_end = float("-inf")
    for resume in resumes:
        reform = by_trace.get(resume.trace_id)
        if reform is not None and reform.trace_id in owned:
            reform = None  # a later resume in the trace: the agents re-formed on their own
        elif reform is not None:
            owned.add(reform.trace_id)
        stalls.append(_stall_from_resume(resume, reform, reforms, checkpoints, previous_end))
        previous_end = resume.end
    return stalls


def _stall_from_resume(
    resume: _TrainerSpan,
    reform: Reform | None,
    reforms: list[Reform],
    checkpoints: list[_TrainerSpan],
    previous_end: float,
) -> Stall:
    attrs = resume.attributes
    phases = resume_phases(attrs)
    saves = [c for c in checkpoints if c.trace_id == resume.trace_id and previous_end <= c.start <= resume.start]
    if reform is not None and reform.planned:
        start = saves[0].start if saves else reform.start + reform.phases.get(DETECT_PHASE, 0.0)
    else:
        # The earliest sign: this re-form, or one since the last world that had no resume of its own.
        signs = [resume.start, resume.end - sum(phases.values())]
        signs += [r.start for r in reforms if previous_end < r.start < resume.end and not r.planned]
        start = max(previous_end, min(signs))
    return Stall(
        start=start,
        end=resume.end,
        kind=_kind(reform) if reform is not None else StallKind.UNPLANNED,
        cause=reform.cause if reform is not None else CRASH,
        mode=str(attrs.get("regroup.reform.mode", "")),
        lost_steps=reform.lost_steps if reform is not None else -1,
        resume_phases=phases,
        checkpoint=sum(float(c.attributes.get("regroup.checkpoint.duration_s", c.end - c.start)) for c in saves),
        resumed_from_step=int(attrs.get("regroup.resumed_from_step", -1)),
    )


def step_seconds(spans: list[dict[str, Any]], stalls: list[Stall]) -> float | None:
    """Seconds per training step between re-forms, from the trainers' spans (None: too few).

    A world starts at its first step (``resumed_from_step + 1``, done when the trainer's
    resume span ends) and trains until the next stall: up to the step a planned checkpoint
    saved (``regroup.step``), or to the resume point of an unplanned re-form that counted
    its lost steps. Steps over seconds, summed over every such world.
    """
    saves = _trainer_spans(spans, TRAINER_CHECKPOINT)
    steps, seconds = 0, 0.0
    for world, following in zip(stalls, stalls[1:]):
        if world.resumed_from_step < 0 or following.start <= world.end:
            continue
        if following.kind != StallKind.UNPLANNED:
            save = next((c for c in saves if world.end <= c.start <= following.end), None)
            last = -1 if save is None else int(save.attributes.get("regroup.step", -1))
        elif following.lost_steps >= 0 and following.resumed_from_step >= 0:
            last = following.resumed_from_step + following.lost_steps
        else:
            last = -1
        trained = last - (world.resumed_from_step + 1)
        if last >= 0 and trained > 0:
            steps += trained
            seconds += following.start - world.end
    return seconds / steps if steps else None


def resumed_from_memory(stall: Stall) -> bool:
    """The new world took its state from the survivors' memory (resharded, nothing loaded):
    at most ``snapshot.max_every`` steps back."""
    return "reshard" in stall.resume_phases and "load" not in stall.resume_phases


def _saves(spans: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Seconds of each trainer checkpoint: (those that wrote to storage, those acked from memory).

    A save wrote when ``regroup.checkpoint.stored`` says so, or, where an older trainer does
    not say, when it counted bytes."""
    stored, from_memory = [], []
    for save in _trainer_spans(spans, TRAINER_CHECKPOINT):
        attrs = save.attributes
        seconds = float(attrs.get("regroup.checkpoint.duration_s", save.end - save.start))
        flag = attrs.get("regroup.checkpoint.stored")
        wrote = bool(attrs.get("regroup.checkpoint.bytes")) if flag is None else bool(flag)
        (stored if wrote else from_memory).append(seconds)
    return stored, from_memory


def checkpoint_seconds(spans: list[dict[str, Any]]) -> float | None:
    """Mean seconds the trainers took to save a checkpoint to storage (None: none recorded).

    Only saves that wrote (``regroup.checkpoint.stored``, or bytes where an older trainer
    does not say): an ack from memory writes nothing."""
    stored, _ = _saves(spans)
    return statistics.fmean(stored) if stored else None


@dataclass(frozen=True)
class RecordedCheckpoint:
    """``C`` as the spans record it, and what it was read from."""

    seconds: float
    source: str


FROM_MEMORY = "acked from memory at {n} re-forms, not saved to storage: the spans time no save to storage"
"""The source of a ``C`` read from checkpoints that were acked from memory (``from_memory``)."""


def from_memory(source: str) -> bool:
    """``C``'s ``source`` says it is an ack from memory standing in for a save to storage."""
    return source.startswith(FROM_MEMORY.split("{", 1)[0])


def recorded_checkpoint(spans: list[dict[str, Any]]) -> RecordedCheckpoint | None:
    """What one checkpoint stopped training, as the trainers recorded it
    (``regroup.trainer.checkpoint``): the mean of their saves to storage; where every
    checkpoint was acked from memory (an in-place job: the state the re-form hands over is
    in memory), the mean of those, said so: a save to storage costs more, and the
    strategies that restart from storage are priced low by it. None when the spans record
    no checkpoint at all."""
    stored, from_memory = _saves(spans)
    if stored:
        return RecordedCheckpoint(statistics.fmean(stored), "recorded")
    if from_memory:
        return RecordedCheckpoint(statistics.fmean(from_memory), FROM_MEMORY.format(n=len(from_memory)))
    return None


def mean_phase(stalls: Iterable[Stall], phase: str) -> float | None:
    """Mean seconds of a resume phase over the stalls that reported it (None: none did)."""
    assert phase in Progress.RESUME_PHASES, phase
    values = [s.resume_phases[phase] for s in stalls if phase in s.resume_phases]
    return statistics.fmean(values) if values else None
