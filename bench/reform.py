"""``python -m bench reform [--quick]``: in-place re-forms vs restarting the workers vs plain torchrun.

Plays one demo scenario (``default`` unless ``--scenario``) three times in one run, one
mode after the other on the same machine:

- ``regroup``: ``regroup-run --standby`` with the controller; workers survive a re-form
  in place (same process, new process group);
- ``regroup-restart``: the same rendezvous and controller, plain torchrun agents: every
  re-form restarts every worker;
- ``torchrun-c10d``: plain torchrun, c10d rendezvous, no controller.

For each mode it measures, from the recorded run (``demo.analysis``):

- planned reclaim: the reclaim taint -> the first training step at one node fewer, and
  the steps lost;
- abrupt loss: the kill -> the first training step at one node fewer;
- grow: the moment the join window closed (the grow plan's ``decided_at``; without a
  controller, the restore plus the scenario's join window) -> the first training step
  at the larger size;
- flaky node: seconds without training after the flaky event, and its lost steps;
- goodput;
- for the controlled modes, how each new world was reached (``in-place`` or
  ``restart``) and where its resume time went, as the trainer reported it.

Every number is shown with its ratio to the in-place mode measured in the same run, and
beside the goal. The tables go to stdout, ``reform.md`` and ``reform.json`` in the run
folder. ``--quick`` shortens the run to 110 s and leaves out the events that no longer
fit (the flaky node). ``--runs`` tabulates recorded run folders again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from demo.main import cancelled_by_sigterm
from demo.analysis import RunData, event_impacts, goodput, load_run
from demo.resizes import reform_latencies, training_at, world_changes
from demo.scenario import (
    JobSpec,
    Scenario,
    ScenarioError,
    load_scenario,
    parse_duration,
    resolve_scenario_path,
    with_overrides,
)
from regroup.records import Progress

MODES: tuple[str, ...] = ("regroup", "regroup-restart", "torchrun-c10d")
"""In the order they are played; the first is the reference of every ratio."""
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "regroup-no-snapshot": ("regroup", {"snapshot": {"every": 0}}),
}
"""Further modes (``--modes``): a demo mode with trainer settings over the scenario's."""
QUICK_DURATION = "110s"
TAIL_S = 25.0
"""An event is played only if it leaves this many seconds before the end of the run."""


@dataclass(frozen=True)
class Metric:
    """One row of the table."""

    key: str
    label: str
    unit: str
    """``s``, ``steps`` or ``%``."""
    goal: float | None = None
    """At most this (``s``) or at least this (``%``)."""


METRICS: tuple[Metric, ...] = (
    Metric("reclaim_s", "planned reclaim: taint -> training at {reclaim_ranks}", "s", 1.5),
    Metric("reclaim_lost_steps", "planned reclaim: steps lost", "steps"),
    Metric("loss_s", "abrupt loss: kill -> training at {loss_ranks}", "s", 3.0),
    Metric("loss_lost_steps", "abrupt loss: steps lost", "steps"),
    Metric("grow_s", "grow: join window closed -> training at {grow_ranks}", "s", 2.0),
    Metric("grow_lost_steps", "grow: steps lost", "steps"),
    Metric("flaky_s", "flaky node: seconds without training", "s", 10.0),
    Metric("flaky_lost_steps", "flaky node: steps lost", "steps"),
    Metric("goodput", "goodput (useful training time / wall time)", "%", 0.90),
)
_EVENT_KEYS = {"reclaim": "reclaim", "lose": "loss", "restore": "grow"}


