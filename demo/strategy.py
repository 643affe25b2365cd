"""How each re-form of a recorded run kept the job's world: ``replace``, ``migrate`` or ``elastic``.

A controller that answers a loss or a reclaim with a waiting node records the re-form's
strategy on its plan (``strategy``, and ``replaced``: the leaving or lost node -> the node
that took its position) and on its trace (the root span's ``regroup.strategy``, and
``regroup.replaced`` as ``n3->n5,n4->n6``):

- ``replace``: an unplanned loss answered with a spare, the world size unchanged;
- ``migrate``: a planned reclaim answered with a spare, the leaving node's shards handed
  over at the agreed step;
- ``elastic``: the world size changed.

The trace's word is taken first, then the plan's (the last record of its generation, as
``plans.jsonl`` holds it). A world the agents formed on their own (a crashed rank's) has no
plan: its strategy is the one its spans show (``regroup.reform_spans``: the controller's
rule on the worlds' positions before and after, e.g. a spare in the crashed rank's position:
``replace``). A re-form none of them gives a strategy is counted as ``NOT_RECORDED``: the
report shows a strategy only where the run recorded it, and never guesses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from regroup.demo.analysis import RunData, run_reforms
from regroup.trace_report import Reform

STRATEGIES: tuple[str, ...] = ("replace", "migrate", "elastic")
STRATEGY_ATTR = "regroup.strategy"
REPLACED_ATTR = "regroup.replaced"
NOT_RECORDED = "not recorded"
"""The name ``strategy_counts`` counts a re-form under when the run recorded no strategy for it."""


@dataclass(frozen=True)
class Strategy:
    """A re-form's strategy, with the positions it handed over."""

    name: str
    """``replace``, ``migrate`` or ``elastic``."""
    replaced: tuple[tuple[str, str], ...] = ()
    """(leaving or lost node, the node that took its position), by leaving node."""

    def describe(self) -> str:
        """``migrate node-2->node-5``; the bare name when no position changed hands."""
        swaps = ",".join(f"{old}->{new}" for old, new in self.replaced)
        return f"{self.name} {swaps}" if swaps else self.name


def parse_replaced(value: Any) -> tuple[tuple[str, str], ...]:
    """``replaced`` as a plan holds it (a dict) or a span attribute (``n3->n5,n4->n6``)."""
    if isinstance(value, dict):
        pairs = [(str(old), str(new)) for old, new in value.items()]
    elif isinstance(value, str):
        pairs = []
        for item in value.split(","):
            old, sep, new = item.strip().partition("->")
            if sep and old.strip() and new.strip():
                pairs.append((old.strip(), new.strip()))
    else:
        pairs = []
    return tuple(sorted(pairs))


def _strategy(name: Any, replaced: Any) -> Strategy | None:
    text = str(name or "").strip()
    return Strategy(text, parse_replaced(replaced)) if text else None


def plan_records(run: RunData) -> list[dict[str, Any]]:
    """The last recorded body of each plan generation, in the order they were decided."""
    last: dict[int, dict[str, Any]] = {}
    for body in run.plans:
        if "generation" in body:
            last[int(body["generation"])] = body
    return sorted(last.values(), key=lambda body: float(body.get("decided_at", 0.0)))


def plan_strategy(body: dict[str, Any]) -> Strategy | None:
    """The strategy a plan record carries (None: the controller did not record one)."""
    return _strategy(body.get("strategy"), body.get("replaced"))


def reform_strategy(reform: Reform, plans_by_trace: dict[str, dict[str, Any]]) -> Strategy | None:
    """The strategy of one re-form: its spans' word (the controller's root span, or for a
    world the agents formed on their own, the one its worlds' positions show), else its
    plan's; None where neither says. A world the agents formed on their own never takes a
    plan's: it has none, and shares a trace with the re-form before it."""
    from_span = _strategy(reform.attributes.get(STRATEGY_ATTR), reform.attributes.get(REPLACED_ATTR))
    if from_span is not None or not reform.asked:
        return from_span
    plan = plans_by_trace.get(reform.trace_id)
    return plan_strategy(plan) if plan is not None else None


def plans_by_trace(run: RunData) -> dict[str, dict[str, Any]]:
    return {str(body["trace_id"]): body for body in plan_records(run) if body.get("trace_id")}


def reform_strategies(run: RunData, reforms: list[Reform] | None = None) -> list[Strategy | None]:
    """The strategy of each re-form (``run_reforms`` unless given), None where not recorded."""
    plans = plans_by_trace(run)
    return [reform_strategy(r, plans) for r in (run_reforms(run) if reforms is None else reforms)]


def round_strategies(run: RunData) -> dict[int, Strategy]:
    """Rendezvous round -> the strategy of the plan that formed it (where recorded)."""
    out = {}
    for body in plan_records(run):
        strategy = plan_strategy(body)
        if strategy is not None and int(body.get("round_after", 0) or 0):
            out[int(body["round_after"])] = strategy
    return out


def strategy_counts(run: RunData) -> dict[str, int]:
    """How many re-forms of the run (``run_reforms``) took each strategy, and how many
    recorded none (``NOT_RECORDED``), so the counts add up to the re-forms; {} when none
    was recorded."""
    counts = Counter(s.name if s is not None else NOT_RECORDED for s in reform_strategies(run))
    if set(counts) <= {NOT_RECORDED}:
        return {}
    names = [*STRATEGIES, *sorted(set(counts) - {*STRATEGIES, NOT_RECORDED}), NOT_RECORDED]
    return {name: counts[name] for name in names if counts[name]}
