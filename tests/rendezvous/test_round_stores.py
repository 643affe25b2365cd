"""Round stores do not pile up in etcd: the agent that closes a round deletes the stores of
the rounds before it in the same transaction (real etcd, the etcd-v3 handler)."""

from __future__ import annotations

from typing import Any

from regroup.demo.etcd_server import EtcdServer
from regroup.records import ReformRequest
from regroup.rendezvous.store import round_prefix
from tests.rendezvous.agents import wait_until
from tests.rendezvous.test_handler import KEYS, Agents, agents, etcd_call, put  # noqa: F401 - the fixture

__all__ = ["agents"]


def test_a_job_re_formed_a_dozen_times_holds_one_round_store(agents: Agents, etcd: EtcdServer) -> None:
    a, b = agents.make("n0", (2, 2)), agents.make("n1", (2, 2))
    infos = [f.result(20) for f in agents.join(a, b)]
    for generation in range(1, 12):  # past round 10: the stores' prefixes sort by number
        infos[0].store.set(f"written-in-round-{a.round}", "x")
        put(etcd.endpoint, KEYS.reform, ReformRequest(generation=generation, cause="manual").to_json())
        wait_until(lambda: a.num_nodes_waiting() and b.num_nodes_waiting(), 10, f"re-form {generation}")
        infos = [f.result(20) for f in agents.join(a, b)]
    assert a.round == b.round == 12

    async def stores(client: Any) -> list[str]:
        return [kv.key.decode() for kv in (await client.get_prefix(f"{KEYS.rdzv}rounds/".encode())).kvs]

    keys = etcd_call(etcd.endpoint, stores)
    assert keys and all(key.startswith(round_prefix(KEYS.rdzv, 12)) for key in keys), keys
