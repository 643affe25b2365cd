"""When the demo counts a job as settled with spares: its usable nodes beyond the max wait,
warm, to join; and a flaky node a spare took the place of is dealt with."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from regroup.controller.cluster import NodeInfo, Taint
from regroup.demo.local_cluster import LocalCluster
from regroup.demo.nodes import RunLayout
from regroup.demo.recorder import JobRecorder
from regroup.demo.run_state import FlakyNode, RunState
from regroup.demo.runner import _unsettled
from regroup.demo.scenario import load_scenario, resolve_scenario_path
from regroup.etcd import EtcdSettings
from regroup.keys import JobKeys
from regroup.records import JoinRecord, Progress, RoundState

NODES = ("node-1", "node-2", "node-3", "node-4", "node-5")


@dataclass
class Nodes:
    """The part of the local cluster the settle check reads: its nodes."""

    infos: dict[str, NodeInfo] = field(default_factory=lambda: {n: NodeInfo(n) for n in NODES})

    def nodes(self) -> list[NodeInfo]:
        return list(self.infos.values())

    def node(self, name: str) -> NodeInfo | None:
        return self.infos.get(name)


def spares_run(tmp_path: Path, round_nodes: list[str], world_size: int = 4) -> tuple[RunState, Nodes]:
    """The spares scenario training in a round of ``round_nodes``, progress fresh."""
    run = RunState(load_scenario(resolve_scenario_path("spares")), "regroup", RunLayout(tmp_path))
    nodes = Nodes()
    run.cluster = cast(LocalCluster, nodes)
    run.recorder = JobRecorder(EtcdSettings.from_endpoint_string("127.0.0.1:2379"), JobKeys("default", "demo"),
                               *(tmp_path / f for f in ("p.jsonl", "m.jsonl", "plans.jsonl")))  # fmt: skip
    view = run.recorder.view
    view.round_state = RoundState(min_nodes=2, max_nodes=4, round=3, nodes=round_nodes)
    view.progress = Progress(step=50, loss=1.0, samples_seen=600, world_size=world_size, time=time.time(), round=3)
    view.progress_seen_at = time.time()
    return run, nodes


def join(node: str, **extra: Any) -> JoinRecord:
    return JoinRecord(node=node, agent=f"{node}@1.0", round=4, host="h", joined_at=1.0, **extra)


def test_a_job_at_max_waits_for_its_spare_to_join_warm(tmp_path: Path) -> None:
    run, _ = spares_run(tmp_path, ["node-1", "node-2", "node-3", "node-4"])
    assert _unsettled(run) == "0 of 1 spare node(s) waiting to join"
    run.recorder.view.joins["node-5"] = join("node-5", not_before=time.time() + 60)
    assert _unsettled(run) == "0 of 1 spare node(s) waiting to join", "on probation it is no spare"
    run.recorder.view.joins["node-5"] = join("node-5")
    assert _unsettled(run) == ""


def test_a_node_under_a_reclaim_notice_is_not_expected_to_wait(tmp_path: Path) -> None:
    run, nodes = spares_run(tmp_path, ["node-1", "node-5", "node-3", "node-4"])
    nodes.infos["node-2"] = NodeInfo("node-2", taints=(Taint("aws-node-termination-handler/spot-itn", "1", "NoSchedule"),))
    assert _unsettled(run) == ""


def test_a_flaky_node_a_spare_took_the_place_of_is_dealt_with(tmp_path: Path) -> None:
    # node-5 trains in node-1's position; node-1, back from probation, waits as the spare.
    run, _ = spares_run(tmp_path, ["node-5", "node-2", "node-3", "node-4"])
    run.flaky["node-1"] = FlakyNode("node-1", crash_after_steps=5)
    run.recorder.view.joins["node-1"] = join("node-1")
    run.dealt_with["node-1"] = time.time() - 10  # the job has trained since
    assert _unsettled(run, final=True) == ""
    # Still in the world, or out of it while the job trains below its max: not dealt with.
    in_world, _ = spares_run(tmp_path, ["node-1", "node-2", "node-3", "node-4"])
    in_world.flaky["node-1"] = FlakyNode("node-1", crash_after_steps=5)
    in_world.recorder.view.joins["node-5"] = join("node-5")
    assert _unsettled(in_world, final=True) == "flaky node-1 not cordoned"
    shrunk, nodes = spares_run(tmp_path, ["node-2", "node-3", "node-4"], world_size=3)
    del nodes.infos["node-5"]
    shrunk.flaky["node-1"] = FlakyNode("node-1", crash_after_steps=5)
    assert _unsettled(shrunk, final=True) == "flaky node-1 not cordoned"
