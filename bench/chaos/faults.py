"""Injecting one planned fault into the running job, at the moment its kind names.

A timed kill first waits for its moment (a step just ended, a save without its commit
marker, a survivor's join record for the next round, a fresh checkpoint ack), then
SIGKILLs a node (``LocalCluster.remove_node``) or a rank (``crash_workers``). Moments that
only come with a re-form (the rendezvous, the ack, the controller mid re-form) come from
the re-forms earlier faults cause (a restored node's grow); when none is under way the
campaign starts one with a reclaim notice long enough to be planned ("provoked").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import structlog

from bench.chaos.job import ChaosJob
from bench.chaos.plan import (
    AFTER_ACK,
    CONTROLLER_KILL,
    DURING_RENDEZVOUS,
    DURING_SAVE,
    ETCD_RESTART,
    MID_STEP,
    NODE_KILL,
    SHORT_RECLAIM,
    WATCH_DROP,
    Fault,
)
from regroup.demo.scenario import DEFAULT_RECLAIM_TAINT
from regroup.records import ReformPhase

log = structlog.get_logger("bench.chaos")

STEP_S = 0.15
"""About one training step here (the 100 ms floor plus its collectives): mid-step kills
land within this much of a step's end."""
MOMENT_WAIT = 45.0
"""How long a timed kill waits for its moment before it strikes anyway (``moment_seen`` false)."""
PROVOKE_NOTICE = timedelta(seconds=8)
"""A reclaim notice long enough for a planned shrink: the controller keeps 5 s of it free
(``notice_margin``) and needs the rest for the checkpoint."""
SHORT_NOTICE = timedelta(seconds=0.5)
NODE_GONE_WAIT = 10.0


@dataclass
class Injection:
    """What a fault did, and when it took effect."""

    at: float
    """When the fault took effect: the kill, etcd going down, the controller cancelled."""
    victim: str = ""
    detail: str = ""
    moment_seen: bool = True
    """The moment the kind waits for came within ``MOMENT_WAIT``."""
    provoked: str = ""
    """The node given a reclaim notice to start a re-form for this fault, if any."""
    world: list[str] = field(default_factory=list)
    """The round's nodes when the fault struck."""
    plan_generation: int | None = None
    """controller-kill: the generation of the re-form in flight at the kill."""


# ---------------------------------------------------------------- choosing a victim


def _healthy(job: ChaosJob, node: str) -> bool:
    """A node with a running agent and no reclaim notice (it is not leaving anyway)."""
    assert job.cluster is not None
    info = job.cluster.node(node)
    return info is not None and not info.taints and not info.unschedulable and job.cluster.agent_pid(node) is not None


def candidates(job: ChaosJob) -> list[str]:
    """Members of the round formed now that are not leaving; else any healthy node."""
    world = sorted(n for n in job.world() if _healthy(job, n))
    return world or sorted(n for n in job.shape.names if _healthy(job, n))


def pick(nodes: list[str], fraction: float) -> str:
    return nodes[min(int(fraction * len(nodes)), len(nodes) - 1)]


FRESH_S = 2.0
"""Progress older than this says the job is not training now (rank 0 publishes every 0.2 s)."""


def training_ranks(job: ChaosJob) -> int:
    """Ranks the job trains at now; 0 when its latest progress is stale (it is not training)."""
    assert job.watcher is not None
    progress = job.watcher.progress
    if not progress or time.time() - progress[-1].time > FRESH_S:
        return 0
    return progress[-1].world_size


async def kill(job: ChaosJob, target: str, node: str) -> tuple[float, str]:
    """SIGKILL the node's whole tree (it vanishes) or its workers only; the kill's time,
    and a note when there was nothing to kill (a rank between two incarnations)."""
    assert job.cluster is not None
    at = time.time()
    if target == NODE_KILL:
        await job.cluster.remove_node(node, reason="chaos: node SIGKILLed")
        return at, ""
    killed = job.cluster.crash_workers(node)
    return at, "" if killed else "no worker process was running"


# ---------------------------------------------------------------- moments


def _pending_reform(job: ChaosJob) -> bool:
    """A re-form is under way or on its way: a plan in flight, or a healthy node that is
    not in the round (a restored node the controller will grow the job with)."""
    assert job.watcher is not None
    world = set(job.world())
    return job.watcher.reform_in_flight() or any(n not in world for n in job.shape.names if _healthy(job, n))


async def provoke(job: ChaosJob, fault: Fault) -> str:
    """Start a planned re-form: a reclaim notice on a member, if the job can lose one and
    still take a second fault at its minimum size. Returns the node, or "" if it cannot."""
    assert job.cluster is not None
    members = candidates(job)
    # The job loses the provoked node; a fault that then takes another must leave the minimum.
    need = job.shape.min_nodes + (2 if takes_a_node(fault) else 1)
    if len(members) < need or training_ranks(job) < need:
        return ""
    node = pick(members, 1.0 - fault.pick)
    await job.cluster.reclaim_notice(node, DEFAULT_RECLAIM_TAINT, PROVOKE_NOTICE)
    log.info("provoked a re-form", fault=fault.index, node=node)
    return node


