"""``--instructions``: what the storm costs the controller in instructions and cache
misses per event, counted by valgrind's callgrind. The same count on every run and every
machine, where seconds are neither.

Seconds on the shared VMs this benchmark runs on move by a third between runs of the same
code, and by several times between VMs: the stand-in-only anchor, the same code on each,
decoded from 26,500 to 156,500 events per CPU-second on three VMs this benchmark was
run on, by 2x on one VM within one hour. A change to the controller is compared
by its count here; a machine's speed on this very work is the count divided by the same
window's CPU time natively (``instructions_per_us``), which turns a count into seconds.

The window: the storm (``storm``) fed one event at a time after a warm-up, every job an
event wakes decided before the next (``costs.storm_replay``), on a virtual clock that
moves ``1 / rate`` per event. No decision depends on how fast the replay runs, under
valgrind (about 100 times slower) or not, so both make the same decisions; the run checks
that they did. ``PYTHONHASHSEED`` is fixed, so sets iterate the same way every run.
Counting only the window: the set-up (listing the cluster) runs uninstrumented, and the
replay process asks callgrind to instrument from the warm-up on, to zero its counters when
the window starts and to dump them when it ends (``callgrind_control``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .direct import DirectFeed, direct_harness
from .storm import Event, Layout, replayed

EVENTS = ("Ir", "D1mr", "D1mw", "I1mr")
"""What is reported per event: instructions, level-1 data read and write misses,
level-1 instruction misses (callgrind's names)."""

_UNDER_CALLGRIND = "REGROUP_BENCH_CALLGRIND"
"""Set in the replay's environment when callgrind runs it."""


VIRTUAL_START = 1_800_000_000.0
"""Unix time at which the replay's virtual clock starts (January 2027)."""


class VirtualClock:
    """Unix time that moves only when told: ``step`` seconds per ``tick``."""

    def __init__(self, start: float, step: float) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.step


def _callgrind(flag: str) -> None:
    """``callgrind_control FLAG`` on this process, when callgrind runs it."""
    if os.environ.get(_UNDER_CALLGRIND):
        subprocess.run(["callgrind_control", flag, str(os.getpid())], check=True, capture_output=True)


async def replay_window(layout: Layout, events: int, warmup: int, seed: int, rate: float) -> dict[str, Any]:
    """Replay ``warmup`` storm events, then count the next ``events``: the decisions they
    made and the CPU seconds they took (callgrind's counters cover exactly these)."""
    clock = VirtualClock(start=VIRTUAL_START, step=1.0 / rate)
    h = await direct_harness(layout, 0, clock)
    feed = DirectFeed(h, layout)
    storm = replayed(layout, h.settings.etcd_prefix, warmup + events, seed)

    async def replay(events: list[Event]) -> None:
        for event in events:
            clock.tick()
            feed(event)
            await h.decide_queued()

    _callgrind("--instr=on")  # the set-up ran uninstrumented; the warm-up fills the simulated caches
    await replay(storm[:warmup])
    decisions = h.decisions
    _callgrind("--zero")
    cpu = time.process_time()
    await replay(storm[warmup:])
    cpu = time.process_time() - cpu
    _callgrind("--dump")
    await h.stop()
    return {"events": events, "decisions": h.decisions - decisions, "cpu_s": cpu}


def summary(dump: str) -> dict[str, int]:
    """The ``summary:`` totals of a callgrind dump, by the names of its ``events:`` line."""
    names: list[str] = []
    for line in dump.splitlines():
        if line.startswith("events:"):
            names = line.split()[1:]
        elif line.startswith("summary:"):
            return dict(zip(names, (int(v) for v in line.split()[1:]), strict=True))
    raise ValueError("no summary line in the callgrind dump")


def _replay(args: list[str], env: dict[str, str], prefix: Sequence[str] = ()) -> dict[str, Any]:
    cmd = [*prefix, sys.executable, "-m", "bench.controller.instructions", *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_instructions(events: int = 1000, warmup: int = 300, seed: int = 8, rate: float = 5000.0) -> dict[str, Any]:
    """Count the window under callgrind, then time the same window natively."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions needs valgrind (apt-get install -y valgrind)")
    args = [str(events), str(warmup), str(seed), str(rate)]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    with tempfile.TemporaryDirectory() as tmp:
        counted = _replay(args, {**env, _UNDER_CALLGRIND: "1"}, [
            "valgrind", "--tool=callgrind", "--cache-sim=yes", "--instr-atstart=no", f"--callgrind-out-file={tmp}/cg.%p"])
        # The dump asked for mid-run is the process's second file (``cg.<pid>.1``).
        dumps = [p for p in Path(tmp).iterdir() if p.name.endswith(".1")]
        if len(dumps) != 1:
            raise RuntimeError(f"expected the window's one callgrind dump, found {sorted(p.name for p in Path(tmp).iterdir())}")
        counts = summary(dumps[0].read_text())
    native = _replay(args, env)
    if native["decisions"] != counted["decisions"]:
        raise RuntimeError(f"the replay decided differently natively ({native['decisions']}) "
                           f"and under callgrind ({counted['decisions']})")
    per_event = {name: round(counts[name] / events, 1) for name in EVENTS}
    return {
        "path": "instructions (callgrind, per storm event)",
        "events": events,
        "decisions_per_event": round(counted["decisions"] / events, 3),
        "instructions_per_event": per_event["Ir"],
        "instructions_per_decision": round(counts["Ir"] / counted["decisions"]),
        "l1_data_misses_per_event": round(per_event["D1mr"] + per_event["D1mw"], 1),
        "l1_instruction_misses_per_event": per_event["I1mr"],
        "native_us_per_event": round(native["cpu_s"] / events * 1e6, 1),
        "instructions_per_us": round(counts["Ir"] / (native["cpu_s"] * 1e6), 1),
    }


def main(argv: list[str]) -> int:
    """The replay process: ``EVENTS WARMUP SEED RATE``; prints its window as JSON."""
    from regroup.telemetry import configure_logging

    configure_logging("error", once=True)
    events, warmup, seed, rate = int(argv[0]), int(argv[1]), int(argv[2]), float(argv[3])
    print(json.dumps(asyncio.run(replay_window(Layout(), events, warmup, seed, rate))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
