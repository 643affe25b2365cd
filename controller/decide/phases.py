"""Advancing the re-form in flight, one step per phase of its plan.

Each step either waits (and says for what), moves the plan to its next phase, or ends it
(``writes.finish``): completed once the trainer resumes at the new size, superseded when
the world it plans for can no longer form, timed out when it does not form in time.

The moment a phase ends is taken from whoever made it end, by their own clock where they
say it: the trainer's ack (``CheckpointAck.acked_at``), the rendezvous' round
(``RoundState.formed_at``), the trainer's first step at the new size (``Progress.time``);
each bounded by the phase's start and by now. So a plan a new leader takes over ends its
phases when they ended, not when the new leader first looked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from regroup.controller.decide.positions import narrowed
from regroup.controller.decide.situation import Situation
from regroup.controller.decide.writes import checkpoint_request, finish, reform_writes, request_reform
from regroup.controller.signals import signal_key
from regroup.controller.snapshot import JobSnapshot, WriteCheckpointRequest, WritePlan
from regroup.records import CheckpointAck, Progress, ReformOutcome, ReformPhase, ReformPlan, evolve

PhaseStep = Callable[[Situation, ReformPlan, list[str]], str]
"""One phase's step: (situation, plan, its target nodes now lost) -> the decision's reason."""


def advance(sit: Situation, plan: ReformPlan) -> str:
    """Drive the in-flight ``plan`` one step from its phase. Returns the reason."""
    step = PHASE_STEPS.get(plan.phase)
    if step is None:
        return finish(sit.s, plan, sit.now, ReformOutcome.SUPERSEDED, sit.out, f"unknown phase {plan.phase.value!r}")
    lost = sit.health.lost
    lost_targets = sorted(set(plan.nodes_after).intersection(lost)) if lost else []
    return step(sit, plan, lost_targets)


def _checkpoint(sit: Situation, plan: ReformPlan, lost_targets: list[str]) -> str:
    """Wait for the checkpoint ack, then re-form; a lost node or the deadline falls back to
    the unplanned path instead."""
    s, now, out, health = sit.s, sit.now, sit.out, sit.health
    if s.checkpoint is None or s.checkpoint.generation != plan.generation:
        out.actions.append(WriteCheckpointRequest(checkpoint_request(plan)))
    ack = s.acks.get(plan.generation)
    fallback = ""
    if ack is None:
        leaving = set(plan.nodes_before) - set(plan.nodes_after)
        vanished = sorted(n for n in leaving if n in health.lost)
        if lost_targets:
            fallback = f"{', '.join(lost_targets)} lost before the checkpoint ack"
        elif vanished:
            fallback = f"{', '.join(vanished)} vanished before the checkpoint ack"
        elif now >= plan.checkpoint_deadline:
            fallback = "no checkpoint ack by the deadline"
        else:
            out.again_in(plan.checkpoint_deadline - now)
            return f"re-form {plan.generation}: waiting for the checkpoint ack"
    acked_at = _acked_at(s, plan, ack, now) if ack is not None else now
    nodes = [n for n in plan.nodes_after if n not in health.lost]
    if len(nodes) < sit.config.min_nodes:
        why = f"only {len(nodes)} target nodes left, below min {sit.config.min_nodes}"
        return finish(s, plan, now, ReformOutcome.SUPERSEDED, out, why)
    # A replacement lost meanwhile fills nothing; a migrate without the ack is a replace.
    updated = evolve(
        plan,
        acked_at=acked_at,
        ack_step=ack.step if ack is not None else -1,
        planned=ack is not None,
        fallback=fallback,
        **narrowed(plan, nodes, ack is not None),
    )
    updated = request_reform(s, updated, now)
    out.actions.append(WritePlan(updated, s.plan_revision))
    reform_writes(updated, out)
    out.again_in(sit.settings.reform.rendezvous_timeout.total_seconds())
    if fallback:
        return f"re-form {plan.generation}: unplanned fallback: {fallback}"
    return f"re-form {plan.generation}: checkpoint acked at step {ack.step if ack else -1}, re-forming"


def _rendezvous(sit: Situation, plan: ReformPlan, lost_targets: list[str]) -> str:
    """Wait for the planned nodes to form a newer round, then wait for the trainer."""
    s, now, out = sit.s, sit.now, sit.out
    reform_writes(plan, out, s)
    members, before = s.members, plan.round_before
    if s.world_round <= before:
        # A member past the plan's round is then outside the job's round, so a suspect: the
        # few suspects say which planned nodes have joined, without a look at every member.
        joined = {n for n in s.suspects if (m := members.get(n)) is not None and m.round > before}
        pending = [n for n in plan.nodes_after if n not in joined] if joined else plan.nodes_after
    else:
        pending = [n for n in plan.nodes_after if n not in members or members[n].round <= before]
    # Formed: the rendezvous' round record shows a newer round of exactly the planned
    # nodes, or (without that record) every planned member reports a newer round. A
    # newer round of other nodes (one formed while no controller led, say) is not this
    # plan's: waiting on it would wait for a state that cannot come.
    newer = s.world_round > plan.round_before and bool(s.world_agents)
    if newer and set(s.world_agents) != set(plan.nodes_after):
        return finish(s, plan, now, ReformOutcome.SUPERSEDED, out, _other_round(s, plan))
    formed = newer and set(plan.nodes_after) <= s.world_seen
    if formed or not pending:
        round_after = s.world_round if formed else max(members[n].round for n in plan.nodes_after)
        done_at = now
        if formed and s.round_formed_at > 0:
            done_at = min(now, max(s.round_formed_at, plan.reform_requested_at))
        updated = evolve(plan, phase=ReformPhase.RESUME, round_after=round_after, rendezvous_done_at=done_at)
        out.actions.append(WritePlan(updated, s.plan_revision))
        out.again_in(sit.settings.reform.resume_timeout.total_seconds())
        return f"re-form {plan.generation}: round {round_after} formed with {len(plan.nodes_after)} nodes"
    if lost_targets:
        return finish(s, plan, now, ReformOutcome.SUPERSEDED, out, f"{', '.join(lost_targets)} lost during the rendezvous")
    elapsed = now - plan.reform_requested_at
    limit = sit.settings.reform.rendezvous_timeout.total_seconds()
    if elapsed >= limit:
        return finish(s, plan, now, ReformOutcome.TIMEOUT, out, "expected members did not all join the new round")
    out.again_in(limit - elapsed)
    return f"re-form {plan.generation}: waiting for {_some(pending)} to join the new round"


def _some(nodes: list[str], shown: int = 3) -> str:
    """``a, b, c`` or, for more, ``49 nodes (a, b, c, ...)``: a reason names a few nodes,
    not a whole job's (it is logged and stored in the status each time it changes)."""
    if len(nodes) <= shown:
        return ", ".join(nodes)
    return f"{len(nodes)} nodes ({', '.join(nodes[:shown])}, ...)"


