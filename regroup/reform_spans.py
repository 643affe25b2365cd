"""The re-forms a job went through, as its exported spans record them.

Every re-form is one: each ``regroup.reform`` trace (the controller's), and each new world
the agents formed on their own, without the controller (a rank crashed: the survivors
re-formed around it). The trainers' ``regroup.trainer.resume`` span tells those apart: a
resume joins the trace of the re-form that asked for it, so the first resume in a
re-form's trace is that re-form's own, and any other is a re-form of the agents' own (cause
``crash``), its nodes, their positions and the time it took read off the agents'
``regroup.rendezvous.join`` spans of the round it formed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from regroup.records import DETECT_PHASE, TRACED_PHASES, Progress, ReformPhase, ReformStrategy
from regroup.reform_causes import cause_label

REFORM_SPAN = "regroup.reform"
TRAINER_RESUME = "regroup.trainer.resume"
"""Rank 0's span of each new world the trainers reached (after its first step)."""
JOIN_SPAN = "regroup.rendezvous.join"
"""An agent's span of joining a rendezvous round (``regroup.round``, ``regroup.node``, ``regroup.rank``)."""
CRASH = "crash"
"""The cause of a re-form the agents made without the controller (a rank or worker crashed)."""
WORKER_EXIT_ATTR = "regroup.worker_exit"
"""The root span's line on workers that exited during the re-form instead of re-forming in place."""
PHASES: tuple[str, ...] = TRACED_PHASES
RESUME_PHASES: tuple[str, ...] = Progress.RESUME_PHASES
_RESUME_ATTR = "regroup.resume."
STRATEGY_ATTR = "regroup.strategy"
"""A re-form's strategy (``ReformStrategy``), as the controller's trace records it."""
REPLACED_ATTR = "regroup.replaced"
"""Who took whose position, ``n3->n5,n4->n6``, as the controller's trace records it."""


@dataclass(frozen=True)
class Reform:
    """One re-form: a ``regroup.reform`` trace, or a world the agents formed on their own."""

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
    """The trainers' resumes into a new world (not a job's first start from an older
    checkpoint: no re-form, ``regroup.reform.mode`` ``start``), in the order the worlds
    trained their first step (the spans' ends). Not by their starts: a spare that becomes
    rank 0 began its resume when it began to wait, maybe before the re-form it waited
    through resumed."""
    found = [s for s in spans if s["name"] == TRAINER_RESUME and s["attributes"].get("regroup.reform.mode") != "start"]
    return sorted(found, key=lambda s: s["end_ns"])


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
    joined: dict[str, float]
    """Node -> when its agent began to join this round (its first join span's start)."""
    positions: dict[int, str]
    """Rank -> the node in that position (where the join spans say, ``regroup.rank``)."""


def _rounds(spans: list[dict[str, Any]]) -> dict[int, _Round]:
    """Rendezvous round -> its nodes, their positions and when it formed, from the agents'
    join spans."""
    joined: dict[int, dict[str, float]] = {}
    positions: dict[int, dict[int, str]] = {}
    formed: dict[int, float] = {}
    for span in spans:
        attrs = span["attributes"]
        if span["name"] != JOIN_SPAN or attrs.get("regroup.round") is None:
            continue
        number, node = int(attrs["regroup.round"]), str(attrs.get("regroup.node", ""))
        began = joined.setdefault(number, {})
        began[node] = min(began.get(node, float("inf")), span["start_ns"] / 1e9)
        if attrs.get("regroup.rank") is not None:
            positions.setdefault(number, {})[int(attrs["regroup.rank"])] = node
        formed[number] = max(formed.get(number, 0.0), span["end_ns"] / 1e9)
    return {n: _Round(frozenset(joined[n]), formed[n], joined[n], positions.get(n, {})) for n in joined}


def _first_sign(before: _Round | None, world: _Round | None, resume_start: float) -> float | None:
    """When the agents of the last world first showed the new one coming: the first of its
    members that stays (a survivor) to begin joining its round, or its rank 0's resume
    when rank 0 is a survivor. A node that waited outside the last world (a spare) may have
    begun to join long before anything happened: its wait is not the re-form's. None when
    the spans do not say."""
    if before is None or world is None:
        return None
    signs = [world.joined[n] for n in world.nodes & before.nodes]
    if world.positions.get(0) in before.nodes:
        signs.append(resume_start)
    return min(signs) if signs else None


