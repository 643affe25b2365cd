"""The handler contract torch defines (``set_closed``, ``is_closed``, ``shutdown``), where a
node that leaves alone does not end the job, and one node name per live agent."""

from __future__ import annotations

import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError

from regroup.demo.etcd_server import EtcdServer
from regroup.rendezvous.agent import DuplicateNode
from tests.rendezvous.agents import wait_until
from tests.rendezvous.test_handler import Agents, agents  # noqa: F401 - the fixture

__all__ = ["agents"]


def test_set_closed_before_any_round_closes_the_run_for_every_later_agent(agents: Agents) -> None:
    first = agents.make("n0", (1, 2))
    assert not first.is_closed()
    first.set_closed()
    first.set_closed()  # idempotent
    assert first.is_closed()
    # A pod restarted after the job ended is told so, and starts no round.
    late = agents.make("n1", (1, 2))
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()


def test_shutdown_of_a_member_closes_the_run_and_a_finished_node_is_not_a_lost_one(agents: Agents) -> None:
    a, b = agents.make("n0", (1, 2)), agents.make("n1", (1, 2))
    infos = [f.result(20) for f in agents.join(a, b)]
    # n0's workers finished first: its agent enters torchrun's exit barrier (nobody waits
    # there for long: the drift case) and shuts down. The run is over, so n1 keeps running
    # its workers instead of re-forming around a "lost" n0.
    infos[0].store.add("torchelastic/agent/terminal_state0", 1)
    assert a.shutdown() is True and a.shutdown() is True
    wait_until(b.is_closed, 10, "n1 to see the run closed")
    assert b.num_nodes_waiting() == 0
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_a_member_that_fails_leaves_alone_and_the_others_re_form(agents: Agents) -> None:
    a, b = agents.make("n0", (1, 2)), agents.make("n1", (1, 2))
    [f.result(20) for f in agents.join(a, b)]
    # n0's agent gives up (its workers past --max-restarts, or a store timeout): the job is
    # elastic, so the run stays open and n1 re-forms alone.
    assert a.shutdown() is True and not b.is_closed()
    wait_until(lambda: b.num_nodes_waiting() > 0, 10, "n1 to see n0 gone")
    assert agents.join(b)[0].result(20).world_size == 1


def test_a_joiner_that_gives_up_leaves_alone_and_the_job_runs_on(agents: Agents) -> None:
    a, b = agents.make("n0", (1, 2)), agents.make("n1", (1, 2))
    [f.result(20) for f in agents.join(a, b)]
    # The job is at max: n2 is a spare, and waits past its join_timeout while the job runs
    # (tests/rendezvous/test_spares.py), until it is told to stop.
    extra = agents.make("n2", (1, 2), join_timeout="0.5")
    waiting = agents.join(extra)[0]
    wait_until(lambda: "n2" in a.view.joins, 10, "n2's join record")
    now = time.time()
    extra.notice_leaving(now, now + 30, now, "the test says stop")
    with pytest.raises(RendezvousError):
        waiting.result(20)
    assert extra.shutdown() is True
    assert not a.is_closed() and not b.is_closed()


def test_shutdown_says_false_when_etcd_cannot_record_it(agents: Agents, etcd: EtcdServer) -> None:
    a = agents.make("n0", (1, 1), close_timeout="1")
    info = agents.join(a)[0].result(20)
    info.store.add("torchelastic/agent/terminal_state0", 1)  # its workers finished: close the run
    etcd.kill()
    started = time.monotonic()
    assert a.shutdown() is False
    assert time.monotonic() - started < 10


def test_a_second_live_agent_under_a_node_name_is_refused_naming_the_pod(agents: Agents) -> None:
    a = agents.make("n0", (1, 2))
    agents.join(a)[0].result(20)
    twin = agents.make("n0", (1, 2), pod="pod-twin")
    with pytest.raises(DuplicateNode, match=r"node name 'n0' is held by the live agent of pod pod-n0"):
        twin.next_rendezvous()
    assert twin.shutdown() is True and not a.is_closed(), "a refused agent does not close the job"
    # The same pod's next agent (its container restarted) takes the name over at once.
    again = agents.make("n0", (1, 2))
    assert agents.join(again)[0].result(20).world_size == 1
