"""``--etcd-job-identities``: the controller gives each job its own etcd identity as soon as it
sees the job and removes it once nothing of the job is left (real etcd 3.4 with TLS and
client-certificate auth, the Kubernetes API stand-in, a real etcd-v3 agent as the job's)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from regroup.controller.identities import FAILED, plan_identities
from regroup.controller.settings import CleanupSettings, ControllerSettings
from regroup.etcd.auth import Access, Grant, ensure_role, ensure_user, job_identities, job_user
from regroup.keys import JobKeys
from regroup.records import FinishedJob, JobStatus
from regroup.rendezvous.handler import EtcdV3RendezvousHandler
from regroup.rendezvous.settings import parse_settings
from tests.etcd_helpers import AuthEtcd, auth_etcd
from tests.scratch import scratch

from .harness import NS, Cluster, controller, fast_settings, notes

JOB = "tenant"
KEYS = JobKeys(NS, JOB)


@pytest.fixture(scope="module")
def auth(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthEtcd]:
    with scratch(request, tmp_path_factory, "auth-etcd") as root, auth_etcd(root) as server:
        yield server


def settings(retention: float = 1.0) -> ControllerSettings:
    base = fast_settings()
    return dataclasses.replace(
        base, cleanup=CleanupSettings(retention=timedelta(seconds=retention)),
        runtime=dataclasses.replace(base.runtime, etcd_job_identities=True, etcd_identity_grace=timedelta(seconds=0.3)),
    )  # fmt: skip


def agent(auth: AuthEtcd, node: str) -> EtcdV3RendezvousHandler:
    """The job's torchrun agent on ``node``, with the job's certificate."""
    return EtcdV3RendezvousHandler(parse_settings(
        endpoint=auth.endpoint, run_id=JOB, min_nodes=1, max_nodes=1,
        conf={"lease_ttl": "2", "last_call_timeout": "0.3", "join_timeout": "30", **auth.rdzv_conf(job_user(KEYS))},
        env={"NODE_NAME": node, "POD_NAME": f"{JOB}-{node}", "POD_NAMESPACE": NS},
        local_addr="127.0.0.1", local_world_size=1,
    ))  # fmt: skip


async def identity_is(client: Any, keys: JobKeys, present: bool, timeout: float = 15.0) -> None:
    """Await the job's user being there (or gone). etcd has no watch on users: asked again
    every 50 ms."""
    async with asyncio.timeout(timeout):
        while (keys in await job_identities(client)) != present:
            await asyncio.sleep(0.05)


def test_which_identities_to_make_and_remove_is_decided_purely() -> None:
    a, b, c, d = ("ml", "a"), ("ml", "b"), ("ml", "c"), ("ml", "d")
    plan = plan_identities([a, b, c, d], tracked={a: 1, b: 1}, made={b}, present={c}, synced=True,
                           backoff={}, now=10.0)
    assert plan.ensure == (a,) and plan.remove == (c,), "b is made already; d has no identity to remove"
    # Nothing is removed on half a view (an unlisted job looks gone).
    assert plan_identities([c], tracked={}, made=set(), present={c}, synced=False, backoff={}, now=10.0).remove == ()
    # A job backing off waits until its time.
    waiting = plan_identities([a, c], tracked={a: 1}, made=set(), present={c}, synced=True,
                              backoff={a: 12.0, c: 11.0}, now=10.0)
    assert waiting.ensure == waiting.remove == () and waiting.later == (a, c) and waiting.wake_at == 11.0
    due = plan_identities([a], tracked={a: 1}, made=set(), present=set(), synced=True, backoff={a: 12.0}, now=12.0)
    assert due.ensure == (a,)
    # A job gone for less than the grace keeps its identity (a job seen gone for a moment is
    # not removed and made again); past it, the identity goes.
    young = plan_identities([c], tracked={}, made={c}, present={c}, synced=True, backoff={}, now=10.0,
                            gone_since={c: 9.0}, grace=30.0)
    assert (young.remove, young.later, young.wake_at) == ((), (c,), 39.0)
    old = plan_identities([c], tracked={}, made={c}, present={c}, synced=True, backoff={}, now=39.0,
                          gone_since={c: 9.0}, grace=30.0)
    assert old.remove == (c,)


async def test_a_jobs_identity_lives_from_its_first_pod_until_its_tombstone_is_gone(
    auth: AuthEtcd, kube_api: Any, kubeconfig: Any
) -> None:
    async with auth.client(auth.CONTROLLER) as admin:
        cluster = Cluster(kube_api, admin)
        async with controller(kube_api, kubeconfig, auth.settings(auth.CONTROLLER), settings(retention=1.0)):
            cluster.add_node("n1")
            cluster.add_pod(JOB, "n1", notes(1, 1))
            # The pod alone makes the job's identity: its agent starts, forms, trains, finishes.
            await identity_is(admin, KEYS, present=True)
            first = agent(auth, "n1")
            late = None
            try:
                info = await asyncio.to_thread(first.next_rendezvous)
                await asyncio.to_thread(info.store.add, "torchelastic/agent/terminal_state0", 1)
                assert await asyncio.to_thread(first.shutdown)
                await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "finished")
                # The retention later its keys go and its tombstone stays, and so does its identity:
                # a pod restarted now reads the tombstone with it and meets a closed run.
                await cluster.wait_deleted(KEYS.status)  # one transaction removes the whole root
                assert not (await admin.get_prefix(KEYS.root.encode())).kvs
                assert await cluster.read(KEYS.tombstone, FinishedJob) is not None
                assert KEYS in await job_identities(admin)
                late = agent(auth, "n1")
                with pytest.raises(RendezvousClosedError):
                    await asyncio.to_thread(late.next_rendezvous)
                # The pod goes; the retention later the tombstone, and then the identity.
                kube_api.delete("Pod", f"{JOB}-n1", NS)
                await cluster.wait_deleted(KEYS.tombstone)
                await identity_is(admin, KEYS, present=False)
            finally:
                for a in (first, late):
                    if a is not None:
                        await asyncio.to_thread(a.shutdown)


async def test_a_controller_that_cannot_manage_identities_backs_off_and_tells_the_jobs_pods(
    auth: AuthEtcd, kube_api: Any, kubeconfig: Any
) -> None:
    """A controller whose etcd user may write every job's keys but does not hold root: the
    job's identity cannot be made; the job is still reconciled, the failure is a Warning Event
    on its pods, and nothing crashes."""
    weak = "regroup-controller-without-root"
    async with auth.client(auth.CONTROLLER) as admin:
        await ensure_role(admin, weak, [Grant(Access.READWRITE, "/regroup/", prefix=True)])
        await ensure_user(admin, weak, (weak,), exact=True)
        cluster = Cluster(kube_api, admin)
        async with controller(kube_api, kubeconfig, auth.settings(weak), settings()):
            cluster.add_node("n2")
            pod = cluster.add_pod("refused", "n2", notes(1, 1))
            events = await kube_api.wait_for(lambda api: [e for e in api.events(NS) if e["reason"] == FAILED])
            assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == pod
            assert "regroup:job:ml:refused" in events[0]["message"] and "denied" in events[0]["message"]
            await cluster.wait_record(JobKeys(NS, "refused").status, JobStatus)  # reconciled all the same
        assert JobKeys(NS, "refused") not in await job_identities(admin)
