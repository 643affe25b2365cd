"""A campaign: start the job, play each planned fault, shut the job down, check.

One fault's cycle: bring back the nodes earlier faults took (``restore``); before a fault
that takes a member out, give the job the chance to grow above its minimum; inject; wait
for the job to train at a legal size again (invariant 1, within ``RECOVERY_BOUND``).
Everything else is checked once the job is shut down, over what the run recorded, and
each finding is filed under the fault whose cycle was running at the time it concerns.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from bench.chaos.faults import Injection, inject, takes_a_node, training_ranks
from bench.chaos.invariants import (
    RECOVERY_BOUND,
    History,
    illegal_sizes,
    kept_history,
    load_committed,
    log_resume_findings,
    read_samples,
    recovery_point,
    resume_findings,
    slow_recovery_finding,
    steps_lost_finding,
)
from bench.chaos.job import GLOBAL_BATCH, TRAINER, ChaosJob, JobShape, Shutdown
from bench.chaos.observe import Finding
from bench.chaos.plan import CONTROLLER_KILL, KINDS, Fault, draw_plan
from regroup.demo.nodes import RunLayout
from regroup.elastic.checkpoint.folders import list_steps
from regroup.elastic.settings import SnapshotConfig
from regroup.records import ReformPhase

log = structlog.get_logger("bench.chaos")

LATE_WAIT = 120.0
"""After a fault the job did not recover from in time: how much longer the campaign waits
for it to train again (the next fault must hit a training job); past it the campaign stops."""
GROW_WAIT = 30.0
"""Before a fault that takes a member out: how long the job may take to grow above its
minimum (the restored nodes' agents start and join); past it the fault strikes anyway."""


@dataclass(frozen=True)
class CampaignSettings:
    seed: int
    faults: int
    root: Path
    """The run folder (``RunLayout``)."""
    kinds: tuple[str, ...] = KINDS
    only: tuple[int, ...] = ()
    """Play only these indices of the seeded plan, on a fresh job."""
    shape: JobShape = JobShape()
    marker: str = ""
    """Tags the run's processes for the leak check (default: the folder name)."""


@dataclass
class FaultResult:
    fault: Fault
    cycle_start: float
    world_before: int
    """Ranks training when the fault struck."""
    grow_wait_s: float
    injection: Injection | None = None
    recovered_at: float | None = None
    """When the job trained again, if within ``RECOVERY_BOUND``."""
    late_at: float | None = None
    """When it trained again after the bound, if it did within ``LATE_WAIT`` more."""
    restored: list[str] = field(default_factory=list)
    steps_lost: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def recovery_s(self) -> float | None:
        if self.recovered_at is None or self.injection is None:
            return None
        return max(0.0, self.recovered_at - self.injection.at)

    def to_json(self) -> dict[str, Any]:
        injection = self.injection
        return {
            **self.fault.to_json(),
            "description": self.fault.describe(),
            "cycle_start": self.cycle_start,
            "world_before": self.world_before,
            "grow_wait_s": round(self.grow_wait_s, 3),
            "at": injection.at if injection else None,
            "victim": injection.victim if injection else "",
            "detail": injection.detail if injection else "",
            "moment_seen": injection.moment_seen if injection else False,
            "provoked": injection.provoked if injection else "",
            "world": injection.world if injection else [],
            "recovered": self.recovered_at is not None,
            "recovery_s": None if self.recovery_s is None else round(self.recovery_s, 3),
            "late_recovery_s": (
                None if self.late_at is None or injection is None else round(self.late_at - injection.at, 3)
            ),
            "restored": self.restored,
            "steps_lost": self.steps_lost,
            "violations": [{"invariant": f.invariant, "message": f.message} for f in self.findings],
        }


@dataclass
class CampaignResult:
    settings: CampaignSettings
    plan: list[Fault]
    faults: list[FaultResult]
    startup: list[Finding] = field(default_factory=list)
    """Findings before the first fault."""
    end: list[Finding] = field(default_factory=list)
    """Findings of the shutdown and the final checks."""
    shutdown: Shutdown | None = None
    started_at: float = 0.0
    first_fault_at: float = 0.0
    shutdown_at: float = 0.0
    """When the orderly end began: later findings are the end's."""
    ended_at: float = 0.0
    stopped: str = ""
    """Why the campaign stopped before the end of its plan, if it did."""
    last_step: int = 0
    controllers: int = 1

    def violations(self) -> list[tuple[str, Finding]]:
        """(where, finding) of every violation: ``fault #i``, ``startup`` or ``end``."""
        out = [("startup", f) for f in self.startup]
        for result in self.faults:
            out += [(f"fault #{result.fault.index} ({result.fault.kind})", f) for f in result.findings]
        return out + [("end", f) for f in self.end]


async def play_fault(job: ChaosJob, fault: Fault) -> FaultResult:
    """One cycle: restore, let the job grow, inject, wait for it to train again, restore."""
    assert job.watcher is not None
    watcher = job.watcher
    cycle_start = time.time()
    await job.restore()
    waited = time.monotonic()
    if takes_a_node(fault):
        await job.restore_until(lambda: training_ranks(job) > job.shape.min_nodes, GROW_WAIT)
    result = FaultResult(fault, cycle_start, training_ranks(job), time.monotonic() - waited)
    start = len(watcher.progress)
    log.info("fault", index=fault.index, kind=fault.kind, world=result.world_before)
    result.injection = injection = await inject(job, fault)
    if sum(1 for n in job.shape.names if job.cluster and job.cluster.node(n)) < job.shape.min_nodes:
        await job.restore()  # the job cannot reach its minimum without them
    legal = range(job.shape.min_nodes, job.shape.max_nodes + 1)

    def recovered() -> Any:
        point = recovery_point(watcher.progress, injection.at, legal, start)
        if point is None or not _reform_finished(job, fault, injection):
            return None
        return point

    point = await job.until(recovered, RECOVERY_BOUND)
    if point is not None:
        result.recovered_at = point.time
    else:
        result.findings.append(
            Finding(injection.at, 1, f"not training at a legal size {RECOVERY_BOUND:.0f}s after the fault")
        )
        late = await job.restore_until(recovered, LATE_WAIT)
        result.late_at = late.time if late is not None else None
    log.info("recovered", index=fault.index, seconds=result.recovery_s, late_at=result.late_at)
    await job.restore()
    result.restored = [node for at, node in job.restored if at >= cycle_start]
    return result


def _reform_finished(job: ChaosJob, fault: Fault, injection: Injection) -> bool:
    """After a controller kill, the re-form it interrupted must be finished by the new one."""
    if fault.kind != CONTROLLER_KILL or injection.plan_generation is None:
        return True
    assert job.watcher is not None
    plan = job.watcher.view.plan
    return plan is not None and (plan.generation > injection.plan_generation or plan.phase == ReformPhase.DONE)


async def run_campaign(settings: CampaignSettings) -> CampaignResult:
    """Play the seeded plan on a fresh job and check every invariant."""
    plan = draw_plan(settings.seed, settings.faults, settings.kinds)
    if settings.only:
        plan = [plan[i] for i in settings.only]
    layout = RunLayout(settings.root)
    job = ChaosJob(layout, settings.shape, settings.marker or settings.root.name)
    result = CampaignResult(settings, plan, [], started_at=time.time())
    try:
        await job.start()
        result.first_fault_at = time.time()
        for fault in plan:
            played = await play_fault(job, fault)
            result.faults.append(played)
            if played.recovered_at is None and played.late_at is None:
                result.stopped = (
                    f"the job did not train again within {RECOVERY_BOUND + LATE_WAIT:.0f}s of fault #{fault.index}; "
                    f"{len(plan) - len(result.faults)} faults not played"
                )
                break
        result.shutdown_at = time.time()
        result.shutdown = await job.shut_down()
    finally:
        await job.close()
    result.ended_at = time.time()
    result.controllers = job.controllers
    await asyncio.to_thread(_check, job, result)
    return result


def _check(job: ChaosJob, result: CampaignResult) -> None:
    """Every check over the recorded run, each finding filed under its fault."""
    assert job.watcher is not None and result.shutdown is not None
    layout = job.layout
    checkpoints = job.checkpoints
    checkpoints.scan(list_steps(layout.checkpoints))
    progress = job.watcher.progress
    legal = range(job.shape.min_nodes, job.shape.max_nodes + 1)
    findings = list(checkpoints.findings)
    findings += illegal_sizes(progress, legal)
    findings += resume_findings(progress, checkpoints.committed_before, checkpoints.newest_committed_before)
    findings += log_resume_findings(layout.logs, checkpoints.committed_before)
    history = kept_history(read_samples(layout.root / "samples"), GLOBAL_BATCH)
    result.last_step = history.last_step
    findings += history.findings
    _file_steps_lost(result, history)
    _check_promises(result)
    end = result.ended_at
    findings += load_committed(layout.checkpoints, end)
    shutdown = result.shutdown
    findings += [Finding(end, 5, f"process left running: {p}") for p in shutdown.processes_left]
    findings += [Finding(end, 5, f"etcd key left: {k}") for k in shutdown.leaked_keys]
    for finding in findings:
        _file(result, finding)


def _window(result: CampaignResult, moment: float) -> FaultResult | None:
    """The fault whose cycle was running at ``moment`` (None: before the first)."""
    current = None
    for fault in result.faults:
        if fault.cycle_start <= moment:
            current = fault
    return current


def _file(result: CampaignResult, finding: Finding) -> None:
    if finding.time <= 0 or finding.time >= result.shutdown_at:
        result.end.append(finding)
        return
    fault = _window(result, finding.time)
    (fault.findings if fault is not None else result.startup).append(finding)


def _file_steps_lost(result: CampaignResult, history: History) -> None:
    for started, steps in history.redone:
        fault = _window(result, started)
        if fault is not None:
            fault.steps_lost += steps


def _check_promises(result: CampaignResult) -> None:
    """Invariants 6 and 7, fault by fault: the steps it lost and how soon it trained again."""
    max_every = int(TRAINER.get("snapshot", {}).get("max_every", SnapshotConfig().max_every))
    for played in result.faults:
        fault = played.fault
        at = played.injection.at if played.injection is not None else played.cycle_start
        found = (
            steps_lost_finding(at, fault.kind, takes_a_node(fault), played.steps_lost, max_every),
            slow_recovery_finding(at, fault.kind, played.recovery_s),
        )
        played.findings += [f for f in found if f is not None]
