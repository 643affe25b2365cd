"""The local cluster adapter: nodes are process trees, with Kubernetes' signals."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import pytest

from regroup.controller.cluster import JOB_LABEL, NodeInfo, ObjectRef, PodInfo
from regroup.demo.local_cluster import LocalCluster
from regroup.demo.nodes import RunLayout, make_launcher, pod_annotations
from regroup.demo.processes import AgentCommand
from regroup.demo.scenario import load_scenario, resolve_scenario_path
from tests.changes import Changes

# An "agent" that, like torchrun, starts its worker in a session of its own, then waits.
# It exits with an error on the attempts listed in argv[3], cleanly once with "clean",
# with 75 (left the job) at its first attempt with "left", and ignores SIGTERM with "stubborn".
AGENT = """
import os, signal, subprocess, sys, time
attempt = int(sys.argv[1]); out = sys.argv[2]
if sys.argv[3] == 'clean':
    if not os.path.exists(out + '.left'):
        open(out + '.left', 'w').close()
        sys.exit(0)
elif sys.argv[3] == 'left':
    if attempt == 0:
        sys.exit(75)
elif sys.argv[3] == 'stubborn':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif attempt in {int(a) for a in sys.argv[3].split(',') if a}:
    sys.exit(3)
worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)
with open(out, 'a') as f:
    f.write(f'{attempt} {os.getpid()} {worker.pid}\\n')
