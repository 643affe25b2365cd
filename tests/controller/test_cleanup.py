"""Nothing left behind in etcd: the controller on real etcd and the Kubernetes API stand-in,
with real etcd-v3 rendezvous handlers (threads of this process) as the job's agents.

A finished job loses its keys after the retention and leaves a tombstone that a pod
restarted afterwards meets as a closed rendezvous; the tombstone goes once the pods are
gone; a job whose pods went away loses its keys without one; a live job keeps a bounded
number of acks; a controller that restarts midway keeps the retention's clock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import timedelta
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from regroup.controller.settings import CleanupSettings, ControllerSettings
from regroup.keys import JobKeys
from regroup.etcd import EventKind
from regroup.records import (
    CheckpointRequest,
    FinishedJob,
    JobStatus,
    ReformCause,
    ReformOutcome,
    ReformPhase,
    ReformPlan,
    ReformRequest,
    RoundState,
)
from regroup.rendezvous.handler import EtcdV3RendezvousHandler
from regroup.rendezvous.settings import parse_settings
from tests.etcd_helpers import lease_count

from .harness import NS, WAIT, Cluster, controller, fast_settings, notes, sample, until

JOB = "llama"
KEYS = JobKeys(NS, JOB)


def settings(retention: float) -> ControllerSettings:
    return dataclasses.replace(fast_settings(), cleanup=CleanupSettings(retention=timedelta(seconds=retention)))


@pytest.fixture
def cluster(kube_api, etcd_client) -> Cluster:
    return Cluster(kube_api, etcd_client)


def agent(endpoint: str, node: str) -> EtcdV3RendezvousHandler:
    """The job's torchrun agent on ``node``, as its pod starts it."""
    return EtcdV3RendezvousHandler(parse_settings(
        endpoint=endpoint, run_id=JOB, min_nodes=1, max_nodes=2,
        conf={"lease_ttl": "2", "last_call_timeout": "0.3", "join_timeout": "30"},
        env={"NODE_NAME": node, "POD_NAME": f"{JOB}-{node}", "POD_NAMESPACE": NS},
        local_addr="127.0.0.1", local_world_size=1,
    ))  # fmt: skip


async def keys_under(client: Any, prefix: str) -> list[str]:
    return [kv.key.decode() for kv in (await client.get_prefix(prefix.encode())).kvs]


async def emptied(client: Any, prefix: str, timeout: float = WAIT) -> float:
    """Await the moment nothing is left under ``prefix`` (watching it); returns that time."""
    listing = await client.get_prefix(prefix.encode())
    left = {kv.key for kv in listing.kvs}
    if not left:
        return time.time()
    watch = await client.watch_prefix(prefix.encode(), start_revision=listing.header.revision + 1)
    try:
        async with asyncio.timeout(timeout):
            async for event in watch:
                if event.kind == EventKind.DELETE:
                    left.discard(event.kv.key)
                else:
                    left.add(event.kv.key)
                if not left:
                    return time.time()
    finally:
        await watch.cancel()
    raise AssertionError(f"{prefix} watch ended")


async def written_since(client: Any, revision: int) -> list[str]:
    """Every key put or deleted anywhere after ``revision`` until now (a marker written now
    ends the replay)."""
    marker = b"/regroup-test/marker"
    await client.put(marker, b"")
    watch = await client.watch_prefix(b"/", start_revision=revision + 1)
    keys = []
    try:
        async with asyncio.timeout(WAIT):
            async for event in watch:
                if event.kv.key == marker:
                    return keys
                keys.append(event.kv.key.decode())
    finally:
        await watch.cancel()
    raise AssertionError("watch ended")


