"""The live terminal view of a demo run.

``render()`` is a pure function from a ``LiveSnapshot`` to lines; ``LiveView`` redraws
it in place once a second on a terminal (ANSI home + clear), or prints one compact
line a second when the output is not a terminal (CI logs, pipes).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from regroup.demo.recorder import JobView
from regroup.records import Progress, ReformPhase


@dataclass(frozen=True)
class LiveSnapshot:
    """What the view shows at one moment."""

    title: str
    elapsed: float
    duration: float
    step: int | None
    loss: float | None
    world_size: int | None
    phase: str
    next_event: str | None
    """Description of the next scripted event, with its countdown."""
    nodes: tuple[tuple[str, str], ...] = ()
    """(node, state) for every node of the scenario."""
    recent: tuple[str, ...] = ()
    """The last few events, newest last."""


FRESH_PROGRESS = 2.0
"""Progress is fresh for at least this long, however often the job publishes it."""
STALE_INTERVALS = 3
"""Progress older than this many of the job's publishing intervals means it stopped training."""


def stale_after(view: JobView, floor: float = FRESH_PROGRESS) -> float:
    """How old the job's latest progress may be while the job still trains: a few of its
    publishing intervals, ``floor`` at least. The interval is the longer of the one the
    trainer announces (``progress_interval_s``: a user's script publishes every 5 s by
    default, the demo's built-in trainer every 250 ms) and the median gap between the
    records seen (a step slower than the interval publishes once a step)."""
    announced = view.progress.extra.get("progress_interval_s") if view.progress is not None else None
    interval = float(announced) if isinstance(announced, int | float) and math.isfinite(announced) else 0.0
    arrivals = view.progress_arrivals
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    if gaps:
        interval = max(interval, statistics.median(gaps))
    return max(floor, STALE_INTERVALS * interval)


def phase_of(view: JobView, now: float, stale: float | None = None) -> str:
    """The job's current phase in a few words, from the controller's plan and progress;
    progress older than ``stale`` seconds (default: ``stale_after(view)``) is a stop."""
    plan = view.plan
    if plan is not None and plan.phase != ReformPhase.DONE:
        how = [plan.cause.value, "planned" if plan.planned else "unplanned"]
        if plan.replaced:  # a spare takes a leaving node's place: replace or migrate
            how.append(plan.strategy + "".join(f" {old}->{new}" for old, new in sorted(plan.replaced.items())))
        return f"re-forming ({', '.join(how)}): {plan.phase.value}"
    status = view.status
    if status is not None and status.state in ("stalled", "waiting", "bad-config"):
        return f"{status.state}: {status.reason}"
    if view.progress is None:
        return "starting"
    if now - view.progress_seen_at > (stale_after(view) if stale is None else stale):
        return "training stopped, waiting to resume"
    return "training" + _last_reform(view.progress)


def _last_reform(progress: Progress) -> str:
    """How the current world came to be, as the trainer reports it ("" on a first start)."""
    if not progress.reform_mode:
        return ""
    resumed = sum(v for v in progress.resume_phases.values() if isinstance(v, int | float))
    took = f", resumed in {resumed:.1f}s" if progress.resume_phases else ""
    return f" (last re-form {progress.reform_mode}{took})"


def render(s: LiveSnapshot) -> list[str]:
    """The full-screen view, as lines."""
    bar_width = 30
    done = min(1.0, s.elapsed / s.duration) if s.duration > 0 else 1.0
    bar = "#" * int(done * bar_width) + "." * (bar_width - int(done * bar_width))
    lines = [
        f"{s.title}",
        f"  time   [{bar}] {s.elapsed:5.0f}s / {s.duration:.0f}s",
        (
            f"  step   {'-' if s.step is None else s.step:>7}    loss {'-' if s.loss is None else f'{s.loss:.4f}'}"
            f"    world size {'-' if s.world_size is None else s.world_size}"
        ),
        f"  phase  {s.phase}",
        f"  next   {s.next_event or 'no more scripted events'}",
        "  nodes  " + "   ".join(f"{name}: {state}" for name, state in s.nodes),
        "  recent",
    ]
    lines += [f"    {line}" for line in s.recent] or ["    -"]
    return lines


def render_line(s: LiveSnapshot) -> str:
    """One line for non-terminal output."""
    step = "-" if s.step is None else str(s.step)
    loss = "-" if s.loss is None else f"{s.loss:.4f}"
    world = "-" if s.world_size is None else str(s.world_size)
    return f"[{s.elapsed:5.0f}s] step {step} loss {loss} world {world} | {s.phase} | next: {s.next_event or '-'}"


@dataclass
class LiveView:
    """Redraws ``snapshot()`` every ``period`` seconds until cancelled."""

    snapshot: Callable[[], LiveSnapshot]
    stream: TextIO = field(default_factory=lambda: sys.stdout)
    period: float = 1.0
    tty: bool = False
    """Redraw in place with ANSI codes; otherwise print one line per period."""

    async def run(self) -> None:
        while True:
            self.draw()
            await asyncio.sleep(self.period)

    def draw(self) -> None:
        snap = self.snapshot()
        if self.tty:
            self.stream.write("\x1b[H\x1b[J" + "\n".join(render(snap)) + "\n")
        else:
            self.stream.write(render_line(snap) + "\n")
        self.stream.flush()
