"""Expected goodput of four ways to run a job through the same churn.

Pure functions of the churn (``Churn``), the job (``JobShape``) and what its re-forms cost
(``ReformCosts``). The model, with rates per second of wall time at full size: ``λr``
reclaims, ``λl`` losses, ``λf`` nodes going bad, ``λj`` grows (``λr + λl + λf`` unless
given: each node that leaves is replaced), ``K`` the restart-storm count; ``N`` nodes, ``S``
spares, ``R`` the time until a leaving node's replacement joins, ``C`` a checkpoint's cost,
``T`` the checkpoint interval, ``t`` a step, ``ℓ`` the steps an unplanned in-place re-form
trains again.

Nodes away. Each node leaves at ``μ = (λr + λl + λf) / N`` and is back ``R`` later, so it is
away with probability ``p = μR / (1 + μR)`` and the nodes away of ``n`` are Binomial(n, p).
A job trains only while enough nodes are there: ``P_run`` is P(away ≤ N − min) for an
elastic job, P(away of N + S ≤ S) with spares, ``(1 − p)^N`` for a fixed-size job.

Events. Each costs seconds of training (``c``), from the recorded stalls (``costs``):

- (a) in place: a reclaim costs a planned shrink if its checkpoint fits in the notice (less
  the controller's margin), else what a loss costs; a loss an unplanned re-form plus its
  lost steps (``u = unplanned + ℓ·t``); a flaky node ``(K + 1)·u + (K − 1)·grow`` (K crashes,
  the rejoins between them, the cordon); a grow a grow. No periodic checkpoint is needed.
- (b) restarting the workers: the same events at restart-path costs, and every unplanned one
  also loses half a checkpoint interval (``u = unplanned + T/2``): the state in memory dies
  with the processes. A flaky node costs ``(K + 1)·u``: each restart takes its node along.
- (c) fixed size with spares, (d) fixed size: every reclaim or loss stops the job, which
  restarts from its last checkpoint (``T/2 + restart``; a flaky node ``K`` of them) on a
  spare at once (c) or once a replacement joins (d: the wait is in ``P_run``). Grows cost
  nothing: a replacement is a spare, or the restart already counted.

Time goodput, useful training time over wall time (``regroup.demo.analysis.goodput``'s):

    G = P_run · max(0, 1 − C/T − Σ λe·ce)

Throughput goodput weighs it by the world trained at against the nodes held: ``G ·
E[world | training] / N`` elastic, ``G · N / (N + S)`` with spares, ``G`` fixed.

Checkpoint interval (Young): ``T* = sqrt(2·C·M)``, ``M`` the mean time between the events
that lose work: ``1 / (λl + (K + 1)·λf)`` for (b), plus ``λr`` in the sum when the notice is
too short; ``1 / (λr + λl + K·λf)`` for (c) and (d). It minimises ``C/T + T/(2M)``, the
terms of ``G`` that depend on ``T``. None needed without such events.

Min nodes: ``G`` never rises with min (a job below min stalls), so the recommended min is the
highest one within ``MIN_SLACK`` of min 1: the smallest world the job need not train at.
Max nodes: the nodes the job is given; the elastic strategies need no spares.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field

from regroup.controller.settings import ReformSettings
from regroup.whatif.churn import Churn, JobShape
from regroup.whatif.costs import ReformCosts
from regroup.whatif.recorded import StallKind

MIN_SLACK = 0.005
"""Time goodput a higher min may cost against min 1 and still be recommended (half a point)."""


class Strategy(enum.StrEnum):
    """The four ways to run a job through churn (the module docstring)."""

    IN_PLACE = "in-place elastic"
    RESTART = "restart elastic"
    SPARES = "fixed size + spares"
    CHECKPOINT_RESTART = "fixed size, checkpoint-restart"


EVENTS = ("reclaim", "loss", "flaky node", "grow")


@dataclass(frozen=True)
class Outcome:
    """One strategy's expected goodput at its settings."""

    strategy: Strategy
    time_goodput: float
    throughput_goodput: float
    min_nodes: int
    max_nodes: int
    nodes_held: int
    checkpoint_every: float | None
    """Seconds between periodic checkpoints (None: none needed)."""
    running: float
    """``P_run``: the share of time enough nodes are there to train."""
    event_costs: dict[str, float] = field(default_factory=dict)
    """Seconds of training one event of each kind costs (``EVENTS``)."""


def away_probability(churn: Churn, nodes: int) -> float:
    """``p``: the chance a node of the job is away, waiting for its replacement."""
    per_node = churn.departures / nodes
    waiting = per_node * churn.replace_after.total_seconds()
    return waiting / (1 + waiting)


def binomial(n: int, p: float) -> list[float]:
    """P(k of n away), k = 0..n (in logs, so thousands of nodes neither overflow nor underflow)."""
    if p <= 0:
        return [1.0] + [0.0] * n
    if p >= 1:
        return [0.0] * n + [1.0]
    log_p, log_q = math.log(p), math.log1p(-p)
    return [
        math.exp(math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_p + (n - k) * log_q)
        for k in range(n + 1)
    ]


