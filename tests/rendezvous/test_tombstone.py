"""A finished job whose keys the controller removed leaves a tombstone beside them: an agent
that starts under the job meets a closed rendezvous and writes nothing (real etcd, the
etcd-v3 handler, no controller)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from regroup.demo.etcd_server import EtcdServer
from regroup.records import FinishedJob, RoundState
from regroup.rendezvous.decisions import Bounds, JobView, Me, plan_join
from regroup.rendezvous.join_steps import Closed
from regroup.rendezvous.settings import SettingsError, parse_settings
from tests.rendezvous.test_handler import KEYS, Agents, agents, etcd_call, put  # noqa: F401 - the fixture

__all__ = ["agents"]

TOMBSTONE = FinishedJob(finished_at=1.0, removed_at=2.0)


def test_a_tombstone_closes_the_run_before_anything_is_written() -> None:
    me = Me("a", "a@1.0", "127.0.0.1")
    bounds = Bounds(1, 2, 0.0)
    assert not JobView().closed
    assert plan_join(JobView(finished=TOMBSTONE), me, None, 0, bounds) == Closed()
    # Whatever keys an older agent wrote since, the tombstone decides.
    open_round = RoundState(min_nodes=1, max_nodes=2, round=3, nodes=["a"], agents=["a@1.0"])
    assert plan_join(JobView(state=open_round, finished=TOMBSTONE), me, 3, 0, bounds) == Closed()
    assert JobView(finished=TOMBSTONE).closed


def test_an_agent_of_a_removed_job_meets_a_closed_run_and_leaves_no_key(agents: Agents, etcd: EtcdServer) -> None:
    put(etcd.endpoint, KEYS.tombstone, TOMBSTONE.to_json())
    late = agents.make("n0", (1, 2))
    assert late.is_closed()
    with pytest.raises(RendezvousClosedError):
        late.next_rendezvous()
    late.set_closed()  # already closed: nothing to write
    assert late.shutdown()  # no round ever formed, yet the run is not closed again under the job

    async def job_keys(client) -> list[bytes]:
        return [kv.key for kv in (await client.get_prefix(KEYS.root.encode())).kvs]

    assert etcd_call(etcd.endpoint, job_keys) == []


def test_the_tombstone_going_lets_a_new_run_start_afresh(agents: Agents, etcd: EtcdServer) -> None:
    put(etcd.endpoint, KEYS.tombstone, TOMBSTONE.to_json())
    etcd_call(etcd.endpoint, lambda c: c.delete(KEYS.tombstone.encode()))
    first = agents.make("n0", (1, 1))
    assert not first.is_closed()
    assert agents.join(first)[0].result(20).world_size == 1


def test_a_key_prefix_that_would_hold_the_tombstones_is_refused_naming_it() -> None:
    with pytest.raises(SettingsError, match="key_prefix"):
        parse_settings(endpoint="127.0.0.1:2379", run_id="job", min_nodes=1, max_nodes=1,
                       conf={"key_prefix": "/regroup/finished"}, env={"NODE_NAME": "n0"})

