"""Playing one scenario in each mode of ``bench reform``, one after the other, each into its
own run folder."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from regroup.demo.main import cancelled_by_sigterm
from regroup.demo.scenario import Scenario

MODES: tuple[str, ...] = ("regroup", "regroup-restart", "torchrun-c10d")
"""In the order they are played; the first is the reference of every ratio."""
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "regroup-no-snapshot": ("regroup", {"snapshot": {"every": 0}}),
}
"""Further modes (``--modes``): a demo mode with trainer settings over the scenario's."""
TAIL_S = 25.0
"""An event is played only if it leaves this many seconds before the end of the run."""


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

    from regroup.demo.nodes import RunLayout
    from regroup.demo.runner import run_scenario
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
