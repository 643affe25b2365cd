"""A node leaving a job that goes on, under ``regroup-run``, with a user's own script that
follows the documented opt-in loop.

Left out of the next round by the controller: ``world.rejoin()`` tells the script that its
node leaves the job (``LeavingJob``), and the node's agent goes past the hand-off at once,
instead of waiting out the hand-off timeout for a "leaving" report that ``rejoin`` used to
overwrite. The agent does not exit (0 would mark its pod succeeded for good): it stays with
fresh workers, is let back in when the controller names it again, and exits 75 only once it
stayed out for ``excluded_timeout`` (0 if the job finished meanwhile: that is success).

Told to stop (SIGTERM, as the kubelet stops a deleted, evicted or drained pod): the agent
keeps its workers training and says so in its member record, the controller leaves the node
out (a planned shrink), its workers hand over and it exits 75. With nobody to hand over to it
stops at once; with a controller that never acts, by its grace. Always 75, never torch's
"death signal" exit.

Real etcd, real ``regroup-run`` agents, real gloo workers (tests/rendezvous/optin_worker.py);
the test plays the controller by writing its etcd records.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from regroup.demo.etcd_server import EtcdServer
from regroup.exit_codes import LEFT_JOB
from regroup.rendezvous.inplace.agent import HANDOFF_TIMEOUT_S, LEFT_OUT
from regroup.rendezvous.inplace.agent_notice import LEAVING, TERM_NOTICE
from regroup.rendezvous.inplace.channel import WAIT_EXPIRED
from regroup.rendezvous.inplace.notice import TERM_MARGIN_S
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
            if r.get("world_size") == world_size and r["round"] > after_round and r["sum"] == world_size
        ]  # fmt: skip
        return rows if len(rows) >= steps else []

    def exited(self, node: str, timeout: float) -> int:
        """The node's agent's exit code, once it exited (within ``timeout`` seconds)."""
        wait_for(lambda: self.procs[node].poll() is not None, timeout, f"{node}'s agent exiting")
        return self.procs[node].returncode

    def no_death_signal(self, node: str) -> None:
        """torch's own answer to SIGTERM (stop the workers, exit 1) did not run."""
        assert "death signal" not in self.log(node), self.log(node)[-3000:]

    def start_all(self, nodes: list[str], **start: Any) -> dict[str, list[dict[str, Any]]]:
        """Start ``nodes`` as the expected membership; their steps once all train together."""
        self.expect(0, nodes, "start")
        for node in nodes:
            self.start(node, **start)
        n = len(nodes)
        return {node: wait_for(lambda node=node: self.trained(node, n), 120, f"{node} training at {n} ranks")
                for node in nodes}  # fmt: skip


@pytest.fixture
def job(etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]) -> Iterator[OptInJob]:
    running = OptInJob(etcd.endpoint, tmp_path / "job", worker_env)
    try:
        yield running
    finally:
        running.close()


def _round(steps: dict[str, list[dict[str, Any]]]) -> int:
    return max(r["round"] for rows in steps.values() for r in rows)