def measure(run: RunData, join_window: float) -> dict[str, Any]:
    """The metrics of one recorded run, keyed as ``METRICS``. A key is absent for an event
    the run did not play; None means the new size never came (latencies) or the job was
    not training (flaky, with ``flaky_note``)."""
    out: dict[str, Any] = {"mode": run.meta.get("mode_label", run.mode), "run": str(run.root), "goodput": goodput(run)}
    latencies = reform_latencies(run, join_window)
    for latency in latencies:
        key = _EVENT_KEYS[latency.event.reason]
        if f"{key}_s" in out:
            continue  # a scenario with two of a kind: the table shows the first, the events list all
        out[f"{key}_s"] = latency.seconds
        out[f"{key}_lost_steps"] = latency.lost_steps
        out[f"{key}_ranks"] = f"{latency.ranks_after} ranks (from {latency.ranks_before})"
        out[f"{key}_from"] = latency.start_from
    out["events"] = [
        {
            "event": latency.event.reason,
            "nodes": list(latency.event.nodes),
            "at_s": round(latency.event.time - run.started_at, 2),
            "ranks_before": latency.ranks_before,
            "ranks_after": latency.ranks_after,
            "measured_from": latency.start_from,
            "measured_from_s": round(latency.start - run.started_at, 2),
            "seconds": None if latency.seconds is None else round(latency.seconds, 3),
            "lost_steps": latency.lost_steps,
        }
        for latency in latencies
    ]
    flaky = next((i for i in event_impacts(run) if i.event.reason == "flaky"), None)
    if flaky is not None:
        trained = training_at(run, flaky.event.time)
        out["flaky_s"] = flaky.downtime if trained else None
        out["flaky_lost_steps"] = flaky.lost_steps if trained else None
        if not trained:
            out["flaky_note"] = "not training when the node turned flaky"
    out["world_changes"] = [
        {
            "at_s": round(change.at - run.started_at, 2),
            "round": change.round,
            "ranks": f"{change.ranks_before}->{change.ranks_after}",
            "cause": change.cause,
            "planned": change.planned,
            "mode": change.mode,
            "plan_mode": change.plan_mode,
            "resume_phases": change.resume_phases,
        }
        for change in world_changes(run)
    ]
    return out


def _seconds(value: float) -> str:
    return f"{value:.2f} s" if abs(value) < 10 else f"{value:.1f} s"


def format_value(metric: Metric, value: float | None, missing: str = "never") -> str:
    if value is None:
        return missing
    if metric.unit == "s":
        return _seconds(value)
    if metric.unit == "%":
        return f"{value:.0%}"
    return str(int(value))


def versus(metric: Metric, ours: float | None, theirs: float | None, missing: str = "never") -> str:
    """``theirs`` with its ratio to ``ours``: ``8.9 s (6.8x)``, ``never (-)``."""
    text = format_value(metric, theirs, missing)
    if theirs is None or ours is None or ours == 0:
        return f"{text} (-)"
    return f"{text} ({theirs / ours:.1f}x)" if metric.unit != "%" else f"{text} ({theirs / ours:.2f}x)"


def goal_met(metric: Metric, value: float | None) -> str:
    if metric.goal is None:
        return ""
    if value is None:
        return "**no**"
    met = value >= metric.goal if metric.unit == "%" else value <= metric.goal
    return "yes" if met else "**no**"


def _goal_text(metric: Metric) -> str:
    if metric.goal is None:
        return ""
    return f">= {metric.goal:.0%}" if metric.unit == "%" else f"<= {metric.goal:g} s"


def metric_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: one per metric, one column per mode; the first mode is the reference."""
    ours = results[0]
    modes = [r["mode"] for r in results]
    head = f"| metric | goal | {ours['mode']} |" + "".join(f" {m} (x {ours['mode']}) |" for m in modes[1:])
    rows = [head + f" {ours['mode']} meets the goal? |", "|---" * (len(results) + 3) + "|"]
    footnotes: list[str] = []
    for metric in METRICS:
        if all(metric.key not in r for r in results):
            continue
        label = metric.label.format(**{k: ours.get(k, "?") for k in ("reclaim_ranks", "loss_ranks", "grow_ranks")})
        cells = [format_value(metric, ours.get(metric.key), _absent(ours, metric))]
        for other in results[1:]:
            cell = versus(metric, ours.get(metric.key), other.get(metric.key), _absent(other, metric))
            if metric.key == "grow_s" and other.get("grow_from") == "restore + join window":
                cell += " †"
                note = "† no grow plan (no controller): measured from the restore + the scenario's join window."
                if note not in footnotes:
                    footnotes.append(note)
            cells.append(cell)
        met = goal_met(metric, ours.get(metric.key))
        rows.append(f"| {label} | {_goal_text(metric)} | {' | '.join(cells)} | {met} |")
    return rows + ([""] + footnotes if footnotes else [])


def _absent(result: dict[str, Any], metric: Metric) -> str:
    """What a run shows for a metric it has no value for."""
    if metric.key not in result:
        return "not played"
    return "not training" if metric.key.startswith("flaky") else "never"


def world_change_table(results: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown rows: every new world of every mode, with how it was reached and the resume split.

    ``workers`` is the trainer's word; where the controller's plan recorded another mode,
    the plan's follows in brackets.
    """
    rows = ["| mode | t (s) | round | cause | ranks | workers | resume split (s) |", "|---|---|---|---|---|---|---|"]
    for result in results:
        for change in result["world_changes"]:
            phases = change["resume_phases"]
            split = ", ".join(f"{p} {phases[p]:.2f}" for p in _ordered(phases))
            total = f" = {sum(phases.values()):.2f}" if phases else ""
            cause = change["cause"] or "(no plan)"
            if change["cause"] and change["planned"]:
                cause += " (planned)"
            workers = change["mode"] or "?"
            if change["cause"] and change["plan_mode"] != change["mode"]:
                workers += f" (plan: {change['plan_mode'] or 'none'})"
            rows.append(
                f"| {result['mode']} | {change['at_s']:.1f} | {change['round'] or '-'} | {cause} | {change['ranks']} "
                f"| {workers} | {split or '-'}{total} |"
            )
    return rows


