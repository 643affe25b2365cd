"""What regroup's public API costs a user's script: PyTorch's FSDP2 example with and without it.

``python -m bench script [--quick] [--rounds N] [--steps N] [--warmup N] [--global-batch G]
[--also-synced-anchor] [--also-without-snapshots] [--max-others CORES] [--profile DIR]
[--json PATH]``

Two variants of the same training, at the demo's scale (4 ranks, one per node), alternated
in one run (without, with, without, with, ...):

- **without** (the anchor): ``bench/_script_anchor.py``, the upstream example's model,
  sharding, optimizer and clipping in a plain loop under ``torchrun --standalone
  --nproc-per-node=4`` (``init_process_group``, no etcd);
- **with** the API: ``examples/fsdp2/train.py`` (the same example converted to
  ``regroup.trainer.elastic``) under four ``regroup-run --standby --rdzv-backend=etcd-v3``
  agents posing as nodes ``n0..n3`` on a real etcd, so the step boundary's all-reduce, the
  in-memory snapshots the example asks for, the checkpoint-request check and progress
  publishing to etcd all run.

Both train the same global batch for the same steps with ``OMP_NUM_THREADS=1``. Rank 0 logs
one JSON line per step with its wall time and its process CPU (``time.process_time()``);
the first ``--warmup`` steps are dropped. Step time is the median gap between consecutive
steps (and the window's mean); CPU per step is rank 0's process CPU over the window divided
by its steps, and the same summed over the four worker processes, read from ``/proc`` by a
sampler thread (``utime + stime``, interpolated at the window's ends); rank 0's CPU off its
main thread and the agents' (plus etcd's) CPU are shown too. The table gives each variant's
median over rounds, the ratio with/without, and the spread: each variant's range over
rounds and the range of the per-round ratios (each round's pair ran back to back).

The machine's busy CPU (``/proc/stat``) less the benchmark's own processes says what other
processes took during each window (``others_cores``); ``--max-others`` runs a round again
(up to 3 times) when that is above a limit. Each run's first-step loss (mean over ranks) is
compared across runs: the variants must train the same thing.

``--also-synced-anchor`` adds a second anchor to each round: the plain loop that also
all-reduces its loss every step (one small collective per step, as the API's boundary).
``--also-without-snapshots`` adds the example with ``snapshot_every=0``. ``--profile DIR``
then runs one more round of the plain loop and the API under cProfile (rank 0's main
thread, CPU clock; ``bench/_profiled.py``, which also records every thread's CPU) and prints
regroup's own per-step functions and rank 0's CPU per thread.

``--compile-reform [--compile-backend B] [--compile-layers N]`` measures something else
instead: what an in-place re-form (a loss, then a grow) costs the same model under
``torch.compile`` against uncompiled, in recompiles and in the first step's time
(``bench/_compile_reform.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from regroup.demo.processes import kill_tree

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "fsdp2" / "train.py"
ANCHOR = Path(__file__).with_name("_script_anchor.py")
PROFILED = Path(__file__).with_name("_profiled.py")
WORLD = 4
NODES = [f"n{i}" for i in range(WORLD)]
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
VARIANTS = ("without", "with")
NO_SNAPSHOTS = "with_no_snapshots"
"""A diagnostic variant: the converted example with ``snapshot_every=0``."""
SYNCED = "without_synced"
"""A second anchor: the plain loop that also all-reduces its loss every step."""

# What the table shows, in its order: key, label, unit scale and unit.
METRICS: tuple[tuple[str, str], ...] = (
    ("step_s", "step time (median step)"),
    ("step_s_mean", "step time (window / steps)"),
    ("cpu_s", "CPU per step, rank 0 (process)"),
    ("cpu_all_s", "CPU per step, all 4 ranks (/proc)"),
    ("cpu_background_s", "CPU per step, rank 0 off its main thread"),
    ("cpu_agents_s", "CPU per step, agents (+ etcd)"),
)


# --- what rank 0 logs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Stamp:
    """Rank 0 at the end of one step: wall time (epoch seconds) and process CPU seconds."""

    step: int
    t: float
    cpu_s: float


def _json_lines(text: str) -> Iterable[dict[str, Any]]:
    for line in text.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            value = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(value, dict):
            yield value


def anchor_stamps(text: str) -> list[Stamp]:
    """The anchor's rank-0 lines ``{"step", "t", "cpu_s", ...}``, in step order."""
    found = {
        v["step"]: Stamp(int(v["step"]), float(v["t"]), float(v["cpu_s"]))
        for v in _json_lines(text)
        if {"step", "t", "cpu_s"} <= v.keys()
    }
    return [found[k] for k in sorted(found)]


