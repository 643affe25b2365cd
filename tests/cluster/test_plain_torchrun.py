"""Plain ``torchrun`` workers (torch's own agent on the ``etcd-v3`` backend) under the
controller: a pod killed between two checkpoints costs every step its trainers completed
past the one they load, and the re-form's plan, trace and Event count exactly those.

The pod killed is rank 0's: its progress record, published every interval, dies with it
several steps behind, and no worker of the world before survives (torch's agents restart
them all). The count comes from the trainers: the survivors' nodes keep the step their
workers completed for the workers started next. The test reads the trainers' own sample
logs and computes ``last completed - resumed from``.

The whole cluster runs here (``tests.cluster.bed``): the API stand-in, the kubelet stand-in
(``restartPolicy: Always``), ``torchrun`` agents training the built-in trainer on gloo with
real checkpoints every 30 steps, real etcd and the real controller.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kubeapi.server import FakeKubeAPI
from regroup.demo.etcd_server import EtcdServer
from regroup.records import ReformCause, ReformOutcome, ReformPhase
from tests.cluster.bed import JOB, NS, WAIT, running
from tests.controller.harness import until

pytestmark = pytest.mark.slow

NODES = ["a", "b", "c"]
EVERY = 30
"""Steps between checkpoints."""
KILL_PAST = 12
"""The kill comes this many steps past a commit."""


def _steps(samples: Path, world: int) -> list[int]:
    """Steps some rank of a world of ``world`` ranks completed (their sample logs)."""
    return [json.loads(line)["step"] for path in samples.glob(f"samples-w{world}-r*.jsonl")
            for line in path.read_text().splitlines()]  # fmt: skip


async def _reached(samples: Path, step: int) -> None:
    """Await a rank of the three logging ``step`` (files: polled)."""
    async with asyncio.timeout(WAIT):
        while max(_steps(samples, 3), default=0) < step:
            await asyncio.sleep(0.05)


async def test_a_pod_killed_between_checkpoints_counts_every_step_past_the_one_loaded(
    kube_api: FakeKubeAPI, kubeconfig: Path, etcd: EtcdServer, etcd_client: Any, tmp_path: Path,
    worker_env: dict[str, str],
) -> None:  # fmt: skip
    samples = tmp_path / "samples"
    trainer = {
        "data": {"sample_log": str(samples)},
        "step_time_floor": "100ms",
        # A commit every 30 steps, the kill 12 steps past one: 1.8 s of steps before the next
        # commit could make the loss small, for a loaded machine's slow look and kill.
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": EVERY},
        # Published every 2 s (production's default is 5 s), and before each commit.
        "etcd": {"endpoint": etcd.endpoint, "job": JOB, "namespace": NS, "progress_interval": "2s"},
    }
    async with running(kube_api, kubeconfig, etcd, etcd_client, tmp_path, worker_env, NODES,
                       launcher="torchrun", trainer=trainer) as bed:  # fmt: skip
        seen = await bed.progress(
            f"3 ranks past the checkpoint of step {EVERY}",
            lambda p: p.world_size == 3 and (p.extra.get("last_committed_step") or 0) >= EVERY,
        )
        # Killed between two commits, a few steps past the progress record seen.
        kill_at = next(step for step in range(seen.step + 3, seen.step + 3 + EVERY) if step % EVERY == KILL_PAST)
        await _reached(samples, kill_at)
        [rank_zero] = [n for n in NODES if any(e["world_size"] == 3 for e in bed.events(n, "training"))]
        assert bed.kubelet is not None
        await bed.kubelet.kill_container(NS, f"{JOB}-{rank_zero}")

        plan = await bed.plan(
            f"the loss of {rank_zero} done",
            lambda p: p.cause == ReformCause.NODE_LOST and rank_zero in p.reason and p.phase == ReformPhase.DONE,
        )
        assert plan.outcome == ReformOutcome.COMPLETED and plan.mode == "restart", plan
        assert plan.resumed_from_step % EVERY == 0, plan
        reached = max(_steps(samples, 3))
        assert plan.lost_steps == reached - plan.resumed_from_step > 1, f"reached {reached}: {plan}"

        spans = await until(lambda: [s for s in bed.spans.get_finished_spans() if s.name == "regroup.reform"
                                     and f"{s.context.trace_id:032x}" == plan.trace_id])  # fmt: skip
        assert spans[0].attributes["regroup.lost_steps"] == plan.lost_steps
        told = await bed.until("the Resized Event", lambda _: [
            e for e in bed.kube_events("Resized") if f"loss of {rank_zero}" in e["message"]
        ])  # fmt: skip
        assert f", {plan.lost_steps} steps lost, " in told[0]["message"], told[0]
