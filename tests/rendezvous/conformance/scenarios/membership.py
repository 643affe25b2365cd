"""Who gets a place in a round (``dynamic_rendezvous_test.py``): every node of a full round
joins with a rank of its own and one store; a node beyond max waits and makes no member
restart; ``num_nodes_waiting()`` counts a joiner; a lone node gives up after
``join_timeout``; each ``next_rendezvous()`` call moves on to the next round."""

from __future__ import annotations

import time
from concurrent.futures import wait

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousTimeoutError

from tests.rendezvous.agents import wait_until
from tests.rendezvous.conformance.checks import holds_for, raises
from tests.rendezvous.conformance.scenario_run import Run


def all_nodes_join(run: Run) -> None:
    a, b = run.handler((2, 2)), run.handler((2, 2))
    first, second = run.join(a, b)
    assert {first.rank, second.rank} == {0, 1}, (first.rank, second.rank)
    assert first.world_size == second.world_size == 2
    # Both got the round's one store.
    first.store.set("conformance/written-by", "first")
    assert second.store.get("conformance/written-by") == b"first"


def beyond_max_waits(run: Run) -> str:
    a, b = run.handler((2, 2)), run.handler((2, 2))
    run.join(a, b)
    extra = run.handler((2, 2), join_timeout="6")
    future = run.submit(extra.next_rendezvous)
    seen: set[tuple[int, int]] = set()

    def waiting_alone() -> bool:
        seen.add((a.num_nodes_waiting(), b.num_nodes_waiting()))
        return not future.done() and seen == {(0, 0)}

    # torch lets the extra node time out or wait on; either way it gets no place, and the
    # members are not made to restart for it.
    assert holds_for(waiting_alone, 2.0, interval=0.1), (
        f"a node beyond max: done {future.done()}, members' num_nodes_waiting {seen}"
    )
    run.call(a.set_closed, 10, "set_closed()")
    done, _ = wait([future], 10)
    assert done, "the node beyond max still waits after the run closed"
    exc = future.exception()
    assert isinstance(exc, RendezvousError), f"the node beyond max: {exc!r}"
    return f"then {type(exc).__name__}"


def num_nodes_waiting(run: Run) -> None:
    a, b = run.handler((2, 3)), run.handler((2, 3))
    run.join(a, b)
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    c = run.handler((2, 3))
    joiner = run.submit(c.next_rendezvous)
    wait_until(lambda: a.num_nodes_waiting() and b.num_nodes_waiting(), 10, "the members to see the joiner")
    counts = (a.num_nodes_waiting(), b.num_nodes_waiting())
    assert counts == (1, 1), f"num_nodes_waiting {counts}, one node waits"
    infos = [*run.join(a, b), joiner.result(20)]
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}


def join_timeout(run: Run) -> str:
    a = run.handler((2, 2), join_timeout="1")
    started = time.monotonic()
    exc = raises(run, a.next_rendezvous, 20, "next_rendezvous() with no peer")
    seconds = time.monotonic() - started
    assert isinstance(exc, RendezvousTimeoutError), f"raised {exc!r}"
    assert 0.9 <= seconds < 1 + 5, f"gave up after {seconds:.1f}s (join_timeout 1s)"
    return f"after {seconds:.1f}s"


def next_round_each_call(run: Run) -> None:
    a = run.handler((1, 1))
    previous = None
    for n in range(3):
        info = run.call(a.next_rendezvous, 15, f"next_rendezvous() #{n + 1}")
        assert (info.rank, info.world_size) == (0, 1)
        if previous is not None:
            assert not info.store.check([previous]), "the next round's store still holds the last round's key"
        previous = f"conformance/round-{n}"
        info.store.set(previous, "x")
