"""``decide(snapshot, now, settings) -> Decision``: the controller's whole policy, pure.

Level-triggered: the same snapshot gives the same actions, and every write it asks for
is checked against what etcd already holds, so repeating a decision is harmless. One
re-form at a time per job: while ``control/plan`` is in flight, new signals only steer
that plan (a node lost mid-checkpoint forces the unplanned path) or wait for the next.

``health`` classifies the job's nodes, ``start`` begins a re-form, ``phases`` advances
the one in flight, ``writes`` holds the records that carry a plan, ``job_status`` the
job's verdict, ``alerts`` the warnings that change nothing else, ``cleanup`` what a job
that is over leaves in etcd and the acks a live one no longer needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from regroup.controller.decide.alerts import flapping, rendezvous_on_gpu
from regroup.controller.decide.cleanup import prune_acks, removal, tombstoned
from regroup.controller.decide.health import (
    assess, keep_exclusions, restart_storms, waiting_joiners, warming_joiners, world_of,
)  # fmt: skip
from regroup.controller.decide.job_status import write_status
from regroup.controller.decide.out import Out, summarize
from regroup.controller.decide.phases import advance
from regroup.controller.decide.positions import spares_of
from regroup.controller.decide.situation import Situation
from regroup.controller.decide.start import start
from regroup.controller.decide.writes import finish, withdraw_stale_checkpoint
from regroup.controller.disruption import pod_notices
from regroup.controller.jobconfig import ConfigProblem, JobConfig, ResolvedConfig
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import (
    AFTER_PREVIOUS_PLAN,
    Alerts,
    Decision,
    JobSnapshot,
    PostEvent,
    WritePlan,
    WritePresence,
)
from regroup.records import ControllerPresence, ReformOutcome, ReformPhase

__all__ = ["Decision", "decide", "summarize"]


def decide(s: JobSnapshot, now: float, settings: ControllerSettings) -> Decision:
    """Everything the controller wants done for job ``s`` at ``now``, with the reason."""
    out = Out()
    if s.tombstone is not None:
        return tombstoned(s, now, settings.cleanup, out)
    removed = removal(s, now, settings.cleanup, out)
    if removed is not None:
        return removed
    resolved = s.resolved
    for problem in resolved.problems:
        ref = problem.pod.ref
        out.actions.append(PostEvent(ref, "Warning", problem.kind, problem.message))
    if s.presence is None or s.presence.identity != s.identity:
        out.actions.append(WritePresence(ControllerPresence(identity=s.identity, since=now)))
    gpu = rendezvous_on_gpu(s, resolved.rendezvous_pods, out)
    flaps = flapping(s, now, settings, resolved.newest, out)
    world = world_of(s)
    config = resolved.config
    if s.finished:
        return _finished(s, now, world, config, out, flaps, gpu)
    if config is None:
        return _unconfigured(s, now, resolved.problems, world, out, flaps, gpu)
    return _running(s, now, settings, resolved, config, world, out, flaps, gpu)


def _unconfigured(
    s: JobSnapshot, now: float, problems: Sequence[ConfigProblem], world: AbstractSet[str], out: Out, flaps: bool, gpu: bool
) -> Decision:
    """No worker pods, or bad annotations: the job is left alone and says why."""
    bad = any(p.kind == "BadConfig" for p in problems)
    reason = "bad configuration: " + "; ".join(p.message for p in problems) if bad else "no worker pods"
    write_status(s, out, "bad-config" if bad else "waiting", reason, world, None, now)
    return out.decision(reason, len(world), None, Alerts(bad_config=bad, flapping=flaps, rendezvous_on_gpu=gpu))


def _finished(
    s: JobSnapshot, now: float, world: AbstractSet[str], config: JobConfig | None, out: Out, flaps: bool, gpu: bool
) -> Decision:
    """The agents closed the rendezvous: training is over, whether its pods are still there
    or not. Nothing to re-form, ever; its keys go after the retention (``cleanup``)."""
    if s.plan is not None and s.plan.phase != ReformPhase.DONE:
        finish(s, s.plan, now, ReformOutcome.SUPERSEDED, out, "the job finished (its rendezvous is closed)")
    withdraw_stale_checkpoint(s, out)
    reason = "finished: the job's rendezvous is closed"
    write_status(s, out, "finished", reason, world, config, now)
    return out.decision(reason, len(world), config, Alerts(flapping=flaps, rendezvous_on_gpu=gpu))


def _running(
    s: JobSnapshot,
    now: float,
    settings: ControllerSettings,
    resolved: ResolvedConfig,
    config: JobConfig,
    world: AbstractSet[str],
    out: Out,
    flaps: bool,
    gpu: bool,
) -> Decision:
    """A configured, running job: advance the re-form in flight, or start one if needed."""
    min_grace = settings.reform.min_planned_grace.total_seconds()
    notices = pod_notices(s.disrupted.values(), resolved.workers_by_node, s.first_seen, now, min_grace)
    health = assess(s, world, config, now, notices, min_grace)
    if health.turns_lost_at is not None:
        out.again_in(health.turns_lost_at - now)  # a leave with time left becomes a loss then
    restart_storms(s, config, resolved.workers_by_node, health, now, settings, out)
    keep_exclusions(s, config, health, now, out)
    joiners = waiting_joiners(s, world, health, now, out)
    warming = warming_joiners(s, world, health)
    sit = Situation(s, now, settings, config, health, out, s.plan_revision)
    in_flight = s.plan is not None and s.plan.phase != ReformPhase.DONE
    stalled = False
    if in_flight:
        reason = advance(sit, s.plan)
        if out.abandoned:
            # Decided afresh in the same decision, on the same view: what the job needs now
            # starts at once, not one trip through the work queue later.
            afresh = Situation(s, now, settings, config, health, out, AFTER_PREVIOUS_PLAN)
            then, stalled = start(afresh, world, joiners, resolved.newest)
            reason = f"{reason}; then {then}"
    else:
        reason, stalled = start(sit, world, joiners, resolved.newest)
    if warming:
        reason = f"{reason}; {len(warming)} warming up to join ({', '.join(warming)})"
    withdraw_stale_checkpoint(s, out)
    prune_acks(s, out)
    reforming = (in_flight and not out.abandoned) or out.started()
    state = "stalled" if stalled else ("reforming" if reforming else "healthy")
    live = world - health.lost.keys() if health.lost else world
    spares = spares_of(joiners, len(live), config.max_nodes, _targets(s, out))
    write_status(s, out, state, reason, live, config, now, flapping=flaps, gpu=gpu, spares=spares, warming=warming)
    alerts = Alerts(stalled=stalled, flapping=flaps, rendezvous_on_gpu=gpu)
    return out.decision(reason, len(live), config, alerts, len(spares), config.spare_nodes)


def _targets(s: JobSnapshot, out: Out) -> AbstractSet[str]:
    """The nodes of the re-form in flight once this decision is applied (none when none is)."""
    for action in reversed(out.actions):
        if type(action) is WritePlan:
            return frozenset() if action.finished else frozenset(action.plan.nodes_after)
    plan = s.plan
    if plan is not None and plan.phase != ReformPhase.DONE:
        return frozenset(plan.nodes_after)
    return frozenset()