time.sleep(600)
"""


class Sink(Changes):
    """A ClusterSink that remembers the latest view and lets a test await a condition."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: dict[str, NodeInfo] = {}
        self.pods: dict[str, PodInfo] = {}
        self.deleted_nodes: list[str] = []
        self.deleted_pods: list[str] = []
        self.lists = 0
        """Full lists received (the first one, then one per relist)."""

    def node_changed(self, node: NodeInfo) -> None:
        self.nodes[node.name] = node
        self.changed()

    def node_deleted(self, name: str) -> None:
        self.nodes.pop(name, None)
        self.deleted_nodes.append(name)
        self.changed()

    def pod_changed(self, pod: PodInfo) -> None:
        self.pods[pod.name] = pod
        self.changed()

    def pod_deleted(self, namespace: str, name: str) -> None:
        self.pods.pop(name, None)
        self.deleted_pods.append(name)
        self.changed()

    def resynced(self, nodes: list[NodeInfo], pods: list[PodInfo]) -> None:
        self.nodes = {n.name: n for n in nodes}
        self.pods = {p.name: p for p in pods}
        self.lists += 1
        self.changed()


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def wait_for_lines(path: Path, count: int, timeout: float = 20.0) -> list[list[int]]:
    """The agent's "started" lines; the agent writes them once, so this polls its file."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [[int(x) for x in line.split()] for line in lines]
        await asyncio.sleep(0.05)
    raise TimeoutError(f"{path}: fewer than {count} lines after {timeout}s")


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[LocalCluster, Sink, Path]]:
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    fail_on: dict[str, str] = {"flaky": "0", "leaver": "clean", "left": "left", "stubborn": "stubborn"}

    def launch(node: str, pod: str, attempt: int) -> AgentCommand:
        argv = [sys.executable, str(script), str(attempt), str(tmp_path / f"{node}.pids"), fail_on.get(node, "")]
        return AgentCommand(argv, {"PATH": "/usr/bin:/bin"}, tmp_path / f"{node}.log")

    local = LocalCluster(
        "default", "job-a", {"regroup.dev/min-nodes": "1", "regroup.dev/max-nodes": "2"}, launch,
        restart_backoff=timedelta(milliseconds=100), stop_grace=timedelta(seconds=2),
    )  # fmt: skip
    sink = Sink()
    source = asyncio.create_task(local.run(sink))
    try:
        yield local, sink, tmp_path
    finally:
        await local.stop()
        source.cancel()
        await asyncio.gather(source, return_exceptions=True)


async def test_a_node_brings_a_labelled_pod_with_the_job_annotations(cluster) -> None:
    local, sink, _ = cluster
    await local.add_node("node-1")
    await sink.until(lambda: "node-1-worker" in sink.pods and "node-1" in sink.nodes)
    pod = sink.pods["node-1-worker"]
    assert (pod.node, pod.job, pod.labels[JOB_LABEL], pod.namespace) == ("node-1", "job-a", "job-a", "default")
    assert pod.annotations["regroup.dev/max-nodes"] == "2"
    assert sink.nodes["node-1"].ready and not sink.nodes["node-1"].unschedulable


async def test_a_job_that_wants_spares_says_so_on_its_pods_and_to_its_rendezvous(tmp_path: Path) -> None:
    """The spares scenario's pods carry ``regroup.dev/spare-nodes`` for the controller; its
    agents pass ``spare_nodes`` to the etcd-v3 rendezvous, and in place they are
    ``regroup-run --standby``: a spare's workers are started before it joins, warm."""
    spares = load_scenario(resolve_scenario_path("spares"))
    layout = RunLayout(tmp_path / "run")
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    real = make_launcher(spares, "regroup", layout, "127.0.0.1:2379", tmp_path / "trainer.yaml")

    def launch(node: str, pod: str, attempt: int) -> AgentCommand:
        argv = [sys.executable, str(script), str(attempt), str(tmp_path / f"{node}.pids"), ""]
        return AgentCommand(argv, {"PATH": "/usr/bin:/bin"}, tmp_path / f"{node}.log")

    local = LocalCluster("default", spares.job.name, pod_annotations(spares, "127.0.0.1:2379"), launch)
    sink = Sink()
    source = asyncio.create_task(local.run(sink))
    try:
        await local.add_node("node-5")
        await sink.until(lambda: "node-5-worker" in sink.pods)
        annotations = sink.pods["node-5-worker"].annotations
        assert annotations["regroup.dev/spare-nodes"] == "1"
        assert (annotations["regroup.dev/max-nodes"], annotations["regroup.dev/rdzv-endpoint"]) == ("4", "127.0.0.1:2379")
    finally:
        await local.stop()
        source.cancel()
        await asyncio.gather(source, return_exceptions=True)
    argv = real("node-5", "node-5-worker", 0).argv
    assert argv[1:4] == ["-m", "regroup.rendezvous.inplace.launcher", "--standby"]
    assert "--rdzv-conf=spare_nodes=1" in argv and "--nnodes=2:4" in argv
    # The restart path asks for the spare too (its spare's workers start once it is let in);
    # plain torchrun's c10d rendezvous knows no spares.
    restart = make_launcher(spares, "regroup-restart", layout, "127.0.0.1:2379", tmp_path / "trainer.yaml")
    assert "--rdzv-conf=spare_nodes=1" in restart("node-5", "node-5-worker", 0).argv
    c10d = make_launcher(spares, "torchrun-c10d", layout, "127.0.0.1:29400", tmp_path / "trainer.yaml")
    assert not any("spare_nodes" in a for a in c10d("node-5", "node-5-worker", 0).argv)
    # A job that wants none says nothing to its rendezvous.
    default_scenario = load_scenario(resolve_scenario_path("default"))
    default = make_launcher(default_scenario, "regroup", layout, "127.0.0.1:2379", tmp_path / "trainer.yaml")
    assert not any("spare_nodes" in a for a in default("node-1", "node-1-worker", 0).argv)


async def test_node_loss_kills_the_agent_and_its_workers_in_their_own_sessions(cluster) -> None:
    local, sink, tmp = cluster
    await local.add_node("node-1")
    [[_, agent, worker]] = await wait_for_lines(tmp / "node-1.pids", 1)
    assert alive(agent) and alive(worker)
    await local.remove_node("node-1")
    await sink.until(lambda: "node-1" in sink.deleted_nodes and "node-1-worker" in sink.deleted_pods)
    assert not alive(agent)
    # The worker was in another session; it died too. (An orphan may linger as a zombie of init.)
    await asyncio.wait_for(_gone(worker), 5)
    assert local.node("node-1") is None and local.pod_on("node-1") is None


async def _gone(pid: int) -> None:
    while alive(pid):
        await asyncio.sleep(0.05)


