"""A node that dies silently is lost from its peers' probe, not from its lease running out.

Every process of one node is SIGKILLed and nothing is written to the API (the first 40 s
of a real dead node: it still reads Ready, its pod Running), with the default member lease
TTL of 5 s. The survivors' collectives fail; their agents read the round's leases, find the
dead agent's unrenewed for a second, and name it (``MemberRecord.silent_peers``); the
controller re-forms the job without it while its member key still stands, which etcd's
revisions show (the plan is written before the key's lease expires and deletes it).

The whole cluster runs here (``tests.cluster.bed``): the API stand-in, the kubelet stand-in,
real ``regroup-run --standby`` agents training the built-in trainer on gloo, real etcd and
the real controller.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kubeapi.server import FakeKubeAPI
from regroup.demo.etcd_server import EtcdServer
from regroup.records import MemberRecord, ReformCause, ReformOutcome, ReformPlan
from tests.cluster.bed import history, running
from tests.cluster.bed import done as finished

pytestmark = pytest.mark.slow


async def test_a_silently_dead_node_is_lost_from_its_peers_probe_before_its_lease_runs_out(
    kube_api: FakeKubeAPI, kubeconfig: Path, etcd: EtcdServer, etcd_client: Any, tmp_path: Path,
    worker_env: dict[str, str],
) -> None:  # fmt: skip
    async with running(kube_api, kubeconfig, etcd, etcd_client, tmp_path, worker_env, ["a", "b", "c"],
                       lease_ttl=5.0) as bed:  # fmt: skip
        before = await bed.progress("3 ranks training", lambda p: p.world_size == 3 and p.step >= 3)
        member_b = bed.keys.member("b")
        assert (await etcd_client.get(member_b.encode())) is not None
        assert bed.kubelet is not None
        async with history(etcd_client, bed.keys) as changes:
            killed_at = time.time()
            await bed.kubelet.kill_node("b", status_unknown=False)  # nothing written to the API
            assert kube_api.get("Node", "b")["status"]["conditions"][0]["status"] == "True"
            plan = await bed.plan("b lost", lambda p: p.cause == ReformCause.NODE_LOST)
            assert plan.reason.startswith("lost b (its lease went unrenewed after a collective of round"), plan
            done = await bed.plan("the loss's re-form done", finished(ReformCause.NODE_LOST, ["a", "c"]))
            assert done.outcome == ReformOutcome.COMPLETED, done
            await bed.progress("2 ranks training", lambda p: p.world_size == 2 and p.round > before.round)
            # The lease runs out, 5 s after b's last renewal.
            deleted = (await changes.until("b's key deleted", lambda c: c.key == member_b and c.value is None)).revision
            gone_at = time.time()

    # Decided while b's member key still stood: the plan was written before its lease ran out.
    plan_at = min(c.revision for c in changes if c.key == bed.keys.plan and c.value)
    assert plan_at < deleted, (plan_at, deleted)
    named = [MemberRecord.from_json(c.value).silent_peers for c in changes if c.key != member_b
             and c.key.startswith(bed.keys.members) and c.value]  # fmt: skip
    assert ["b"] in named, "a survivor named b"
    # b's record, standing until then, was never taken for a joiner.
    plans = [ReformPlan.from_json(c.value) for c in changes if c.key == bed.keys.plan and c.value]
    assert {p.cause for p in plans} == {ReformCause.NODE_LOST}, [(p.cause, p.reason) for p in plans]
    print(f"silent death: decided {plan.decided_at - killed_at:.2f}s after the kill, "
          f"the lease ran out {gone_at - killed_at:.2f}s after it")  # fmt: skip
