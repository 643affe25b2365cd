"""A plan's phases end when the agents and trainers say they did, by their own clocks, not
when a controller first looked: a plan a new leader takes over ends at the trainers' resume."""

from __future__ import annotations

import pytest

from regroup.controller.decide.phases import resumed_at
from regroup.controller.settings import ControllerSettings
from regroup.records import Progress, ReformPlan, evolve

from .builders import T0, Scene, acked, job, member, with_taint
from .builders import step as reconcile

S = ControllerSettings()
LATER = T0 + 20
"""When a new leader first looks at the job (its predecessor went away meanwhile)."""


def step(s: Scene, now: float):
    return reconcile(s, now, S)


def progress(step_: int = 101, time: float = T0 + 3, resumed_from: int = 100, **fields) -> Progress:
    return Progress(step=step_, loss=1.0, samples_seen=0, world_size=4, time=time, resumed_from_step=resumed_from,
                    **fields)


def reforming() -> Scene:
    """n3 lost at ``T0``: a plan re-forming n1, n2, asked for at ``T0``; then its leader went away."""
    s, _ = step(job().without_member("n3"), T0)
    assert s.plan.phase == "rendezvous" and s.plan.reform_requested_at == T0
    return s


def taken_over(s: Scene, record: Progress, formed_at: float = T0 + 1.5) -> ReformPlan:
    """What happened while no leader led, all first seen by the new leader at ``LATER``: the
    round formed (at ``formed_at``, by the rendezvous), the trainers resumed (``record``)."""
    s = s.round_formed(2, ("n1", "n2"), at=LATER, formed_at=formed_at)
    s = s.at(LATER).with_members(member(n, 2) for n in ("n1", "n2")).with_progress(record, 50)
    s, _ = step(s, LATER)
    assert s.plan.phase == "resume"
    s, _ = step(s, LATER)
    assert s.plan.outcome == "completed"
    return s.plan


def test_a_taken_over_plan_ends_when_the_round_formed_and_the_trainers_resumed() -> None:
    plan = taken_over(reforming(), progress(time=T0 + 3))
    assert plan.rendezvous_done_at == T0 + 1.5 and plan.resumed_at == T0 + 3 and plan.finished_at == LATER


def test_a_later_progress_record_dates_the_resume_by_the_trainers_own_account() -> None:
    # The new leader sees the record of step 130, published at T0 + 18: the first step at the
    # new size came after the round formed and the 1.75 s rank 0 says the resume took.
    record = progress(step_=130, time=T0 + 18, resume_phases={"process_group": 0.5, "reshard": 1.0, "first_step": 0.25})
    plan = taken_over(reforming(), record)
    assert plan.resumed_at == pytest.approx(T0 + 1.5 + 1.75)
    # Without that account, the record's own time is all there is.
    assert taken_over(reforming(), progress(step_=130, time=T0 + 18)).resumed_at == T0 + 18


def test_the_trainers_and_rendezvous_clocks_are_bounded_by_the_phases_and_now() -> None:
    plan = taken_over(reforming(), progress(time=T0 - 2), formed_at=T0 - 5)
    # A round "formed" before it was asked for starts at the request; a resume before the
    # round formed ends where the round formed.
    assert plan.rendezvous_done_at == T0 and plan.resumed_at == T0
    resuming = evolve(plan, phase="resume", rendezvous_done_at=T0 + 2)
    assert resumed_at(resuming, progress(time=LATER + 60), LATER) == LATER


def test_the_leader_that_saw_it_all_dates_each_phase_as_before() -> None:
    s = reforming()
    s, _ = step(s.round_formed(2, ("n1", "n2"), at=T0 + 1, formed_at=T0 + 0.9), T0 + 1)
    assert s.plan.rendezvous_done_at == T0 + 0.9
    s = s.at(T0 + 2.5).with_members(member(n, 2) for n in ("n1", "n2"))
    s, _ = step(s.with_progress(progress(time=T0 + 2.4), 50), T0 + 2.5)
    assert s.plan.outcome == "completed" and s.plan.resumed_at == T0 + 2.4


def test_a_taken_over_checkpoint_ends_at_the_trainers_ack() -> None:
    s, _ = step(with_taint(job(), "n2", "karpenter.sh/disrupted"), T0)
    g = s.plan.generation
    s, _ = step(acked(s.at(LATER), g, 100, acked_at=T0 + 4), LATER)
    assert s.plan.phase == "rendezvous" and s.plan.acked_at == T0 + 4 and s.plan.reform_requested_at == LATER
    # A trainer clock behind the controller's is held to the request.
    s, _ = step(with_taint(job(), "n2", "karpenter.sh/disrupted"), T0)
    s, _ = step(acked(s.at(T0 + 3), g, 100, acked_at=T0 - 7), T0 + 3)
    assert s.plan.acked_at == T0
