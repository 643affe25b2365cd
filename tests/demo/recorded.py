"""Builds recorded runs (the files ``regroup demo`` leaves) for tests of the analysis and report.

Spans go through the real OpenTelemetry SDK and regroup's OTLP JSON-lines exporter.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from regroup.telemetry import JsonLinesSpanExporter, read_spans

T0 = 1_700_000_000.0


def write_reform_spans(path: Path, reforms: list[dict[str, Any]]) -> None:
    """Each dict: start (s after T0), cause, before, after, planned, lost, phases {name: seconds},
    and optionally mode and resume {sub-phase: seconds} (as a trainer that reports them gives),
    strategy and replaced (``n2->n5``, as a controller that keeps spares records them)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(path)))
    tracer = provider.get_tracer("test")
    for r in reforms:
        start = T0 + r["start"]
        end = start + sum(r["phases"].values())
        attributes = {
            "regroup.job": "demo",
            "regroup.cause": r["cause"],
            "regroup.node_count.before": r["before"],
            "regroup.node_count.after": r["after"],
            "regroup.planned": r["planned"],
            "regroup.lost_steps": r["lost"],
        }
        if "mode" in r:
            attributes["regroup.reform.mode"] = r["mode"]
        if "strategy" in r:
            attributes["regroup.strategy"] = r["strategy"]
        if "replaced" in r:
            attributes["regroup.replaced"] = r["replaced"]
        root = tracer.start_span("regroup.reform", start_time=int(start * 1e9), attributes=attributes)
        ctx = trace.set_span_in_context(root)
        at = start
        for name, seconds in r["phases"].items():
            child = tracer.start_span(f"regroup.{name}", context=ctx, start_time=int(at * 1e9))
            if name == "resume":
                _resume_split(tracer, child, at, r.get("resume", {}))
            at += seconds
            child.end(end_time=int(at * 1e9))
        root.end(end_time=int(end * 1e9))
    provider.shutdown()


def _resume_split(tracer: trace.Tracer, resume: trace.Span, at: float, split: dict[str, float]) -> None:
    ctx = trace.set_span_in_context(resume)
    for name, seconds in split.items():
        resume.set_attribute(f"regroup.resume.{name}_s", seconds)
        tracer.start_span(f"regroup.resume.{name}", context=ctx, start_time=int(at * 1e9)).end(end_time=int((at + seconds) * 1e9))
        at += seconds


def progress_rows(incarnations: list[tuple[int, int, int, float, int]], step_s: float = 0.5) -> list[dict[str, Any]]:
    """(resumed_from, first_step, last_step, start second, world size) -> progress records."""
    rows = []
    for resumed_from, first, last, start, world in incarnations:
        for i, step in enumerate(range(first, last + 1)):
            t = T0 + start + i * step_s
            rows.append(
                {"seen": t, "time": t, "step": step, "loss": 5.0 / (1 + step / 20), "world_size": world,
                 "samples_seen": step * 12, "resumed_from_step": resumed_from}
            )  # fmt: skip
    return rows