def first_loss(text: str, world: int = WORLD) -> float | None:
    """The first step's loss, the mean over ranks: from the anchor's ``{"rank", "first_loss"}``
    lines (one per rank; None unless all ``world`` are readable: the ranks share one log, and
    lines written at once can mix), or from the API's first ``step`` event (the boundary's mean)."""
    ranks = {int(v["rank"]): float(v["first_loss"]) for v in _json_lines(text) if "first_loss" in v and "rank" in v}
    if ranks:
        return sum(ranks.values()) / len(ranks) if len(ranks) == world else None
    steps = [v for v in _json_lines(text) if v.get("event") == "step" and v.get("step") == 1 and "loss" in v]
    return float(steps[0]["loss"]) if steps else None


def same_training(without: float | None, with_: float | None, rel: float = 1e-4) -> bool:
    """Whether two runs' first-step losses agree: the same model, data and loss."""
    if without is None or with_ is None:
        return False
    return abs(without - with_) <= rel * max(abs(without), abs(with_), 1e-12)


def api_stamps(text: str) -> list[Stamp]:
    """Rank 0's ``{"event": "step", "step", "timestamp" (ISO), "cpu_s", ...}`` log events, in
    step order (a repeated step, as after a re-form, keeps its last record)."""
    found: dict[int, Stamp] = {}
    for v in _json_lines(text):
        if v.get("event") != "step" or "cpu_s" not in v or v.get("rank", 0) != 0:
            continue
        t = datetime.fromisoformat(str(v["timestamp"]).replace("Z", "+00:00")).timestamp()
        found[int(v["step"])] = Stamp(int(v["step"]), t, float(v["cpu_s"]))
    return [found[k] for k in sorted(found)]


# --- CPU of the processes, from /proc ---------------------------------------------------------


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


# --- one variant's numbers -----------------------------------------------------------------


def summarize(
    stamps: Sequence[Stamp], warmup: int, samples: Sequence[CpuSample] = (), rank0: int | None = None
) -> dict[str, Any]:
    """Per-step numbers of one run after dropping ``warmup`` steps: ``step_s`` (median gap
    between consecutive steps), ``step_s_mean`` (the window over its steps), ``cpu_s``
    (rank 0's process CPU over the window, per step) and ``cpu_s_median`` (median of its
    per-step CPU); with CPU samples also ``cpu_all_s`` (the workers together),
    ``cpu_agents_s``, and with rank 0's pid ``cpu_background_s`` (rank 0 off its main thread)."""
    window = list(stamps[warmup:])
    if len(window) < 3:
        raise ValueError(f"{len(stamps)} steps logged: too few after {warmup} warm-up steps")
    steps = len(window) - 1
    gaps = [b.t - a.t for a, b in zip(window, window[1:], strict=False)]
    cpus = [b.cpu_s - a.cpu_s for a, b in zip(window, window[1:], strict=False)]
    t0, t1 = window[0].t, window[-1].t
    row: dict[str, Any] = {
        "steps": steps,
        "first_step": window[0].step,
        "step_s": statistics.median(gaps),
        "step_s_mean": (t1 - t0) / steps,
        "cpu_s": (window[-1].cpu_s - window[0].cpu_s) / steps,
        "cpu_s_median": statistics.median(cpus),
    }
    if samples:
        spent = cpu_between(samples, t0, t1)
        row["cpu_all_s"] = spent["all"] / steps
        row["cpu_agents_s"] = spent["agents"] / steps
        # Cores other processes kept busy during the window (this benchmark's own sampler included).
        row["others_cores"] = (spent["machine"] - spent["all"] - spent["agents"]) / (t1 - t0)
        row["steal_cores"] = spent["steal"] / (t1 - t0)
        if rank0 is not None and str(rank0) in spent:
            row["cpu_rank0_proc_s"] = spent[str(rank0)] / steps
            row["cpu_background_s"] = (spent[str(rank0)] - spent[f"main:{rank0}"]) / steps
    return row


