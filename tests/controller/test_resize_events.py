"""Every completed re-form is told: a Normal ``Resized`` Event on each of the job's pods
(``regroup status`` shows the same line for the last one: tests/controller/test_resilience.py)."""

from __future__ import annotations


import pytest

from regroup.controller.reform_summary import resize_message
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import PostPodEvents
from regroup.records import Progress, ReformPlan

from .builders import JOB, T0, applied, decide, job, member

S = ControllerSettings()


def _plan(cause: str, before: list[str], after: list[str], lost: int = 0, seconds: float = 1.23, **kw) -> ReformPlan:
    return ReformPlan(
        generation=3, cause=cause, planned=True, phase="done", reason="", nodes_before=before, nodes_after=after,
        trace_id="0" * 32, detected_at=T0, decided_at=T0, resumed_at=T0 + seconds, finished_at=T0 + seconds + 1,
        lost_steps=lost, outcome="completed", **kw,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (_plan("reclaim", ["n1", "n2", "n3", "n4"], ["n1", "n2", "n4"]), "4 → 3 nodes: reclaim of n3, 0 steps lost, 1.2 s"),
        (_plan("node-lost", ["n1", "n2", "n3"], ["n1", "n2"], lost=1), "3 → 2 nodes: loss of n3, 1 step lost, 1.2 s"),
        (_plan("grow", ["n1", "n2"], ["n1", "n2", "n3", "n4"], seconds=12.0),
         "2 → 4 nodes: grow with n3, n4, 0 steps lost, 12.0 s"),
        (_plan("restart-storm", ["n1", "n2", "n3"], ["n1", "n3", "n5"], lost=7),
         "3 → 3 nodes: restart storm on n2 (n5 joined), 7 steps lost, 1.2 s"),
        (_plan("manual", ["n1", "n2", "n3"], ["n1", "n2"], lost=-1), "3 → 2 nodes: manual: n3 left, steps lost unknown, 1.2 s"),
        (_plan("reclaim", ["n1", "n2", "n3"], ["n1", "n3"], lost=4, fallback="no checkpoint ack by the deadline"),
         "3 → 2 nodes: reclaim of n2, 4 steps lost, 1.2 s, unplanned: no checkpoint ack by the deadline"),
    ],
    ids=["reclaim", "node-lost", "grow", "restart-storm", "manual", "fallback"],
)
def test_the_resize_message_says_sizes_cause_nodes_lost_steps_and_duration(plan: ReformPlan, message: str) -> None:
    assert resize_message(plan) == message


def test_a_completed_reform_posts_resized_on_every_pod_and_only_then() -> None:
    s = job(step=230).without_member("n3")
    d = decide(s, T0, S)
    assert not [a for a in d.actions if isinstance(a, PostPodEvents) and a.reason == "Resized"]
    s = applied(s, d.actions, T0)
    s = s.with_members(member(n, 2) for n in ("n1", "n2"))
    s = applied(s, decide(s, T0 + 1, S).actions, T0 + 1)
    assert s.plan.phase == "resume"
    s = s.at(T0 + 2.5).with_progress(
        Progress(step=229, loss=1.0, samples_seen=0, world_size=4, time=T0 + 2.5, resumed_from_step=228, last_step=230), 50
    )
    d = decide(s, T0 + 2.5, S)
    [events] = [a for a in d.actions if isinstance(a, PostPodEvents) and a.reason == "Resized"]
    assert {pod.name for pod in events.pods} == {f"{JOB}-{n}" for n in ("n1", "n2", "n3")}
    assert (events.type_, events.message) == ("Normal", "3 → 2 nodes: loss of n3, 2 steps lost, 2.5 s")

