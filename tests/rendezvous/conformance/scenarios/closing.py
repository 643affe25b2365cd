"""Closing a run (``dynamic_rendezvous_test.py``): ``set_closed()`` and ``shutdown()``,
idempotent and seen by every node; a closed run refuses members and newcomers."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from tests.rendezvous.agents import wait_until
from tests.rendezvous.conformance.checks import raises
from tests.rendezvous.conformance.scenario_run import Run


def set_closed(run: Run) -> None:
    a = run.handler((1, 2))
    assert not a.is_closed()
    run.call(a.set_closed, 10, "set_closed()")
    run.call(a.set_closed, 10, "set_closed() again")
    assert a.is_closed()
    b = run.handler((1, 2))
    wait_until(b.is_closed, 10, "another node to see the run closed")


def closed_raises(run: Run) -> None:
    a, b = run.handler((2, 2)), run.handler((2, 2))
    run.join(a, b)
    run.call(a.set_closed, 10, "set_closed()")
    exc = raises(run, b.next_rendezvous, 10, "a member's next_rendezvous() on a closed run")
    assert isinstance(exc, RendezvousClosedError), f"member: {exc!r}"
    late = run.handler((2, 2))
    exc = raises(run, late.next_rendezvous, 10, "a newcomer's next_rendezvous() on a closed run")
    assert isinstance(exc, RendezvousClosedError), f"newcomer: {exc!r}"


def shutdown_closes(run: Run) -> None:
    a, b = run.handler((2, 2)), run.handler((2, 2))
    run.join(a, b)
    assert run.call(a.shutdown, 15, "shutdown()") is True
    assert run.call(a.shutdown, 15, "shutdown() again") is True
    wait_until(b.is_closed, 10, "the other member to see the run closed")
    assert b.num_nodes_waiting() == 0
