"""A reclaim that arrives as an eviction loses nothing: the planned path runs inside the
grace period. A node left out of a round never reports success, whatever the restart policy.

The whole cluster runs here (``tests.cluster.bed``): the API stand-in, a kubelet stand-in
that SIGTERMs an evicted pod's agent and SIGKILLs its tree when the grace is over, real
``regroup-run --standby`` agents training the built-in trainer on gloo, real etcd and the
real controller. The test acts as ``kubectl``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kubeapi import objects
from kubeapi.server import FakeKubeAPI
from regroup.demo.etcd_server import EtcdServer
from regroup.records import ReformCause, ReformOutcome, ReformPhase
from regroup.rendezvous.inplace.agent import LEFT_OUT
from tests.cluster.bed import done, evict, left_inside_its_grace, running

pytestmark = pytest.mark.slow


async def test_an_eviction_and_a_drain_leave_in_place_inside_their_grace_and_lose_nothing(
    kube_api: FakeKubeAPI, kubeconfig: Path, etcd: EtcdServer, etcd_client: Any, kube_client: Any,
    tmp_path: Path, worker_env: dict[str, str],
) -> None:  # fmt: skip
    async with running(kube_api, kubeconfig, etcd, etcd_client, tmp_path, worker_env, ["a", "b", "c"]) as bed:
        await bed.progress("3 ranks training", lambda p: p.world_size == 3 and p.step >= 5)

        # An eviction with a 30 s grace: the API server writes DisruptionTarget, then the
        # deletion; the kubelet SIGTERMs the agent at once.
        evicted_at = await evict(bed, kube_client, "c", 30)
        plan = await bed.plan("the eviction's shrink done", done(ReformCause.RECLAIM, ["a", "b"]))
        assert (plan.outcome, plan.planned, plan.lost_steps) == (ReformOutcome.COMPLETED, True, 0), plan
        shrunk = await bed.progress("2 ranks training", lambda p: p.world_size == 2 and p.step > p.resumed_from_step)
        assert shrunk.reform_mode == "in-place"
        assert shrunk.last_step == shrunk.resumed_from_step, "no step was redone"
        await left_inside_its_grace(bed, "c", evicted_at, 30)
        # One Event per pod of the job, each with the same summary of the re-form.
        resized = await bed.until("the Resized Events", lambda _: bed.kube_events("Resized"))
        assert all("0 steps lost" in e["message"] for e in resized), resized

        # `kubectl drain b`: cordon, then the eviction, here with a 5 s grace.
        kube_api.patch("Node", "b", {"spec": {"unschedulable": True}})
        drained_at = await evict(bed, kube_client, "b", 5)
        plan = await bed.plan("the drain's shrink done", done(ReformCause.RECLAIM, ["a"]))
        assert (plan.outcome, plan.planned, plan.lost_steps) == (ReformOutcome.COMPLETED, True, 0), plan
        alone = await bed.progress("1 rank training", lambda p: p.world_size == 1 and p.step > p.resumed_from_step)
        assert alone.last_step == alone.resumed_from_step, "no step was redone"
        await left_inside_its_grace(bed, "b", drained_at, 5)


async def test_a_grace_too_short_for_the_hand_off_is_a_loss_of_at_most_one_step_and_no_stall(
    kube_api: FakeKubeAPI, kubeconfig: Path, etcd: EtcdServer, etcd_client: Any, kube_client: Any,
    tmp_path: Path, worker_env: dict[str, str],
) -> None:  # fmt: skip
    async with running(kube_api, kubeconfig, etcd, etcd_client, tmp_path, worker_env, ["a", "b"]) as bed:
        await bed.progress("2 ranks training", lambda p: p.world_size == 2 and p.step >= 5)
        await evict(bed, kube_client, "b", 1)  # below the controller's min_planned_grace (2 s)
        plan = await bed.plan("the loss's re-form done", lambda p: p.phase == ReformPhase.DONE and p.nodes_after == ["a"])
        assert plan.outcome == ReformOutcome.COMPLETED and not plan.planned, plan
        assert 0 <= plan.lost_steps <= 1, plan
        alone = await bed.progress("1 rank training", lambda p: p.world_size == 1 and p.step > p.resumed_from_step)
        # No stall: no request outlived the plan, nothing holds; 20 more steps come at once.
        later = await bed.progress("20 more steps", lambda p: p.step >= alone.step + 20, timeout=30)
        assert later.extra["state"] == "training", later.extra


@pytest.mark.parametrize("restart_policy", ["Always", "OnFailure", "Never"])
async def test_a_node_left_out_of_a_round_never_succeeds_and_comes_back_when_it_may(
    restart_policy: str, kube_api: FakeKubeAPI, kubeconfig: Path, etcd: EtcdServer, etcd_client: Any,
    tmp_path: Path, worker_env: dict[str, str],
) -> None:  # fmt: skip
    nodes = ["a", "b"]
    async with running(
        kube_api, kubeconfig, etcd, etcd_client, tmp_path, worker_env, nodes, restart_policy=restart_policy
    ) as bed:
        await bed.progress("2 ranks training", lambda p: p.world_size == 2 and p.step >= 5)
        # Karpenter marks b as being disrupted: the job leaves it (planned), b stays excluded.
        kube_api.patch("Node", "b", {"spec": {"taints": [objects.taint("karpenter.sh/disrupted")]}})
        plan = await bed.plan("the shrink done", done(ReformCause.RECLAIM, ["a"]))
        assert plan.planned and plan.lost_steps == 0, plan
        shrunk = await bed.progress("1 rank training", lambda p: p.world_size == 1 and p.step > p.resumed_from_step)
        await bed.logged("b", LEFT_OUT)
        pod = bed.pod("b")
        assert pod is not None and pod["status"]["phase"] == "Running", pod and pod["status"]
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]

        # The node is kept after all: the taint goes, and b comes back into the job.
        kube_api.patch("Node", "b", {"spec": {"taints": []}})
        grown = await bed.progress("2 ranks again", lambda p: p.world_size == 2 and p.round > shrunk.round)
        assert grown.reform_mode == "in-place"
        pod = bed.pod("b")
        assert pod is not None and pod["status"]["phase"] == "Running", pod and pod["status"]
        assert pod["status"]["containerStatuses"][0]["restartCount"] == 0, pod["status"]
