"""The invariants, checked over what the run recorded.

1. After every fault the job trains again at a legal size within ``RECOVERY_BOUND``.
2. No committed checkpoint is lost (retention aside) or corrupt; the newest one loads.
3. No partial checkpoint is ever loaded: every resume comes from memory or from a
   checkpoint whose commit marker was written before it.
4. In the kept history (a resumed world's steps replace the ones it redoes) no sample
   id is trained twice and none is skipped.
5. No process and no member or join key outlives the job.
6. Steps lost on one fault stay within the promise: at most ``snapshot.max_every`` on a
   fault that takes a member without notice, none on one that takes no member.
7. Every single fault trains again within ``RECOVERY_PROMISE``.

Each check returns ``Finding``s stamped with the time they concern; the campaign files
each under the fault whose window holds that time. Pure functions over records and
files, apart from the checkpoint load (torch, imported there).
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench.chaos.observe import Finding
from regroup.records import Progress

RECOVERY_BOUND = 60.0
"""Seconds from a fault to training at a legal size again. The slowest legitimate path
here is a worker restarted from scratch (a Python interpreter and ``import torch``: 5-10 s
on two loaded cores), after a dead agent's lease ran out (5 s), a probation (5 s) and a
rendezvous; about 20 s. Three times that leaves room for a loaded machine and still
flags a job that hangs (a dead collective would hang for gloo's 30 minutes)."""

RECOVERY_PROMISE = 10.0
"""Seconds from one fault to training again that the project promises (invariant 7); the
looser ``RECOVERY_BOUND`` tells a slow recovery from a hung job."""

INVARIANTS: dict[int, str] = {
    1: "trains again at a legal size in time",
    2: "no committed checkpoint lost or corrupt",
    3: "no partial checkpoint loaded",
    4: "no sample trained twice or skipped",
    5: "no process or etcd key leaked",
    6: "steps lost within the promise",
    7: f"trains again within {RECOVERY_PROMISE:.0f} s",
}


def steps_lost_finding(at: float, kind: str, takes_a_member: bool, lost: int, max_every: int) -> Finding | None:
    """Invariant 6 for one fault that lost ``lost`` steps: ``takes_a_member`` without notice
    may cost ``max_every``; any other fault nothing."""
    bound = max_every if takes_a_member else 0
    if lost <= bound:
        return None
    return Finding(at, 6, f"{kind} lost {lost} steps, more than {bound} (snapshot.max_every {max_every})")


def slow_recovery_finding(at: float, kind: str, recovery_s: float | None) -> Finding | None:
    """Invariant 7 for one fault that trained again after ``recovery_s`` (None: not within
    ``RECOVERY_BOUND``, which invariant 1 reports)."""
    if recovery_s is None or recovery_s <= RECOVERY_PROMISE:
        return None
    return Finding(at, 7, f"{kind} trained again after {recovery_s:.2f} s, more than {RECOVERY_PROMISE:.0f} s")


# ---------------------------------------------------------------- 1: recovery


def world_key(p: Progress) -> tuple[int, int, int, int]:
    """One world of the trainer: the round, its size, the step it resumed from, rank 0's restarts."""
    return (p.round, p.world_size, p.resumed_from_step, p.restart_count)


def recovery_point(progress: list[Progress], since: float, legal: range, start: int = 0) -> Progress | None:
    """The first progress record after ``since`` of a world at a legal size that then trains
    at least one more step: that step began and ended after ``since``, so the job trains.
    (One record after ``since`` is not enough: its step may have ended before the fault.)"""
    first: dict[tuple[int, int, int, int], Progress] = {}
    for p in progress[start:]:
        if p.time <= since or p.world_size not in legal:
            continue
        seen = first.setdefault(world_key(p), p)
        if p.step > seen.step:
            return seen
    return None


def illegal_sizes(progress: list[Progress], legal: range) -> list[Finding]:
    return [
        Finding(p.time, 1, f"trained at {p.world_size} ranks (step {p.step}), outside {legal.start}..{legal.stop - 1}")
        for p in progress
        if p.world_size not in legal
    ]


# ---------------------------------------------------------------- 3: resumes


def resume_findings(
    progress: list[Progress],
    committed_before: Callable[[int, float], bool],
    newest_before: Callable[[float], int | None],
) -> list[Finding]:
    """Each world's first record says where it resumed from (``resume_phases``): ``load`` must
    be a checkpoint committed before; starting over at step 0 while one was committed loses it."""
    found = []
    seen: set[tuple[int, int, int, int]] = set()
    for p in progress:
        key = world_key(p)
        if key in seen:
            continue
        seen.add(key)
        step = p.resumed_from_step
        if "load" in p.resume_phases and not committed_before(step, p.time):
            found.append(Finding(p.time, 3, f"world of round {p.round} loaded step-{step}, never committed before"))
        newest = newest_before(p.time)
        if not p.resume_phases.keys() & {"load", "reshard"} and step == 0 and p.reform_mode and newest:
            why = f"world of round {p.round} started over at step 0; step-{newest} was committed"
            found.append(Finding(p.time, 3, why))
    return found


def _log_time(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def logged_resumes(logs: Path) -> list[tuple[float, str, int]]:
    """(time, node, step) of every ``resumed`` event the trainers logged (a checkpoint load)."""
    out = []
    for path in sorted(logs.glob("node-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{") or '"resumed"' not in line:
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "resumed" and "step" in event and "timestamp" in event:
                out.append((_log_time(event["timestamp"]), path.stem, int(event["step"])))
    return out


def log_resume_findings(logs: Path, committed_before: Callable[[int, float], bool]) -> list[Finding]:
    return [
        Finding(t, 3, f"{node}: a rank logged loading step-{step}, never committed before")
        for t, node, step in logged_resumes(logs)
        if not committed_before(step, t)
    ]


# ---------------------------------------------------------------- 4: the kept history


@dataclass
class Incarnation:
    """The steps one world (a world size and a rendezvous round) trained, from the sample log."""

    world_size: int
    round: int
    start: float = float("inf")
    end: float = 0.0
    steps: dict[int, dict[int, list[int]]] = field(default_factory=dict)
    """step -> rank -> the sample ids that rank trained at that step."""
    times: dict[int, float] = field(default_factory=dict)
    """step -> when its first rank logged it."""
    repeats: list[tuple[int, int]] = field(default_factory=list)
    """(step, rank) logged twice within this world."""
    losses: dict[int, dict[int, float]] = field(default_factory=dict)
    """step -> rank -> that rank's own loss, where the log carries one."""

    def complete(self, step: int) -> bool:
        return set(self.steps.get(step, {})) == set(range(self.world_size))


def read_samples(folder: Path) -> list[Incarnation]:
    """Every world's steps from the ``samples-w<W>-r<R>.jsonl`` files, oldest world first."""
    worlds: dict[tuple[int, int], Incarnation] = {}
    for path in sorted(folder.glob("samples-w*-r*.jsonl")):
        size, rank = (int(part[1:]) for part in path.stem.removeprefix("samples-").split("-"))
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a line cut by SIGKILL
            round_ = int(record.get("round", 0))
            world = worlds.setdefault((size, round_), Incarnation(size, round_))
            step, t = int(record["step"]), float(record.get("t", 0.0))
            ranks = world.steps.setdefault(step, {})
            if rank in ranks:
                world.repeats.append((step, rank))
            ranks[rank] = list(record["ids"])
            if "loss" in record:
                world.losses.setdefault(step, {})[rank] = float(record["loss"])
            world.times[step] = min(world.times.get(step, t), t)
            world.start, world.end = min(world.start, t), max(world.end, t)
    return sorted(worlds.values(), key=lambda w: w.start)


@dataclass
class History:
    """The kept trajectory: for each step, the world whose training of it counts."""

    kept: dict[int, Incarnation]
    redone: list[tuple[float, int]]
    """(when a world started, how many complete steps of the history it replaced)."""
    findings: list[Finding]
    last_step: int


def kept_history(worlds: list[Incarnation], global_batch: int) -> History:
    """Replay the worlds in the order they started: each replaces every step from its first
    one on. Then every step 1..last must be complete, and the ids must cover
    [0, last * global_batch) exactly once."""
    kept: dict[int, Incarnation] = {}
    redone: list[tuple[float, int]] = []
    findings: list[Finding] = []
    for i, world in enumerate(worlds):
        for step, rank in world.repeats:
            findings.append(Finding(world.times[step], 4, f"rank {rank} of {_name(world)} trained step {step} twice"))
        later = worlds[i + 1] if i + 1 < len(worlds) else None
        if later is not None and world.end > later.start:
            findings.append(Finding(later.start, 4, f"{_name(world)} trained on after {_name(later)} had started"))
        first = min(world.steps)
        replaced = [s for s in kept if s >= first]
        redone.append((world.start, sum(1 for s in replaced if kept[s].complete(s))))
        for step in replaced:
            del kept[step]
        kept.update({step: world for step in world.steps})
    last = max(kept, default=0)
    if last and not kept[last].complete(last) and kept[last] is worlds[-1]:
        del kept[last]  # the job was stopped in the middle of its last step
        last -= 1
    findings += _coverage(kept, last, global_batch)
    return History(kept, redone, findings, last)


def _coverage(kept: dict[int, Incarnation], last: int, global_batch: int) -> list[Finding]:
    findings = []
    counts: Counter[int] = Counter()
    where: dict[int, float] = {}
    for step in range(1, last + 1):
        world = kept.get(step)
        if world is None:
            findings.append(Finding(0.0, 4, f"step {step} is in no world's log: ids skipped"))
            continue
        missing = sorted(set(range(world.world_size)) - set(world.steps[step]))
        if missing:
            why = f"step {step} of {_name(world)} lacks ranks {missing}: ids skipped"
            findings.append(Finding(world.times[step], 4, why))
        for ids in world.steps[step].values():
            counts.update(ids)
            where.update({i: world.times[step] for i in ids})
    twice = sorted(i for i, n in counts.items() if n > 1)
    if twice:
        findings.append(Finding(where[twice[0]], 4, f"{len(twice)} sample ids trained twice, first {twice[0]}"))
    skipped = sorted(set(range(last * global_batch)) - set(counts))
    if skipped:
        findings.append(Finding(0.0, 4, f"{len(skipped)} sample ids skipped, first {skipped[0]}"))
    return findings


def _name(world: Incarnation) -> str:
    return f"world (round {world.round}, {world.world_size} ranks)"


# ---------------------------------------------------------------- 2: the checkpoints left


def load_committed(root: Path, moment: float) -> list[Finding]:
    """Every committed checkpoint left must load whole, without a process group, and hold
    its own step; the newest one is the one a restart would resume from."""
    from torch import load
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from regroup.elastic.checkpoint.folders import list_steps, step_dir

    committed = [step for step, ok in list_steps(root) if ok]
    if not committed:
        return [Finding(moment, 2, "no committed checkpoint at the end")]
    findings = []
    with tempfile.TemporaryDirectory(prefix="chaos-load-") as scratch:
        for step in committed:
            out = Path(scratch) / f"{step}.pt"
            try:
                dcp_to_torch_save(str(step_dir(root, step)), str(out))
                held = int(load(out, weights_only=False)["app"]["trainer"]["step"])
            except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
                findings.append(Finding(moment, 2, f"step-{step} does not load: {exc!r}"[:300]))
                continue
            if held != step:
                findings.append(Finding(moment, 2, f"step-{step} holds step {held}"))
    return findings
