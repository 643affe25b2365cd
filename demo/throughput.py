"""Training throughput just before and just after each scripted event of a recorded run.

The global batch is constant across sizes (DESIGN contract 4), so a job that shrinks does
as many samples per step on fewer ranks, and where the ranks are what bounds a step its
samples per second drop by the lost share. A job that replaces the leaving node with a
warm spare keeps its size: its throughput after the event should equal its throughput
before it. This module measures both sides from the ``progress`` records (``samples_seen``
over rank 0's clock; steps per second for a script that does not report samples):

- **before**: the world training when the event fired, over the ``window`` seconds of
  training up to the event;
- **after**: the first world formed after the event (before the next scripted event or the
  end of the run), over its first ``window`` seconds; where no world was formed in answer
  (nothing to re-form), the same world over the ``window`` seconds after the event.

A rate comes from the first and the last record of its window, both inside one world, so
the re-form's own pause and its first step are never part of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from regroup.demo.analysis import ProgressSample, RunData, ScriptedEvent, scripted_events
from regroup.demo.resizes import world_segments

DEFAULT_WINDOW_S = 10.0


@dataclass(frozen=True)
class Rate:
    """Throughput over one window of one world."""

    per_s: float
    """Samples (or steps, see ``EventThroughput.unit``) per second."""
    ranks: int
    since: float
    """Unix time of the window's first record."""
    until: float
    """Unix time of its last record."""


@dataclass(frozen=True)
class EventThroughput:
    """Throughput around one scripted event."""

    event: ScriptedEvent
    before: Rate | None
    """None: the job was not training in the window before the event."""
    after: Rate | None
    """None: no world trained long enough after the event to measure (before the next)."""
    unit: str
    """``samples/s``, or ``steps/s`` for a script that reports no ``samples_seen``."""

    @property
    def ratio(self) -> float | None:
        """after / before (1.0: the event cost no throughput)."""
        if self.before is None or self.after is None or self.before.per_s <= 0:
            return None
        return self.after.per_s / self.before.per_s


def _rate(samples: list[ProgressSample], by_samples: bool) -> Rate | None:
    if len(samples) < 2 or samples[-1].time <= samples[0].time:
        return None
    first, last = samples[0], samples[-1]
    done = last.samples_seen - first.samples_seen if by_samples else last.step - first.step
    return Rate(done / (last.time - first.time), first.world_size, first.time, last.time)


def throughput_around_events(run: RunData, window: float = DEFAULT_WINDOW_S) -> list[EventThroughput]:
    """Each scripted event with the throughput in a ``window`` before and after it."""
    by_samples = any(p.samples_seen > 0 for p in run.progress)
    unit = "samples/s" if by_samples else "steps/s"
    worlds = world_segments(run.progress)
    events = scripted_events(run)
    out = []
    for i, event in enumerate(events):
        until = events[i + 1].time if i + 1 < len(events) else run.ended_at
        training = next((w for w in reversed(worlds) if w[0].time <= event.time), None)
        before = None
        if training is not None:
            before = _rate([p for p in training if event.time - window <= p.time <= event.time], by_samples)
        after = None
        for world in worlds:
            if world[0].time <= event.time or world[0].time >= until:
                continue
            after = _rate([p for p in world if p.time <= min(world[0].time + window, until)], by_samples)
            if after is not None:
                break
        if after is None and training is not None and not any(event.time < w[0].time < until for w in worlds):
            after = _rate([p for p in training if event.time <= p.time <= min(event.time + window, until)], by_samples)
        out.append(EventThroughput(event, before, after, unit))
    return out
