"""``python -m bench script --compile-reform``: what an in-place re-form costs a compiled model.

The same script (``bench/_compiled_script.py``: the FSDP2 example's model under
``elastic.in_place``, snapshots every step) runs twice in one benchmark, uncompiled and
under ``torch.compile(model)``, each under three ``regroup-run --standby`` agents posing as
nodes ``n0..n2`` on one real etcd, through the same two re-forms:

1. **loss**: ``n2`` is killed (agent and worker) once the world of 3 has trained 10 steps
   (4 with ``--quick``); ``n0`` and ``n1`` re-form in place as a world of 2, the state
   rebuilt in memory from the snapshots. Each survivor's share of the global batch grows
   from G/3 to G/2 samples, so its compiled graphs see a new input shape;
2. **grow**: ``n2``'s agent starts again once the world of 2 has trained as many steps;
   the world of 3 forms in place with the survivors' processes and one new one, whose
   compile starts from nothing in that process.

For each world, from every rank's per-step lines: the frames Dynamo compiled in it, a
first compile or a recompile (on the processes the world kept, and on the new one), the
seconds the slowest rank spent compiling, rank 0's first step's wall time and the median
of its steps after the second (steady). The first step of a world is every rank's: the collectives wait for
the slowest, so a newcomer's compile is the survivors' wait too.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.script import REPO, _json_lines, _kill_group, base_env, loadavg

NODES = ("n0", "n1", "n2")
LOST = "n2"
VARIANTS = ("none", "compiled")
"""The script uncompiled (the baseline) and under ``torch.compile``."""


@dataclass
class Settings:
    backend: str
    layers: int
    global_batch: int
    warm: int
    """Steps of the first world before the loss (its compile done, its steps steady)."""
    settle: int
    """Steps of each re-formed world before the next event and the end."""
    timeout: float = 600.0


def _records(logs: dict[str, list[Path]]) -> list[dict[str, Any]]:
    """Every ``world`` and ``bench_step`` line of every node's logs, with its node and the
    incarnation of its agent (0: the first, 1: started again)."""
    out = []
    for node, paths in logs.items():
        for life, path in enumerate(paths):
            if not path.exists():
                continue
            for value in _json_lines(path.read_text(errors="replace")):
                for kind in ("world", "bench_step"):
                    if kind in value:
                        out.append({**value[kind], "kind": kind, "node": node, "life": life})
    return out


def _steps(records: list[dict[str, Any]], world_size: int, after_round: int) -> list[dict[str, Any]]:
    """Rank 0's steps in worlds of ``world_size`` formed after round ``after_round``."""
    return [
        r for r in records
        if r["kind"] == "bench_step" and r["rank"] == 0 and r["world_size"] == world_size and r["round"] > after_round
    ]  # fmt: skip


def _await(what: str, check: Callable[[], Any], timeout: float, procs: dict[str, subprocess.Popen[bytes]]) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        dead = [n for n, p in procs.items() if p.poll() is not None]
        if dead:
            raise RuntimeError(f"waiting for {what}: the agent of {dead} exited")
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def play(variant: str, settings: Settings, root: Path, endpoint: str) -> list[dict[str, Any]]:
    """One run of the script through the loss and the grow; every rank's lines."""
    job = f"compile-{variant}"
    cwd = root / job
    cwd.mkdir()
    backend = "none" if variant == "none" else settings.backend
    worker = [
        "-m", "bench._compiled_script", f"--backend={backend}", f"--layers={settings.layers}",
        f"--global-batch={settings.global_batch}",
    ]  # fmt: skip
    argv = [
        sys.executable, "-m", "regroup.rendezvous.inplace.launcher", "--standby", "--monitor-interval=0.1",
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}", "--nnodes=2:3",
        "--nproc-per-node=1", "--rdzv-conf=lease_ttl=2,last_call_timeout=1,join_timeout=300",
        "--local-addr=127.0.0.1", *worker,
    ]  # fmt: skip
    env = base_env()
    logs: dict[str, list[Path]] = {node: [] for node in NODES}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(node: str) -> None:
        log = cwd / f"{node}-{len(logs[node])}.log"
        logs[node].append(log)
        with open(log, "wb") as out:
            procs[node] = subprocess.Popen(
                argv, env={**env, "NODE_NAME": node}, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                start_new_session=True,
            )  # fmt: skip

    def reached(world_size: int, after_round: int, count: int) -> int | None:
        """The round of a world of ``world_size`` after ``after_round`` once it trained ``count`` steps."""
        steps = _steps(_records(logs), world_size, after_round)
        rounds = sorted({s["round"] for s in steps})
        for round_ in rounds:
            if sum(s["round"] == round_ for s in steps) >= count:
                return round_
        return None

    try:
        for node in NODES:
            start(node)
        first = _await(
            f"{settings.warm} steps of 3 ranks", lambda: reached(3, -1, settings.warm), settings.timeout, procs
        )
        _kill_group(procs.pop(LOST))
        shrunk = _await(
            f"{settings.settle} steps of 2 ranks", lambda: reached(2, first, settings.settle), settings.timeout, procs
        )
        start(LOST)
        _await(
            f"{settings.settle} steps of 3 ranks again", lambda: reached(3, shrunk, settings.settle),
            settings.timeout, procs,
        )  # fmt: skip
    finally:
        for proc in procs.values():
            _kill_group(proc)
    return _records(logs)


