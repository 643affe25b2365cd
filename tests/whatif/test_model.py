"""The goodput model on hand-made costs: steady state, churn, Young's interval, min nodes."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import timedelta

import pytest

from regroup.whatif.churn import Churn, JobShape
from regroup.whatif.costs import Figure, ReformCosts
from regroup.whatif.model import MIN_SLACK, Outcome, Strategy, outcomes, young_interval
from regroup.whatif.recorded import StallKind


def made_costs(*, planned: float = 1.5, unplanned: float = 1.0, grow: float = 2.0, restart: float = 60.0,
               checkpoint: float = 10.0, planned_wait: float = 0.2, lost_steps: float = 0.0,
               step: float = 1.0) -> ReformCosts:  # fmt: skip
    """In place as given; the restart path ``restart`` seconds more for every kind."""
    in_place = {StallKind.PLANNED_SHRINK: planned, StallKind.UNPLANNED: unplanned, StallKind.GROW: grow}
    return ReformCosts(
        in_place={k: Figure(v, "test") for k, v in in_place.items()},
        restart={k: Figure(v + restart, "test") for k, v in in_place.items()},
        lost_steps=Figure(lost_steps, "test"), step=Figure(step, "test"), checkpoint=Figure(checkpoint, "test"),
        planned_wait=Figure(planned_wait, "test"), process_start=Figure(restart, "test"),
        load=Figure(checkpoint, "test"),
    )  # fmt: skip


def by_strategy(found: list[Outcome]) -> dict[Strategy, Outcome]:
    return {o.strategy: o for o in found}


def minutes(n: float) -> timedelta:
    return timedelta(minutes=n)


def test_without_churn_every_strategy_trains_all_the_time() -> None:
    found = by_strategy(outcomes(made_costs(), Churn(), JobShape(8, spares=2)))
    assert set(found) == set(Strategy)
    for outcome in found.values():
        assert outcome.time_goodput == 1.0 and outcome.running == 1.0
        assert outcome.checkpoint_every is None, "no failure, no periodic checkpoint"
    # Idle spares are nodes held that do not train.
    assert found[Strategy.SPARES].throughput_goodput == pytest.approx(8 / 10)
    assert found[Strategy.IN_PLACE].throughput_goodput == 1.0
    assert found[Strategy.CHECKPOINT_RESTART].throughput_goodput == 1.0


def test_in_place_loses_the_recorded_stall_of_each_event() -> None:
    # Replaced at once: no node is ever away, every reclaim is followed by one grow.
    churn = Churn(reclaim_every=timedelta(seconds=1000), replace_after=timedelta(0))
    found = by_strategy(outcomes(made_costs(planned=1.5, grow=2.0), churn, JobShape(4)))
    assert found[Strategy.IN_PLACE].time_goodput == pytest.approx(1 - (1.5 + 2.0) / 1000)
    assert found[Strategy.IN_PLACE].event_costs == {"reclaim": 1.5, "loss": 1.0, "flaky node": 4 * 1.0 + 2 * 2.0,
                                                    "grow": 2.0}  # fmt: skip


def test_lost_steps_cost_their_step_time_in_place() -> None:
    churn = Churn(loss_every=timedelta(seconds=1000), replace_after=timedelta(0))
    found = by_strategy(outcomes(made_costs(unplanned=1.0, lost_steps=3, step=0.5), churn, JobShape(4)))
    assert found[Strategy.IN_PLACE].event_costs["loss"] == pytest.approx(1.0 + 3 * 0.5)


def test_restarting_elastic_also_loses_half_a_checkpoint_interval_per_loss() -> None:
    churn = Churn(loss_every=timedelta(seconds=1000), replace_after=timedelta(0))
    restart = by_strategy(outcomes(made_costs(checkpoint=10.0), churn, JobShape(4)))[Strategy.RESTART]
    interval = math.sqrt(2 * 10.0 * 1000)
    assert restart.checkpoint_every == pytest.approx(interval)
    lost = (1.0 + 60 + interval / 2) + (2.0 + 60)  # the loss, then its replacement's grow
    assert restart.time_goodput == pytest.approx(1 - 10.0 / interval - lost / 1000)


def test_checkpoint_restart_gets_worse_as_losses_get_more_frequent() -> None:
    every = [minutes(480), minutes(240), minutes(120), minutes(60), minutes(30), minutes(15)]
    fixed, in_place = [], []
    for loss_every in every:
        found = by_strategy(outcomes(made_costs(), Churn(loss_every=loss_every), JobShape(16)))
        fixed.append(found[Strategy.CHECKPOINT_RESTART].time_goodput)
        in_place.append(found[Strategy.IN_PLACE].time_goodput)
    assert fixed == sorted(fixed, reverse=True) and len(set(fixed)) == len(fixed), fixed
    assert all(a > b for a, b in zip(in_place, fixed)), (in_place, fixed)


def test_youngs_interval_is_sqrt_of_twice_the_checkpoint_cost_times_the_mtbf() -> None:
    assert young_interval(30.0, 1 / 3600) == pytest.approx(math.sqrt(2 * 30 * 3600))
    assert young_interval(30.0, 0.0) is None
    # Every reclaim, loss and flaky crash loses work on a fixed-size job: M = 1 / their rate.
    churn = Churn(reclaim_every=minutes(20), loss_every=minutes(120), flaky_every=minutes(600))
    found = by_strategy(outcomes(made_costs(checkpoint=30.0), churn, JobShape(8)))
    failures = 1 / 1200 + 1 / 7200 + churn.restart_storm / 36000
    best = found[Strategy.CHECKPOINT_RESTART]
    assert best.checkpoint_every == pytest.approx(math.sqrt(2 * 30.0 / failures))
    # It maximises the goodput: a shorter or a longer interval does worse.
    for factor in (0.5, 0.8, 1.25, 2.0):
        pinned = JobShape(8, checkpoint_every=timedelta(seconds=best.checkpoint_every * factor))
        other = by_strategy(outcomes(made_costs(checkpoint=30.0), churn, pinned))[Strategy.CHECKPOINT_RESTART]
        assert other.time_goodput < best.time_goodput


def test_a_reclaim_whose_checkpoint_misses_the_notice_costs_what_a_loss_does() -> None:
    costs = made_costs(planned=1.5, unplanned=1.0, planned_wait=20.0)
    fits = by_strategy(outcomes(costs, Churn(reclaim_every=minutes(20), notice=timedelta(seconds=30)), JobShape(4)))
    assert fits[Strategy.IN_PLACE].event_costs["reclaim"] == 1.5
    # 20 s of checkpoint do not fit in 20 s of notice less the controller's 5 s margin.
    short = by_strategy(outcomes(costs, Churn(reclaim_every=minutes(20), notice=timedelta(seconds=20)), JobShape(4)))
    assert short[Strategy.IN_PLACE].event_costs["reclaim"] == short[Strategy.IN_PLACE].event_costs["loss"] == 1.0


def test_the_recommended_min_is_the_highest_within_half_a_point_of_min_one() -> None:
    churn = Churn(reclaim_every=minutes(10), loss_every=minutes(30), replace_after=minutes(20))
    job = JobShape(8)
    recommended = by_strategy(outcomes(made_costs(), churn, job))[Strategy.IN_PLACE]

    def at(m: int) -> Outcome:
        return by_strategy(outcomes(made_costs(), churn, replace(job, min_nodes=m)))[Strategy.IN_PLACE]

    goodputs = [at(m).time_goodput for m in range(1, 9)]
    assert goodputs == sorted(goodputs, reverse=True), "a job below min stalls: a higher min never helps"
    assert 1 < recommended.min_nodes < 8, recommended
    assert recommended.time_goodput >= goodputs[0] - MIN_SLACK
    assert goodputs[recommended.min_nodes] < goodputs[0] - MIN_SLACK
    # An elastic job that needs every node runs exactly when a fixed-size one can.
    fixed = by_strategy(outcomes(made_costs(), churn, job))[Strategy.CHECKPOINT_RESTART]
    assert at(8).running == pytest.approx(fixed.running)


def test_spares_keep_a_fixed_size_job_running_while_nodes_are_away() -> None:
    churn = Churn(loss_every=minutes(30), replace_after=minutes(15))
    found = by_strategy(outcomes(made_costs(), churn, JobShape(8, spares=2)))
    spares, fixed = found[Strategy.SPARES], found[Strategy.CHECKPOINT_RESTART]
    assert spares.running > fixed.running and spares.time_goodput > fixed.time_goodput
    assert (spares.nodes_held, fixed.nodes_held) == (10, 8)
    assert spares.throughput_goodput == pytest.approx(spares.time_goodput * 8 / 10)
    assert spares.event_costs == fixed.event_costs


def test_throughput_goodput_weighs_the_world_trained_at() -> None:
    churn = Churn(loss_every=minutes(30), replace_after=minutes(15))
    in_place = by_strategy(outcomes(made_costs(), churn, JobShape(8, min_nodes=1)))[Strategy.IN_PLACE]
    # Each node is away with p = μR / (1 + μR): the job trains at 8·(1 − p) nodes on average.
    away = (900 / 1800 / 8) / (1 + 900 / 1800 / 8)
    assert in_place.throughput_goodput == pytest.approx(in_place.time_goodput * (1 - away), rel=1e-3)
