"""The run report's charts, each a PNG inlined as base64: the world size over time with
the scripted events, the loss across re-forms, each re-form's latency by phase, the
downtime and lost steps per scripted event, and the goodput."""

from __future__ import annotations

import base64
import io
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from regroup.demo.analysis import RunData, event_impacts, goodput, incarnations, reform_label, run_reforms, world_size_timeline
from regroup.trace_report import PHASES, Reform

PHASE_COLOURS = {"detect": "#d62728", "checkpoint": "#1f77b4", "rendezvous": "#ff7f0e", "resume": "#2ca02c"}
RUN_COLOURS = {"regroup": "#1f77b4", "regroup-restart": "#ff7f0e", "torchrun-c10d": "#7f7f7f"}


def _png(fig: plt.Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def world_size_chart(runs: list[RunData]) -> str:
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), sharex=True, squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        points = world_size_timeline(run)
        ax.step([p[0] for p in points], [p[1] for p in points], where="post", color=RUN_COLOURS.get(run.mode, "k"))
        top = max([p[1] for p in points] + [1])
        for event in run.events:
            at = event.time - run.started_at
            if event.source == "scenario":
                ax.axvline(at, color="#444", linestyle="--", linewidth=0.8)
                ax.text(at, top + 0.35, event.reason, rotation=0, fontsize=8, ha="left", va="bottom")
            elif event.reason == "RankCrashed":
                ax.plot([at], [0.2], marker="x", color="#d62728")
            elif event.reason == "Cordoned":
                ax.plot([at], [top], marker="v", color="#9467bd", markersize=9)
                ax.text(at, top - 0.5, "cordon", fontsize=8, color="#9467bd")
        ax.set_ylim(-0.2, top + 1)
        ax.set_ylabel("ranks training")
        ax.set_title(run.mode, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("seconds since the job's start (x: injected rank crash, v: cordon)")
    return _png(fig)


def loss_chart(runs: list[RunData]) -> str | None:
    """None when no run reported a loss (a script that publishes none)."""
    runs = [r for r in runs if r.reported["loss"]]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.4))
    for run in runs:
        colour = RUN_COLOURS.get(run.mode, "k")
        labelled = False
        for i, part in enumerate(incarnations(run.progress)):
            # The record written at (re)start carries the checkpoint step and no loss yet.
            measured = [
                s for s in part.samples
                if math.isfinite(s.loss) and (s.step > part.resumed_from_step or s.step == 0 and s.loss > 0)
            ]  # fmt: skip
            if not measured:
                continue
            ax.plot(
                [s.step for s in measured], [s.loss for s in measured], color=colour, linewidth=1,
                label=None if labelled else run.mode,
            )  # fmt: skip
            labelled = True
            if i > 0:
                ax.plot([measured[0].step], [measured[0].loss], "o", color=colour, markersize=3)
    ax.set_xlabel("step (dots: first step after a resume)")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    return _png(fig)


MAX_X_LABELS = 16
"""The latency chart names at most this many bars (every k-th, the others by their number
in the table): more would not fit side by side at any angle."""


def _world_text(reform: Reform) -> str:
    return "->".join("?" if n < 0 else str(n) for n in (reform.world_before, reform.world_after))


def reform_latency_figure(run: RunData) -> plt.Figure | None:
    """Stacked phase bars, one per re-form (numbered as in the table), labelled with the
    cause, the world and the time, slanted so neighbours do not overlap; with more than
    ``MAX_X_LABELS`` bars only every k-th is named."""
    reforms = run_reforms(run)
    if not reforms:
        return None
    fig, ax = plt.subplots(figsize=(10, 3.8))
    xs = list(range(len(reforms)))
    bottoms = [0.0] * len(reforms)
    for phase in PHASES:
        values = [r.phases.get(phase, 0.0) for r in reforms]
        ax.bar(xs, values, bottom=bottoms, color=PHASE_COLOURS[phase], label=phase)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    every = -(-len(reforms) // MAX_X_LABELS)
    named = xs[::every]
    labels = [
        f"#{i + 1} {reform_label(run, reforms[i])} {_world_text(reforms[i])} @{reforms[i].start - run.started_at:.0f}s"
        for i in named
    ]
    ax.set_xticks(named, labels, rotation=35, ha="right", rotation_mode="anchor", fontsize=8)
    ax.set_xlim(-0.6, len(reforms) - 0.4)
    ax.set_ylabel("seconds")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return fig


def reform_latency_chart(run: RunData) -> str | None:
    fig = reform_latency_figure(run)
    return None if fig is None else _png(fig)


def per_event_chart(runs: list[RunData], metric: str) -> str:
    """Grouped bars per scripted event: ``lost`` steps or training ``downtime`` seconds."""
    impacts = {run.mode: event_impacts(run) for run in runs}
    names = [f"{e.event.reason}\n{', '.join(e.event.nodes)}" for e in impacts[runs[0].mode]]
    fig, ax = plt.subplots(figsize=(10, 3.0))
    width = 0.8 / len(runs)
    for k, run in enumerate(runs):
        values = [
            (imp.lost_steps if metric == "lost" else imp.downtime) for imp in impacts[run.mode]
        ]
        xs = [i + k * width for i in range(len(values))]
        bars = ax.bar(xs, values, width=width, color=RUN_COLOURS.get(run.mode, "k"), label=run.mode)
        ax.bar_label(bars, labels=[f"{v:.0f}" if metric == "lost" else f"{v:.1f}" for v in values], fontsize=8)
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(names))], names, fontsize=8)
    ax.set_ylabel("steps lost" if metric == "lost" else "seconds without training")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return _png(fig)


def goodput_chart(runs: list[RunData]) -> str:
    fig, ax = plt.subplots(figsize=(5, 2.4))
    values = [goodput(r) * 100 for r in runs]
    bars = ax.barh([r.mode for r in runs], values, color=[RUN_COLOURS.get(r.mode, "k") for r in runs])
    ax.bar_label(bars, labels=[f"{v:.0f}%" for v in values])
    ax.set_xlim(0, 100)
    ax.set_xlabel("goodput: useful training time / wall time (%)")
    return _png(fig)
