"""The rounds of ``bench script``: the variants alternated on one etcd, a round run again
when other processes took too much of the machine, and the summaries over rounds."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.script.profiling import profile_round
from bench.script.runs import loadavg, run_with, run_without
from bench.script.summary import compare, summarize
from bench.script.variants import NO_SNAPSHOTS, SYNCED, VARIANTS, Settings, without_snapshots


def disturbed(pair: Mapping[str, Mapping[str, Any]], max_others: float | None) -> float | None:
    """The most cores other processes kept busy in any run of a round, when above ``max_others``."""
    busiest = max((r.get("others_cores", 0.0) for r in pair.values()), default=0.0)
    return busiest if max_others is not None and busiest > max_others else None


def measure(
    settings: Settings, rounds: int, root: Path, profile: Path | None = None, no_snapshots: bool = False,
    clock: str = "cpu", max_others: float | None = None, retries: int = 3, synced: bool = False,
) -> dict[str, Any]:
    from regroup.demo.etcd_server import EtcdServer

    etcd = EtcdServer(data_dir=root / "etcd")
    etcd.start()
    per_round: list[dict[str, dict[str, Any]]] = []
    load = {"start": loadavg()}
    variants = [*VARIANTS, *([SYNCED] if synced else []), *([NO_SNAPSHOTS] if no_snapshots else [])]
    bare = without_snapshots(root) if no_snapshots else None
    redone = 0
    try:
        for i in range(rounds):
            for attempt in range(retries + 1):
                pair: dict[str, dict[str, Any]] = {}
                for variant in variants:
                    job = f"script-{i}-{attempt}"
                    if variant in ("without", SYNCED):
                        run = run_without(settings, root, synced=variant == SYNCED)
                    elif variant == "with":
                        run = run_with(settings, root, etcd.endpoint, job, etcd.pid)
                    else:
                        assert bare is not None
                        run = run_with(settings, root, etcd.endpoint, f"{job}-bare", etcd.pid, script=bare)
                    pair[variant] = summarize(run["stamps"], settings.warmup, run["samples"], run["rank0"])
                    pair[variant]["first_loss"] = run["first_loss"]
                    pair[variant]["failed_after_training"] = run["failed"]
                    shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in pair[variant].items()}
                    print(f"round {i + 1}/{rounds} {variant}: {json.dumps(shown)}", file=sys.stderr, flush=True)
                busy = disturbed(pair, max_others)
                if busy is None or attempt == retries:
                    break
                redone += 1
                print(f"round {i + 1}: other processes kept {busy:.2f} cores busy; again", file=sys.stderr, flush=True)
            per_round.append(pair)
        load["end"] = loadavg()
        profiled = profile_round(settings, root, etcd.endpoint, etcd.pid, clock) if profile is not None else None
    finally:
        etcd.kill()
    result = {
        "rounds": per_round, "summary": compare(per_round), "loadavg": load, "profile": profiled, "rounds_redone": redone,
    }  # fmt: skip
    if no_snapshots:
        result["summary_no_snapshots"] = compare(per_round, NO_SNAPSHOTS)
    if synced:
        result["summary_synced"] = compare(per_round, "with", base=SYNCED)
        result["summary_synced_vs_plain"] = compare(per_round, SYNCED)
    return result