def worlds(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per world, in order: how it came to be, its size, the frames each rank
    compiled in it and the seconds that took, its first step and its steady step."""
    rows: list[dict[str, Any]] = []
    rounds = sorted({r["round"] for r in records if r["kind"] == "bench_step"})
    for round_ in rounds:
        mine = [r for r in records if r["round"] == round_]
        steps = sorted((r for r in mine if r["kind"] == "bench_step" and r["rank"] == 0), key=lambda r: r["step"])
        if len(steps) < 4:
            continue  # a world that re-formed again before it settled
        per_rank: dict[tuple[str, int], dict[str, float]] = {}
        for r in mine:
            if r["kind"] == "bench_step":
                got = per_rank.setdefault((r["node"], r["life"]), {"frames": 0, "compile_s": 0.0})
                got["frames"] += r["frames"]
                got["compile_s"] += r["compile_s"]
        size = steps[0]["world_size"]
        event = "start" if not rows else ("loss" if size < rows[-1]["world_size"] else "grow")
        rows.append({
            "event": event,
            "round": round_,
            "world_size": size,
            "restore_s": max(r["restore_s"] for r in mine if r["kind"] == "world"),
            # A process started again (the returning node's second agent) compiles from nothing.
            "frames_kept": sorted({int(v["frames"]) for k, v in per_rank.items() if k[1] == 0}),
            "frames_new": sorted({int(v["frames"]) for k, v in per_rank.items() if k[1] > 0}),
            "compile_s": max(v["compile_s"] for v in per_rank.values()),
            "first_step_s": steps[0]["step_s"],
            "steady_step_s": statistics.median(s["step_s"] for s in steps[2:]),
            "steps": len(steps),
        })  # fmt: skip
    return rows


def _frames(row: dict[str, Any]) -> str:
    kept = "/".join(str(f) for f in row["frames_kept"])
    return f"{kept} (new process: {'/'.join(str(f) for f in row['frames_new'])})" if row["frames_new"] else kept


def table(result: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Markdown: per world, the uncompiled script beside the compiled one."""
    lines = [
        "| world | frames compiled (uncompiled / compiled) | compiling, slowest rank | first step: uncompiled "
        "| first step: compiled | steady step: uncompiled | steady step: compiled |",
        "|---|---|---|---|---|---|---|",
    ]
    for plain, compiled in zip(result["none"], result["compiled"], strict=False):
        label = f"{compiled['event']} (world of {compiled['world_size']})"
        lines.append(
            f"| {label} | {_frames(plain)} / {_frames(compiled)} | {compiled['compile_s']:.2f} s "
            f"| {plain['first_step_s'] * 1e3:.0f} ms | {compiled['first_step_s'] * 1e3:.0f} ms "
            f"| {plain['steady_step_s'] * 1e3:.0f} ms | {compiled['steady_step_s'] * 1e3:.0f} ms |"
        )
    return lines


def measure(settings: Settings, root: Path) -> dict[str, Any]:
    from regroup.demo.etcd_server import EtcdServer

    etcd = EtcdServer(data_dir=root / "etcd")
    etcd.start()
    load = {"start": loadavg()}
    result: dict[str, Any] = {}
    try:
        for variant in VARIANTS:
            records = play(variant, settings, root, etcd.endpoint)
            result[variant] = worlds(records)
            shown = json.dumps(result[variant], default=str)
            print(f"{variant}: {shown}", file=sys.stderr, flush=True)
    finally:
        etcd.kill()
    load["end"] = loadavg()
    return {"worlds": result, "loadavg": load, "settings": settings.__dict__}


def report(measured: dict[str, Any]) -> list[str]:
    s = measured["settings"]
    lines = [
        f"FSDP2 example's model ({s['layers']} layers), global batch {s['global_batch']}, torch.compile backend "
        f"{s['backend']!r} against the same script uncompiled; 3 ranks -> loss of n2 (2 ranks) -> n2 back (3 ranks); "
        f"load average {measured['loadavg']['start']} at the start, {measured['loadavg']['end']} at the end",
        "",
        *table(measured["worlds"]),
    ]
    return lines


GLOBAL_BATCH = 12
"""Divides by 3 and by 2: every world trains the same global batch."""


def main(args: Any) -> int:
    """``python -m bench script --compile-reform``, with ``bench script``'s parsed flags
    (``--quick``: 4 steps per world instead of 10; ``--keep``, ``--json``)."""
    steps = 4 if args.quick else 10
    settings = Settings(args.compile_backend, args.compile_layers, GLOBAL_BATCH, warm=steps, settle=steps)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="regroup-bench-compile-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        measured = measure(settings, root)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print("\n".join(report(measured)))
    if args.json:
        Path(args.json).write_text(json.dumps(measured, indent=2, default=str))
    return 0