def write_run(root: Path, mode: str, progress: list[dict[str, Any]], events: list[dict[str, Any]],
              duration: float, reforms: list[dict[str, Any]] | None = None,
              latest_checkpoint_step: int | None = None, meta: dict[str, Any] | None = None) -> Path:  # fmt: skip
    """A run folder; ``meta`` overrides fields of its ``run.json`` (three nodes, job 1 to 3)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "run.json").write_text(
        json.dumps(
            {"mode": mode, "scenario": "test", "job": "demo", "nodes": ["node-1", "node-2", "node-3"],
             "min_nodes": 1, "max_nodes": 3, "nproc_per_node": 1, "duration": duration,
             "started_at": T0, "ended_at": T0 + duration, "events": [],
             "latest_checkpoint_step": latest_checkpoint_step, **(meta or {})}
        )
    )  # fmt: skip
    (root / "progress.jsonl").write_text("".join(json.dumps(p) + "\n" for p in progress))
    (root / "events.jsonl").write_text(
        "".join(json.dumps({"nodes": [], "type": "Normal", **e, "time": T0 + e["time"]}) + "\n" for e in events)
    )
    if reforms:
        write_reform_spans(root / "spans.jsonl", reforms)
    return root


# A regroup-like run: planned reclaim (no loss; the survivors re-form in place), abrupt loss
# (resume from step 40 after 47; workers restarted), grow (a trainer that reports no mode),
# and a cordon.
REFORMS = [
    {"start": 10.5, "cause": "reclaim", "before": 3, "after": 2, "planned": True, "lost": 0,
     "phases": {"detect": 0.1, "checkpoint": 0.8, "rendezvous": 1.5, "resume": 2.0},
     "mode": "in-place", "resume": {"process_group": 0.3, "reshard": 0.9, "first_step": 0.6}},
    {"start": 30.2, "cause": "node-lost", "before": 2, "after": 1, "planned": False, "lost": 7,
     "phases": {"detect": 0.4, "rendezvous": 1.2, "resume": 2.5},
     "mode": "restart", "resume": {"startup": 1.2, "process_group": 0.3, "load": 0.6, "first_step": 0.3}},
    {"start": 45.0, "cause": "grow", "before": 1, "after": 3, "planned": True, "lost": 0,
     "phases": {"detect": 3.0, "checkpoint": 0.5, "rendezvous": 1.0, "resume": 2.0}},
]  # fmt: skip
INCARNATIONS = [(0, 1, 20, 0.0, 3), (20, 21, 47, 15.0, 2), (40, 41, 60, 35.0, 1), (60, 61, 80, 52.0, 3)]
EVENTS = [
    {"time": 10.0, "source": "scenario", "reason": "reclaim", "message": "reclaim notice on node-2", "nodes": ["node-2"]},
    {"time": 29.0, "source": "scenario", "reason": "lose", "message": "abrupt loss of node-3", "nodes": ["node-3"]},
    {"time": 44.0, "source": "scenario", "reason": "restore", "message": "node-2, node-3 come back"},
    {"time": 60.0, "source": "scenario", "reason": "flaky", "message": "node-1 starts crashing"},
    {"time": 61.0, "source": "fault", "reason": "RankCrashed", "message": "node-1: rank killed"},
    {"time": 63.0, "source": "cluster", "reason": "Cordoned", "message": "restart storm", "nodes": ["node-1"]},
]  # fmt: skip


# A run of a job at max 4 that keeps one spare (node-5), 12 samples a step: the reclaim of
# node-2 is migrated to node-5 at the same pace; the loss of node-3, with no spare left,
# shrinks the job to 3 ranks, whose steps take 4/3 as long; the restore grows it back (node-3
# waits as the spare) and node-3 then takes flaky node-1's place. The loss's strategy is in
# its plan only (``plans.jsonl``), the others in their traces.
SPARES_META = {"scenario": "spares", "nodes": ["node-1", "node-2", "node-3", "node-4", "node-5"],
               "min_nodes": 2, "max_nodes": 4}  # fmt: skip
SPARES_WORLDS = [
    # (resumed_from, first step, last step, start s, ranks, round, seconds a step)
    (0, 1, 20, 0.0, 4, 1, 0.5),
    (20, 21, 56, 11.7, 4, 2, 0.5),
    (55, 56, 72, 32.0, 3, 3, 2 / 3),
    (72, 73, 94, 49.0, 4, 4, 0.5),
    (94, 95, 118, 62.5, 4, 5, 0.5),
]
SPARES_REFORMS = [
    {"start": 10.2, "cause": "reclaim", "before": 4, "after": 4, "planned": True, "lost": 0,
     "phases": {"detect": 0.1, "checkpoint": 0.3, "rendezvous": 0.5, "resume": 0.6},
     "mode": "in-place", "strategy": "migrate", "replaced": "node-2->node-5"},
    {"start": 30.1, "cause": "node-lost", "before": 4, "after": 3, "planned": False, "lost": 1,
     "phases": {"detect": 0.2, "rendezvous": 0.8, "resume": 0.9}, "mode": "in-place"},
    {"start": 44.5, "cause": "grow", "before": 3, "after": 4, "planned": True, "lost": 0,
     "phases": {"detect": 3.0, "checkpoint": 0.3, "rendezvous": 0.5, "resume": 0.7},
     "mode": "in-place", "strategy": "elastic"},
    {"start": 61.0, "cause": "node-lost", "before": 4, "after": 4, "planned": False, "lost": 1,
     "phases": {"detect": 0.3, "rendezvous": 0.5, "resume": 0.7},
     "mode": "in-place", "strategy": "replace", "replaced": "node-1->node-3"},
]  # fmt: skip
SPARES_EVENTS = [
    {"time": 10.0, "source": "scenario", "reason": "reclaim", "message": "reclaim notice on node-2", "nodes": ["node-2"]},
    {"time": 30.0, "source": "scenario", "reason": "lose", "message": "abrupt loss of node-3", "nodes": ["node-3"]},
    {"time": 44.0, "source": "scenario", "reason": "restore", "message": "node-2, node-3 come back",
     "nodes": ["node-2", "node-3"]},
    {"time": 60.0, "source": "scenario", "reason": "flaky", "message": "node-1 starts crashing", "nodes": ["node-1"]},
    {"time": 60.8, "source": "fault", "reason": "RankCrashed", "message": "node-1: rank killed", "nodes": ["node-1"]},
]  # fmt: skip


def spares_run(root: Path, mode: str = "regroup") -> Path:
    """``SPARES_WORLDS`` recorded as a run, with the loss's plan carrying its strategy."""
    progress = []
    for resumed_from, first, last, start, ranks, round_, step_s in SPARES_WORLDS:
        rows = progress_rows([(resumed_from, first, last, start, ranks)], step_s=step_s)
        progress += [{**row, "round": round_, "reform_mode": "in-place" if round_ > 1 else ""} for row in rows]
    root = write_run(root, mode, progress, SPARES_EVENTS, 75.0, SPARES_REFORMS, meta=SPARES_META)
    lost = next(s for s in read_spans(root / "spans.jsonl") if s["start_ns"] == int((T0 + 30.1) * 1e9))
    plan = {"seen": T0 + 32.5, "generation": 2, "cause": "node-lost", "planned": False, "phase": "done",
            "reason": "node-3 gone", "nodes_before": ["node-1", "node-5", "node-3", "node-4"],
            "nodes_after": ["node-1", "node-5", "node-4"], "trace_id": lost["trace_id"], "detected_at": T0 + 30.1,
            "decided_at": T0 + 30.3, "round_after": 3, "outcome": "completed", "strategy": "elastic",
            "replaced": {}}  # fmt: skip
    (root / "plans.jsonl").write_text(json.dumps(plan) + "\n")
    return root
