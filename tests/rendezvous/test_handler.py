"""The etcd-v3 handler driven directly (several agents as threads of this process), on real etcd."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from regroup.etcd import EtcdSettings, EtcdUnavailable, connect, enable_auth
from regroup.demo.etcd_server import EtcdServer, make_tls_files
from regroup.keys import JobKeys
from regroup.ports import free_port
from regroup.records import ControllerPresence, Exclusions, ExpectedMembership, MemberRecord, ReformRequest
from regroup.rendezvous.handler import EtcdV3RendezvousHandler
from regroup.rendezvous.joining import ExcludedFromRound, ExcludedTooLong, JoinStopped
from regroup.rendezvous.settings import parse_settings
from tests.rendezvous.agents import wait_until

KEYS = JobKeys("default", "job")
FAST = {"lease_ttl": "2", "last_call_timeout": "0.3", "join_timeout": "20"}


class Agents:
    """Handlers posing as nodes ``n0``, ``n1``, ... of job ``job``; all shut down after the test."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.handlers: list[EtcdV3RendezvousHandler] = []
        self.pool = ThreadPoolExecutor(max_workers=8)

    def make(self, node: str, nnodes: tuple[int, int] = (1, 3), pod: str = "", **conf: str) -> EtcdV3RendezvousHandler:
        settings = parse_settings(
            endpoint=self.endpoint,
            run_id="job",
            min_nodes=nnodes[0],
            max_nodes=nnodes[1],
            conf={**FAST, **conf},
            env={"NODE_NAME": node, "POD_NAME": pod or f"pod-{node}"},
            local_addr="127.0.0.1",
        )
        handler = EtcdV3RendezvousHandler(settings)
        self.handlers.append(handler)
        return handler

    def join(self, *handlers: EtcdV3RendezvousHandler) -> list[Future[Any]]:
        return [self.pool.submit(h.next_rendezvous) for h in handlers]

    def close(self) -> None:
        for handler in self.handlers:
            handler.shutdown()
        self.pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def agents(etcd: EtcdServer) -> Iterator[Agents]:
    group = Agents(etcd.endpoint)
    try:
        yield group
    finally:
        group.close()


def etcd_call(endpoint: str, action: Callable[[Any], Any], **settings: Any) -> Any:
    async def run() -> Any:
        # Right after an etcd restart, gRPC may still back off from the refused connections the
        # agents' channels met while it was down (subchannels are shared within a process):
        # connect again until etcd answers, as the agents do, within a bound.
        deadline = time.monotonic() + 20
        while True:
            try:
                client = await connect(EtcdSettings.from_endpoint_string(endpoint, **settings))
                break
            except EtcdUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        try:
            return await action(client)
        finally:
            await client.close()

    return asyncio.run(run())


def put(endpoint: str, key: str, value: bytes) -> None:
    etcd_call(endpoint, lambda c: c.put(key.encode(), value))


def test_the_entry_point_registers_the_etcd_v3_backend(etcd: EtcdServer) -> None:
    params = RendezvousParameters(
        backend="etcd-v3", endpoint=etcd.endpoint, run_id="job", min_nodes=1, max_nodes=2, lease_ttl="3"
    )
    handler = get_rendezvous_handler(params)
    try:
        assert isinstance(handler, EtcdV3RendezvousHandler)
        assert handler.get_backend() == "etcd-v3"
        assert handler.get_run_id() == "job"
        assert handler.settings.lease_ttl.total_seconds() == 3
    finally:
        handler.shutdown()


def test_agents_get_distinct_ranks_and_a_fresh_store_each_round(agents: Agents, etcd: EtcdServer) -> None:
    a, b = agents.make("n0", (2, 2)), agents.make("n1", (2, 2))
    first = [f.result(20) for f in agents.join(a, b)]
    assert sorted(i.rank for i in first) == [0, 1] and {i.world_size for i in first} == {2}
    first[0].store.set("stale-gloo-address", "dead")
    put(etcd.endpoint, KEYS.reform, ReformRequest(generation=1, cause="manual").to_json())
    wait_until(lambda: a.num_nodes_waiting() and b.num_nodes_waiting(), 10, "the re-form request")
    second = [f.result(20) for f in agents.join(a, b)]
    # Same ranks (previous members keep their order), a new store without the old keys.
    assert [i.rank for i in second] == [i.rank for i in first]
    assert second[0].bootstrap_store_info.master_port != first[0].bootstrap_store_info.master_port
    assert not second[0].store.check(["stale-gloo-address"])
    assert a.round == b.round == 2
    assert a.num_nodes_waiting() == 0


