"""A worker whose container dies is lost from its pod's status, not a lease TTL later: the
kubelet reports the exit (137 for a SIGKILL) and restarts the container, and the controller
re-forms the job from that while the dead agent's member record still stands. The agent of
the restarted container then comes back into the job.

All of it on an etcd with client-certificate auth, as the production overlay runs it: the
controller holds its own certificate and makes the job's etcd identity from its pods
(``--etcd-job-identities``); the agents, and through ``regroup-run`` their trainers, hold only
the job's certificate. The loss, the grow and then a planned eviction (checkpoint before the
resize, the leaving rank's hand-off, 0 steps lost) all run under those identities.

The whole cluster runs here (``tests.cluster.bed``): the API stand-in, a kubelet stand-in
that kills and restarts containers as a kubelet does (``restartPolicy: Always``), real
``regroup-run --standby`` agents (member lease TTL 2 s) training the built-in trainer on
gloo, real etcd and the real controller.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kubeapi.server import FakeKubeAPI
from regroup.controller.kube.convert import parse_time
from regroup.etcd.auth import job_identities, job_user
from regroup.records import MemberRecord, ReformCause, ReformOutcome, ReformPhase
from tests.cluster.bed import JOB, NS, Bed, evict, left_inside_its_grace, running
from tests.cluster.bed import done as finished
from tests.controller.harness import until
from tests.etcd_helpers import AuthEtcd, auth_etcd

pytestmark = pytest.mark.slow


@pytest.fixture
def auth(tmp_path: Path) -> Iterator[AuthEtcd]:
    with auth_etcd(tmp_path / "auth-etcd") as server:
        yield server


@pytest.fixture
async def controller_client(auth: AuthEtcd) -> AsyncIterator[Any]:
    async with auth.client(AuthEtcd.CONTROLLER) as client:
        yield client


def killed(bed: Bed, node: str) -> dict[str, Any] | None:
    """The termination the kubelet reports for the killed container of ``node``'s pod, once it does."""
    pod = bed.pod(node)
    for container in (pod or {}).get("status", {}).get("containerStatuses") or ():
        terminated = (container.get("lastState") or {}).get("terminated")
        if terminated and terminated.get("exitCode") == 137:
            return terminated
    return None


async def test_a_killed_agent_container_is_lost_from_its_exit_before_its_lease_and_comes_back(
    kube_api: FakeKubeAPI, kubeconfig: Path, auth: AuthEtcd, controller_client: Any, kube_client: Any,
    tmp_path: Path, worker_env: dict[str, str],
) -> None:  # fmt: skip
    samples = tmp_path / "samples"
    async with running(kube_api, kubeconfig, auth, controller_client, tmp_path, worker_env, ["a", "b", "c"],
                       trainer={"data": {"sample_log": str(samples)}}) as bed:  # fmt: skip
        before = await bed.progress("3 ranks training", lambda p: p.world_size == 3 and p.step >= 5)
        # Everything the agents and trainers wrote, they wrote as the job's identity, which
        # the controller made from the pods: there is no other certificate in their hands.
        assert bed.keys in await job_identities(controller_client)
        assert f"cert={auth.pki.client(job_user(bed.keys))[0]}" in bed.rdzv_conf()
        member = await bed.cluster.read(bed.keys.member("b"), MemberRecord)
        assert member is not None and member.pod == f"{JOB}-b"

        # An OOM kill, as the kubelet sees one: SIGKILL of the container's whole tree.
        assert bed.kubelet is not None
        await bed.kubelet.kill_container(NS, f"{JOB}-b")
        exit_ = await bed.until("the kubelet reporting b's exit", lambda _: killed(bed, "b"))
        finished_at = parse_time(exit_["finishedAt"])
        assert finished_at is not None and finished_at > member.joined_at

        plan = await bed.plan("the loss of b", lambda p: p.cause == ReformCause.NODE_LOST and "b" in p.reason)
        # Decided from the container's exit, while the member record (lease TTL 2 s) still
        # stood and before the restarted container's agent registered: either of those would
        # have named the lease ("member lease expired") or the new agent ("agent on b restarted").
        assert plan.reason == f"lost b (pod {JOB}-b container exited (code 137))", plan
        # The survivors keep their positions in the round (its order is the agents' join order).
        assert plan.detected_at == finished_at and not plan.planned and sorted(plan.nodes_after) == ["a", "c"], plan
        done = await bed.plan("the loss's re-form done",
                              lambda p: p.generation == plan.generation and p.phase == ReformPhase.DONE)
        assert done.outcome == ReformOutcome.COMPLETED and done.detected_at == finished_at, done
        assert done.rendezvous_done_at <= done.resumed_at <= done.finished_at, done
        await bed.progress("2 ranks training", lambda p: p.world_size == 2 and p.round > before.round)

        # The trace starts at the container's exit and ends at the trainers' resume.
        spans = await until(lambda: [s for s in bed.spans.get_finished_spans() if s.name == "regroup.reform"
                                     and f"{s.context.trace_id:032x}" == done.trace_id])  # fmt: skip
        assert spans[0].start_time == int(done.detected_at * 1e9), spans[0]
        assert spans[0].end_time == int(done.resumed_at * 1e9), spans[0]
        assert spans[0].attributes["regroup.cause"] == "node-lost"
        # The survivors rebuilt in place from the snapshots: the steps lost are those past the
        # resumed one that any rank of the worlds before completed, by their sample logs.
        rows = [json.loads(line) for path in samples.glob("samples-*.jsonl") for line in path.read_text().splitlines()]
        reached = max(row["step"] for row in rows if row["round"] < done.round_after)
        assert done.lost_steps == reached - done.resumed_from_step, (reached, done)
        assert spans[0].attributes["regroup.lost_steps"] == done.lost_steps
        told = await bed.until("the loss's Resized Event",
                               lambda _: [e for e in bed.kube_events("Resized") if "loss of b" in e["message"]])  # fmt: skip
        assert f", {done.lost_steps} step{'' if done.lost_steps == 1 else 's'} lost, " in told[0]["message"], told[0]

        # The restarted container's agent registered after the exit: not a loss, a joiner.
        grown = await bed.plan("b back in the job", lambda p: p.generation > plan.generation
                               and p.phase == ReformPhase.DONE and sorted(p.nodes_after) == ["a", "b", "c"])  # fmt: skip
        assert grown.cause == ReformCause.GROW and grown.outcome == ReformOutcome.COMPLETED, grown
        pod = bed.pod("b")
        assert pod is not None and pod["status"]["containerStatuses"][0]["restartCount"] == 1, pod and pod["status"]

        # A planned leave under the same identities: the eviction's checkpoint request, the
        # ack from memory, the hand-off and the shrink, 0 steps lost.
        evicted_at = await evict(bed, kube_client, "c", 30)
        plan = await bed.plan("the eviction's shrink done", finished(ReformCause.RECLAIM, ["a", "b"]))
        assert (plan.outcome, plan.planned, plan.lost_steps) == (ReformOutcome.COMPLETED, True, 0), plan
        shrunk = await bed.progress("2 ranks training", lambda p: p.world_size == 2 and p.step > p.resumed_from_step)
        assert shrunk.reform_mode == "in-place" and shrunk.last_step == shrunk.resumed_from_step, shrunk
        await left_inside_its_grace(bed, "c", evicted_at, 30)
