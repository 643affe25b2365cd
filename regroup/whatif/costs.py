"""What one re-form of each kind costs, in place and with restarted workers: the recorded
stalls' means, and where the spans hold none of a kind, a stated stand-in.

Every figure carries its source, so the output can say which numbers were measured on the
job and which were filled in:

- a kind recorded on one path but not the other converts through the resume phases that
  differ: a restart adds the new process's ``startup`` and the ``load`` from storage, and
  needs no ``reshard`` from memory; a planned re-form on the restart path must store its
  checkpoint (``C``) where an in-place one acks from memory;
- a kind not recorded at all stands in from another: a planned shrink and a grow for each
  other (both checkpoint, rendezvous and resume), an unplanned re-form from a planned one
  less its checkpoint, a planned one from an unplanned one plus ``C``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

from regroup.whatif.churn import DEFAULT_PROCESS_START, WhatIfError
from regroup.whatif.recorded import RESTART_MODE, Stall, StallKind, mean_phase, resumed_from_memory


@dataclass(frozen=True)
class Figure:
    """A number of seconds and where it comes from."""

    seconds: float
    source: str
    """``recorded`` (``recorded: n`` for a mean of n re-forms), ``--option``, ``default``,
    or how it was derived."""


@dataclass(frozen=True)
class ReformCosts:
    """Seconds of training one re-form costs, by kind and path, and what they derive from."""

    in_place: dict[StallKind, Figure]
    """Stall of an in-place re-form (the survivors keep their processes and their state)."""
    restart: dict[StallKind, Figure]
    """Stall of a re-form that restarts every worker (no lost work counted: that depends on
    the checkpoint interval)."""
    lost_steps: Figure
    """Mean steps an unplanned in-place re-form trains again (in ``seconds``' place: a count)."""
    step: Figure | None
    """Seconds per training step (None: not recorded and not given)."""
    checkpoint: Figure
    """``C``: one checkpoint saved to storage, training stopped meanwhile."""
    planned_wait: Figure
    """The checkpoint part of an in-place planned re-form: what a reclaim notice must fit."""
    process_start: Figure
    """A restarted worker's start, before it can join the rendezvous."""
    load: Figure
    """Reading the state back from a checkpoint."""


def _is_restart(stall: Stall) -> bool:
    return stall.mode == RESTART_MODE or "startup" in stall.resume_phases


def _mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def _recorded(stalls: list[Stall], value: Callable[[Stall], float]) -> Figure | None:
    if not stalls:
        return None
    return Figure(_mean([value(s) for s in stalls]), f"recorded: {len(stalls)}")


def _option(value: timedelta | None, option: str, recorded: float | None, source: str = "recorded") -> Figure | None:
    """The option when given, else the recorded figure (None: neither)."""
    if value is not None:
        return Figure(value.total_seconds(), option)
    return None if recorded is None else Figure(recorded, source)


def costs_from_stalls(
    stalls: list[Stall],
    *,
    step: float | None,
    checkpoint: float | None,
    step_option: timedelta | None = None,
    checkpoint_option: timedelta | None = None,
    process_start_option: timedelta | None = None,
    checkpoint_source: str = "recorded",
) -> ReformCosts:
    """The costs of re-forms, from the recorded ``stalls`` (options override what they measure).

    ``step`` and ``checkpoint`` are what the spans measured (``recorded.step_seconds``,
    ``recorded.recorded_checkpoint``, whose source ``checkpoint_source`` says); raises
    ``WhatIfError`` naming the option to give when a needed figure is neither recorded nor
    given.
    """
    if not stalls:
        raise WhatIfError("the spans record no re-form")
    restarts = [s for s in stalls if _is_restart(s)]
    in_place = [s for s in stalls if not _is_restart(s)]
    save = _option(checkpoint_option, "--checkpoint-cost", checkpoint, checkpoint_source)
    if save is None:
        raise WhatIfError(
            "the spans record no checkpoint (no regroup.trainer.checkpoint span: the trainers exported none, or no "
            "re-form asked them for one): give --checkpoint-cost, the seconds one save to storage stops training"
        )
    start = _option(process_start_option, "--process-start", mean_phase(restarts, "startup")) or Figure(
        DEFAULT_PROCESS_START.total_seconds(), "default; --process-start"
    )
    recorded_load = mean_phase(stalls, "load")
    load = Figure(recorded_load, "recorded") if recorded_load is not None else Figure(save.seconds, "as C")
    # Moving the state between hosts instead of from storage: about the same bytes.
    reshard = mean_phase(in_place, "reshard")
    restart_extra = start.seconds + load.seconds - (load.seconds if reshard is None else reshard)
    in_place_costs, restart_costs = _path_costs(in_place, restarts, save.seconds, restart_extra)
    planned = [s for s in in_place if s.kind != StallKind.UNPLANNED]
    planned_wait = _recorded(planned, lambda s: s.checkpoint) or Figure(save.seconds, "as C")
    step_figure = _option(step_option, "--step-time", step)
    lost = _lost_steps(in_place)
    if lost.seconds > 0 and step_figure is None:
        raise WhatIfError(
            "the spans record lost steps but no step time (too few steps between re-forms): give --step-time"
        )
    return ReformCosts(in_place_costs, restart_costs, lost, step_figure, save, planned_wait, start, load)


def _lost_steps(in_place: list[Stall]) -> Figure:
    """Mean steps an unplanned in-place re-form trained again: as the controller counted
    them, and none for a world the agents re-formed on their own from the survivors' memory
    (a snapshot is at most ``snapshot.max_every`` steps old, one by default)."""
    unplanned = [s for s in in_place if s.kind == StallKind.UNPLANNED]
    counted = [s for s in unplanned if s.lost_steps >= 0]
    from_memory = [s for s in unplanned if s.lost_steps < 0 and resumed_from_memory(s)]
    figure = _recorded(counted + from_memory, lambda s: float(max(0, s.lost_steps)))
    if figure is None:
        return Figure(0.0, "none recorded")
    return replace(figure, source=f"{figure.source}, {len(from_memory)} from memory") if from_memory else figure


def _path_costs(in_place: list[Stall], restarts: list[Stall], checkpoint: float,
                restart_extra: float) -> tuple[dict[StallKind, Figure], dict[StallKind, Figure]]:  # fmt: skip
    """Each kind's stall in place and on the restart path: recorded, converted from the other
    path (a restart costs ``restart_extra`` more, and a planned one stores its checkpoint),
    or stood in for (``_fill_kinds``)."""

    def by_kind(group: list[Stall]) -> dict[StallKind, tuple[Figure, float]]:
        found = {}
        for kind in StallKind:
            of_kind = [s for s in group if s.kind == kind]
            figure = _recorded(of_kind, lambda s: s.seconds)
            if figure is not None:
                found[kind] = (figure, _mean([s.checkpoint for s in of_kind]))
        return found

    recorded_in_place, recorded_restart = by_kind(in_place), by_kind(restarts)
    in_place_costs = {kind: figure for kind, (figure, _) in recorded_in_place.items()}
    for kind, (figure, _) in recorded_restart.items():
        if kind not in in_place_costs:
            in_place_costs[kind] = Figure(max(0.0, figure.seconds - restart_extra), "from restarts")
    _fill_kinds(in_place_costs, checkpoint)
    restart_costs = {kind: figure for kind, (figure, _) in recorded_restart.items()}
    for kind in StallKind:
        if kind not in restart_costs:
            saved = recorded_in_place[kind][1] if kind in recorded_in_place else 0.0
            store = 0.0 if kind == StallKind.UNPLANNED else max(0.0, checkpoint - saved)
            restart_costs[kind] = Figure(in_place_costs[kind].seconds + restart_extra + store, "from in-place")
    return in_place_costs, restart_costs


def _fill_kinds(costs: dict[StallKind, Figure], checkpoint: float) -> None:
    """Stand in for the kinds no re-form recorded, from the others (the module docstring)."""
    shrink, grow = costs.get(StallKind.PLANNED_SHRINK), costs.get(StallKind.GROW)
    unplanned = costs.get(StallKind.UNPLANNED)
    if shrink is None and grow is None:
        if unplanned is None:
            raise WhatIfError("the spans record no re-form")
        shrink = grow = Figure(unplanned.seconds + checkpoint, "unplanned + C")
    if shrink is None and grow is not None:
        shrink = Figure(grow.seconds, "as a grow")
    if grow is None and shrink is not None:
        grow = Figure(shrink.seconds, "as a planned shrink")
    if unplanned is None and shrink is not None:
        unplanned = Figure(max(0.0, shrink.seconds - checkpoint), "planned - C")
    assert shrink is not None and grow is not None and unplanned is not None
    costs.update({StallKind.PLANNED_SHRINK: shrink, StallKind.GROW: grow, StallKind.UNPLANNED: unplanned})