async def test_a_failing_agent_restarts_in_place_and_the_pod_counts_it(cluster) -> None:
    local, sink, tmp = cluster
    await local.add_node("flaky")
    await sink.until(lambda: sink.pods.get("flaky-worker") is not None and sink.pods["flaky-worker"].restart_count == 1)
    [[attempt, agent, _]] = await wait_for_lines(tmp / "flaky.pids", 1)
    assert attempt == 1 and local.agent_pid("flaky") == agent
    assert sink.pods["flaky-worker"].phase == "Running"
    # As a kubelet reports lastState.terminated: the restart followed a failure (exit 3).
    assert [(c.count, c.last_failed) for c in sink.pods["flaky-worker"].containers] == [(1, True)]


async def test_an_agent_that_left_the_job_is_restarted_and_that_is_no_failure(cluster) -> None:
    """Exit 75 (``regroup.exit_codes.LEFT_JOB``) restarts the container in place, as
    ``restartPolicy: Always`` does, and the restart is reported as no failure."""
    local, sink, tmp = cluster
    await local.add_node("left")
    await sink.until(lambda: sink.pods.get("left-worker") is not None and sink.pods["left-worker"].restart_count == 1)
    [[attempt, _, _]] = await wait_for_lines(tmp / "left.pids", 1)
    assert attempt == 1
    assert [(c.count, c.last_failed) for c in sink.pods["left-worker"].containers] == [(1, False)]


async def test_an_agent_that_leaves_cleanly_gets_a_fresh_pod(cluster) -> None:
    local, sink, tmp = cluster
    await local.add_node("leaver")
    [[attempt, agent, _]] = await wait_for_lines(tmp / "leaver.pids", 1)
    assert attempt == 0 and local.agent_pid("leaver") == agent
    # The finished pod was replaced, not restarted in place (its process may write its pids
    # before the watch delivers the deletion and the new pod: await them).
    await sink.until(lambda: "leaver-worker" in sink.deleted_pods and "leaver-worker" in sink.pods)
    assert sink.pods["leaver-worker"].restart_count == 0


async def test_crashing_workers_leaves_the_agent_running(cluster) -> None:
    local, _, tmp = cluster
    await local.add_node("node-1")
    [[_, agent, worker]] = await wait_for_lines(tmp / "node-1.pids", 1)
    assert local.crash_workers("node-1") == 1
    await asyncio.wait_for(_gone(worker), 5)
    assert alive(agent)


async def test_cordon_marks_the_node_and_a_deleted_pod_does_not_come_back(cluster) -> None:
    local, sink, tmp = cluster
    await local.add_node("node-1")
    [[_, agent, worker]] = await wait_for_lines(tmp / "node-1.pids", 1)
    await local.cordon("node-1", "3 rank restarts in 2m", "regroup.dev/restart-storm", now=1234.0)
    await sink.until(lambda: sink.nodes["node-1"].unschedulable)
    node = sink.nodes["node-1"]
    assert [t.key for t in node.taints] == ["regroup.dev/restart-storm"]
    assert "3 rank restarts" in node.annotations["regroup.dev/cordon-reason"]
    await local.delete_pod("default", "node-1-worker", "restart storm")
    await sink.until(lambda: "node-1-worker" in sink.deleted_pods)
    assert not alive(agent)
    await asyncio.wait_for(_gone(worker), 5)
    assert local.pod_on("node-1") is None
    assert [e.reason for e in local.events if e.name == "node-1"][-1] == "Cordoned"
    await local.post_event(ObjectRef("Node", "node-1"), "Warning", "RestartStorm", "cordoned")
    assert local.events[-1].reason == "RestartStorm" and local.events[-1].source == "controller"


async def test_a_deleted_pod_on_a_schedulable_node_is_replaced(cluster) -> None:
    local, sink, tmp = cluster
    await local.add_node("node-1")
    await wait_for_lines(tmp / "node-1.pids", 1)
    # The pod's process may write its pids before the watch delivers the pod: await that too.
    await sink.until(lambda: "node-1-worker" in sink.pods)
    uid = sink.pods["node-1-worker"].uid
    await local.delete_pod("default", "node-1-worker", "evicted")
    await sink.until(lambda: "node-1-worker" in sink.pods and sink.pods["node-1-worker"].uid != uid)
    await wait_for_lines(tmp / "node-1.pids", 2)