@pytest.mark.parametrize("standby", [False, True], ids=["plain", "standby"])
def test_a_node_left_out_hands_over_at_once_stays_and_is_let_back_in(job: OptInJob, standby: bool) -> None:
    nodes = ["a", "b", "c"]
    job.claim_control()
    first = job.start_all(nodes, standby=standby)
    pids = {n: job.workers(n) for n in nodes}
    assert all(len(p) == 1 for p in pids.values()), pids
    before = job.members()["c"]["joined_at"]

    job.reform(1, ["a", "b"], cause="reclaim")
    shrunk = {n: wait_for(lambda n=n: job.trained(n, 2, after_round=_round(first)), 120, f"{n} training at 2 ranks")
              for n in ("a", "b")}  # fmt: skip
    # Past the hand-off by now, or within moments: not after the hand-off timeout, which the
    # agent used to wait out for a "leaving" report that rejoin() overwrote.
    wait_for(lambda: job.events("c", LEFT_OUT), HANDOFF_TIMEOUT_S / 3, "c's agent past the hand-off")
    log_c = job.log("c")
    assert not job.events("c", WAIT_EXPIRED), log_c[-3000:]
    assert job.events("c", "workers left their world; leaving the job"), log_c[-3000:]
    # rejoin() told the script that its node leaves the job (LeavingJob, an exit with 0).
    assert job.events("c", "this node leaves the job; leaving the script"), log_c[-3000:]
    # Its script's clean-up after LeavingJob ran to the end: the agent let the workers end
    # on their own before it stopped them.
    wait_for(lambda: [r for r in job.steps("c") if r.get("left")], 30, "c's script cleaning up")
    assert {r["pid"] for r in job.steps("c") if r.get("left")} == set(pids["c"])
    wait_for(lambda: job.events("c", "leaving workers ended on their own"), 30, "c's agent seeing its workers end")
    # The survivors re-formed in place: same processes, new world, nothing expired.
    assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}
    for node in ("a", "b"):
        assert {r["pid"] for r in job.steps(node)} == set(pids[node])
        assert job.events(node, "re-formed in place"), job.log(node)[-3000:]
        assert not job.events(node, WAIT_EXPIRED), job.log(node)[-3000:]

    # c's agent did not report success (its workers' exit 0 is not the job's): it stays, as
    # a new agent of its node asking to join, in no round.
    job.await_joiner("c", after=before, timeout=60)
    assert job.procs["c"].poll() is None, log_c[-3000:]
    # The controller names it again: it is let back in, with fresh workers.
    job.reform(2, nodes, cause="grow")
    for node in nodes:
        wait_for(lambda n=node: job.trained(n, 3, after_round=_round(shrunk)), 120, f"{node} back at 3 ranks")
    assert job.workers("c") and job.workers("c") != pids["c"]
    assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}
    assert job.procs["c"].poll() is None


def test_a_node_left_out_exits_75_past_excluded_timeout_or_0_once_the_job_is_over(job: OptInJob) -> None:
    job.claim_control()
    job.expect(0, ["a", "b", "c"], "start")
    job.start("a", nnodes="1:3")
    job.start("b", nnodes="1:3", standby=False, conf="excluded_timeout=2")
    job.start("c", nnodes="1:3", standby=False)
    first = {n: wait_for(lambda n=n: job.trained(n, 3), 120, f"{n} training at 3 ranks") for n in ("a", "b", "c")}
    job.reform(1, ["a"], cause="reclaim")
    wait_for(lambda: job.trained("a", 1, after_round=_round(first)), 120, "a training alone")
    # b is not let back in within its excluded_timeout: it leaves a job that goes on.
    assert job.exited("b", 60) == LEFT_JOB, job.log("b")[-3000:]
    (left_out,) = job.events("b", LEFT_OUT)
    (leaving,) = job.events("b", LEAVING)
    assert "excluded_timeout 2s" in leaving["reason"], leaving
    assert _seconds(leaving) - _seconds(left_out) >= 2, (left_out, leaving)
    # c waits to be let back in; the job ends meanwhile (its rendezvous closed): that is success.
    wait_for(lambda: job.events("c", LEFT_OUT), 60, "c staying to be let back in")
    assert job.procs["c"].poll() is None, job.log("c")[-3000:]
    job.close_run()
    assert job.exited("c", 60) == 0, job.log("c")[-3000:]


