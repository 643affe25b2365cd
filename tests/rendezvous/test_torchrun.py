"""Real torchrun agents on the etcd-v3 backend: forming, growing, losing a node, levers, etcd restart."""

from __future__ import annotations

import asyncio
import time

import pytest

from regroup.etcd import EtcdSettings, connect
from regroup.exit_codes import LEFT_JOB
from regroup.demo.etcd_server import EtcdServer
from regroup.keys import JobKeys
from regroup.records import ExpectedMembership, MemberRecord, ReformRequest
from tests.rendezvous.agents import TorchrunNodes, wait_until

pytestmark = pytest.mark.slow

KEYS = JobKeys("default", "job")


def rounds(nodes: TorchrunNodes, node: str) -> list[str]:
    """The rounds (by MASTER_ADDR:PORT) a node trained in, in order."""
    seen: list[str] = []
    for row in nodes.rows(node):
        if not seen or seen[-1] != row["master"]:
            seen.append(str(row["master"]))
    return seen


def put(etcd: EtcdServer, key: str, value: bytes) -> None:
    async def write() -> None:
        client = await connect(EtcdSettings.from_endpoint_string(etcd.endpoint))
        try:
            await client.put(key.encode(), value)
        finally:
            await client.close()

    asyncio.run(write())


def members(etcd: EtcdServer) -> dict[str, MemberRecord]:
    async def read() -> dict[str, MemberRecord]:
        client = await connect(EtcdSettings.from_endpoint_string(etcd.endpoint))
        try:
            found = await client.get_prefix(KEYS.members.encode())
            return {kv.key.decode().rsplit("/", 1)[1]: MemberRecord.from_json(kv.value) for kv in found}
        finally:
            await client.close()

    return asyncio.run(read())


def test_three_agents_form_one_round_with_distinct_ranks(nodes: TorchrunNodes, etcd: EtcdServer) -> None:
    for node in "abc":
        nodes.start(node, nnodes="3:3", nproc=2)
    def rows_at_6() -> list[dict[str, object]]:
        return [r for n in "abc" for r in nodes.rows(n) if r["world"] == 6]

    # Every worker's first row, not just one per node: the two workers of a node log apart.
    wait_until(lambda: len({r["rank"] for r in rows_at_6()}) == 6, 60, "all six ranks training at world size 6")
    rows = rows_at_6()
    assert {r["rank"] for r in rows} == set(range(6))
    assert len({r["master"] for r in rows}) == 1
    assert all(r["sum"] == 6.0 for r in rows)
    registered = members(etcd)
    assert sorted(registered) == ["a", "b", "c"]
    assert {m.round for m in registered.values()} == {1}
    assert {m.local_world_size for m in registered.values()} == {2}
    assert nodes.stop() == {"a": 0, "b": 0, "c": 0}


def test_a_node_joining_a_running_job_grows_it_and_training_goes_on(nodes: TorchrunNodes) -> None:
    nodes.start("a")
    nodes.start("b")
    wait_until(lambda: nodes.training_at(["a", "b"], world=2), 60, "a and b training at world size 2")
    first = rounds(nodes, "a")
    joined = time.time()
    nodes.start("c")
    wait_until(lambda: nodes.training_at(list("abc"), world=3, after=joined), 60, "a, b, c training at world 3")
    # The survivors kept training and re-formed once; a membership change is not a restart.
    assert rounds(nodes, "a")[: len(first)] == first
    assert all(r["restart"] == 0 for n in "abc" for r in nodes.rows(n))
    steps_b = len(nodes.rows("b"))
    wait_until(lambda: len(nodes.rows("b")) > steps_b + 5, 30, "b training on at world 3")
    assert nodes.stop() == {"a": 0, "b": 0, "c": 0}


def test_a_killed_agent_is_dropped_within_the_lease_ttl(nodes: TorchrunNodes, etcd: EtcdServer) -> None:
    for node in "abc":
        nodes.start(node, nnodes="2:3")
    wait_until(lambda: nodes.training_at(list("abc"), world=3), 60, "a, b, c training at world 3")
    first = members(etcd)["a"].round
    killed, killed_at = time.monotonic(), time.time()
    nodes.kill_node("c")

    def reformed() -> bool:
        now = members(etcd)
        return "c" not in now and all(now[n].round > first for n in "ab")

    # lease_ttl=2s, one monitor tick, then the survivors' new round (their workers' start-up aside).
    wait_until(reformed, 2 + 6, "a and b in a new round without c", interval=0.1)
    assert time.monotonic() - killed >= 1.0, "c's lease cannot have expired that soon"
    wait_until(lambda: nodes.training_at(["a", "b"], world=2, after=killed_at), 60, "a and b training at world 2")
    assert nodes.stop() == {"a": 0, "b": 0}


def test_expected_membership_drops_a_node_which_exits_75_and_may_come_back(
    nodes: TorchrunNodes, etcd: EtcdServer
) -> None:
    for node in "abc":
        nodes.start(node, nnodes="1:3")
    wait_until(lambda: nodes.training_at(list("abc"), world=3), 60, "a, b, c training at world 3")
    asked = time.time()
    put(etcd, KEYS.expected, ExpectedMembership(generation=1, nodes=["a", "b"], reason="reclaim c").to_json())
    put(etcd, KEYS.reform, ReformRequest(generation=1, cause="reclaim").to_json())
    # torch's agent cannot rejoin: it leaves a job that goes on, and never with 0 (which would
    # mark an Indexed Job's pod succeeded, its index gone for good).
    assert nodes.exit_code("c", timeout=30) == LEFT_JOB
    wait_until(lambda: nodes.training_at(["a", "b"], world=2, after=asked), 30, "a and b training at world 2")
    # Generation 1 is spent: a new agent on node c joins like any other node.
    back = time.time()
    nodes.start("c")
    wait_until(lambda: nodes.training_at(list("abc"), world=3, after=back), 60, "c back at world 3")
    assert nodes.stop() == {"a": 0, "b": 0, "c": 0}


def test_a_reform_request_restarts_every_agent_into_a_new_round(nodes: TorchrunNodes, etcd: EtcdServer) -> None:
    nodes.start("a", nnodes="2:2")
    nodes.start("b", nnodes="2:2")
    wait_until(lambda: nodes.training_at(["a", "b"], world=2), 60, "a and b training")
    before = rounds(nodes, "a")
    put(etcd, KEYS.reform, ReformRequest(generation=7, cause="manual").to_json())
    wait_until(
        lambda: len(rounds(nodes, "a")) > len(before) and len(rounds(nodes, "b")) > len(before), 30, "a new round"
    )
    assert rounds(nodes, "a")[-1] == rounds(nodes, "b")[-1]
    assert nodes.stop() == {"a": 0, "b": 0}


def test_training_rides_out_an_etcd_restart_and_can_re_form_after(nodes: TorchrunNodes, etcd: EtcdServer) -> None:
    nodes.start("a")
    nodes.start("b")
    wait_until(lambda: nodes.training_at(["a", "b"], world=2), 60, "a and b training")
    first = rounds(nodes, "a")
    etcd.restart()
    restarted = time.time()
    wait_until(lambda: nodes.training_at(["a", "b"], world=2, after=restarted + 1), 30, "training after the restart")
    assert rounds(nodes, "a") == first, "an etcd restart must not re-form the job"
    nodes.start("c")
    wait_until(lambda: nodes.training_at(list("abc"), world=3, after=restarted), 60, "a re-form after the restart")
    assert nodes.stop() == {"a": 0, "b": 0, "c": 0}
