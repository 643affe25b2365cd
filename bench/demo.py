"""``python -m bench demo [--quick]``: the demo scenario on regroup and on plain torchrun.

Plays the scenario twice in one run (``regroup demo --compare``): regroup (etcd-v3
rendezvous + controller), then the anchor, torchrun with c10d rendezvous and no
controller, with the same trainer, checkpoint cadence and churn. Prints, per scripted
event, regroup's re-form latency by phase (from its traces), and for both the seconds
without training and the steps lost; then goodput and the anchor/regroup ratios.
``--quick`` plays the shortened scenario instead of the default one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from regroup.demo import main as demo_main
from regroup.demo.analysis import RunData, event_impacts, goodput, load_run
from regroup.trace_report import PHASES


def _ratio(anchor: float, ours: float) -> str:
    return f"{anchor / ours:.1f}x" if ours > 0 else "-"


def event_table(ours: RunData, anchor: RunData) -> list[str]:
    """Markdown rows, one per scripted event."""
    rows = [
        (
            "| event | regroup re-forms (cause: detect/checkpoint/rendezvous/resume = total s) "
            "| regroup s without training | torchrun-c10d s without training | regroup steps lost | torchrun-c10d steps lost |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for mine, theirs in zip(event_impacts(ours), event_impacts(anchor)):
        reforms = "; ".join(
            f"{r.cause}: {'/'.join(f'{r.phases.get(p, 0.0):.1f}' for p in PHASES)} = {r.duration:.1f}" for r in mine.reforms
        ) or "-"
        label = f"{mine.event.reason} {', '.join(mine.event.nodes)}".strip()
        rows.append(
            f"| {label} | {reforms} | {mine.downtime:.1f} | {theirs.downtime:.1f} | {mine.lost_steps} | {theirs.lost_steps} |"
        )
    return rows


def summary_rows(ours: RunData, anchor: RunData) -> list[str]:
    mine, theirs = event_impacts(ours), event_impacts(anchor)
    down = (sum(i.downtime for i in mine), sum(i.downtime for i in theirs))
    lost = (sum(i.lost_steps for i in mine), sum(i.lost_steps for i in theirs))
    good = (goodput(ours), goodput(anchor))
    steps = (max((p.step for p in ours.progress), default=0), max((p.step for p in anchor.progress), default=0))
    return [
        "| | regroup | torchrun-c10d | torchrun-c10d / regroup |",
        "|---|---|---|---|",
        f"| seconds without training (all events) | {down[0]:.1f} | {down[1]:.1f} | {_ratio(down[1], down[0])} |",
        f"| steps lost (all events) | {lost[0]} | {lost[1]} | {_ratio(lost[1], lost[0])} |",
        f"| goodput (useful training time / wall time) | {good[0]:.0%} | {good[1]:.0%} | {good[1] / good[0]:.2f} |"
        if good[0] > 0
        else f"| goodput | {good[0]:.0%} | {good[1]:.0%} | - |",
        f"| steps trained in {ours.ended_at - ours.started_at:.0f} s | {steps[0]} | {steps[1]} | "
        f"{steps[1] / steps[0]:.2f} |" if steps[0] else "| steps trained | 0 | 0 | - |",
    ]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench demo", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the shortened scenario (about 2 x 2 minutes)")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for the run (default: out)")
    parser.add_argument("--runs", type=Path, nargs=2, metavar=("REGROUP_RUN", "BASELINE_RUN"),
                        help="tabulate two recorded runs instead of playing the scenario")  # fmt: skip
    args = parser.parse_args(argv)
    if args.runs:
        ours_dir, anchor_dir = args.runs
    else:
        scenario = "short" if args.quick else "default"
        name = f"bench-{scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
        demo_parser = argparse.ArgumentParser()
        demo_main.add_arguments(demo_parser)
        demo_args = demo_parser.parse_args(
            ["--scenario", scenario, "--compare", "--out", str(args.out), "--name", name, "--no-live"]
        )
        code = demo_main.run(demo_args)
        if code != 0:
            return code
        ours_dir, anchor_dir = args.out / name, args.out / name / "torchrun-c10d"
    ours, anchor = load_run(ours_dir), load_run(anchor_dir)
    lines = [f"scenario {ours.meta.get('scenario')}: {ours_dir} vs {anchor_dir}", "", *event_table(ours, anchor), "",
             *summary_rows(ours, anchor)]  # fmt: skip
    print("\n".join(lines))
    (ours_dir / "bench.json").write_text(
        json.dumps(
            {
                "scenario": ours.meta.get("scenario"),
                "regroup": {"goodput": goodput(ours), "events": _impacts_json(ours)},
                "torchrun-c10d": {"goodput": goodput(anchor), "events": _impacts_json(anchor)},
            },
            indent=2,
        )
    )
    return 0


def _impacts_json(run: RunData) -> list[dict[str, object]]:
    return [
        {
            "event": i.event.reason,
            "nodes": list(i.event.nodes),
            "at_s": round(i.event.time - run.started_at, 1),
            "downtime_s": round(i.downtime, 2),
            "lost_steps": i.lost_steps,
            "reforms": [
                {"cause": r.cause, "total_s": round(r.duration, 2), **{p: round(r.phases.get(p, 0.0), 2) for p in PHASES}}
                for r in i.reforms
            ],
        }
        for i in event_impacts(run)
    ]
