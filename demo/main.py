"""``regroup demo``: the whole loop on one machine, with a live view and a report.

    regroup demo                                  # the default scenario, regroup
    regroup demo --baseline torchrun-c10d         # the same churn on plain torchrun
    regroup demo --compare                        # both, one report side by side
    regroup demo --scenario short --duration 90s  # a bundled scenario, overridden
    regroup demo --scenario spares                # the default churn on a job that keeps a warm spare
    regroup demo --script train.py [-- ARGS...]   # your own training script instead of the built-in trainer
    regroup demo -- python train.py --lr 3e-4     # the same, as a command after --
    regroup demo --report out/RUN [out/RUN2]      # rebuild a report from recorded runs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from regroup.demo.scenario import ScenarioError, load_scenario, resolve_scenario_path, with_overrides

BASELINES = ("regroup-restart", "torchrun-c10d")
T = TypeVar("T")


async def cancelled_by_sigterm(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``; SIGTERM cancels it like Ctrl-C does, so every local node is stopped."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await coro
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


@contextlib.contextmanager
def exit_codes(program: str, logs: Path) -> Iterator[None]:
    """Ctrl-C or SIGTERM ends ``program`` with status 130; an OS or runtime failure with 1,
    saying where the logs are. Either way the ``finally`` blocks around it still run."""
    try:
        yield
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"{program}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except (OSError, RuntimeError, TimeoutError) as exc:
        print(f"{program}: {exc} (logs in {logs})", file=sys.stderr)
        raise SystemExit(1) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scenario", default="default", help="scenario YAML file, or a bundled one: default, short, spares, evict, drain, silent (default: default)"
    )
    parser.add_argument(
        "--nodes", type=int, help="number of local nodes (overrides the scenario; the job's max follows, less its spares)"
    )
    parser.add_argument("--duration", help="run length, e.g. 150s or 3m (overrides the scenario)")
    parser.add_argument("--out", type=Path, default=Path("out"), help="folder for run folders (default: out)")
    parser.add_argument("--name", help="run folder name (default: <scenario>-<time>)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--baseline", choices=BASELINES, help="play the scenario with every re-form restarting the workers (regroup-restart), or on plain torchrun")
    which.add_argument("--compare", action="store_true", help="play it on regroup, then on torchrun-c10d; one report")
    which.add_argument(
        "--report", type=Path, nargs="+", metavar="RUN_DIR", help="only rebuild the report of recorded run folders"
    )
    parser.add_argument("--no-live", action="store_true", help="print a line a second instead of the live view")
    parser.add_argument(
        "--script",
        metavar="PATH",
        help="run this training script on every rank instead of the built-in trainer; its arguments go after --",
    )
    parser.add_argument(
        "command",
        nargs="*",
        metavar="-- COMMAND",
        help="the script's arguments with --script; without it, the whole training command (python train.py ...)",
    )


def _script(args: argparse.Namespace) -> list[str] | None:
    """The user's training command (torchrun's part of it), None for the built-in trainer.
    Raises ``ScriptError`` saying what is wrong."""
    from regroup.demo.nodes import ScriptError, worker_command

    script, rest = getattr(args, "script", None), list(getattr(args, "command", None) or [])
    if script is None and not rest:
        return None
    if args.report:
        raise ScriptError("--report only rebuilds the report of recorded runs; it runs no script")
    return worker_command(script, rest)


def _render(run_dirs: list[Path], report_path: Path) -> int:
    from regroup.demo.analysis import load_run
    from regroup.demo.report import build_report, summary_text

    runs = [load_run(d) for d in run_dirs]
    build_report(runs, report_path)
    print(summary_text(runs, report_path.resolve()))
    return 0


def run(args: argparse.Namespace) -> int:
    from regroup.demo.nodes import ScriptError

    try:
        script = _script(args)
    except ScriptError as exc:
        print(f"regroup demo: {exc}", file=sys.stderr)
        return 2
    if args.report:
        try:
            return _render(list(args.report), args.report[0] / "report.html")
        except FileNotFoundError as exc:
            print(f"regroup demo: {exc}", file=sys.stderr)
            return 2
    try:
        scenario = with_overrides(
            load_scenario(resolve_scenario_path(args.scenario)), nodes=args.nodes, duration=args.duration
        )
    except ScenarioError as exc:
        print(f"regroup demo: {exc}", file=sys.stderr)
        return 2

    from regroup.demo.nodes import CONTROLLED, RunLayout
    from regroup.demo.runner import run_scenario
    from regroup.telemetry import configure_logging, configure_tracing

    root = args.out / (args.name or f"{scenario.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if (root / "run.json").exists():
        print(f"regroup demo: {root} already holds a run; pick another --name", file=sys.stderr)
        return 2
    modes = ["regroup", "torchrun-c10d"] if args.compare else [args.baseline or "regroup"]
    layouts = [RunLayout(root if i == 0 else root / mode) for i, mode in enumerate(modes)]
    layouts[0].logs.mkdir(parents=True, exist_ok=True)
    # Logs go to a file: the terminal belongs to the live view.
    log_stream = open(layouts[0].logs / "demo.log", "a")  # noqa: SIM115 - closed below
    configure_logging(stream=log_stream)
    controlled = [i for i, mode in enumerate(modes) if mode in CONTROLLED]
    provider = configure_tracing("regroup-controller", spans_file=str(layouts[controlled[0]].spans)) if controlled else None
    live = False if args.no_live else None
    try:
        with exit_codes("regroup demo", layouts[0].logs):
            for mode, layout in zip(modes, layouts):
                what = f" with {' '.join(script)}" if script else ""
                print(f"regroup demo: playing {scenario.name!r} on {mode}{what} ({scenario.duration.total_seconds():.0f}s) in {layout.root}")
                asyncio.run(cancelled_by_sigterm(run_scenario(scenario, mode, layout, live=live, script=script)))
    finally:
        if provider is not None:
            provider.shutdown()
        log_stream.close()
    return _render([layout.root for layout in layouts], root / "report.html")