def test_expected_membership_closes_at_once_and_leaves_a_node_never_in_a_round_waiting(
    agents: Agents, etcd: EtcdServer
) -> None:
    # A last call of 60 s would stall the round if the expected membership did not close it.
    handlers = [agents.make(f"n{i}", (1, 4), last_call_timeout="60") for i in range(3)]
    futures = agents.join(*handlers)
    wait_until(lambda: len(handlers[0].view.joins) == 3, 10, "three join records")
    started = time.monotonic()
    put(etcd.endpoint, KEYS.expected, ExpectedMembership(generation=5, nodes=["n2", "n0"]).to_json())
    infos = {h.node: f.result(20) for h, f in zip(handlers[::2], futures[::2])}
    assert time.monotonic() - started < 10
    assert {n: (i.rank, i.world_size) for n, i in infos.items()} == {"n2": (0, 2), "n0": (1, 2)}
    # n1 was never in a round: left out, it is not sent away (a spare of a job at its max
    # keeps its workers warm) but asks for the next round, and with no controller and the
    # job below its max the running agents take it in.
    state = handlers[0].view.state
    assert state is not None and state.excluded == [] and not futures[1].done()
    wait_until(lambda: handlers[0].num_nodes_waiting() > 0, 10, "the running agents to see n1 waiting")
    grown = [f.result(20) for f in [futures[1], *agents.join(handlers[2], handlers[0])]]
    assert [(i.rank, i.world_size) for i in grown] == [(2, 3), (0, 3), (1, 3)]


def test_with_a_controller_present_joiners_wait_for_it(agents: Agents, etcd: EtcdServer) -> None:
    a, b = agents.make("n0", (1, 3)), agents.make("n1", (1, 3))
    [f.result(20) for f in agents.join(a, b)]

    async def be_controller(client: Any) -> None:
        lease = await client.lease(30)
        await client.put(KEYS.controller.encode(), ControllerPresence("ctl", time.time()).to_json(), lease=lease)

    etcd_call(etcd.endpoint, be_controller)
    wait_until(lambda: a.view.controller, 10, "the controller key")
    c = agents.make("n2", (1, 3))
    joiner = agents.join(c)[0]
    wait_until(lambda: "n2" in a.view.joins, 10, "n2's join record")
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    put(etcd.endpoint, KEYS.expected, ExpectedMembership(generation=1, nodes=["n0", "n1", "n2"]).to_json())
    put(etcd.endpoint, KEYS.reform, ReformRequest(generation=1, cause="grow").to_json())
    wait_until(lambda: a.num_nodes_waiting() and b.num_nodes_waiting(), 10, "the re-form request")
    infos = [f.result(20) for f in [joiner, *agents.join(a, b)]]
    assert {i.world_size for i in infos} == {3}


def test_an_agent_on_an_excluded_node_waits_joins_once_lifted_and_exits_non_zero_if_never(
    agents: Agents, etcd: EtcdServer
) -> None:
    why = "taint aws-node-termination-handler/spot-itn (AWS node-termination-handler)"
    put(etcd.endpoint, KEYS.excluded, Exclusions(nodes={"n1": why}).to_json())
    a, b = agents.make("n0", (1, 2)), agents.make("n1", (1, 2), excluded_timeout="60")
    [first] = agents.join(a)
    waiting = agents.join(b)[0]
    assert first.result(20).world_size == 1, "the excluded node does not hold the round up"
    wait_until(lambda: "excluded from the job" in b.waiting_for, 10, "n1 to wait as excluded")
    assert why in b.waiting_for and not waiting.done() and a.num_nodes_waiting() == 0
    # The taint lifted: the controller empties the record, and n1 joins the next round.
    put(etcd.endpoint, KEYS.excluded, Exclusions(nodes={}).to_json())
    wait_until(lambda: a.num_nodes_waiting(), 10, "n0 to see n1 waiting to join")
    infos = [f.result(20) for f in [waiting, *agents.join(a)]]
    assert {i.world_size for i in infos} == {2}
    # Never lifted: the agent gives up after excluded_timeout with an error naming why.
    put(etcd.endpoint, KEYS.excluded, Exclusions(nodes={"n2": "spec.unschedulable (cordoned)"}).to_json())
    c = agents.make("n2", (1, 2), excluded_timeout="0.5")
    with pytest.raises(RendezvousError, match=r"n2 is excluded from the job: spec.unschedulable .* excluded_timeout"):
        c.next_rendezvous()


