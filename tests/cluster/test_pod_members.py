"""Two worker pods of one job on one node (a packing Kueue makes of two 4-GPU pods on an
8-GPU node): with ``regroup.dev/member: pod`` each pod's agent is a member under its pod's
name (``--rdzv-conf node_name={pod}``), and the node is where they run.

Two such pairs on two nodes form one world of four; an eviction of one pod re-forms the job
with the other of its pair training on beside it; a reclaim taint on the other node then
takes both of its pods in one plan. The whole cluster runs here (``tests.cluster.bed``): the API stand-in, the
kubelet stand-in, real ``regroup-run --standby`` agents training the built-in trainer on
gloo, real etcd and the real controller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kubeapi.server import FakeKubeAPI
from regroup.demo.etcd_server import EtcdServer
from regroup.records import MemberRecord, ReformCause, ReformOutcome
from tests.cluster.bed import JOB, done, running

pytestmark = pytest.mark.slow

A0, A1, B0, B1 = f"{JOB}-a0", f"{JOB}-a1", f"{JOB}-b0", f"{JOB}-b1"


async def test_two_pods_on_one_node_form_reform_and_go_with_their_node(
    kube_api: FakeKubeAPI, kubeconfig: Path, etcd: EtcdServer, etcd_client: Any, kube_client: Any,
    tmp_path: Path, worker_env: dict[str, str],
) -> None:  # fmt: skip
    pods = {A0: "a", A1: "a", B0: "b", B1: "b"}
    async with running(kube_api, kubeconfig, etcd, etcd_client, tmp_path, worker_env, ["a", "b"], pods=pods,
                       member="pod", max_nodes=4) as bed:  # fmt: skip
        await bed.progress("4 ranks training", lambda p: p.world_size == 4 and p.step >= 3)
        for pod in pods:
            record = await bed.cluster.wait_record(bed.keys.member(pod), MemberRecord, lambda m: m.round > 0)
            assert (record.node, record.pod) == (pod, pod)

        # One of the two pods on b is evicted: the job re-forms in place without it, and
        # the other pod on b trains on.
        await bed.cluster.evict(kube_client, B1, 30)
        plan = await bed.plan("b1's leave done", done(ReformCause.RECLAIM, [A0, A1, B0]))
        assert (plan.outcome, plan.planned, plan.lost_steps) == (ReformOutcome.COMPLETED, True, 0), plan
        await bed.progress("3 ranks training", lambda p: p.world_size == 3 and p.step > p.resumed_from_step)

        # A spot reclaim of node a takes both members on it, in one plan.
        kube_api.patch("Node", "a", {"spec": {"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}})
        plan = await bed.plan("a's reclaim done", done(ReformCause.RECLAIM, [B0]))
        assert (plan.outcome, plan.planned, plan.nodes_before) == (ReformOutcome.COMPLETED, True, [A0, A1, B0]), plan
        alone = await bed.progress("1 rank training", lambda p: p.world_size == 1 and p.step > p.resumed_from_step)
        assert alone.last_step == alone.resumed_from_step, "no step was redone"