def compare(
    rounds: Sequence[Mapping[str, Mapping[str, float]]], variant: str = "with", base: str = "without"
) -> dict[str, dict[str, Any]]:
    """For each metric both variants have in every round: each variant's median over rounds
    and range, the ratio of the medians (``variant`` / ``base``) and the range of per-round
    ratios."""
    out: dict[str, dict[str, Any]] = {}
    if not rounds:
        return out
    pair = (base, variant)
    for key, _ in METRICS:
        if not all(key in r[v] for r in rounds for v in pair):
            continue
        values = {v: [float(r[v][key]) for r in rounds] for v in pair}
        medians = {v: statistics.median(values[v]) for v in pair}
        paired = [w / a for a, w in zip(values[base], values[variant], strict=True) if a > 0]
        out[key] = {
            "without": medians[base],
            "with": medians[variant],
            "without_range": [min(values[base]), max(values[base])],
            "with_range": [min(values[variant]), max(values[variant])],
            "delta": medians[variant] - medians[base],
            "ratio": medians[variant] / medians[base] if medians[base] > 0 else None,
            "ratio_range": [min(paired), max(paired)] if paired else None,
        }
    return out


def _ms(value: float) -> str:
    return f"{value * 1e3:.1f} ms"


def table(
    summary: Mapping[str, Mapping[str, Any]],
    label: str = "with the API (regroup-run, etcd)",
    base: str = "without (plain torchrun)",
) -> list[str]:
    """The markdown table of ``compare``'s result."""
    lines = [
        f"| per step | {base} | {label} | with − without | with / without | per-round ratios |",
        "|---|---|---|---|---|---|",
    ]
    for key, label in METRICS:
        if key not in summary:
            continue
        s = summary[key]
        ratio = f"{s['ratio']:.3f}" if s["ratio"] is not None else "n/a"
        spread = f"{s['ratio_range'][0]:.3f} – {s['ratio_range'][1]:.3f}" if s["ratio_range"] else "n/a"
        lines.append(
            f"| {label} | {_ms(s['without'])} ({_ms(s['without_range'][0])} – {_ms(s['without_range'][1])}) "
            f"| {_ms(s['with'])} ({_ms(s['with_range'][0])} – {_ms(s['with_range'][1])}) "
            f"| {s['delta'] * 1e3:+.1f} ms | {ratio} | {spread} |"
        )
    return lines