async def test_an_eviction_sigterms_the_agent_and_kills_its_tree_at_the_grace_end(cluster) -> None:
    """As the API server and a kubelet carry an eviction out: the condition, then the
    deletion with its deadline; SIGTERM at once (ignored here), SIGKILL of the whole tree
    when the grace is over; then the pod is gone and a new one starts on the node."""
    local, sink, tmp = cluster
    await local.add_node("stubborn")
    [[_, agent, worker]] = await wait_for_lines(tmp / "stubborn.pids", 1)
    await sink.until(lambda: "stubborn-worker" in sink.pods)
    uid = sink.pods["stubborn-worker"].uid
    evicted_at = asyncio.get_running_loop().time()
    await local.evict("stubborn", timedelta(seconds=1))
    await sink.until(lambda: sink.pods["stubborn-worker"].deleting)
    pod = sink.pods["stubborn-worker"]
    assert pod.disruption is not None and pod.disruption.reason == "EvictionByEvictionAPI"
    assert pod.deletion_grace_seconds == 1.0 and pod.deletion_deadline is not None
    assert alive(agent), "SIGTERM is a notice: the agent lives on until the grace is over"
    await sink.until(lambda: "stubborn-worker" in sink.deleted_pods, timeout=10)
    assert asyncio.get_running_loop().time() - evicted_at >= 1.0
    assert not alive(agent)
    await asyncio.wait_for(_gone(worker), 5)
    await sink.until(lambda: "stubborn-worker" in sink.pods and sink.pods["stubborn-worker"].uid != uid)
    assert not sink.pods["stubborn-worker"].deleting


async def test_a_drain_cordons_then_evicts_and_an_uncordon_brings_a_new_pod(cluster) -> None:
    local, sink, tmp = cluster
    await local.add_node("node-1")
    [[_, agent, _]] = await wait_for_lines(tmp / "node-1.pids", 1)
    await local.drain("node-1", timedelta(seconds=5))
    await sink.until(lambda: "node-1-worker" in sink.deleted_pods)
    node = sink.nodes["node-1"]
    assert node.unschedulable and [t.key for t in node.taints] == ["node.kubernetes.io/unschedulable"]
    assert not alive(agent), "the agent stopped on SIGTERM, long before its grace"
    assert local.pod_on("node-1") is None, "no new pod on a cordoned node"
    await local.uncordon("node-1")
    await sink.until(lambda: "node-1-worker" in sink.pods and not sink.nodes["node-1"].unschedulable)
    await wait_for_lines(tmp / "node-1.pids", 2)


async def test_a_reclaim_notice_taints_the_node_then_it_dies(cluster) -> None:
    local, sink, tmp = cluster
    await local.add_node("node-1")
    [[_, agent, _]] = await wait_for_lines(tmp / "node-1.pids", 1)
    await local.reclaim_notice("node-1", "aws-node-termination-handler/spot-itn", timedelta(milliseconds=500))
    await sink.until(lambda: any(t.key == "aws-node-termination-handler/spot-itn" for t in sink.nodes["node-1"].taints))
    assert alive(agent)
    await sink.until(lambda: "node-1" in sink.deleted_nodes)
    assert not alive(agent)


async def test_a_dropped_watch_sees_the_gap_only_through_the_relist(cluster) -> None:
    local, sink, tmp = cluster
    await local.add_node("node-1")
    await sink.until(lambda: "node-1-worker" in sink.pods)
    assert local.drop_watches() == 1
    await local.remove_node("node-1")
    await local.add_node("node-2")
    assert local.drop_watches() == 0, "a broken watch does not break twice"
    assert local.relist() == 1
    await sink.until(lambda: sink.lists == 2)
    assert set(sink.nodes) == {"node-2"} and set(sink.pods) == {"node-2-worker"}
    # No change from the gap arrived on its own: the deletion is known from the list only.
    assert sink.deleted_nodes == [] and sink.deleted_pods == []
    await local.remove_node("node-2")
    await sink.until(lambda: "node-2" in sink.deleted_nodes)
    assert [e.reason for e in local.events if e.name == "watch"] == ["WatchDropped", "Relisted"]