def _ordered(phases: dict[str, float]) -> list[str]:
    rank = {name: i for i, name in enumerate(Progress.RESUME_PHASES)}
    return sorted(phases, key=lambda p: (rank.get(p, len(rank)), p))


def mode_counts(results: Sequence[dict[str, Any]]) -> list[str]:
    lines = []
    for result in results:
        changes = result["world_changes"]
        counts: dict[str, int] = {}
        for change in changes:
            mode = change["mode"] or "not reported"
            counts[mode] = counts.get(mode, 0) + 1
        detail = ", ".join(f"{n} {mode}" for mode, n in sorted(counts.items()))
        counted = f"- {result['mode']}: {len(changes)} new worlds after the first"
        lines.append(counted + (f": {detail}" if detail else ""))
    return lines


def render(results: Sequence[dict[str, Any]], header: Sequence[str]) -> str:
    return "\n".join(
        [
            *header,
            "",
            *metric_table(results),
            "",
            "New worlds, as the trainer's rank 0 reported them (cause: the controller's plan for that round):",
            "",
            *world_change_table(results),
            "",
            *mode_counts(results),
        ]
    )


# Playing the scenario.


def fitting(scenario: Scenario, tail: float = TAIL_S) -> tuple[Scenario, list[str]]:
    """The scenario without the events that leave less than ``tail`` seconds before its end
    (a run plays every event whatever its duration, so an event past the end is measured
    on nothing); returns it with a description of each event left out."""
    end = scenario.duration.total_seconds()
    kept = tuple(e for e in scenario.events if e.at.total_seconds() + tail <= end)
    dropped = [f"{e.describe()} at {e.at.total_seconds():.0f}s" for e in scenario.events if e not in kept]
    return replace(scenario, events=kept), dropped


