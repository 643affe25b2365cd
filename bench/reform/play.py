"""Playing one scenario in each mode of ``bench reform``, one after the other, each into its
own run folder: the demo's modes through ``regroup.demo.runner``, the torchft modes through
``bench.reform.torchft_peer``."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from bench.reform import torchft_peer
from bench.reform.torchft_peer import PEERS
from regroup.demo.main import cancelled_by_sigterm
from regroup.demo.scenario import Scenario, with_spares


@dataclass(frozen=True)
class Variant:
    """A demo mode played on a variation of the scenario."""

    mode: str
    """The demo mode (``regroup``, ``regroup-restart``, ``torchrun-c10d``)."""
    trainer: dict[str, Any] = field(default_factory=dict)
    """Trainer settings over the scenario's."""
    spare_nodes: int = 0
    """Nodes added to the scenario, kept by the job as warm spares (its max unchanged)."""

    def apply(self, scenario: Scenario) -> Scenario:
        varied = replace(scenario, trainer=_merged(scenario.trainer, self.trainer))
        return with_spares(varied, self.spare_nodes) if self.spare_nodes else varied


VARIANTS: dict[str, Variant] = {
    "regroup-spares": Variant("regroup", spare_nodes=2),
    "regroup-no-snapshot": Variant("regroup", {"snapshot": {"every": 0}}),
}
"""Modes beyond the demo's own: ``regroup-spares`` is the in-place mode on the scenario
with two more nodes, which the job keeps as warm spares (a loss or a reclaim is answered
by one, at the same size; two, so that the default scenario's loss, which comes while the
reclaimed node is away, still finds one); ``regroup-no-snapshot`` the in-place mode without in-memory
snapshots (``--modes``)."""
MODES: tuple[str, ...] = ("regroup", "regroup-spares", "regroup-restart", "torchrun-c10d", "torchft")
"""The default modes, in the order they are played; the first is the reference of every
ratio. ``torchft`` only where torchft is installed (``default_modes``)."""
TORCHFT_MISSING = f"torchft is not installed: {torchft_peer.INSTALL_HINT}"


def default_modes() -> tuple[tuple[str, ...], str]:
    """The modes played without ``--modes``, and why one was left out ("" none was)."""
    if torchft_peer.installed():
        return MODES, ""
    return tuple(m for m in MODES if m not in PEERS), f"{TORCHFT_MISSING}; the default modes leave torchft out"


def missing(modes: Sequence[str]) -> str:
    """Why ``modes`` cannot be played here ("" they can)."""
    if any(m in PEERS for m in modes) and not torchft_peer.installed():
        return f"--modes {','.join(m for m in modes if m in PEERS)}: {TORCHFT_MISSING}"
    return ""


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

    from regroup.demo.nodes import Mode, RunLayout
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
            print(f"bench reform: playing {scenario.name!r} on {mode} in {layout.root}", flush=True)
            if mode in PEERS:
                asyncio.run(cancelled_by_sigterm(torchft_peer.play_on_torchft(scenario, mode, layout.root)))
                continue
            router.target = JsonLinesSpanExporter(layout.spans)
            variant = VARIANTS.get(mode, Variant(mode))
            # The live view's line a second goes to a log; the terminal gets the tables.
            with open(layout.logs / "live.log", "w") as live:
                demo_mode = cast(Mode, variant.mode)
                played = run_scenario(variant.apply(scenario), demo_mode, layout, stream=live, live=False)
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
