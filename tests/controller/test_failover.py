"""A leader lost in each phase of a planned shrink, with real rendezvous agents.

Two controller replicas behind the Lease (the Kubernetes API stand-in), real etcd-v3
rendezvous handlers posing as the three nodes' agents (threads of this process), and the
trainer played from etcd: it acks each checkpoint request and reports progress once a
round has formed. A spot notice lands on n2; the leader goes away before the ack, after
it, or after the new round formed. The reclaimed node's agent is left out, exits, and
its pod is started again by its workload on the still-tainted node, as a StatefulSet's
would be, so it tries to rejoin while no leader is present. Each run must end with the
job at n1, n3, the plan finished, and n2 kept out until its taint lifts.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
from regroup.controller.settings import ControllerSettings, ReformSettings
from regroup.controller.status import job_status, render
from regroup.keys import JobKeys
from regroup.records import CheckpointRequest, Exclusions, Progress, ReformPlan, ReformRequest, RoundState
from regroup.rendezvous.handler import EtcdV3RendezvousHandler
from regroup.rendezvous.joining import ExcludedFromRound
from regroup.rendezvous.settings import parse_settings
from kubeapi import objects

from .harness import NS, Cluster, fast_settings, notes, sample, until
from .harness import replica as harness_replica

JOB = "llama"
KEYS = JobKeys(NS, JOB)
SPOT = "aws-node-termination-handler/spot-itn"
WAIT = 30.0


@dataclass
class NodeAgent:
    """One node's torchrun agent as the rendezvous sees it, in a thread: join, run until
    the rendezvous reports a change, join again. Left out of a round, it exits cleanly and
    its pod's workload starts a new one on the same node (``restarts``)."""

    endpoint: str
    node: str
    hold: threading.Event
    """While set, a running agent does not re-enter the rendezvous (the test pins a phase)."""
    rounds: list[tuple[int, int]] = field(default_factory=list)
    restarts: int = 0
    error: BaseException | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    """Orders a new handler against ``stop``: none is made once stopping began."""
    _handler: EtcdV3RendezvousHandler | None = None
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"agent-{self.node}", daemon=True)
        self._thread.start()

    def _new_handler(self) -> EtcdV3RendezvousHandler:
        settings = parse_settings(
            endpoint=self.endpoint, run_id=JOB, min_nodes=2, max_nodes=3,
            conf={"lease_ttl": "2", "last_call_timeout": "0.3", "join_timeout": "60"},
            env={"NODE_NAME": self.node, "POD_NAME": f"{JOB}-{self.node}", "POD_NAMESPACE": NS},
            local_addr="127.0.0.1", local_world_size=1,
        )  # fmt: skip
        return EtcdV3RendezvousHandler(settings)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop.is_set():
                    return
                handler = self._handler = self._new_handler()
            try:
                while not self._stop.is_set():
                    info = handler.next_rendezvous()
                    self.rounds.append((handler.round, info.world_size))
                    # torchrun's monitor loop: poll until the rendezvous reports a change.
                    while not self._stop.wait(0.05):
                        if not self.hold.is_set() and handler.num_nodes_waiting():
                            break
            except ExcludedFromRound:
                self.restarts += 1  # exit 0; the workload starts the pod again
            except BaseException as exc:  # noqa: BLE001 - stop() shuts the handler under a waiting join
                if not self._stop.is_set():
                    self.error = exc
                return
            finally:
                handler.shutdown()

    def waiting_excluded(self) -> bool:
        """Its rendezvous decided to wait because the node is excluded (it joins nothing)."""
        handler = self._handler
        return handler is not None and handler.round == 0 and "is excluded from the job" in handler.waiting_for

    def stop(self) -> None:
        with self._lock:
            self._stop.set()
            handler = self._handler
        if handler is not None:
            handler.shutdown()  # unblocks a next_rendezvous still waiting
        if self._thread is not None:
            self._thread.join(30)
            assert not self._thread.is_alive(), f"agent {self.node} did not stop"