def test_an_agent_left_out_starts_over_as_a_new_joiner_and_gives_up_only_after_excluded_timeout(
    agents: Agents, etcd: EtcdServer
) -> None:
    put(etcd.endpoint, KEYS.controller, ControllerPresence("test", time.time()).to_json())
    a = agents.make("n0", (1, 3), last_call_timeout="60")
    b = agents.make("n1", (1, 3), last_call_timeout="60")
    c = agents.make("n2", (1, 3), last_call_timeout="60", excluded_timeout="1")
    put(etcd.endpoint, KEYS.expected, ExpectedMembership(generation=1, nodes=["n0", "n1", "n2"]).to_json())
    assert {f.result(20).world_size for f in agents.join(a, b, c)} == {3}
    # The controller leaves n1 and n2 out: each of them is told so, and stays.
    put(etcd.endpoint, KEYS.expected, ExpectedMembership(generation=2, nodes=["n0"]).to_json())
    put(etcd.endpoint, KEYS.reform, ReformRequest(generation=2, cause="reclaim").to_json())
    wait_until(lambda: a.num_nodes_waiting(), 10, "the re-form request")
    survivor, *left = agents.join(a, b, c)
    assert survivor.result(20).world_size == 1
    old = {h.node: a.view.members[h.node].joined_at for h in (b, c)}
    started = time.monotonic()
    for handler, future in zip((b, c), left):
        with pytest.raises(ExcludedFromRound):
            future.result(20)
        assert handler.in_round(), "its workers still hold ranks of the round before: theirs to hand over"
        handler.start_over("left out", warming=handler is b)  # n1 restarts standby workers first
        assert not handler.in_round()
    # Each is a new agent of its node now (the round never admits the one it left out), in no round.
    wait_until(lambda: all(a.view.members[n].joined_at > old[n] for n in old), 10, "n1 and n2 as new agents")
    assert {a.view.members[n].round for n in old} == {0}
    # n1 says it is warming up, and asks not to be counted until it joins; n2 is a joiner now.
    warming, joiner = a.view.members["n1"], a.view.members["n2"]
    assert warming.warming_since > 0 and warming.not_before > time.time() + 600
    assert joiner.warming_since == joiner.not_before == 0
    back, given_up = agents.join(b, c)
    # Joining is being warm (its workers are up): the record says so at once.
    wait_until(lambda: a.view.members["n1"].warming_since == a.view.members["n1"].not_before == 0, 10,
               "n1 warm")
    # n2 is not let back in within its excluded_timeout: it gives up, naming why.
    gives_up = r"left out; out of the job for excluded_timeout 1s, leaving it \(exit 75\)"
    with pytest.raises(ExcludedTooLong, match=gives_up):
        given_up.result(20)
    assert time.monotonic() - started >= 1.0, "excluded_timeout counts from being left out"
    # n1 waits to be let back in (a joiner does not make the running agent re-form while a
    # controller leads), and is: the next expected membership names it.
    assert not back.done() and a.num_nodes_waiting() == 0
    put(etcd.endpoint, KEYS.expected, ExpectedMembership(generation=3, nodes=["n0", "n1"]).to_json())
    put(etcd.endpoint, KEYS.reform, ReformRequest(generation=3, cause="grow").to_json())
    wait_until(lambda: a.num_nodes_waiting(), 10, "the re-form request")
    assert {f.result(20).world_size for f in [back, *agents.join(a)]} == {2}
    assert b.round == a.round
    c.shutdown()
    assert not a.is_closed(), "an agent that gives up leaves the job alone"


