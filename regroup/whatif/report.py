"""The tables and the JSON ``regroup whatif`` prints."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

from regroup.whatif.churn import Churn, JobShape
from regroup.whatif.costs import Figure, ReformCosts
from regroup.whatif.model import EVENTS, Outcome
from regroup.whatif.recorded import Stall, StallKind, from_memory


def _every(value: timedelta | None) -> float | None:
    return None if value is None else value.total_seconds()


def as_json(path: Path, churn: Churn, job: JobShape, stalls: list[Stall], costs: ReformCosts,
            found: list[Outcome]) -> dict[str, Any]:  # fmt: skip
    """Everything the tables show, and the stalls read, for ``--json``."""
    def figure(f: Figure | None) -> dict[str, Any] | None:
        return None if f is None else {"seconds": f.seconds, "source": f.source}

    return {
        "spans": str(path),
        "churn": {
            "reclaim_every_s": _every(churn.reclaim_every), "loss_every_s": _every(churn.loss_every),
            "flaky_every_s": _every(churn.flaky_every), "joins_every_s": _every(churn.joins_every),
            "notice_s": churn.notice.total_seconds(), "replace_after_s": churn.replace_after.total_seconds(),
            "restart_storm": churn.restart_storm,
        },  # fmt: skip
        "job": {"nodes": job.nodes, "spares": job.spares, "min_nodes": job.min_nodes,
                "checkpoint_every_s": _every(job.checkpoint_every)},  # fmt: skip
        "recorded": {kind.value: sum(1 for s in stalls if s.kind == kind) for kind in StallKind},
        "stalls": [
            {"start": s.start, "seconds": s.seconds, "kind": s.kind.value, "cause": s.cause, "mode": s.mode,
             "lost_steps": s.lost_steps}
            for s in stalls
        ],  # fmt: skip
        "costs": {
            "in_place": {k.value: figure(f) for k, f in costs.in_place.items()},
            "restart": {k.value: figure(f) for k, f in costs.restart.items()},
            "lost_steps": figure(costs.lost_steps), "step": figure(costs.step), "checkpoint": figure(costs.checkpoint),
            "planned_wait": figure(costs.planned_wait), "process_start": figure(costs.process_start),
            "load": figure(costs.load),
        },  # fmt: skip
        "strategies": [_outcome_json(o) for o in found],
    }


def _outcome_json(outcome: Outcome) -> dict[str, Any]:
    fields = asdict(outcome)
    fields["checkpoint_every_s"] = fields.pop("checkpoint_every")
    fields["event_costs_s"] = fields.pop("event_costs")
    return fields


def human(seconds: float) -> str:
    """``45s``, ``4m10s``, ``2h``, ``1h30m``: a duration as the options take it."""
    whole = round(seconds)
    if whole < 60:
        return f"{seconds:.3g}s" if seconds < 10 else f"{whole}s"
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else "", f"{secs}s" if secs and not hours else ""]
    return "".join(parts)


def _table(rows: list[list[str]], words: frozenset[int] = frozenset({0})) -> list[str]:
    """Fixed-width columns, numbers right-aligned, the ``words`` columns left-aligned."""
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if c in words else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return [line.rstrip() for line in lines]


def _churn_line(churn: Churn, job: JobShape) -> str:
    given = [
        (f"reclaim every {human(churn.reclaim_every.total_seconds())} ({human(churn.notice.total_seconds())} notice)"
         if churn.reclaim_every else ""),
        f"loss every {human(churn.loss_every.total_seconds())}" if churn.loss_every else "",
        f"flaky node every {human(churn.flaky_every.total_seconds())} ({churn.restart_storm} crashes, then its cordon)"
        if churn.flaky_every else "",
        f"grow every {human(churn.joins_every.total_seconds())}" if churn.joins_every else "",
    ]  # fmt: skip
    what = ", ".join(g for g in given if g) or "no churn"
    spares = f" + {job.spares} spares" if job.spares else ""
    replaced = human(churn.replace_after.total_seconds())
    return f"{job.nodes} nodes{spares}; {what}; a leaving node is replaced after {replaced}"


def _counted(kind: StallKind, count: int) -> str:
    name = kind.value.replace("-", " ")
    return f"{count} {name}{'s' if count != 1 and kind == StallKind.GROW else ''}"


STORAGE_NOT_TIMED = (
    "note: C is an ack from memory, not the cost of a save to storage; the restart paths and the checkpoint\n"
    "interval below use it in place of one (a save to storage costs more): give --checkpoint-cost for its cost"
)
"""Said under the recorded figures when ``C`` is an ack from memory (``recorded.from_memory``)."""


def _recorded_line(stalls: list[Stall], costs: ReformCosts) -> str:
    counts = Counter(s.kind for s in stalls)
    kinds = ", ".join(_counted(k, counts[k]) for k in StallKind if counts[k])
    step = "not recorded" if costs.step is None else f"{costs.step.seconds:.3f}s ({costs.step.source})"
    lost = costs.lost_steps
    memory = from_memory(costs.checkpoint.source)
    return "\n".join([
        f"recorded: {len(stalls)} re-forms ({kinds}), {lost.seconds:.2g} steps lost per unplanned one ({lost.source})",
        f"step {step}; checkpoint {costs.checkpoint.seconds:.3g}s ({costs.checkpoint.source}); "
        f"load {costs.load.seconds:.3g}s ({costs.load.source}); "
        f"process start {human(costs.process_start.seconds)} ({costs.process_start.source})",
        *([STORAGE_NOT_TIMED] if memory else []),
    ])  # fmt: skip


def format_report(churn: Churn, job: JobShape, stalls: list[Stall], costs: ReformCosts, found: list[Outcome]) -> str:
    """The strategies' table, then what one event and one re-form cost under each."""
    step = costs.step.seconds if costs.step is not None else None

    def interval(o: Outcome) -> str:
        if o.checkpoint_every is None:
            return "none needed"
        steps = f" ({o.checkpoint_every / step:.0f} steps)" if step else ""
        return human(o.checkpoint_every) + steps

    strategies = [["strategy", "time goodput", "throughput goodput", "min", "max", "nodes held", "running",
                   "checkpoint every"]]  # fmt: skip
    for o in found:
        strategies.append([o.strategy.value, f"{o.time_goodput:.1%}", f"{o.throughput_goodput:.1%}", str(o.min_nodes),
                           str(o.max_nodes), str(o.nodes_held), f"{o.running:.1%}", interval(o)])  # fmt: skip
    events = [["event", *(o.strategy.value for o in found)]]
    for event in EVENTS:
        events.append([event, *(f"{o.event_costs[event]:.2f}" for o in found)])
    reforms = [["re-form", "in place", "source", "restart", "source"]]
    for kind in StallKind:
        a, b = costs.in_place[kind], costs.restart[kind]
        reforms.append([kind.value.replace("-", " "), f"{a.seconds:.2f}", a.source, f"{b.seconds:.2f}", b.source])
    return "\n".join([
        f"regroup whatif: {_churn_line(churn, job)}",
        _recorded_line(stalls, costs),
        "",
        *_table(strategies, frozenset({0, 7})),
        "",
        "seconds of training one event costs:",
        *_table(events),
        "",
        "seconds one re-form stops training (lost work not included):",
        *_table(reforms, frozenset({0, 2, 4})),
    ])  # fmt: skip