class Trainer:
    """Rank 0 of the trainer, as the controller sees it: an ack for each checkpoint request
    (once ``acks`` is set) and a progress record for each newly formed round (once
    ``reports`` is set)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.acks = asyncio.Event()
        self.reports = asyncio.Event()
        self.step = 10

    async def run(self) -> None:
        acked, reported = 0, 0
        while True:
            request = await self.cluster.read(KEYS.checkpoint, CheckpointRequest)
            if self.acks.is_set() and request is not None and request.generation > acked:
                await self.cluster.ack(JOB, request.generation, self.step, 0)
                acked = request.generation
            state = await self.cluster.read(KEYS.rdzv + "state", RoundState)
            if self.reports.is_set() and state is not None and state.round > reported:
                self.step += 1
                await self.cluster.progress(JOB, self.step, len(state.nodes), resumed_from=self.step - 1)
                reported = state.round
            await asyncio.sleep(0.05)


def settings(identity: str) -> ControllerSettings:
    base = fast_settings(identity)
    # Short phase deadlines: a plan that cannot finish must end within the test.
    reform = ReformSettings(rendezvous_timeout=timedelta(seconds=20), resume_timeout=timedelta(seconds=20))
    return ControllerSettings(runtime=base.runtime, kube=base.kube, reform=reform)


@contextlib.asynccontextmanager
async def replica(kube_api, kubeconfig, etcd_settings, identity: str):
    """One controller replica behind leader election (``harness.replica``)."""
    async with harness_replica(kube_api, kubeconfig, etcd_settings, settings(identity)) as running:
        yield running


async def _stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("killed", ["before-the-ack", "after-the-ack", "after-the-round-formed"])
async def test_a_leader_lost_mid_shrink_ends_at_the_right_size_with_the_leaving_node_kept_out(
    killed, kube_api, kubeconfig, etcd, etcd_settings, etcd_client
) -> None:
    cluster = Cluster(kube_api, etcd_client)
    hold = threading.Event()
    agents = {n: NodeAgent(etcd.endpoint, n, hold) for n in ("n1", "n2", "n3")}
    trainer = Trainer(cluster)
    for node in agents:
        cluster.add_node(node)
        cluster.add_pod(JOB, node, notes(2, 3, join_window="1s"))
    trainer_task = asyncio.create_task(trainer.run())
    try:
        for agent in agents.values():
            agent.start()
        first = await cluster.wait_record(KEYS.rdzv + "state", RoundState, lambda s: len(s.nodes) == 3, WAIT)
        survivors = [n for n in first.nodes if n != "n2"]  # in their positions: the round's rank order
        trainer.reports.set()
        # A reclaim is planned only for a job whose trainer has reported: the leader must
        # find round 1's progress in its first listing, whatever the machine's load.
        await cluster.wait_record(KEYS.progress, Progress, timeout=WAIT)
        async with replica(kube_api, kubeconfig, etcd_settings, "ctl-a") as (a, a_task, _):
            await until(lambda: a.leading, WAIT)
            async with replica(kube_api, kubeconfig, etcd_settings, "ctl-b") as (b, _, b_metrics):
                kube_api.patch("Node", "n2", {"spec": {"taints": [objects.taint(SPOT)]}})
                request = await cluster.wait_record(KEYS.checkpoint, CheckpointRequest, timeout=WAIT)
                excluded = await cluster.wait_record(KEYS.excluded, Exclusions, lambda e: "n2" in e.nodes, WAIT)
                assert SPOT in excluded.nodes["n2"]
                if killed == "before-the-ack":
                    await _stop(a_task)
                    trainer.acks.set()
                elif killed == "after-the-ack":
                    hold.set()  # the agents see the re-form request only after the leader is gone
                    trainer.acks.set()
                    await cluster.wait_record(KEYS.reform, ReformRequest, lambda r: r.generation == request.generation, WAIT)
                    await _stop(a_task)
                    hold.clear()
                else:
                    trainer.reports.clear()  # the trainer resumes only after the leader is gone
                    trainer.acks.set()
                    await cluster.wait_record(KEYS.plan, ReformPlan, lambda p: p.phase == "resume", WAIT)
                    await _stop(a_task)
                    trainer.reports.set()
                await until(lambda: b.leading, WAIT)
                plan = await cluster.wait_record(
                    KEYS.plan, ReformPlan, lambda p: p.generation == request.generation and p.phase == "done", WAIT
                )
                assert plan.outcome == "completed" and plan.nodes_after == survivors, plan
                state = await cluster.read(KEYS.rdzv + "state", RoundState)
                assert state.nodes == survivors
                # The left-out agent exited and came back on the tainted node: it waits outside.
                await until(lambda: agents["n2"].restarts >= 1 and agents["n2"].waiting_excluded(), WAIT)
                report = await job_status(KEYS, etcd_settings)
                assert "excluded: n2 (taint " + SPOT in render(report)
                assert sample(b_metrics, "regroup_reforms_abandoned_total", namespace=NS, job=JOB, cause="reclaim",
                              phase="resume", outcome="timeout") == 0
                # The taint lifts: so does the exclusion, and the job grows back to three.
                kube_api.patch("Node", "n2", {"spec": {"taints": []}})
                await cluster.wait_record(KEYS.excluded, Exclusions, lambda e: not e.nodes, WAIT)
                grown = await cluster.wait_record(KEYS.rdzv + "state", RoundState, lambda s: len(s.nodes) == 3, WAIT)
                assert sorted(grown.nodes) == ["n1", "n2", "n3"]
        assert all(agent.error is None for agent in agents.values()), {n: a.error for n, a in agents.items()}
    finally:
        await _stop(trainer_task)
        for agent in agents.values():
            agent.stop()