# --- running the variants --------------------------------------------------------------------


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="lo")
    # Each step's time and CPU come from rank 0's `step` log events: one a step, as the anchor logs.
    env["REGROUP_LOG_EVERY"] = "1"
    for key in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "REGROUP_CHECKPOINT_DIR"):
        env.pop(key, None)
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launcher this bench started and everything under it (``kill_tree``)."""
    if proc.poll() is None:
        kill_tree(proc.pid)
        proc.wait()


def _wait_all(procs: Mapping[str, subprocess.Popen[bytes]], timeout: float, logs: Mapping[str, Path]) -> list[str]:
    """Wait for every process; what failed, as ``name exited with N (log)``. A timeout raises."""
    deadline = time.monotonic() + timeout
    failed = []
    try:
        for name, proc in procs.items():
            left = deadline - time.monotonic()
            try:
                code = proc.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired as exc:
                raise RuntimeError(f"{name} still running after {timeout:.0f}s; log: {logs[name]}") from exc
            if code != 0:
                failed.append(f"{name} exited with {code} ({logs[name]})")
    finally:
        for proc in procs.values():
            _kill_group(proc)
    return failed


def _check_complete(stamps: Sequence[Stamp], steps: int, failed: Sequence[str], log: Path) -> None:
    """A run counts when rank 0 logged every step; a process that failed after that (a crash
    on the way out) is reported, not fatal."""
    if len(stamps) < steps:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{len(stamps)} of {steps} steps logged; {'; '.join(failed) or 'no failure'}:\n{tail}")
    for failure in failed:
        print(f"warning: after all {steps} steps, {failure}", file=sys.stderr, flush=True)


@dataclass
class Settings:
    global_batch: int
    steps: int
    warmup: int
    script_args: list[str] = field(default_factory=list)
    """Extra arguments for examples/fsdp2/train.py."""


def _timeout(settings: Settings) -> float:
    return 180 + 5 * settings.steps


def run_without(
    settings: Settings, root: Path, wrap: list[str] | None = None, extra_env: Mapping[str, str] | None = None,
    synced: bool = False,
) -> dict[str, Any]:
    """The anchor under plain ``torchrun --standalone``: its rank-0 stamps and CPU samples
    (``synced``: it also all-reduces its loss every step)."""
    cwd = Path(tempfile.mkdtemp(prefix="without-", dir=root))
    log = cwd / "torchrun.log"
    worker = [*(wrap or []), str(ANCHOR), f"--global-batch={settings.global_batch}", f"--steps={settings.steps}"]
    worker += ["--all-reduce-loss"] if synced else []
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", *worker]
    with open(log, "wb") as out:
        env = {**base_env(), **(extra_env or {})}
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd, env=env)
    sampler = CpuSampler({"torchrun": proc.pid}, marker=ANCHOR.name, count=WORLD)
    sampler.start()
    try:
        failed = _wait_all({"torchrun": proc}, _timeout(settings), {"torchrun": log})
    finally:
        sampler.stop()
    text = log.read_text(errors="replace")
    _check_complete(anchor_stamps(text), settings.steps, failed, log)
    pids = {int(v["pid"]) for v in _json_lines(text) if "pid" in v and "cpu_s" in v}
    return {
        "stamps": anchor_stamps(text), "samples": sampler.samples, "rank0": next(iter(pids), None), "log": log,
        "first_loss": first_loss(text), "failed": failed,
    }  # fmt: skip


def run_with(
    settings: Settings, root: Path, endpoint: str, job: str, etcd_pid: int | None,
    wrap: list[str] | None = None, script: Path = SCRIPT, extra_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The converted example under four ``regroup-run`` agents (nodes n0..n3) on etcd."""
    env = {**base_env(), **(extra_env or {})}
    # Its own folder: the script's upstream checkpointer writes ./checkpoints and resumes from it.
    cwd = root / job
    cwd.mkdir()
    env["REGROUP_CHECKPOINT_DIR"] = str(cwd / "regroup-checkpoints")
    worker = [*(wrap or []), str(script), *settings.script_args]
    argv = [
        sys.executable, "-m", "regroup.rendezvous.inplace.launcher", "--standby",
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job}",
        f"--nnodes={WORLD}", "--nproc-per-node=1", "--local-addr=127.0.0.1", *worker,
    ]  # fmt: skip
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs = {node: root / f"{job}-{node}.log" for node in NODES}
    try:
        for node in NODES:
            with open(logs[node], "wb") as out:
                procs[node] = subprocess.Popen(
                    argv, env={**env, "NODE_NAME": node}, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True, cwd=cwd,
                )  # fmt: skip
    except BaseException:
        for proc in procs.values():
            _kill_group(proc)
        raise
    roots = {n: p.pid for n, p in procs.items()}
    sampler = CpuSampler(roots, marker=SCRIPT.name, count=WORLD, extra=[etcd_pid] if etcd_pid else [])
    sampler.start()
    try:
        failed = _wait_all(procs, _timeout(settings), logs)
    finally:
        sampler.stop()
    by_node = {node: api_stamps(logs[node].read_text(errors="replace")) for node in NODES}
    node0 = max(by_node, key=lambda n: len(by_node[n]))
    _check_complete(by_node[node0], settings.steps, failed, logs[node0])
    rank0 = [pid for pid, label in sampler.owner.items() if label == node0]
    trained = global_batch_of(logs[node0].read_text(errors="replace"))
    if trained != settings.global_batch:
        raise RuntimeError(
            f"{SCRIPT.name} trained a global batch of {trained}, the anchor {settings.global_batch}: "
            f"give --global-batch {trained}"
        )
    return {
        "stamps": by_node[node0],
        "samples": sampler.samples,
        "rank0": rank0[0] if len(rank0) == 1 else None,
        "log": logs[node0],
        "first_loss": first_loss(logs[node0].read_text(errors="replace")),
        "failed": failed,
    }


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _script_flags() -> str:
    """The converted example's ``--help``, to build its command line from its own flags."""
    argv = [sys.executable, str(SCRIPT), "--help"]
    result = subprocess.run(argv, capture_output=True, text=True, env=base_env(), timeout=120)
    return result.stdout


