"""A job's start: its agents register one by one before the first round forms, so the
first of them is alone for a while. That is no stall (no ``JobStalled`` Event) unless the
nodes are still too few once the rendezvous' time to gather has passed; after a round has
formed, fewer than min nodes is a stall at once."""

from __future__ import annotations

from regroup.controller.cluster import NodeInfo
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import PostEvent, WritePlan, WriteStatus

from .builders import T0, annotations, decide, job, member, of, pod

S = ControllerSettings()
GATHER = S.reform.rendezvous_timeout.total_seconds()


def test_the_first_agent_to_register_is_no_stall() -> None:
    notes = annotations(2, 4)
    # node-1's agent registered, waiting for the first round; the others are still starting.
    s = job(("n1",), notes=notes, round_=0, step=None)
    for node in ("n2", "n3", "n4"):
        s = s.with_node(NodeInfo(node)).with_pod(pod(node, notes))
    for now in (T0, T0 + 1, T0 + GATHER - 1):
        d = decide(s, now, S)
        assert not of(d.actions, PostEvent) and not d.alerts.stalled, d.reason
        [status] = of(d.actions, WriteStatus)
        assert status.status.state != "stalled" and d.reason == "starting: 1 of min 2 nodes registered for the first round"
        assert d.requeue_after is not None and d.requeue_after.total_seconds() <= T0 + GATHER - now
    # The others register: the job starts, and was never stalled.
    for i, node in enumerate(("n2", "n3", "n4")):
        s = s.with_member(member(node, 0), at=T0 + 2 + i)
    d = decide(s, T0 + 6, S)
    assert not of(d.actions, PostEvent) and not d.alerts.stalled and not of(d.actions, WritePlan)


def test_a_first_round_that_never_gathers_min_nodes_stalls_loudly() -> None:
    s = job(("n1",), notes=annotations(2, 4), round_=0, step=None)
    d = decide(s, T0 + GATHER + 1, S)
    assert d.alerts.stalled and [e.reason for e in of(d.actions, PostEvent)] == ["JobStalled"]
    assert "after the first registered" in d.reason


def test_below_min_after_the_first_round_formed_stalls_at_once() -> None:
    # The job trained in round 1 and is down to one node of min 2: a stall, no grace.
    s = job(("n1",), notes=annotations(2, 4), round_=1)
    d = decide(s, T0, S)
    assert d.alerts.stalled and [e.reason for e in of(d.actions, PostEvent)] == ["JobStalled"]