def _resume(sit: Situation, plan: ReformPlan, lost_targets: list[str]) -> str:
    """Complete once the trainer reports progress at the planned world size."""
    s, now, out = sit.s, sit.now, sit.out
    reform_writes(plan, out, s)
    progress = s.progress
    if (
        progress is not None
        and s.progress_revision > plan.progress_revision
        and (plan.world_size_target == 0 or progress.world_size == plan.world_size_target)
        # From the new round, where the trainer says which round (0: a restarted worker under
        # torchrun does not): a replacement keeps the world size, so the old world's progress
        # is at the planned size too.
        and (progress.round == 0 or progress.round >= plan.round_after)
    ):
        lost = lost_steps(progress)
        # Only the trainer's rank 0 knows how its world came to be and where the resume time
        # went; the plan carries that to the re-form's trace.
        resumed = evolve(
            plan, resumed_at=resumed_at(plan, progress, now), resumed_from_step=progress.resumed_from_step,
            lost_steps=lost, mode=progress.reform_mode, resume_phases=dict(progress.resume_phases),
        )
        return finish(s, resumed, now, ReformOutcome.COMPLETED, out, f"resumed from step {progress.resumed_from_step}")
    if lost_targets:
        why = f"{', '.join(lost_targets)} lost before the trainer resumed"
        return finish(s, plan, now, ReformOutcome.SUPERSEDED, out, why)
    if s.world_round > plan.round_after and s.world_agents and set(s.world_agents) != set(plan.nodes_after):
        return finish(s, plan, now, ReformOutcome.SUPERSEDED, out, _other_round(s, plan) + " before the trainer resumed")
    elapsed = now - plan.rendezvous_done_at
    limit = sit.settings.reform.resume_timeout.total_seconds()
    if elapsed >= limit:
        return finish(s, plan, now, ReformOutcome.TIMEOUT, out, "the trainer reported no progress at the new size")
    out.again_in(limit - elapsed)
    return f"re-form {plan.generation}: waiting for the trainer to resume at the new size"


def _acked_at(s: JobSnapshot, plan: ReformPlan, ack: CheckpointAck, now: float) -> float:
    """When the checkpoint was acked: the trainer's ``acked_at`` where it gives one, not
    before the request nor after the controller first saw the ack."""
    seen = min(now, s.first_seen.get(signal_key("", f"ack:{plan.generation}"), now))
    if ack.acked_at <= 0:
        return seen
    return min(seen, max(ack.acked_at, plan.checkpoint_requested_at))


def resumed_at(plan: ReformPlan, progress: Progress, now: float) -> float:
    """When the trainers completed their first step at the new size, by their own clock:
    the ``time`` of ``progress``, the record that completes ``plan``, when it is that step's
    record (rank 0 publishes it at once). A later one (the leader that completes the plan
    came after more progress: a new leader) is as late as the latest step; the resume then
    ended, by rank 0's account of it, ``sum(resume_phases)`` after the round formed, where
    that is earlier. Never before the rendezvous ended, nor after ``now``."""
    at = progress.time
    if progress.step > progress.resumed_from_step + 1:
        took = sum(v for v in progress.resume_phases.values() if isinstance(v, int | float) and v > 0)
        if took > 0:
            at = min(at, plan.rendezvous_done_at + took)
    return min(now, max(at, plan.rendezvous_done_at))


def lost_steps(progress: Progress) -> int:
    """Steps the re-form made the trainers redo, from their own account: the newest step any
    rank completed before the world that resumed (``last_step``) minus the step it resumed
    from. -1 when the trainers do not know: the controller's own view of their progress
    (``plan.step_before``, read up to a publishing interval before the world broke) would
    be a guess, and under-counts every step completed after it."""
    if progress.last_step < 0:
        return -1
    return max(0, progress.last_step - progress.resumed_from_step)


def _other_round(s: JobSnapshot, plan: ReformPlan) -> str:
    formed = ", ".join(sorted(s.world_agents))
    return f"round {s.world_round} formed with {formed}, not the planned {', '.join(plan.nodes_after)}"


PHASE_STEPS: Mapping[ReformPhase, PhaseStep] = {
    ReformPhase.CHECKPOINT: _checkpoint,
    ReformPhase.RENDEZVOUS: _rendezvous,
    ReformPhase.RESUME: _resume,
}
"""The step for each phase of a plan in flight (``done`` has none: nothing is in flight)."""