async def test_a_finished_job_leaves_only_a_tombstone_that_a_restarted_pod_respects_until_its_pods_are_gone(
    cluster, kube_api, kubeconfig, etcd, etcd_settings, etcd_client
) -> None:
    async with controller(kube_api, kubeconfig, etcd_settings, settings(retention=1.0)) as (metrics, _):
        leases = await lease_count(etcd_client)  # the controller's own
        for node in ("n1", "n2"):
            cluster.add_node(node)
            cluster.add_pod(JOB, node, notes(1, 2))
        agents = [agent(etcd.endpoint, node) for node in ("n1", "n2")]
        try:
            infos = await asyncio.gather(*(asyncio.to_thread(a.next_rendezvous) for a in agents))
            assert await lease_count(etcd_client) == leases + 2
            # Training ends: n1's workers finished (torchrun's exit barrier), both agents shut down.
            await asyncio.to_thread(infos[0].store.add, "torchelastic/agent/terminal_state0", 1)
            for a in agents:
                assert await asyncio.to_thread(a.shutdown)
            status = await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "finished")
            assert status.since > 0

            # (a) After the retention the job's root is empty; its tombstone says when it finished.
            removed = await emptied(etcd_client, KEYS.root)
            tombstone = await cluster.read(KEYS.tombstone, FinishedJob)
            assert tombstone is not None and tombstone.finished_at == status.since
            assert status.since + 1.0 <= tombstone.removed_at <= removed
            await until(lambda: sample(metrics, "regroup_jobs_removed_total", reason="finished") == 1)
            for series in ("regroup_job_nodes", "regroup_rendezvous_rounds_total"):
                assert metrics.registry.get_sample_value(series, {"namespace": NS, "job": JOB}) is None, series
            assert sample(metrics, "regroup_jobs_tracked") == 1, "the tombstone and pods are still tracked"

            # (b) A pod restarted afterwards: its agent meets a closed run and writes nothing.
            before = (await etcd_client.get(KEYS.tombstone.encode())).mod_revision
            late = agent(etcd.endpoint, "n1")
            agents.append(late)
            with pytest.raises(RendezvousClosedError):
                await asyncio.to_thread(late.next_rendezvous)
            assert late.is_closed()
            assert await asyncio.to_thread(late.shutdown)
            assert await written_since(etcd_client, before) == [], "the late agent wrote nothing anywhere"

            # (g) Every agent's lease went with it.
            assert await lease_count(etcd_client) == leases

            # (c) The pods go; the retention later, so does the tombstone, and nothing is left.
            for node in ("n1", "n2"):
                kube_api.delete("Pod", f"{JOB}-{node}", NS)
            vacant = await cluster.wait_record(KEYS.tombstone, FinishedJob, lambda t: t.vacant_since > 0)
            await cluster.wait_deleted(KEYS.tombstone)
            assert time.time() >= vacant.vacant_since + 1.0
            assert await keys_under(etcd_client, KEYS.root) == []
            await until(lambda: sample(metrics, "regroup_jobs_tracked") == 0)
        finally:
            for a in agents:
                await asyncio.to_thread(a.shutdown)


async def test_a_job_whose_pods_and_members_are_gone_is_removed_without_a_tombstone(
    cluster, kube_api, kubeconfig, etcd_settings, etcd_client
) -> None:
    await cluster.job(JOB, ["n1", "n2"], notes(1, 2))
    async with controller(kube_api, kubeconfig, etcd_settings, settings(retention=1.0)) as (metrics, _):
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "healthy")
        for node in ("n1", "n2"):
            kube_api.delete("Pod", f"{JOB}-{node}", NS)
        status = await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "waiting")
        assert status.vacant_since == 0.0, "its agents are still registered"
        gone = time.time()
        for node in ("n1", "n2"):
            await cluster.drop_member(JOB, node)
        removed = await emptied(etcd_client, KEYS.root)
        assert removed >= gone + 1.0
        assert await cluster.read(KEYS.tombstone, FinishedJob) is None
        await until(lambda: sample(metrics, "regroup_jobs_removed_total", reason="gone") == 1)
        await until(lambda: sample(metrics, "regroup_jobs_tracked") == 0)
        assert sample(metrics, "regroup_jobs_removed_total", reason="finished") == 0


async def test_a_job_re_formed_over_and_over_keeps_only_the_acks_still_read(
    cluster, kube_api, kubeconfig, etcd_settings, etcd_client
) -> None:
    """A long run's acks piled up (a 200-fault run left 168): the controller prunes them a
    batch per decision down to the plan's generation and the one before; then each re-form
    leaves only those (after a grow and a loss: the grow's ack)."""
    config = notes(2, 3, join_window="0s")
    await cluster.job(JOB, ["n1", "n2"], config)
    cluster.add_node("n3")
    cluster.add_pod(JOB, "n3", config)
    for generation in range(1, 151):
        await cluster.ack(JOB, generation, generation, 4)
    done = ReformPlan(generation=150, cause=ReformCause.NODE_LOST, planned=False, reason="lost n3",
                      nodes_before=["n1", "n2", "n3"], nodes_after=["n1", "n2"], trace_id="1" * 32,
                      detected_at=time.time(), decided_at=time.time(), phase=ReformPhase.DONE, round_before=0,
                      round_after=1, outcome=ReformOutcome.COMPLETED, finished_at=time.time())
    await etcd_client.put(KEYS.plan.encode(), done.to_json())
    async with controller(kube_api, kubeconfig, etcd_settings, settings(retention=600.0)):
        await until_acks(etcd_client, lambda generations: generations == {149, 150})
        round_, step, last = 1, 10, 150
        for _ in range(4):
            # n3's agent joins: a planned grow, acked.
            await cluster.member(JOB, "n3", round_ + 1)
            request = await cluster.wait_record(KEYS.checkpoint, CheckpointRequest, lambda r, g=last: r.generation > g)
            await cluster.ack(JOB, request.generation, step, 4)
            await cluster.wait_record(KEYS.reform, ReformRequest, lambda r: r.generation == request.generation)
            round_ += 1
            for node in ("n1", "n2"):
                await cluster.member(JOB, node, round_)
            await cluster.progress(JOB, step, 6)
            await done_plan(cluster, request.generation)
            # n3's agent is lost: an unplanned shrink, no ack.
            await cluster.drop_member(JOB, "n3")
            grown = request.generation
            reform = await cluster.wait_record(KEYS.reform, ReformRequest, lambda r, g=grown: r.generation > g)
            round_ += 1
            for node in ("n1", "n2"):
                await cluster.member(JOB, node, round_)
            step += 1
            await cluster.progress(JOB, step, 4)
            await done_plan(cluster, reform.generation)
            await until_acks(etcd_client, lambda generations, g=request.generation: generations == {g})
            last = reform.generation
        assert len(await keys_under(etcd_client, KEYS.acks)) == 1