async def await_moment(job: ChaosJob, fault: Fault, seen: Callable[[], bool]) -> tuple[bool, str]:
    """Wait for a moment that only a re-form brings. Whenever no re-form is on its way,
    bring one: the nodes earlier faults took come back (their grow is a planned re-form),
    or, with every node in the job, a member gets a reclaim notice. Returns (the moment
    came within ``MOMENT_WAIT``, the node provoked)."""
    deadline = time.monotonic() + MOMENT_WAIT
    provoked = ""
    while not seen() and time.monotonic() < deadline:
        if not _pending_reform(job) and not await job.restore() and not provoked:
            provoked = await provoke(job, fault)
        remaining = deadline - time.monotonic()
        if not _pending_reform(job):
            # Nothing more to bring now; a node the notice takes comes back when it is gone.
            await job.restore_until(seen, max(remaining, 0.1))
            break
        await job.until(lambda: seen() or not _pending_reform(job), max(remaining, 0.1))
    return seen(), provoked


async def _timed_kill(job: ChaosJob, fault: Fault) -> Injection:
    assert job.watcher is not None and fault.target is not None
    watcher = job.watcher
    point = fault.point
    came, provoked, count = True, "", 0
    if point == MID_STEP:
        count = len(watcher.progress)
        came = await job.until(lambda: len(watcher.progress) > count, MOMENT_WAIT) is not None
        await asyncio.sleep(fault.delay * STEP_S)  # where in the next step the kill lands
    elif point == DURING_SAVE:
        job.checkpoints.fast += 1
        try:
            came = await job.until(lambda: job.checkpoints.saving, MOMENT_WAIT) is not None
        finally:
            job.checkpoints.fast -= 1
    elif point == DURING_RENDEZVOUS:
        count = len(watcher.joins)
        came, provoked = await await_moment(job, fault, lambda: any(j.survivor for j in watcher.joins[count:]))
    elif point == AFTER_ACK:
        count = len(watcher.acks)
        came, provoked = await await_moment(job, fault, lambda: len(watcher.acks) > count)
    detail = _moment_detail(job, point, count)
    victim = pick(candidates(job), fault.pick)
    world = job.world()
    at, note = await kill(job, fault.target, victim)
    return Injection(at, victim, "; ".join(filter(None, (detail, note))), came, provoked, world)


def _moment_detail(job: ChaosJob, point: str | None, count: int) -> str:
    assert job.watcher is not None
    if point == DURING_SAVE and job.checkpoints.saving:
        return f"save of step-{max(job.checkpoints.saving)} in flight"
    if point == DURING_RENDEZVOUS and job.watcher.joins[count:]:
        join = job.watcher.joins[-1]
        return f"{join.node} joining round {join.round}"
    if point == AFTER_ACK and job.watcher.acks[count:]:
        ack = job.watcher.acks[-1].ack
        return f"ack of generation {ack.generation} (step {ack.step})"
    return ""


# ---------------------------------------------------------------- the other kinds


async def _etcd_restart(job: ChaosJob, fault: Fault) -> Injection:
    at = time.time()
    await job.restart_etcd(crash=fault.crash)
    down = time.time() - at
    return Injection(at, "etcd", f"{'SIGKILL' if fault.crash else 'SIGTERM'}; serving again after {down:.2f}s")


async def _controller_kill(job: ChaosJob, fault: Fault) -> Injection:
    assert job.watcher is not None
    watcher = job.watcher
    came, provoked = await await_moment(job, fault, watcher.reform_in_flight)
    plan = watcher.view.plan
    old = job.controller.get_name() if job.controller is not None else "?"
    at = time.time()
    await job.stop_controller()
    new = await job.start_controller()
    phase = f"plan generation {plan.generation} in phase {plan.phase.value}" if plan is not None else "no plan"
    generation = plan.generation if plan is not None and plan.phase != ReformPhase.DONE else None
    return Injection(at, old, f"{phase}; {new} took over", came, provoked, job.world(), generation)


async def _watch_drop(job: ChaosJob, fault: Fault) -> Injection:
    assert job.cluster is not None
    job.cluster.drop_watches()
    try:
        victim = pick(candidates(job), fault.pick)
        world = job.world()
        at, _ = await kill(job, NODE_KILL, victim)
        await asyncio.sleep(fault.gap_s)  # the gap lasts this long: the fault's shape, not a wait
    finally:
        job.cluster.relist()
    return Injection(at, victim, f"watch down {fault.gap_s:.1f}s; {victim} killed in the gap", world=world)


async def _short_reclaim(job: ChaosJob, fault: Fault) -> Injection:
    assert job.cluster is not None
    cluster = job.cluster
    victim = pick(candidates(job), fault.pick)
    world = job.world()
    noticed = time.time()
    await cluster.reclaim_notice(victim, DEFAULT_RECLAIM_TAINT, SHORT_NOTICE)
    gone = await job.until(lambda: cluster.node(victim) is None, NODE_GONE_WAIT)
    at = time.time()
    detail = f"notice {SHORT_NOTICE.total_seconds():.1f}s; node gone {at - noticed:.2f}s after the taint"
    return Injection(at, victim, detail, gone is not None, world=world)


async def inject(job: ChaosJob, fault: Fault) -> Injection:
    """Play ``fault`` on the job; returns once it took effect."""
    if fault.target is not None:
        return await _timed_kill(job, fault)
    if fault.kind == ETCD_RESTART:
        return await _etcd_restart(job, fault)
    if fault.kind == CONTROLLER_KILL:
        return await _controller_kill(job, fault)
    if fault.kind == WATCH_DROP:
        return await _watch_drop(job, fault)
    if fault.kind == SHORT_RECLAIM:
        return await _short_reclaim(job, fault)
    raise ValueError(f"unknown fault kind {fault.kind!r}")


def takes_a_node(fault: Fault) -> bool:
    """Faults that take a member out of the job (the campaign first lets it grow above min)."""
    return fault.target is not None or fault.kind in (WATCH_DROP, SHORT_RECLAIM)
