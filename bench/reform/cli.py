"""``python -m bench reform [--quick]``: in-place re-forms vs restarting the workers vs plain torchrun vs torchft.

The command line: play the scenario in each mode (``bench.reform.play``), or read recorded
run folders (``--runs``); then measure them and write the tables (``bench.reform.report``)
to stdout, ``reform.md`` and ``reform.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench.reform.play import MODES, TAIL_S, VARIANTS, default_modes, fitting, missing, play
from bench.reform.report import METRICS, measure, render
from bench.reform.torchft_measure import is_torchft, measure_recorded
from bench.reform.torchft_peer import PEERS
from regroup.demo.analysis import RunData, load_run
from regroup.demo.main import exit_codes
from regroup.demo.scenario import (
    JobSpec,
    ScenarioError,
    load_scenario,
    parse_duration,
    resolve_scenario_path,
    with_overrides,
)

QUICK_DURATION = "110s"


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
    if args.modes is None:
        defaults, left_out = default_modes()
        modes = list(defaults)
        if left_out:
            print(f"bench reform: {left_out}")
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    known = dict.fromkeys((*MODES, *VARIANTS, *PEERS))
    unknown = [m for m in modes if m not in known] or ([] if modes else [""])
    if unknown:
        print(f"bench reform: --modes: unknown mode {unknown[0]!r} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    if why := missing(modes):
        print(f"bench reform: {why}", file=sys.stderr)
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
    with exit_codes("bench reform", root / "logs"):
        folders = play(scenario, modes, root)
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
    parser.add_argument(
        "--modes",
        help=f"comma-separated; the first is the ratios' reference (default: {','.join(MODES)}, torchft if installed)",
    )
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
                if folder.name in (*VARIANTS, *PEERS):  # a sub-folder of a played run is named after its mode
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
    results = [measure_recorded(run) if is_torchft(run) else measure(run, window) for run in runs]
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