def script_args(global_batch: int, steps: int) -> list[str]:
    """``examples/fsdp2/train.py``'s flags for this global batch and step count (a script
    without a batch flag keeps its own: ``global_batch_of`` checks it after the run)."""
    flags = _script_flags()
    batch = next((f for f in ("--global-batch", "--batch-size") if f in flags), None)
    count = next((f for f in ("--max-steps", "--steps") if f in flags), None)
    if count is None:
        raise RuntimeError(f"examples/fsdp2/train.py: found no step-count flag in its --help:\n{flags}")
    return [*([f"{batch}={global_batch}"] if batch else []), f"{count}={steps}"]


def global_batch_of(text: str) -> int | None:
    """The global batch a run trained with, from rank 0's ``training`` event (world size x
    micro-batch x accumulation)."""
    for v in _json_lines(text):
        if v.get("event") == "training" and {"world_size", "micro_batch", "accumulation"} <= v.keys():
            return int(v["world_size"]) * int(v["micro_batch"]) * int(v["accumulation"])
    return None


# --- the profile ----------------------------------------------------------------------------


REGROUP_DIRS = tuple(str(REPO / d) for d in ("trainer", "rendezvous", "regroup"))
# The loop's own parts, in both variants: (end of the file's path, function name).
LANDMARKS = (
    ("torch/nn/modules/module.py", "_wrapped_call_impl"),
    ("torch/_tensor.py", "backward"),
    ("torch/nn/utils/clip_grad.py", "clip_grad_norm_"),
    ("torch/optim/adam.py", "step"),
    ("torch/_tensor.py", "__float__"),
)


def profile_rows(path: Path, steps: int, top: int = 25) -> list[tuple[str, float, float, int]]:
    """One cProfile file: (name, cumulative ms/step, own ms/step, calls/step) of the whole
    main thread (start and end included), of the loop's landmarks (forward, backward,
    clipping, Adam) and of regroup's own functions called at least once a step, by
    cumulative time."""
    import pstats

    stats = pstats.Stats(str(path))
    entries = stats.stats  # type: ignore[attr-defined]
    total = max(ct for (_, _, _), (_, _, _, ct, _) in entries.items())
    rows = [("(main thread, whole run)", total * 1e3 / steps, 0.0, 0)]
    mine = []
    for (file, line, name), (_, calls, tt, ct, _) in entries.items():
        row = (name, ct * 1e3 / steps, tt * 1e3 / steps, round(calls / steps))
        if any(file.endswith(suffix) and name == wanted for suffix, wanted in LANDMARKS):
            rows.append((f"{Path(file).name}:{line} {name}", *row[1:]))
        elif calls >= steps and str(Path(file).resolve()).startswith(REGROUP_DIRS):
            mine.append((f"{Path(file).resolve().relative_to(REPO)}:{line} {name}", *row[1:]))
    mine.sort(key=lambda r: -r[1])
    return rows + mine[:top]


def thread_cpu(samples: Sequence[Mapping[str, Any]], t0: float, t1: float) -> dict[str, float]:
    """CPU seconds each thread spent between ``t0`` and ``t1``, summed by thread name (threads
    Python does not know are ``native``), from ``bench/_profiled.py``'s ``.threads.json``."""
    tids = {tid for s in samples for tid in s["threads"]}
    out: dict[str, float] = {}
    for tid in tids:
        points, last, name = [], 0.0, "native"
        for s in samples:
            if tid in s["threads"]:
                name, last = s["threads"][tid][0], float(s["threads"][tid][1])
            points.append((float(s["t"]), last))
        # Numbered threads of one kind (a pool's workers, "Thread-7 (run)") count together.
        kind = name.rsplit("_", 1)[0] if name.rsplit("_", 1)[-1].isdigit() else name
        kind = kind.split(" ", 1)[1] if kind.startswith("Thread-") and " " in kind else kind
        out[kind] = out.get(kind, 0.0) + interpolate(points, t1) - interpolate(points, t0)
    return out


