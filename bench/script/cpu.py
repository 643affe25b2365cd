"""The CPU of ``bench script``'s processes, from ``/proc``: a sampler thread over the
workers, the agents and the machine, and the CPU spent between two moments."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu(path: str) -> float | None:
    """``utime + stime`` in seconds from a ``/proc/.../stat`` file; None once it is gone."""
    try:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _ppids() -> dict[int, int]:
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    found[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def _descendants(root: int, ppids: Mapping[int, int]) -> list[int]:
    out, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, pp in ppids.items() if pp == parent]
        out += kids
        frontier += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class CpuSample:
    """Cumulative CPU seconds at wall time ``t``: each worker's process and main thread, the
    agents (plus any other watched process) together, and the whole machine's busy and
    stolen time (``/proc/stat``), which tell what other processes took meanwhile."""

    t: float
    workers: dict[int, float]
    main: dict[int, float]
    agents: float
    machine: float = 0.0
    steal: float = 0.0


def machine_cpu() -> tuple[float, float]:
    """The machine's busy CPU seconds (user, nice, system, irq, softirq) and stolen ones."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq) / CLK_TCK, steal / CLK_TCK


def interpolate(points: Sequence[tuple[float, float]], t: float) -> float:
    """The value at ``t`` of a non-decreasing series sampled at ``points`` (time, value),
    linear between samples and held flat beyond the ends."""
    if not points:
        raise ValueError("no samples")
    if t <= points[0][0]:
        return points[0][1]
    for (t0, v0), (t1, v1) in zip(points, points[1:], strict=False):
        if t <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def cpu_between(
    samples: Sequence[CpuSample], t0: float, t1: float, pids: Iterable[int] | None = None
) -> dict[str, float]:
    """CPU seconds spent between ``t0`` and ``t1``: by the workers together (``all``), by
    each worker (``pid``), by each worker's main thread (``main:pid``), and by the agents."""
    workers = sorted(pids if pids is not None else {p for s in samples for p in s.workers})
    out: dict[str, float] = {}

    def series(get: Any) -> list[tuple[float, float]]:
        # A process not seen yet counts from 0; one gone keeps its last value.
        points, last = [], 0.0
        for s in samples:
            value = get(s)
            last = last if value is None else value
            points.append((s.t, last))
        return points

    def between(points: list[tuple[float, float]]) -> float:
        return interpolate(points, t1) - interpolate(points, t0)

    total = 0.0
    for pid in workers:
        spent = between(series(lambda s, p=pid: s.workers.get(p)))
        out[str(pid)] = spent
        out[f"main:{pid}"] = between(series(lambda s, p=pid: s.main.get(p)))
        total += spent
    out["all"] = total
    out["agents"] = between(series(lambda s: s.agents))
    out["machine"] = between(series(lambda s: s.machine))
    out["steal"] = between(series(lambda s: s.steal))
    return out


class CpuSampler(threading.Thread):
    """Samples the CPU of the workers under ``roots`` (label -> agent pid; a worker is a
    descendant whose command line contains ``marker``), of the roots themselves and of
    ``extra`` pids, every ``interval`` seconds. Workers are looked up until ``count`` are
    found; only their stat files are read after that, to keep the sampler's own cost small."""

    def __init__(
        self, roots: Mapping[str, int], marker: str, count: int, extra: Sequence[int] = (), interval: float = 0.2
    ) -> None:
        super().__init__(name="cpu-sampler", daemon=True)
        self.roots, self.marker, self.count = dict(roots), marker, count
        self.extra, self.interval = list(extra), interval
        self.samples: list[CpuSample] = []
        self.owner: dict[int, str] = {}
        """Worker pid -> the label of the root it runs under."""
        self._halt = threading.Event()

    def _discover(self) -> None:
        ppids = _ppids()
        for label, root in self.roots.items():
            for pid in _descendants(root, ppids):
                if pid not in self.owner and self.marker in _cmdline(pid):
                    self.owner[pid] = label

    def sample(self) -> CpuSample:
        workers, main = {}, {}
        for pid in self.owner:
            total, thread = proc_cpu(f"/proc/{pid}/stat"), proc_cpu(f"/proc/{pid}/task/{pid}/stat")
            if total is not None and thread is not None:
                workers[pid], main[pid] = total, thread
        agents = sum(filter(None, (proc_cpu(f"/proc/{pid}/stat") for pid in [*self.roots.values(), *self.extra])))
        return CpuSample(time.time(), workers, main, agents, *machine_cpu())

    def run(self) -> None:
        while not self._halt.is_set():
            if len(self.owner) < self.count:
                self._discover()
            self.samples.append(self.sample())
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.samples.append(self.sample())
