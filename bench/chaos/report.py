"""The campaign's table (stdout and ``chaos.md``) and its numbers (``chaos.json``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench._stats import percentile
from bench.chaos.campaign import CampaignResult, FaultResult
from bench.chaos.invariants import INVARIANTS, RECOVERY_BOUND
from bench.chaos.plan import KINDS


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def kind_rows(faults: Sequence[FaultResult]) -> list[dict[str, Any]]:
    """One row per kind played (in ``KINDS`` order), then ``all``."""
    rows = []
    groups = [(kind, [f for f in faults if f.fault.kind == kind]) for kind in KINDS]
    for kind, group in [*((k, g) for k, g in groups if g), ("all", list(faults))]:
        times = [f.recovery_s for f in group if f.recovery_s is not None]
        rows.append(
            {
                "kind": kind,
                "faults": len(group),
                "recovered": sum(1 for f in group if f.recovered_at is not None),
                "recovery_p50_s": percentile(times, 0.50),
                "recovery_p99_s": percentile(times, 0.99),
                "recovery_max_s": max(times, default=None),
                "steps_lost": sum(f.steps_lost for f in group),
                "steps_lost_max": max((f.steps_lost for f in group), default=0),
                "moment_missed": sum(1 for f in group if f.injection is not None and not f.injection.moment_seen),
                "provoked": sum(1 for f in group if f.injection is not None and f.injection.provoked),
                "violations": sum(len(f.findings) for f in group),
            }
        )
    return rows


def _cycle_s(result: CampaignResult) -> float:
    span = (result.shutdown_at or result.ended_at) - result.first_fault_at
    return span / len(result.faults) if result.faults else 0.0


def render(result: CampaignResult, load: tuple[float, float]) -> str:
    s = result.settings
    shape = s.shape
    header = [
        f"# bench chaos: seed {s.seed}, {len(result.faults)} faults",
        "",
        f"{shape.nodes} local nodes, job min {shape.min_nodes} / max {shape.max_nodes} (1 rank per node); "
        f"recovery bound {RECOVERY_BOUND:.0f} s; {result.controllers} controller instances; "
        f"last step {result.last_step}",
        f"wall {result.ended_at - result.started_at:.0f} s (startup {result.first_fault_at - result.started_at:.0f} s, "
        f"{_cycle_s(result):.1f} s per fault cycle); load average {load[0]:.1f} before, {load[1]:.1f} after",
        "",
        "| fault kind | faults | recovered | recovery p50 | recovery p99 | steps lost (max) | violations |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [
        f"| {r['kind']} | {r['faults']} | {r['recovered']} | {_seconds(r['recovery_p50_s'])} | "
        f"{_seconds(r['recovery_p99_s'])} | {r['steps_lost']} ({r['steps_lost_max']}) | {r['violations']} |"
        for r in kind_rows(result.faults)
    ]
    violations = result.violations()
    counts = {i: sum(1 for _, f in violations if f.invariant == i) for i in INVARIANTS}
    invariants = ["", "| invariant | violations |", "|---|---|"]
    invariants += [f"| {i}. {text} | {counts[i]} |" for i, text in INVARIANTS.items()]
    return "\n".join([*header, *rows, *invariants, "", *_notes(result), *_violation_lines(result)])


def _notes(result: CampaignResult) -> list[str]:
    faults = [f for f in result.faults if f.injection is not None]
    missed = [f"#{f.fault.index}" for f in faults if not f.injection.moment_seen]  # type: ignore[union-attr]
    provoked = [f"#{f.fault.index}" for f in faults if f.injection.provoked]  # type: ignore[union-attr]
    late = [
        f"#{f.fault.index} after {f.late_at - f.injection.at:.0f} s"  # type: ignore[union-attr]
        for f in faults
        if f.late_at is not None
    ]
    lines = [f"- stopped early: {result.stopped}"] if result.stopped else []
    lines += [
        f"- trained again only after the bound: {', '.join(late) or 'none'}",
        f"- moments not seen in time (the fault struck anyway): {', '.join(missed) or 'none'}",
        f"- re-forms provoked with a reclaim notice for a fault: {', '.join(provoked) or 'none'}",
    ]
    shutdown = result.shutdown
    if shutdown is not None:
        kept = ", ".join(f"{k} {n}" for k, n in shutdown.keys_left.items()) or "nothing"
        lines.append(f"- etcd after the job ended: {kept}")
        lines.append(f"- processes left: {len(shutdown.processes_left)}; leaked keys: {len(shutdown.leaked_keys)}")
    return lines


def _violation_lines(result: CampaignResult) -> list[str]:
    violations = result.violations()
    if not violations:
        return ["", "No invariant violated."]
    seed = result.settings.seed
    lines = ["", "Violations (each with the seed and fault that reproduce it):", ""]
    for where, finding in violations:
        index = where.removeprefix("fault #").split(" ")[0] if where.startswith("fault #") else None
        again = (
            f" (replay: --seed {seed} --faults {int(index) + 1}; alone: --seed {seed} --only {index})" if index else ""
        )
        lines.append(f"- seed {seed}, {where}: invariant {finding.invariant}: {finding.message}{again}")
    return lines


def to_json(result: CampaignResult, load: tuple[float, float]) -> dict[str, Any]:
    s = result.settings
    shutdown = result.shutdown
    return {
        "seed": s.seed,
        "faults_planned": s.faults,
        "only": list(s.only),
        "kinds": list(s.kinds),
        "shape": {"nodes": s.shape.nodes, "min_nodes": s.shape.min_nodes, "max_nodes": s.shape.max_nodes},
        "recovery_bound_s": RECOVERY_BOUND,
        "started_at": result.started_at,
        "first_fault_at": result.first_fault_at,
        "ended_at": result.ended_at,
        "cycle_s": round(_cycle_s(result), 3),
        "load_average": {"before": load[0], "after": load[1]},
        "controllers": result.controllers,
        "last_step": result.last_step,
        "stopped": result.stopped,
        "by_kind": kind_rows(result.faults),
        "invariants": {
            str(i): {"text": text, "violations": sum(1 for _, f in result.violations() if f.invariant == i)}
            for i, text in INVARIANTS.items()
        },
        "violations": [
            {"where": where, "invariant": f.invariant, "time": f.time, "message": f.message}
            for where, f in result.violations()
        ],
        "faults": [f.to_json() for f in result.faults],
        "end": {
            "keys_left": shutdown.keys_left if shutdown else {},
            "leaked_keys": shutdown.leaked_keys if shutdown else [],
            "processes_left": shutdown.processes_left if shutdown else [],
        },
    }