def profile_round(settings: Settings, root: Path, endpoint: str, etcd_pid: int | None, clock: str) -> dict[str, Any]:
    out = root / "profiles"
    out.mkdir(exist_ok=True)
    result: dict[str, Any] = {}
    for variant in VARIANTS:
        folder = out / variant
        folder.mkdir()
        wrap = [str(PROFILED), str(folder)]
        env = {"REGROUP_BENCH_PROFILE_CLOCK": clock}  # read by bench/_profiled.py in the workers
        if variant == "without":
            run = run_without(settings, root, wrap=wrap, extra_env=env)
            rank0_label = "rank0"
        else:
            run = run_with(settings, root, endpoint, "script-profile", etcd_pid, wrap=wrap, extra_env=env)
            rank0_label = next(
                (n for n in NODES if api_stamps((root / f"script-profile-{n}.log").read_text(errors="replace"))), "n0"
            )
        files = sorted(folder.glob(f"{rank0_label}-*.prof"))
        if not files:
            raise RuntimeError(f"no profile of rank 0 in {folder}")
        summary = summarize(run["stamps"], settings.warmup)
        window = run["stamps"][settings.warmup :]
        threads_file = files[0].with_suffix(".threads.json")
        threads = json.loads(threads_file.read_text()) if threads_file.exists() else []
        per_thread = thread_cpu(threads, window[0].t, window[-1].t) if threads else {}
        result[variant] = {
            "file": str(files[0]),
            "rows": profile_rows(files[0], settings.steps),
            "summary": summary,
            "threads_cpu_per_step": {
                k: v / summary["steps"] for k, v in sorted(per_thread.items(), key=lambda kv: -kv[1])
            },
        }
    return result


# --- main -----------------------------------------------------------------------------------


