"""Spare nodes on real etcd: a node waiting beyond max takes a lost node's position, and the
round says how many spares the job has against ``spare_nodes``."""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from regroup.demo.etcd_server import EtcdServer
from regroup.records import ReformRequest
from regroup.rendezvous import handler as handler_module
from tests.rendezvous.agents import wait_until
from tests.rendezvous.test_handler import KEYS, Agents, agents, put  # noqa: F401 - the fixture

__all__ = ["agents"]


class Recorder:
    """Stands in for the handler's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.events.append((level, event, fields))

    def named(self, event: str, round: int) -> list[dict[str, Any]]:
        return [fields for _, name, fields in self.events if name == event and fields.get("round") == round]


def test_a_spare_takes_the_lost_nodes_position_and_rounds_report_the_spares(
    agents: Agents, etcd: EtcdServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = Recorder()
    monkeypatch.setattr(handler_module, "log", log)
    first = {h.node: h for h in (agents.make(n, (2, 2), spare_nodes="1") for n in ("n0", "n1"))}
    infos = {node: f.result(20) for node, f in zip(first, agents.join(*first.values()))}
    lost = next(node for node, info in infos.items() if info.rank == 0)
    survivor = first[next(node for node in first if node != lost)]
    [below] = log.named("spares below wanted", round=1)
    assert (below["spares"], below["spares_wanted"], below["node"]) == (0, 1, lost)
    assert below["note"] == "the next loss of a node stalls the job below --nnodes min 2"

    # n2 waits beyond max: a spare, which makes no member re-form.
    spare = agents.make("n2", (2, 2), spare_nodes="1")
    spare_joined = agents.join(spare)[0]
    wait_until(lambda: "n2" in survivor.view.joins, 10, "the spare's join record")
    assert survivor.num_nodes_waiting() == 0 and first[lost].num_nodes_waiting() == 0

    # Rank 0's node is lost: the spare takes its position (rank 0: it closes the round and
    # hosts the workers' store), the survivor keeps its rank, at once at max.
    first[lost].shutdown()
    wait_until(lambda: survivor.num_nodes_waiting() > 0, 10, "the survivor to see the loss")
    rejoined = agents.join(survivor)[0].result(20)
    taken = spare_joined.result(20)
    assert (taken.rank, taken.world_size, rejoined.rank) == (0, 2, 1)
    assert taken.bootstrap_store_info.master_addr == "127.0.0.1"
    state = survivor.view.state
    assert state is not None and state.nodes == ["n2", survivor.node] and state.reason == "max 2 nodes joined"
    [complete] = [f for f in log.named("rendezvous complete", round=2) if f["node"] == "n2"]
    assert (complete["spares"], complete["spares_wanted"]) == (0, 1)
    assert [f["node"] for f in log.named("spares below wanted", round=2)] == ["n2"]

    # With a spare waiting, the next round has what it wants and warns no more; the spare
    # waits for every running member rather than take a survivor's position.
    extra = agents.make("n3", (2, 2), spare_nodes="1")
    extra_joined = agents.join(extra)[0]
    wait_until(lambda: "n3" in survivor.view.joins, 10, "the second spare's join record")
    put(etcd.endpoint, KEYS.reform, ReformRequest(generation=1, cause="manual").to_json())
    wait_until(lambda: survivor.num_nodes_waiting() and spare.num_nodes_waiting(), 10, "the re-form request")
    again = {f.result(20).rank: h.node for h, f in zip((spare, survivor), agents.join(spare, survivor))}
    assert again == {0: "n2", 1: survivor.node}
    assert [f["spares"] for f in log.named("rendezvous complete", round=3)] == [1, 1]
    assert not log.named("spares below wanted", round=3)

    survivor.set_closed()
    with pytest.raises(RendezvousClosedError):
        extra_joined.result(20)


def test_a_spare_waits_past_join_timeout_while_the_job_runs_then_takes_a_place(agents: Agents) -> None:
    """``join_timeout`` bounds forming a round, not a spare's wait: a spare of a running job
    waits for as long as the job runs (hours, on a quiet fleet), then takes a lost place."""
    first = [agents.make(n, (2, 2)) for n in ("n0", "n1")]
    infos = [f.result(20) for f in agents.join(*first)]
    # Its join_timeout still bounds the round it forms once a place is free, from the loss on:
    # 3 s leaves a busy machine the time to see the loss and rejoin the survivor.
    spare = agents.make("n2", (2, 2), join_timeout="3")
    waiting = agents.join(spare)[0]
    started = time.monotonic()
    wait_until(lambda: time.monotonic() - started > 6, 15, "two join timeouts of the spare")
    assert not waiting.done(), "the spare gave up waiting while the job ran"
    lost = next(h for h, info in zip(first, infos) if info.rank == 1)
    survivor = next(h for h in first if h is not lost)
    lost.shutdown()
    wait_until(lambda: survivor.num_nodes_waiting() > 0, 10, "the survivor to see the loss")
    rejoined = agents.join(survivor)[0].result(20)
    taken = waiting.result(20)
    assert (rejoined.rank, taken.rank, taken.world_size) == (0, 1, 2)
    survivor.set_closed()
