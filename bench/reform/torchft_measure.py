"""What ``bench reform`` measures in a torchft run: the numbers ``report.measure`` gives for
a demo run, from the replicas' step log and the played events.

The step log becomes the job's progress, then regroup's own analysis measures it, so both
sides are read by one definition:

- each step once, at its first commit, with the number of participating replicas as the
  world size and the lighthouse's quorum id as the round: a new quorum, or a new count
  of participants, is a new world (a re-form);
- a new world continues from the step the job had reached: the survivors keep their
  state, a fresh replica recovers it from a peer (``infer_resume_points``), so steps are
  lost only where the step went backwards (every replica gone);
- abrupt loss: the kill -> the first committed step at N-1 participants; planned reclaim:
  the taint -> the first at N-1, torchft having no planned leave (the replica dies when
  the notice ends, see ``reclaim_note``); grow: the restore, when the fresh replicas are
  launched (no grow plan: a fresh replica joins the next quorum; ``grow_from`` reads
  ``launch``) -> the first committed step at the full count; flaky node: the
  stand-stills after the flaky event;
- goodput: ``regroup.demo.analysis.goodput``: the time between commits of one world, over
  the run's wall time; the time from a world's last commit to the next world's first is
  not training.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.reform.report import measure
from bench.reform.torchft_replica import StepRecord
from regroup.demo.analysis import ProgressSample, RunData, ScriptedEvent, infer_resume_points, scripted_events
from regroup.demo.resizes import first_progress_at, scripted_resizes

STEPS_LOG = "steps.jsonl"
GROW_FROM = "launch"
"""``grow_from`` of a torchft run: from the restore, when the fresh replicas were launched."""


def is_torchft(run: RunData) -> bool:
    return run.mode == "torchft"


def job_progress(steps: Sequence[StepRecord], since: float | None = None) -> list[ProgressSample]:
    """The job's progress from every replica's committed steps: each (quorum, step) once, at
    its first commit, as one progress sample whose world is the quorum and its participants.

    ``since``: the start of the run; the quorums that formed before it (the replicas joining
    one by one) are not the run's re-forms, so progress starts with the last commit at or
    before it."""
    first: dict[tuple[int, int], StepRecord] = {}
    ordered = sorted(steps, key=lambda s: s["time"])
    if since is not None:
        before = [i for i, s in enumerate(ordered) if s["time"] <= since]
        ordered = ordered[before[-1] if before else 0 :]
    for step in ordered:
        first.setdefault((step["quorum"], step["step"]), step)
    samples = [
        ProgressSample(
            time=s["time"],
            step=s["step"],
            loss=s["loss"],
            world_size=s["participants"],
            resumed_from_step=0,
            round=s["quorum"],
            reform_mode="torchft",
        )
        for s in sorted(first.values(), key=lambda s: s["time"])
    ]
    return infer_resume_points(samples)


def measure_torchft(
    steps: Sequence[StepRecord], events: Sequence[ScriptedEvent], meta: Mapping[str, Any], root: Path
) -> dict[str, Any]:
    """The metrics of a torchft run, keyed as ``report.measure``'s, plus ``reclaim_note``,
    ``flaky_note`` and ``not_played`` where they apply. ``meta`` is the run's ``run.json``."""
    started = meta.get("started_at")
    progress = job_progress(steps, None if started is None else float(started))
    run = RunData(root, dict(meta), progress, [], list(events), [], [])
    # No join window: a restore is measured from the moment the fresh replicas were launched.
    out = measure(run, join_window=0.0)
    settings = meta.get("torchft", {})
    out["mode"] = f"{meta.get('mode_label', 'torchft')} (heartbeat {settings.get('heartbeat_timeout_s', 5.0):g} s)"
    if str(out.get("grow_from", "")).endswith(" + join window"):
        out["grow_from"] = GROW_FROM
    for event in out["events"]:
        if event["measured_from"].endswith(" + join window"):
            event["measured_from"] = GROW_FROM
    reclaim = reclaim_note(run)
    if reclaim:
        out["reclaim_note"] = reclaim
    crashes = dict(meta.get("flaky_crashes") or {})
    flaky = next((e for e in scripted_events(run) if e.reason == "flaky"), None)
    if flaky is not None and "flaky_note" not in out:
        count = ", ".join(f"{node} {n} times" for node, n in crashes.items()) or "none"
        out["flaky_note"] = f"no cordon: the flaky replica was crashed and restarted at once until the end ({count})"
    if meta.get("not_played"):
        out["not_played"] = list(meta["not_played"])
    return out


def reclaim_note(run: RunData) -> str:
    """How torchft went through the first reclaim, which it cannot plan for: the replica's
    kill at the end of the notice, and training at the smaller size after it ("" without a
    reclaim)."""
    resizes = scripted_resizes(run)
    for i, resize in enumerate(resizes):
        event = resize.event
        if event.reason != "reclaim":
            continue
        kill = next(
            (e for e in run.events if e.source == "torchft" and e.reason == "Killed" and e.time >= event.time
             and set(e.nodes) & set(event.nodes)),
            None,
        )  # fmt: skip
        who = ", ".join(event.nodes)
        if kill is None:
            return f"no planned leave: {who}'s replica was to be SIGKILLed when its notice ended, after the run"
        until = resizes[i + 1].event.time if i + 1 < len(resizes) else None
        reached = first_progress_at(run, kill.time, resize.ranks_after, until)
        after = (
            f"training at {resize.ranks_after} ranks {reached.time - kill.time:.2f} s after the kill"
            if reached is not None
            else f"no training at {resize.ranks_after} ranks after the kill before the next event"
        )
        return (
            f"no planned leave: {who}'s replica trained on through its notice and was SIGKILLed when it "
            f"ended, {kill.time - event.time:.0f} s after the taint; {after}"
        )
    return ""


def read_steps(path: Path) -> list[StepRecord]:
    """The step log of a torchft run folder."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def measure_recorded(run: RunData) -> dict[str, Any]:
    """``measure_torchft`` of a recorded torchft run folder (loaded with ``load_run``)."""
    meta = dict(run.meta)
    return measure_torchft(read_steps(run.root / STEPS_LOG), run.events, meta, run.root)