def _strategy(before: _Round | None, world: _Round | None) -> dict[str, str]:
    """The span attributes of an agents' re-form's strategy, by the controller's rule
    (``regroup.controller.decide.positions.strategy_of``, unplanned): ``replace`` when new
    nodes took every vacated position and the world kept its size, ``elastic`` otherwise;
    {} when the spans do not say which nodes formed the worlds."""
    if before is None or world is None:
        return {}
    vacated = before.nodes - world.nodes
    joined = world.nodes - before.nodes
    if not vacated or len(world.nodes) != len(before.nodes):
        return {STRATEGY_ATTR: ReformStrategy.ELASTIC.value}
    swaps = sorted((old, world.positions[rank]) for rank, old in before.positions.items()
                   if old in vacated and world.positions.get(rank) in joined)  # fmt: skip
    if before.positions and world.positions and len(swaps) != len(vacated):
        return {STRATEGY_ATTR: ReformStrategy.ELASTIC.value}
    replaced = ",".join(f"{old}->{new}" for old, new in swaps)
    return {STRATEGY_ATTR: ReformStrategy.REPLACE.value, **({REPLACED_ATTR: replaced} if replaced else {})}


def agent_reforms(spans: list[dict[str, Any]], traced: list[Reform] | None = None,
                  faults: Iterable[float] = ()) -> list[Reform]:  # fmt: skip
    """The new worlds the agents formed on their own (cause ``CRASH``), in time order: each
    trainer resume that is not the first in a ``regroup.reform`` trace (``traced``, read from
    ``spans`` unless given). Its world is the newest round formed by the resume's end (the
    agents' join spans), its strategy the controller's rule on the two worlds (``_strategy``),
    its lost steps unknown (-1: the spans do not say).

    It starts at the fault that set it off, when ``faults`` (unix times, e.g. the rank
    crashes a ``regroup demo`` run records) holds one since the last world's first step and
    before the first sign of the re-form (``_first_sign``): detecting it takes until that
    sign. Without one it starts at that sign, and where the spans show none, at the resume's
    start (or its end less the resume phases the trainer reported), not before the last
    world's first step."""
    traced = reforms_from_spans(spans) if traced is None else traced
    asked = {r.trace_id for r in traced}
    rounds = _rounds(spans)
    faults = sorted(faults)
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
        earliest = max(previous_end, min(start, end - sum(split.values())))
        formed = [(n, r) for n, r in rounds.items() if earliest - 1.0 <= r.formed_at <= end]
        number, world = max(formed, key=lambda item: item[0]) if formed else (0, None)
        before = rounds.get(number - 1)
        sign = _first_sign(before, world, start)
        sign = earliest if sign is None else max(previous_end, sign)
        fault = next((t for t in faults if previous_end <= t <= sign), None)
        phases = {DETECT_PHASE: sign - fault} if fault is not None else {}
        if world is not None and sign <= world.formed_at:
            phases.update({"rendezvous": world.formed_at - sign, "resume": end - world.formed_at})
        else:
            phases["resume"] = end - sign
        previous_end = end
        found.append(
            Reform(
                trace_id=trace_id,
                start=sign if fault is None else fault,
                end=end,
                cause=CRASH,
                planned=False,
                world_before=len(before.nodes) if before is not None else -1,
                world_after=len(world.nodes) if world is not None else -1,
                lost_steps=-1,
                phases=phases,
                mode=str(attrs.get("regroup.reform.mode", "")),
                resume_phases=split,
                attributes={**attrs, **_strategy(before, world)},
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


def all_reforms(spans: list[dict[str, Any]], faults: Iterable[float] = ()) -> list[Reform]:
    """Every re-form the spans record, in time order: the controller's traces and the worlds
    the agents formed on their own (``agent_reforms``, started at the ``faults`` that set
    them off where given)."""
    traced = reforms_from_spans(spans)
    return sorted([*traced, *agent_reforms(spans, traced, faults)], key=lambda r: r.start)


def decided_at(reform: Reform) -> float:
    """When the re-form was decided: its start, after the detection (which may begin before
    what caused it, e.g. a joiner seen earlier)."""
    return reform.start + reform.phases.get(DETECT_PHASE, 0.0)


def first_round(spans: list[dict[str, Any]]) -> tuple[int, float] | None:
    """(number, unix time it formed) of the first rendezvous round the join spans show; None
    without any."""
    rounds = _rounds(spans)
    return (min(rounds), rounds[min(rounds)].formed_at) if rounds else None
