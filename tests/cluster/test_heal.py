"""A healed node grows the job only once its workers are warm.

A node goes NotReady while its processes live on (a kubelet that stopped posting status):
the controller re-forms the job without it, and the node's agent, left out of the round,
restarts its ``--standby`` workers to ask back in. The node turns Ready while they start up.
The survivors must train on meanwhile: the member record says the agent is warming up, so
the grow, its checkpoint request and the survivors' hold come only after the workers are
up (the order is read from etcd's own revisions, not from clocks).

The whole cluster runs here (``tests.cluster.bed``): the API stand-in, the kubelet stand-in,
real ``regroup-run --standby`` agents training the built-in trainer on gloo, real etcd and
the real controller.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kubeapi.server import FakeKubeAPI
from regroup.demo.etcd_server import EtcdServer
from regroup.records import MemberRecord, ReformCause, ReformOutcome, ReformPhase, ReformPlan
from tests.cluster.bed import history, running
from tests.cluster.bed import done as finished

pytestmark = pytest.mark.slow


def _ready(api: FakeKubeAPI, node: str, ready: bool) -> None:
    api.patch("Node", node, {"status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}})


async def test_a_healed_node_grows_the_job_once_its_standby_workers_are_warm(
    kube_api: FakeKubeAPI, kubeconfig: Path, etcd: EtcdServer, etcd_client: Any, tmp_path: Path,
    worker_env: dict[str, str],
) -> None:  # fmt: skip
    async with running(kube_api, kubeconfig, etcd, etcd_client, tmp_path, worker_env, ["a", "b", "c"]) as bed:
        await bed.progress("3 ranks training", lambda p: p.world_size == 3 and p.step >= 3)
        async with history(etcd_client, bed.keys) as changes:
            _ready(kube_api, "b", False)
            lost = await bed.plan("b lost", finished(ReformCause.NODE_LOST, ["a", "c"]))
            assert lost.outcome == ReformOutcome.COMPLETED, lost
            member_b = bed.keys.member("b")
            await bed.cluster.wait_record(member_b, MemberRecord, lambda m: m.warming_since > 0)
            _ready(kube_api, "b", True)  # healed while its workers start up
            grown = await bed.plan("b back in", finished(ReformCause.GROW, ["a", "b", "c"]))
            assert grown.outcome == ReformOutcome.COMPLETED, grown

    members = [(c.revision, MemberRecord.from_json(c.value)) for c in changes if c.key == member_b and c.value]
    plans = [(c.revision, ReformPlan.from_json(c.value)) for c in changes if c.key == bed.keys.plan and c.value]
    warming = [rev for rev, m in members if m.warming_since > 0]
    assert warming, "b's agent never said it was warming up"
    warm = min(rev for rev, m in members if rev > warming[0] and m.warming_since == 0)
    grow = min(rev for rev, p in plans if p.cause == ReformCause.GROW)
    assert grow > warm, f"the grow (revision {grow}) came before b was warm (revision {warm})"
    # The survivors held (checkpoint request to resume) only for the grow itself.
    held = grown.resumed_at - grown.checkpoint_requested_at
    assert grown.checkpoint_requested_at > 0 and grown.phase == ReformPhase.DONE and held > 0, grown
    print(f"held {held:.2f}s for the grow, lost {grown.lost_steps} steps")