def play(scenario: Scenario, modes: Sequence[str], root: Path) -> list[Path]:
    """Play ``scenario`` in each mode, one after the other; the first run's folder is
    ``root``, the others are its sub-folders named after their mode."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    from demo.nodes import RunLayout
    from demo.runner import run_scenario
    from regroup.telemetry import JsonLinesSpanExporter, configure_logging, configure_tracing

    class RunSpans(SpanExporter):
        """The controller's spans, into the spans file of the run being played (a process
        has one tracer provider; the controller runs in this process in every mode)."""

        target: JsonLinesSpanExporter | None = None

        def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
            return self.target.export(spans) if self.target is not None else SpanExportResult.SUCCESS

    layouts = [RunLayout(root if i == 0 else root / mode) for i, mode in enumerate(modes)]
    layouts[0].logs.mkdir(parents=True, exist_ok=True)
    log_stream = open(layouts[0].logs / "demo.log", "a")  # noqa: SIM115 - closed below
    configure_logging(stream=log_stream)
    router = RunSpans()
    provider = configure_tracing("regroup-controller")
    provider.add_span_processor(SimpleSpanProcessor(router))
    try:
        for mode, layout in zip(modes, layouts):
            layout.logs.mkdir(parents=True, exist_ok=True)
            router.target = JsonLinesSpanExporter(layout.spans)
            print(f"bench reform: playing {scenario.name!r} on {mode} in {layout.root}", flush=True)
            demo_mode, trainer = VARIANTS.get(mode, (mode, {}))
            variant = replace(scenario, trainer=_merged(scenario.trainer, trainer))
            # The live view's line a second goes to a log; the terminal gets the tables.
            with open(layout.logs / "live.log", "w") as live:
                played = run_scenario(variant, demo_mode, layout, stream=live, live=False)  # type: ignore[arg-type]
                asyncio.run(cancelled_by_sigterm(played))
    finally:
        provider.shutdown()
        log_stream.close()
    return [layout.root for layout in layouts]


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merged(merged.get(key) or {}, value) if isinstance(value, dict) else value
    return merged


def _join_window(name: str) -> tuple[float, str]:
    """The join window of the bundled or given scenario ``name``, and where it came from."""
    try:
        window = load_scenario(resolve_scenario_path(name)).job.join_window
        source = f"scenario {name}"
    except ScenarioError:
        window = JobSpec().join_window
        source = f"the default {window}: no scenario {name!r} here"
    return parse_duration(window, "job.join_window").total_seconds(), source


def _play_from(args: argparse.Namespace, header: list[str]) -> list[RunData] | int:
    """Play the scenario the arguments name in each mode; the runs, or an exit code."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in (*MODES, *VARIANTS)] or ([] if modes else [""])
    if unknown:
        known = ", ".join((*MODES, *VARIANTS))
        print(f"bench reform: --modes: unknown mode {unknown[0]!r} (known: {known})", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(resolve_scenario_path(args.scenario))
        scenario = with_overrides(scenario, duration=args.duration or (QUICK_DURATION if args.quick else None))
    except ScenarioError as exc:
        print(f"bench reform: {exc}", file=sys.stderr)
        return 2
    scenario, dropped = fitting(scenario)
    root = args.out / (args.name or f"reform-{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if (root / "run.json").exists():
        print(f"bench reform: {root} already holds a run; pick another --name", file=sys.stderr)
        return 2
    if dropped:
        header.append(f"left out, less than {TAIL_S:.0f} s before the end: {'; '.join(dropped)}")
        print(f"bench reform: {header[-1]}")
    started = time.time()
    try:
        folders = play(scenario, modes, root)
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("bench reform: interrupted", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"bench reform: {exc} (logs in {root / 'logs'})", file=sys.stderr)
        return 1
    header.append(
        f"played {scenario.name!r} ({scenario.duration.total_seconds():.0f} s of scenario) on "
        f"{', '.join(modes)}, one after the other, in {time.time() - started:.0f} s wall: {root}"
    )
    runs = [load_run(folder) for folder in folders]
    for run, mode in zip(runs, modes):
        run.meta["mode_label"] = mode
    return runs


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench reform", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a {QUICK_DURATION} run, less the events it cannot fit")
    parser.add_argument("--scenario", default="default", help="bundled scenario or YAML file (default: default)")
    parser.add_argument("--duration", help=f"run length, e.g. 150s (overrides the scenario; --quick: {QUICK_DURATION})")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated; the first is the ratios' reference")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the run (default: out)")
    parser.add_argument("--name", help="run folder name (default: reform-<scenario>-<time>)")
    parser.add_argument("--runs", type=Path, nargs="+", metavar="RUN_DIR",
                        help="tabulate recorded run folders instead (the first is the reference)")  # fmt: skip
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    header: list[str] = []
    if args.runs:
        try:
            runs = [load_run(d) for d in args.runs]
            for run, folder in zip(runs, args.runs):
                if folder.name in VARIANTS:  # a sub-folder of a played run is named after its mode
                    run.meta["mode_label"] = folder.name
        except FileNotFoundError as exc:
            print(f"bench reform: {exc}", file=sys.stderr)
            return 2
        header.append(f"recorded runs: {', '.join(str(d) for d in args.runs)}")
    else:
        played = _play_from(args, header)
        if isinstance(played, int):
            return played
        runs = played
    scenario_name = str(runs[0].meta.get("scenario", "default"))
    window, window_from = _join_window(args.scenario if not args.runs else scenario_name)
    load_after = os.getloadavg()[0]
    load = f"load average {load_before:.1f} before, {load_after:.1f} after"
    header.append(f"join window {window:g} s ({window_from}); {load}")
    results = [measure(run, window) for run in runs]
    text = render(results, [f"# bench reform: {scenario_name}, {runs[0].meta.get('duration', 0):.0f} s", "", *header])
    print(text)
    out_dir = runs[0].root
    (out_dir / "reform.md").write_text(text + "\n")
    body = {
        "scenario": scenario_name,
        "duration_s": runs[0].meta.get("duration"),
        "join_window_s": window,
        "load_average": {"before": load_before, "after": load_after},
        "goals": {m.key: m.goal for m in METRICS if m.goal is not None},
        "modes": {r["mode"]: r for r in results},
    }
    (out_dir / "reform.json").write_text(json.dumps(body, indent=2) + "\n")
    print(f"\nwrote {out_dir / 'reform.md'} and {out_dir / 'reform.json'}")
    return 0
