"""A user's own script that follows the documented opt-in loop, on a node that the
controller leaves out of the next round: ``world.rejoin()`` tells the script that its node
leaves the job (``LeavingJob``) and the node's agent exits at once, instead of waiting out
the hand-off timeout for a "leaving" report that ``rejoin`` used to overwrite at once.

Real etcd, real ``regroup-run`` agents, real gloo workers (tests/rendezvous/optin_worker.py);
the test plays the controller by writing its etcd records.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from regroup.demo.etcd_server import EtcdServer
from regroup.rendezvous.inplace.agent import HANDOFF_TIMEOUT_S
from regroup.rendezvous.inplace.channel import WAIT_EXPIRED
from tests.rendezvous.inplace_job import InPlaceJob, wait_for

pytestmark = pytest.mark.slow


class OptInJob(InPlaceJob):
    """Agents of one job whose workers run tests/rendezvous/optin_worker.py."""

    max_restarts = 0

    def worker(self) -> list[str]:
        (self.root / "steps").mkdir(exist_ok=True)
        return ["-m", "tests.rendezvous.optin_worker", str(self.root / "steps")]

    def steps(self, node: str) -> list[dict[str, Any]]:
        path = self.root / "steps" / f"steps-{node}-0.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass  # a line being written
        return rows

    def trained(self, node: str, world_size: int, after_round: int = 0, steps: int = 3) -> list[dict[str, Any]]:
        """``node``'s steps at ``world_size`` in a round after ``after_round`` (every rank in
        the all-reduce), once there are ``steps`` of them; else []."""
        rows = [
            r for r in self.steps(node)
            if r["world_size"] == world_size and r["round"] > after_round and r["sum"] == world_size
        ]  # fmt: skip
        return rows if len(rows) >= steps else []


@pytest.fixture
def job(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[OptInJob]:
    running = OptInJob(etcd.endpoint, tmp_path / "job", worker_env)
    try:
        yield running
    finally:
        running.close()


@pytest.mark.parametrize("standby", [False, True], ids=["plain", "standby"])
def test_a_script_calling_rejoin_on_a_node_left_out_leaves_at_once(job: OptInJob, standby: bool) -> None:
    nodes = ["a", "b", "c"]
    job.claim_control()
    job.expect(0, nodes, "start")
    for node in nodes:
        job.start(node, standby=standby)
    first = {n: wait_for(lambda n=n: job.trained(n, 3), 120, f"{n} training at 3 ranks") for n in nodes}
    pids = {n: job.workers(n) for n in nodes}
    assert all(len(p) == 1 for p in pids.values()), pids
    old_round = max(r["round"] for rows in first.values() for r in rows)

    job.reform(1, ["a", "b"], cause="reclaim")
    for node in ("a", "b"):
        wait_for(lambda n=node: job.trained(n, 2, after_round=old_round), 120, f"{node} training at 2 ranks")
    # The left-out node's agent is gone by now, or within moments: not after the hand-off
    # timeout, which it used to wait out for a "leaving" report that rejoin() overwrote.
    wait_for(lambda: job.procs["c"].poll() is not None, HANDOFF_TIMEOUT_S / 3, "c's agent exiting")
    log_c = job.log("c")
    assert job.procs["c"].returncode == 0, log_c[-3000:]
    assert not job.events("c", WAIT_EXPIRED), log_c[-3000:]
    assert job.events("c", "workers left their world; leaving the job"), log_c[-3000:]
    assert job.events("c", "left out of the next round; exiting"), log_c[-3000:]
    # rejoin() told the script that its node leaves the job (LeavingJob, an exit with 0).
    assert job.events("c", "this node leaves the job; leaving the script"), log_c[-3000:]
    # The survivors re-formed in place: same processes, new world, nothing expired.
    assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}
    for node in ("a", "b"):
        assert {r["pid"] for r in job.steps(node)} == set(pids[node])
        assert job.events(node, "re-formed in place"), job.log(node)[-3000:]
        assert not job.events(node, WAIT_EXPIRED), job.log(node)[-3000:]