def test_an_agent_told_to_stop_says_so_in_its_member_record_and_stops_waiting_for_a_round(
    agents: Agents, etcd: EtcdServer
) -> None:
    put(etcd.endpoint, KEYS.controller, ControllerPresence("test", time.time()).to_json())
    a, b = agents.make("n0", (1, 3), last_call_timeout="0.3"), agents.make("n1", (1, 3))
    assert a.next_rendezvous().world_size == 1
    assert a.in_round()
    # n1 joins the running job and waits for the controller to let it in.
    joining = agents.join(b)[0]
    wait_until(lambda: "n1" in a.view.joins, 10, "n1's join record")
    assert not b.in_round()
    now = time.time()
    b.notice_leaving(now, now + 30, now + 0.5, "the test says stop")
    with pytest.raises(JoinStopped, match="the test says stop"):
        joining.result(10)
    assert time.time() - now >= 0.5
    member = a.view.members["n1"]
    assert (member.leaving_since, member.leaving_by) == (now, now + 30)
    b.shutdown()
    assert not a.is_closed(), "an agent told to stop leaves the job alone"
    # A member told to stop later says so too, and keeps its round meanwhile.
    a.notice_leaving(now, now + 30, now + 27, "the test says stop")
    wait_until(lambda: a.view.members["n0"].leaving_by == now + 30, 10, "n0's member record to say it leaves")
    assert a.num_nodes_waiting() == 0 and a.in_round()


def test_a_lost_member_is_seen_and_its_agent_re_registers(agents: Agents, etcd: EtcdServer) -> None:
    a, b = agents.make("n0", (1, 2)), agents.make("n1", (1, 2))
    [f.result(20) for f in agents.join(a, b)]

    async def revoke_n1(client: Any) -> int:
        found = await client.get(KEYS.member("n1").encode())
        await client.revoke_lease(found.lease)
        return int(found.lease)

    old_lease = etcd_call(etcd.endpoint, revoke_n1)
    wait_until(lambda: a.num_nodes_waiting() > 0, 5, "n0 to notice n1's member key is gone")

    def n1_lease() -> int:
        found = etcd_call(etcd.endpoint, lambda c: c.get(KEYS.member("n1").encode()))
        return int(found.lease) if found is not None else 0

    wait_until(lambda: n1_lease() not in (0, old_lease), 10, "n1 to re-register under a new lease")
    infos = [f.result(20) for f in agents.join(a, b)]
    assert {i.world_size for i in infos} == {2}


def test_restart_count_counts_only_rounds_re_entered_after_worker_failures(agents: Agents, etcd: EtcdServer) -> None:
    a = agents.make("n0", (1, 1))
    a.next_rendezvous()
    a.next_rendezvous()  # torchrun re-enters without a membership change: its workers failed
    assert a.restart_count == 1
    put(etcd.endpoint, KEYS.reform, ReformRequest(generation=1, cause="manual").to_json())
    wait_until(lambda: a.num_nodes_waiting() > 0, 10, "the re-form request")
    a.next_rendezvous()
    assert a.restart_count == 1
    record = etcd_call(etcd.endpoint, lambda c: c.get(KEYS.member("n0").encode()))
    member = MemberRecord.from_json(record.value)
    assert (member.round, member.restart_count, member.pod, member.namespace) == (3, 1, "pod-n0", "default")


def test_a_failed_round_is_charged_only_to_the_node_whose_workers_failed_of_their_own(agents: Agents) -> None:
    # n0's rank crashed; n1's rank then failed in the collective and said so (regroup.failures).
    a, b = agents.make("n0", (2, 2)), agents.make("n1", (2, 2))
    [f.result(20) for f in agents.join(a, b)]
    Path(b._failures, "0").write_text("peer")
    [f.result(20) for f in agents.join(a, b)]
    assert (a.restart_count, b.restart_count) == (1, 0)
    # The reports are consumed: n1's next failure, with nothing reported, is its own.
    [f.result(20) for f in agents.join(a, b)]
    assert (a.restart_count, b.restart_count) == (2, 1)


def test_the_same_job_with_other_bounds_is_refused_naming_both(agents: Agents) -> None:
    agents.make("n0", (1, 2)).next_rendezvous()
    other = agents.make("n1", (2, 4))
    with pytest.raises(RendezvousError, match=r"--nnodes=1:2.*--nnodes=2:4"):
        other.next_rendezvous()


def test_an_unreachable_etcd_is_named_after_join_timeout(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    settings = parse_settings(
        endpoint=endpoint, run_id="job", min_nodes=1, max_nodes=1, conf={"join_timeout": "1.5"}, env={}
    )
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match=endpoint):
        EtcdV3RendezvousHandler(settings)
    assert 1.0 < time.monotonic() - started < 10