def without_snapshots(root: Path) -> Path:
    """A copy of the example whose ``Run`` takes no snapshots (``snapshot_every=0``)."""
    folder = root / "fsdp2-no-snapshots"
    shutil.copytree(SCRIPT.parent, folder, ignore=shutil.ignore_patterns("upstream", "__pycache__"))
    text = SCRIPT.read_text()
    if "snapshot_every=1" not in text:
        raise RuntimeError(f"{SCRIPT.name} no longer says snapshot_every=1: the no-snapshot variant cannot be made")
    (folder / SCRIPT.name).write_text(text.replace("snapshot_every=1", "snapshot_every=0"))
    return folder / SCRIPT.name


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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench script", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 12 steps each (a couple of minutes)")
    parser.add_argument("--rounds", type=int, default=4, help="pairs (without, with), run alternately")
    parser.add_argument("--steps", type=int, default=60, help="steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="first steps of each run left out")
    parser.add_argument("--global-batch", type=int, default=32, help="samples per step, all ranks together")
    parser.add_argument(
        "--also-without-snapshots", action="store_true",
        help="a third variant in each round: the example with snapshot_every=0 (where the overhead goes)",
    )  # fmt: skip
    parser.add_argument(
        "--also-synced-anchor", action="store_true",
        help="a second anchor in each round: the plain loop all-reducing its loss every step",
    )  # fmt: skip
    parser.add_argument(
        "--max-others", type=float,
        help="run a round again (up to 3 times) when other processes kept more than this many cores busy",
    )  # fmt: skip
    parser.add_argument("--profile", help="also profile one round of each under cProfile; profiles go to this folder")
    parser.add_argument(
        "--profile-clock", choices=("cpu", "wall"), default="cpu",
        help="what --profile measures: the main thread's CPU time, or wall time",
    )  # fmt: skip
    parser.add_argument("--keep", help="keep the runs' logs in this folder (default: a temp dir, removed)")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument(
        "--compile-reform", action="store_true",
        help="instead: a loss and a grow re-formed in place, torch.compile against uncompiled (recompiles, first step)",
    )  # fmt: skip
    parser.add_argument("--compile-backend", default="inductor", help="--compile-reform: the torch.compile backend")
    parser.add_argument("--compile-layers", type=int, default=10, help="--compile-reform: the model's blocks")
    args = parser.parse_args(argv)
    if args.compile_reform:
        from bench._compile_reform import main as compile_reform

        return compile_reform(args)
    rounds, steps, warmup = (1, 12, 4) if args.quick else (args.rounds, args.steps, args.warmup)
    if args.global_batch % WORLD:
        parser.error(f"--global-batch must divide by {WORLD}")
    if "elastic.in_place" not in SCRIPT.read_text():
        print(f"warning: {SCRIPT.relative_to(REPO)} does not use elastic.in_place", file=sys.stderr)
    settings = Settings(args.global_batch, steps, warmup, script_args(args.global_batch, steps))
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="regroup-bench-script-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        profile = Path(args.profile) if args.profile else None
        result = measure(
            settings, rounds, root, profile, args.also_without_snapshots, args.profile_clock, args.max_others,
            synced=args.also_synced_anchor,
        )
        if args.profile and result["profile"]:
            shutil.copytree(root / "profiles", args.profile, dirs_exist_ok=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"FSDP2 example, {WORLD} ranks (1 per node), global batch {settings.global_batch}, {steps} steps per run, "
        f"first {warmup} dropped, {rounds} rounds (without, with) alternated; load average {result['loadavg']['start']} "
        f"at the start, {result['loadavg'].get('end')} at the end; {result['rounds_redone']} rounds run again"
    )
    losses = {r[v]["first_loss"] for r in result["rounds"] for v in r} - {None}
    reference = next(iter(losses), None)
    mismatched = [loss for loss in losses if not same_training(reference, loss)]
    if mismatched:
        print(f"warning: the first step's loss differs between runs ({sorted(losses)}): not the same training")
    elif reference is not None:
        unread = sum(r[v]["first_loss"] is None for r in result["rounds"] for v in r)
        print(
            f"same training: the first step's loss is {reference:.6g} in every run"
            + (f" ({unread} runs' could not be read)" if unread else "")
        )
    exits = [f for r in result["rounds"] for v in r for f in r[v].get("failed_after_training", [])]
    if exits:
        print(f"{len(exits)} runs had a process fail after its last step (kept: every step was logged): {exits}")
    busy = [r[v]["others_cores"] for r in result["rounds"] for v in r if "others_cores" in r[v]]
    if busy:
        print(
            f"other processes kept {statistics.median(busy):.2f} cores busy during the measured windows "
            f"(median over runs; max {max(busy):.2f})"
        )
    print("\n".join(table(result["summary"])))
    if "summary_synced" in result:
        print("\nAgainst the plain loop that all-reduces its loss every step:")
        print("\n".join(table(result["summary_synced"], base="without, loss all-reduced (torchrun)")))
        print("\nThat loop against the plain one (what one small all-reduce per step does here):")
        print(
            "\n".join(
                table(result["summary_synced_vs_plain"], "without, loss all-reduced (torchrun)", "without (torchrun)")
            )
        )
    if "summary_no_snapshots" in result:
        print("\nThe same example without snapshots (snapshot_every=0), against the same anchor runs:")
        print("\n".join(table(result["summary_no_snapshots"], "with the API, no snapshots")))
    if result["profile"]:
        for variant in VARIANTS:
            prof = result["profile"][variant]
            print(
                f"\ncProfile ({args.profile_clock} time), rank 0's main thread, {variant} the API "
                f"({prof['summary']['step_s'] * 1e3:.1f} ms/step under the profiler):"
            )
            print("| function | cumulative ms/step | own ms/step | calls/step |\n|---|---|---|---|")
            for name, cum, own, calls in prof["rows"]:
                print(f"| {name} | {cum:.2f} | {own:.2f} | {calls} |")
        print("\nRank 0's threads, CPU ms per step (profiled runs; the main thread is slowed by the profiler):")
        threads = {v: result["profile"][v]["threads_cpu_per_step"] for v in VARIANTS}
        names = list(dict.fromkeys([*threads["with"], *threads["without"]]))
        print("| thread | without | with |\n|---|---|---|")
        for name in names:
            cells = [threads[v].get(name) for v in VARIANTS]
            print(f"| {name} | " + " | ".join("-" if c is None else f"{c * 1e3:.2f}" for c in cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": settings.__dict__, **result}, indent=2, default=str))
    return 0
