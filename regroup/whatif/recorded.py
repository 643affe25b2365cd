"""What a job's own re-forms cost it, read from the spans it exported.

Every new world the trainers reached is one ``Stall``: training stopped, then ran again at
the trainers' first step in the new world. The re-forms are the ones ``regroup trace-report``
and the demo's report show (``regroup.reform_spans.all_reforms``): the controller's traces,
and the worlds the agents formed on their own (a rank crashed: cause ``crash``). Where the
trainers exported their half of the trace (``regroup.trainer.resume``,
``regroup.trainer.checkpoint``: any script on the public API does), each re-form with a
resume of its own is one stall, and it ends at that resume's end, as its row does. It starts:

- for a planned re-form (``regroup.planned``: the controller asked for a checkpoint first),
  when the trainers stopped at the agreed step to save: the start of the trainer's
  checkpoint span in the same trace (training goes on while the controller gathers a join
  window or waits for the checkpoint request to be seen), so the stall is its row less
  those seconds;
- for an unplanned one, where its row starts: the controller's ``regroup.reform`` start,
  or for a world the agents formed on their own, the crash a ``regroup demo`` run recorded
  (``faults``), else the first survivor of the last world to begin joining the new one (a
  spare's wait in the round is not the re-form's), else the trainer's resume start or its
  end less the seconds it reported resuming. A re-form without a resume of its own (one
  superseded by the next) starts the stall it belongs to, so its time counts. A re-form the
  controller began before the last world's first step (a restart storm's cordon decided
  while the crash's world resumed) stalls from its own trainers' resume: the last world
  trained until then.

Stalls are in the order training resumed (each new world's first step), not the order the
re-forms started.

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
from regroup.trace_report import TRAINER_RESUME, Reform, all_reforms, resume_phases

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
    """The re-forms of a running job (the first formation, from no node, is not churn; a
    world the agents formed on their own always had one before it)."""
    return [r for r in reforms if not r.asked or r.world_before > 0]


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


def stalls_from_spans(spans: list[dict[str, Any]], faults: Iterable[float] = ()) -> list[Stall]:
    """Every stall of training the spans record, in the order training resumed (the module
    docstring). ``faults``: unix times of the rank crashes a ``regroup demo`` run recorded,
    where the worlds the agents formed on their own start (``all_reforms``)."""
    reforms = _churn(all_reforms(spans, faults))
    resumed = sorted((r for r in reforms if r.resumed_at), key=lambda r: r.resumed_at)
    if not resumed:
        return [_stall_from_reform(r) for r in reforms]
    own = {(s.trace_id, s.end): s for s in _trainer_spans(spans, TRAINER_RESUME)}
    checkpoints = _trainer_spans(spans, TRAINER_CHECKPOINT)
    superseded = [r.start for r in reforms if not r.resumed_at and not r.planned]
    stalls: list[Stall] = []
    previous_end = float("-inf")
    for reform in resumed:
        resume = own.get((reform.trace_id, reform.resumed_at))
        attrs = reform.attributes if resume is None else resume.attributes
        saves = [c for c in checkpoints
                 if c.trace_id == reform.trace_id and previous_end <= c.start <= reform.resumed_at]  # fmt: skip
        since = [t for t in superseded if previous_end < t < reform.resumed_at]
        stalls.append(
            Stall(
                start=_stall_start(reform, resume, saves, since, previous_end),
                end=reform.resumed_at,
                kind=_kind(reform),
                cause=reform.cause,
                mode=str(attrs.get("regroup.reform.mode", reform.mode)),
                lost_steps=reform.lost_steps,
                resume_phases=resume_phases(attrs) or dict(reform.resume_phases),
                checkpoint=sum(float(c.attributes.get("regroup.checkpoint.duration_s", c.end - c.start))
                               for c in saves),  # fmt: skip
                resumed_from_step=int(attrs.get("regroup.resumed_from_step", -1)),
            )
        )
        previous_end = reform.resumed_at
    return stalls


def _stall_start(reform: Reform, resume: _TrainerSpan | None, saves: list[_TrainerSpan], superseded: list[float],
                 previous_end: float) -> float:  # fmt: skip
    """When training stopped for ``reform``, whose trainers' first step in the new world
    follows ``previous_end`` (the last world's): ``saves`` are its trainers' checkpoints since,
    ``superseded`` the starts of the unplanned re-forms since that had no resume of their own."""
    if reform.planned:
        return saves[0].start if saves else reform.start + reform.phases.get(DETECT_PHASE, 0.0)
    if reform.start >= previous_end:
        return min([reform.start, *superseded])
    # Begun before the last world's first step, it waited while that world trained: the first
    # sign since is its trainers' resume, its start or its end less the phases they reported
    # (a start before the last world's first step is a spare's wait in the round, not this stall).
    signs = [*superseded]
    if resume is not None:
        reported = sum(resume_phases(resume.attributes).values())
        signs += [t for t in (resume.start, resume.end - reported) if t >= previous_end]
    return min(signs, default=previous_end)


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