def test_tls_works_and_a_mismatch_gets_a_clear_error(tmp_path: Path, etcd: EtcdServer) -> None:
    tls = make_tls_files(tmp_path / "tls")
    conf = {**FAST, "cacert": str(tls.ca), "cert": str(tls.client_cert), "key": str(tls.client_key)}
    to_plain = parse_settings(endpoint=etcd.endpoint, run_id="job", min_nodes=1, max_nodes=1, conf=conf, env={})
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="TLS handshake"):
        EtcdV3RendezvousHandler(to_plain)
    assert time.monotonic() - started < 5, "a TLS mismatch must fail at once, not retry"
    with EtcdServer(data_dir=tmp_path / "tls-etcd", tls=tls) as server:
        settings = parse_settings(
            endpoint=server.endpoint,
            run_id="job",
            min_nodes=1,
            max_nodes=1,
            conf=conf,
            env={"NODE_NAME": "n0"},
            local_addr="127.0.0.1",
        )
        handler = EtcdV3RendezvousHandler(settings)
        try:
            assert handler.next_rendezvous().world_size == 1
        finally:
            handler.shutdown()
        plain = parse_settings(
            endpoint=server.endpoint, run_id="job", min_nodes=1, max_nodes=1, conf={"join_timeout": "1"}, env={}
        )
        with pytest.raises(RendezvousConnectionError, match=f"{server.endpoint}.*cacert"):
            EtcdV3RendezvousHandler(plain)


def test_auth_accepts_the_right_password_and_names_the_user_on_a_wrong_one(etcd: EtcdServer) -> None:
    etcd_call(etcd.endpoint, lambda c: enable_auth(c, "root-secret", {"trainer": "s3cret"}))
    good = parse_settings(
        endpoint=etcd.endpoint, run_id="job", min_nodes=1, max_nodes=1,
        conf={**FAST, "user": "trainer", "password": "s3cret"}, env={"NODE_NAME": "n0"}, local_addr="127.0.0.1",
    )  # fmt: skip
    handler = EtcdV3RendezvousHandler(good)
    try:
        assert handler.next_rendezvous().world_size == 1
    finally:
        handler.shutdown()
    bad = parse_settings(
        endpoint=etcd.endpoint, run_id="job", min_nodes=1, max_nodes=1,
        conf={"user": "trainer", "password": "wrong"}, env={},
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="trainer"):
        EtcdV3RendezvousHandler(bad)
    assert time.monotonic() - started < 5, "bad credentials must fail at once, not retry"


def test_after_an_etcd_restart_the_watch_resumes_and_leases_survive(agents: Agents, etcd: EtcdServer) -> None:
    a, b = agents.make("n0", (2, 2)), agents.make("n1", (2, 2))
    [f.result(20) for f in agents.join(a, b)]
    leases = etcd_call(etcd.endpoint, lambda c: c.get_prefix(KEYS.members.encode()))
    before = {kv.key: kv.lease for kv in leases}
    etcd.restart()
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    # The re-form request is only seen if each agent's watch came back after the restart.
    put(etcd.endpoint, KEYS.reform, ReformRequest(generation=1, cause="manual").to_json())
    wait_until(lambda: a.num_nodes_waiting() and b.num_nodes_waiting(), 15, "both watches to resume")
    infos = [f.result(20) for f in agents.join(a, b)]
    assert {i.world_size for i in infos} == {2} and a.round == 2
    after = etcd_call(etcd.endpoint, lambda c: c.get_prefix(KEYS.members.encode()))
    assert {kv.key: kv.lease for kv in after} == before, "the agents' leases outlived the restart"


def test_an_agents_rendezvous_span_joins_the_trace_of_the_reform_request(etcd: EtcdServer) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = parse_settings(
        endpoint=etcd.endpoint, run_id="job", min_nodes=1, max_nodes=1, conf=FAST, env={"NODE_NAME": "n0"}
    )
    handler = EtcdV3RendezvousHandler(settings, tracer_provider=provider)
    try:
        handler.next_rendezvous()
        traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        put(etcd.endpoint, KEYS.reform, ReformRequest(generation=1, cause="grow", traceparent=traceparent).to_json())
        wait_until(lambda: handler.num_nodes_waiting() > 0, 10, "the re-form request")
        handler.next_rendezvous()
    finally:
        handler.shutdown()
    first, second = exporter.get_finished_spans()
    assert first.name == second.name == "regroup.rendezvous.join"
    assert first.parent is None
    assert f"{second.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert second.attributes["regroup.round"] == 2 and second.attributes["regroup.node_count"] == 1