def _seconds(event: dict[str, Any]) -> float:
    """When a log event was written (its ``timestamp``), in seconds."""
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def test_sigterm_with_a_controller_hands_the_node_over_and_exits_75(job: OptInJob) -> None:
    nodes, grace = ["a", "b", "c"], 60
    job.claim_control()
    first = job.start_all(nodes, flags=(f"--term-grace={grace}",))
    pids = {n: job.workers(n) for n in nodes}

    sent = job.terminate("c")
    # The notice is in c's member record, the controller's cue for a planned leave.
    member = wait_for(lambda: job.members()["c"]["leaving_by"] and job.members()["c"], 30, "c's notice in etcd")
    assert member["leaving_since"] >= sent - 1 and member["leaving_by"] == member["leaving_since"] + grace
    # c trains on meanwhile (its workers got no signal): more steps at 3 ranks after the notice.
    steps = len(job.trained("c", 3))
    wait_for(lambda: len(job.trained("c", 3)) > steps, 30, "c training on after its SIGTERM")
    assert job.workers("c") == pids["c"]

    # The controller's planned shrink without c.
    job.reform(1, ["a", "b"], cause="reclaim")
    for node in ("a", "b"):
        wait_for(lambda n=node: job.trained(n, 2, after_round=_round(first)), 120, f"{node} training at 2 ranks")
    assert job.exited("c", 60) == LEFT_JOB, job.log("c")[-3000:]
    assert time.time() - sent < grace - TERM_MARGIN_S, "c left once handed over, not at the end of its grace"
    (notice,) = job.events("c", TERM_NOTICE)
    assert notice["hands_over"], notice
    assert job.events("c", "workers left their world; leaving the job"), job.log("c")[-3000:]
    assert job.events("c", "this node leaves the job; leaving the script"), job.log("c")[-3000:]
    (leaving,) = job.events("c", LEAVING)
    assert "left out of the job's round on notice" in leaving["reason"], leaving
    job.no_death_signal("c")
    # The survivors re-formed in place.
    assert {n: job.workers(n) for n in ("a", "b")} == {n: pids[n] for n in ("a", "b")}


def test_sigterm_with_nothing_to_hand_over_stops_at_once_else_by_the_grace_and_exits_75(job: OptInJob) -> None:
    nodes, grace = ["a", "b", "c"], 6
    job.start_all(nodes, flags=(f"--term-grace={grace}",))

    # No controller leads the job: c stops at once (not at the end of its grace).
    sent = job.terminate("c")
    assert job.exited("c", 30) == LEFT_JOB, job.log("c")[-3000:]
    assert time.time() - sent < grace
    (notice,) = job.events("c", TERM_NOTICE)
    assert not notice["hands_over"] and "no controller leads the job" in notice["reason"], notice
    (leaving,) = job.events("c", LEAVING)
    assert "no controller leads the job" in leaving["reason"], leaving
    job.no_death_signal("c")
    for node in ("a", "b"):
        wait_for(lambda n=node: job.trained(n, 2), 120, f"{node} training at 2 ranks without c")

    # A controller leads, but never leaves b out: b trains on, then stops by its grace. (A
    # re-form after the controller key: the agents have read the key once they formed it.)
    job.claim_control()
    job.reform(1, ["a", "b"])
    before = job.members()["b"]["round"]
    wait_for(lambda: job.members()["b"]["round"] > before and job.trained("b", 2, after_round=before), 120,
             "a and b re-formed after the controller key")  # fmt: skip

    # A node told to stop while it waits inside the rendezvous (a joiner the controller has
    # not let in) has nothing to hand over: it stops waiting at once.
    job.start("d", standby=False, flags=(f"--term-grace={grace}",))
    wait_for(lambda: "d" in job.members(), 60, "d waiting to join")
    sent = job.terminate("d")
    assert job.exited("d", 30) == LEFT_JOB, job.log("d")[-3000:]
    assert time.time() - sent < grace
    (leaving,) = job.events("d", LEAVING)
    assert "nothing to hand over" in leaving["reason"], leaving
    job.no_death_signal("d")

    sent = job.terminate("b")
    wait_for(lambda: job.members()["b"]["leaving_by"], 30, "b's notice in etcd")
    assert job.exited("b", 30) == LEFT_JOB, job.log("b")[-3000:]
    took = time.time() - sent
    assert grace - TERM_MARGIN_S <= took < grace, took
    (notice,) = job.events("b", TERM_NOTICE)
    assert notice["hands_over"], notice
    (leaving,) = job.events("b", LEAVING)
    assert "not left out of the job within its grace of 6s" in leaving["reason"], leaving
    job.no_death_signal("b")
