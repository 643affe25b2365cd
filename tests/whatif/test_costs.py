"""What one re-form costs on each path, from recorded stalls and stated stand-ins."""

from __future__ import annotations

from datetime import timedelta

import pytest

from regroup.whatif.churn import DEFAULT_PROCESS_START, WhatIfError
from regroup.whatif.costs import costs_from_stalls
from regroup.whatif.recorded import Stall, StallKind

IN_PLACE = {"process_group": 0.1, "reshard": 0.3, "first_step": 0.2}


def stall(kind: StallKind, seconds: float, *, mode: str = "in-place", checkpoint: float = 0.0, lost: int = 0,
          phases: dict[str, float] = IN_PLACE) -> Stall:  # fmt: skip
    return Stall(start=100.0, end=100.0 + seconds, kind=kind, cause="test", mode=mode, lost_steps=lost,
                 resume_phases=phases, checkpoint=checkpoint)  # fmt: skip


IN_PLACE_STALLS = [
    stall(StallKind.PLANNED_SHRINK, 1.0, checkpoint=0.1),
    stall(StallKind.UNPLANNED, 0.4, lost=1),
    stall(StallKind.UNPLANNED, 0.6, lost=-1),
    stall(StallKind.GROW, 2.0, checkpoint=0.1),
]


def test_in_place_costs_are_the_recorded_means_and_restarts_add_start_and_load() -> None:
    costs = costs_from_stalls(IN_PLACE_STALLS, step=0.5, checkpoint=5.0, process_start_option=timedelta(seconds=30))
    assert {k: f.seconds for k, f in costs.in_place.items()} == pytest.approx(
        {StallKind.PLANNED_SHRINK: 1.0, StallKind.UNPLANNED: 0.5, StallKind.GROW: 2.0}
    )
    assert costs.in_place[StallKind.UNPLANNED].source == "recorded: 2"
    # No load recorded: reading a checkpoint back takes about what writing it took (C).
    assert (costs.load.seconds, costs.load.source) == (5.0, "as C")
    # A restart starts the process and loads instead of resharding from memory; a planned
    # one also stores its checkpoint where in place it acked from memory.
    restart = {k: f.seconds for k, f in costs.restart.items()}
    assert restart[StallKind.UNPLANNED] == pytest.approx(0.5 + 30 + 5.0 - 0.3)
    assert restart[StallKind.PLANNED_SHRINK] == pytest.approx(1.0 + 30 + 5.0 - 0.3 + (5.0 - 0.1))
    # Lost steps: as counted (1), and none for the crash resumed from memory (-1: uncounted).
    assert (costs.lost_steps.seconds, costs.lost_steps.source) == (0.5, "recorded: 2, 1 from memory")
    assert costs.step is not None and costs.step.seconds == 0.5


def test_recorded_restarts_price_the_restart_path_as_they_are() -> None:
    phases = {"startup": 4.0, "process_group": 0.1, "load": 0.5, "first_step": 0.2}
    restarts = [stall(StallKind.UNPLANNED, 6.0, mode="restart", phases=phases)]
    costs = costs_from_stalls(IN_PLACE_STALLS + restarts, step=0.5, checkpoint=5.0)
    unplanned = costs.restart[StallKind.UNPLANNED]
    assert (unplanned.seconds, unplanned.source) == (6.0, "recorded: 1")
    assert (costs.process_start.seconds, costs.process_start.source) == (4.0, "recorded")
    assert (costs.load.seconds, costs.load.source) == (0.5, "recorded")
    # Only restarts recorded: in place is a restart without its startup and load, with a reshard.
    only = costs_from_stalls(restarts, step=0.5, checkpoint=5.0)
    assert only.in_place[StallKind.UNPLANNED].seconds == pytest.approx(6.0 - 4.0 - 0.5 + 0.5)
    assert only.in_place[StallKind.UNPLANNED].source == "from restarts"


def test_a_kind_never_recorded_stands_in_from_the_others() -> None:
    costs = costs_from_stalls([stall(StallKind.GROW, 2.0, checkpoint=0.1)], step=None, checkpoint=0.5)
    assert (costs.in_place[StallKind.PLANNED_SHRINK].seconds, costs.in_place[StallKind.PLANNED_SHRINK].source) == (
        2.0, "as a grow")  # fmt: skip
    assert costs.in_place[StallKind.UNPLANNED].seconds == pytest.approx(2.0 - 0.5)
    unplanned_only = costs_from_stalls([stall(StallKind.UNPLANNED, 1.0)], step=None, checkpoint=0.5)
    assert unplanned_only.in_place[StallKind.GROW].seconds == pytest.approx(1.0 + 0.5)
    assert unplanned_only.process_start.seconds == DEFAULT_PROCESS_START.total_seconds()


def test_options_override_what_was_recorded() -> None:
    costs = costs_from_stalls(IN_PLACE_STALLS, step=0.5, checkpoint=5.0, step_option=timedelta(seconds=2),
                              checkpoint_option=timedelta(seconds=40))  # fmt: skip
    assert costs.step is not None and (costs.step.seconds, costs.step.source) == (2.0, "--step-time")
    assert (costs.checkpoint.seconds, costs.checkpoint.source) == (40.0, "--checkpoint-cost")


def test_a_figure_neither_recorded_nor_given_names_the_option_to_give() -> None:
    with pytest.raises(WhatIfError, match="--checkpoint-cost"):
        costs_from_stalls(IN_PLACE_STALLS, step=0.5, checkpoint=None)
    # Lost steps recorded, but nothing says how long a step takes.
    with pytest.raises(WhatIfError, match="--step-time"):
        costs_from_stalls(IN_PLACE_STALLS, step=None, checkpoint=5.0)
    with pytest.raises(WhatIfError, match="no re-form"):
        costs_from_stalls([], step=None, checkpoint=5.0)