def young_interval(checkpoint: float, failures_per_second: float) -> float | None:
    """Young's checkpoint interval ``sqrt(2·C·M)``, ``M = 1 / failures``; None without failures."""
    if failures_per_second <= 0:
        return None
    return math.sqrt(2 * checkpoint / failures_per_second)


def time_goodput(running: float, checkpoint: float, interval: float | None, rates: dict[str, float],
                 costs: dict[str, float]) -> float:  # fmt: skip
    """``P_run · max(0, 1 − C/T − Σ λe·ce)``."""
    overhead = 0.0 if interval is None else checkpoint / interval
    lost = sum(rates[e] * costs[e] for e in EVENTS)
    return running * max(0.0, 1.0 - overhead - lost)


def _rates(churn: Churn) -> dict[str, float]:
    return {"reclaim": churn.reclaims, "loss": churn.losses, "flaky node": churn.flaky, "grow": churn.joins}


def _notice_fits(churn: Churn, seconds: float) -> bool:
    """Whether a checkpoint of ``seconds`` finishes within the notice, less the margin the
    controller keeps for the re-form (half the notice when it is short)."""
    notice = churn.notice.total_seconds()
    margin = min(ReformSettings().notice_margin.total_seconds(), notice / 2)
    return seconds <= notice - margin


def _elastic(costs: ReformCosts, churn: Churn, job: JobShape, *, in_place: bool) -> Outcome:
    k = churn.restart_storm
    if in_place:
        stall = costs.in_place
        lost = costs.lost_steps.seconds * costs.step.seconds if costs.step is not None else 0.0
        fits = _notice_fits(churn, costs.planned_wait.seconds)
        interval = None
    else:
        stall = costs.restart
        fits = _notice_fits(churn, costs.checkpoint.seconds)
        unplanned_rate = churn.losses + (k + 1) * churn.flaky + (0.0 if fits else churn.reclaims)
        interval = _interval(job, costs, unplanned_rate)
        lost = 0.0 if interval is None else interval / 2
    unplanned = stall[StallKind.UNPLANNED].seconds + lost
    grow = stall[StallKind.GROW].seconds
    event_costs = {
        "reclaim": stall[StallKind.PLANNED_SHRINK].seconds if fits else unplanned,
        "loss": unplanned,
        # In place the crashed rank's node leaves the world and rejoins between crashes; a
        # restart takes it along in the new world.
        "flaky node": (k + 1) * unplanned + ((k - 1) * grow if in_place else 0.0),
        "grow": grow,
    }
    n = job.nodes
    away = binomial(n, away_probability(churn, n))
    # Training at min m needs at most n - m away: P_run and E[world · 1(training)] for each m.
    running_at = list(itertools.accumulate(away))
    worlds_at = list(itertools.accumulate((n - a) * share for a, share in enumerate(away)))

    def at_min(m: int) -> tuple[float, float, float]:
        running = running_at[n - m]
        goodput = time_goodput(running, costs.checkpoint.seconds, interval, _rates(churn), event_costs)
        world = worlds_at[n - m] / running if running > 0 else 0.0
        return running, goodput, goodput * world / n

    if job.min_nodes is not None:
        min_nodes = job.min_nodes
    else:
        best = at_min(1)[1]
        # Where nothing trains at all, no min does better than another: keep 1.
        min_nodes = max(m for m in range(1, n + 1) if m == 1 or 0 < best - MIN_SLACK <= at_min(m)[1])
    running, goodput, throughput = at_min(min_nodes)
    strategy = Strategy.IN_PLACE if in_place else Strategy.RESTART
    return Outcome(strategy, goodput, throughput, min_nodes, n, n, interval, running, event_costs)


def _interval(job: JobShape, costs: ReformCosts, failures: float) -> float | None:
    if job.checkpoint_every is not None:
        return job.checkpoint_every.total_seconds()
    return young_interval(costs.checkpoint.seconds, failures)


def _fixed(costs: ReformCosts, churn: Churn, job: JobShape, *, spares: int) -> Outcome:
    k = churn.restart_storm
    interval = _interval(job, costs, churn.reclaims + churn.losses + k * churn.flaky)
    restart = (0.0 if interval is None else interval / 2) + costs.restart[StallKind.UNPLANNED].seconds
    event_costs = {"reclaim": restart, "loss": restart, "flaky node": k * restart, "grow": 0.0}
    n = job.nodes
    held = n + spares
    running = math.fsum(binomial(held, away_probability(churn, n))[: spares + 1])
    goodput = time_goodput(running, costs.checkpoint.seconds, interval, _rates(churn), event_costs)
    strategy = Strategy.SPARES if spares else Strategy.CHECKPOINT_RESTART
    return Outcome(strategy, goodput, goodput * n / held, n, n, held, interval, running, event_costs)


def outcomes(costs: ReformCosts, churn: Churn, job: JobShape) -> list[Outcome]:
    """The expected goodput of each strategy, at the settings that maximise it (or those
    ``job`` pins); fixed size with spares only when ``job`` has spares."""
    found = [_elastic(costs, churn, job, in_place=True), _elastic(costs, churn, job, in_place=False)]
    if job.spares:
        found.append(_fixed(costs, churn, job, spares=job.spares))
    found.append(_fixed(costs, churn, job, spares=0))
    return found