async def done_plan(cluster: Cluster, generation: int) -> ReformPlan:
    return await cluster.wait_record(KEYS.plan, ReformPlan, lambda p: p.generation == generation and p.phase == "done")


async def until_acks(client: Any, predicate: Any) -> set[int]:
    """Await a set of ack generations in etcd that satisfies ``predicate`` (polled, with a deadline)."""
    async with asyncio.timeout(WAIT):
        while True:
            keys = await keys_under(client, KEYS.acks)
            generations = {int(k[len(KEYS.acks):].split("/")[0]) for k in keys}
            if predicate(generations):
                return generations
            await asyncio.sleep(0.05)


async def test_a_controller_restarted_midway_keeps_the_retention_clock(
    cluster, kube_api, kubeconfig, etcd_settings, etcd_client
) -> None:
    retention = 6.0
    await cluster.job(JOB, ["n1", "n2"], notes(1, 2))
    # The agents closed the run and left.
    closed = RoundState(min_nodes=1, max_nodes=2, round=1, nodes=["n1", "n2"], closed=True)
    await etcd_client.put((KEYS.rdzv + "state").encode(), closed.to_json())
    for node in ("n1", "n2"):
        await cluster.drop_member(JOB, node)
    async with controller(kube_api, kubeconfig, etcd_settings, settings(retention)):
        status = await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "finished")
        # This controller goes away halfway through the retention (a rollout, a lost leader).
        await asyncio.sleep(max(0.0, status.since + retention / 2 - time.time()))
    assert await keys_under(etcd_client, KEYS.root), "nothing removed before the retention"
    restarted = time.time()
    async with controller(kube_api, kubeconfig, etcd_settings, settings(retention)):
        removed = await emptied(etcd_client, KEYS.root)
    assert removed >= status.since + retention
    # The new controller counted from the recorded moment, not from its own start.
    assert removed - restarted < retention - 1.5, (removed - restarted)
    tombstone = await cluster.read(KEYS.tombstone, FinishedJob)
    assert tombstone is not None and tombstone.finished_at == status.since


async def test_the_controller_deletes_nothing_under_a_job_an_agent_just_joined(etcd_client) -> None:
    """The removal is fenced: an agent that registered after the decision keeps its keys."""
    from regroup.controller.etcd_mirror import OwnWrites
    from regroup.controller.reconciler import PlanConflict
    from regroup.controller.runtime import EtcdLeaseWriter

    writer = EtcdLeaseWriter(etcd_client, OwnWrites())
    await etcd_client.put(KEYS.progress.encode(), b"{}")
    await etcd_client.put(KEYS.joins.encode() + b"n1", b"{}")
    with pytest.raises(PlanConflict):
        await writer.remove_prefix(KEYS.root, (KEYS.members, KEYS.joins))
    assert len(await keys_under(etcd_client, KEYS.root)) == 2
    await etcd_client.delete(KEYS.joins.encode() + b"n1")
    other = JobKeys(NS, JOB + "-2")  # a job whose name extends this one's is not under its root
    await etcd_client.put(other.progress.encode(), b"{}")
    tombstone = FinishedJob(finished_at=1.0, removed_at=2.0).to_json()
    revision = await writer.remove_prefix(KEYS.root, (KEYS.members, KEYS.joins), put=(KEYS.tombstone, tombstone))
    assert await keys_under(etcd_client, KEYS.root) == [] and await keys_under(etcd_client, other.root)
    assert (await etcd_client.get(KEYS.tombstone.encode())).mod_revision == revision
    with pytest.raises(PlanConflict):  # a tombstone rewritten since is not deleted
        await writer.remove_prefix(KEYS.root, (KEYS.members,), delete=(KEYS.tombstone, revision - 1))
    await writer.remove_prefix(KEYS.root, (KEYS.members,), delete=(KEYS.tombstone, revision))
    assert await etcd_client.get(KEYS.tombstone.encode()) is None

