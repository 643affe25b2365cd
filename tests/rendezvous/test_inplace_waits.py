"""The waits of the in-place hand-off, on both sides of the node's channel, without agents.

``ElasticWorld.rejoin`` on a node that is left out raises ``LeavingJob`` (whether the
announcement came before or during its wait); the agent of a leaving node counts a worker
as gone once it reported "leaving", or "waiting" since the announcement, and waits for one
still "running" (its hand-off may be under way); and every such wait that runs out logs one
``WAIT_EXPIRED`` warning saying what it waited for and who had not answered with what.
The test writes the channel's files as the agent and the workers do; no process group forms.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import regroup.rendezvous.inplace.agent as agent_module
import regroup.rendezvous.inplace.world as world_module
from regroup.rendezvous.inplace import agent_notice
from regroup.rendezvous.inplace.agent import InPlaceAgent, _left_since, _started
from regroup.rendezvous.inplace.agent_notice import LEAVING_EXIT_S
from regroup.rendezvous.inplace.channel import (
    CHANNEL_ENV,
    WAIT_EXPIRED,
    WORLD_FILE,
    NodeWorld,
    RankSlot,
    WorkerReport,
    report_name,
    write_atomically,
)
from regroup.rendezvous.inplace.membership import LeavingJob, Membership, ReformFailed
from regroup.rendezvous.inplace.world import ElasticWorld


class Recorder:
    """Stands in for a module's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Any:
        return lambda event, **fields: self.events.append((level, event, fields))

    def named(self, event: str) -> list[dict[str, Any]]:
        return [fields for _, name, fields in self.events if name == event]


@pytest.fixture
def world_log(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(world_module, "log", recorder)
    return recorder


@pytest.fixture
def agent_log(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(agent_module, "log", recorder)
    monkeypatch.setattr(agent_notice, "log", recorder)
    return recorder


def _node_world(seq: int, round: int, *, pending: bool = False, leaving: bool = False, reason: str = "") -> bytes:
    return NodeWorld(
        seq=seq, round=round, pending=pending, master_addr="" if pending else "127.0.0.1",
        master_port=0 if pending else 1, group_rank=-1 if pending else 0, group_world_size=-1 if pending else 2,
        slots={} if pending else {"0": RankSlot(1, 2, 1, 2)}, reason=reason, leaving=leaving, written_at=time.time(),
    ).to_json()  # fmt: skip


def _running_world(channel: Path) -> ElasticWorld:
    """A worker of round 3 (rank 1 of 2), as after ``join``; no process group is made (it
    has left it already, so ``leave`` has nothing to drop)."""
    channel.mkdir()
    write_atomically(channel / WORLD_FILE, _node_world(1, 3))
    world = ElasticWorld({CHANNEL_ENV: str(channel), "LOCAL_RANK": "0"}, "gloo", timedelta(seconds=30),
                         timedelta(seconds=1), ())  # fmt: skip
    world.membership = Membership(round=3, rank=1, world_size=2, local_rank=0, master_addr="127.0.0.1",
                                  master_port=1, seq=1)  # fmt: skip
    return world


def _report(channel: Path) -> WorkerReport:
    report = WorkerReport.read(channel, 0)
    assert report is not None
    return report


def test_rejoin_on_a_node_announced_as_leaving_raises_leaving_job(tmp_path: Path, world_log: Recorder) -> None:
    channel = tmp_path / "channel"
    world = _running_world(channel)
    write_atomically(channel / WORLD_FILE, _node_world(2, 3, pending=True, leaving=True, reason="leaving the job"))
    assert world.reform_due()
    with pytest.raises(LeavingJob) as raised:
        world.rejoin(timeout=timedelta(seconds=30))
    # A SystemExit with code 0: the documented loop, which does not catch it, ends cleanly.
    assert isinstance(raised.value, SystemExit) and raised.value.code == 0
    assert "leaves the job" in str(raised.value)
    # The agent reads "leaving" (rejoin no longer overwrites it with "waiting").
    assert (_report(channel).state, _report(channel).round) == ("leaving", 3)
    assert world_log.named("this node leaves the job; leaving the script")
    assert not world_log.named(WAIT_EXPIRED)


def test_a_leaving_announcement_ends_a_rejoin_already_waiting(tmp_path: Path, world_log: Recorder) -> None:
    # The worker left on a failed collective (a peer went away) before its agent announced.
    channel = tmp_path / "channel"
    world = _running_world(channel)
    outcome: list[BaseException] = []

    def rejoin() -> None:
        try:
            world.rejoin(timeout=timedelta(seconds=60))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    waiter = threading.Thread(target=rejoin)
    waiter.start()
    try:
        deadline = time.monotonic() + 30
        while _report_state(channel) != "waiting" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _report_state(channel) == "waiting"
        write_atomically(channel / WORLD_FILE, _node_world(2, 3, pending=True, leaving=True))
    finally:
        waiter.join(30)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], LeavingJob), outcome
    assert _report(channel).state == "leaving"


def _report_state(channel: Path) -> str:
    report = WorkerReport.read(channel, 0)
    return report.state if report else ""


def test_a_wait_for_the_next_world_that_runs_out_says_what_the_agent_last_wrote(
    tmp_path: Path, world_log: Recorder
) -> None:
    channel = tmp_path / "channel"
    world = _running_world(channel)
    write_atomically(channel / WORLD_FILE, _node_world(2, 3, pending=True, reason="membership changed"))
    with pytest.raises(ReformFailed, match="no world handed out within"):
        world.rejoin(timeout=timedelta(milliseconds=100))
    (expired,) = world_log.named(WAIT_EXPIRED)
    assert expired["waited_for"] == "the world after round 3"
    assert (expired["timeout_s"], expired["rank"], expired["round"]) == (0.1, 1, 3)
    (agent,) = expired["not_answered"]
    assert agent["last_state"] == "pending" and agent["last_round"] == 3 and agent["last_seq"] == 2
    assert agent["reason"] == "membership changed"


def test_a_wait_for_this_nodes_announcement_that_runs_out_is_logged(tmp_path: Path, world_log: Recorder) -> None:
    world = _running_world(tmp_path / "channel")
    assert world.announcement(timedelta(milliseconds=50)) is None
    (expired,) = world_log.named(WAIT_EXPIRED)
    assert "announcement" in expired["waited_for"]
    assert expired["not_answered"][0]["last_state"] == "world handed out"


class _Agent:
    """The parts of ``InPlaceAgent`` that its waits on the workers read."""

    _await_workers = InPlaceAgent._await_workers
    _exited = InPlaceAgent._exited
    _check_notice = InPlaceAgent._check_notice

    def __init__(self, channel: Path, pids: dict[int, int]) -> None:
        self._notice = None
        self._channel = channel
        self._pcontext = SimpleNamespace(pids=lambda: pids, wait=lambda timeout: None, subprocess_handlers={})
        self._worker_group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=SimpleNamespace(node="c", round=4)))
        self._rounds = 4


def _write_report(channel: Path, local_rank: int, pid: int, state: str, written_at: float) -> None:
    report = WorkerReport(local_rank=local_rank, pid=pid, round=4, state=state, written_at=written_at)
    write_atomically(channel / report_name(local_rank), report.to_json())


def test_a_leaving_nodes_agent_waits_only_for_workers_still_in_their_world(tmp_path: Path, agent_log: Recorder) -> None:
    announced_at = time.time()
    pids = {0: 100, 1: 101, 2: 102, 3: 103, 4: 104}
    _write_report(tmp_path, 0, 100, "running", announced_at - 5)  # handing its shards over
    _write_report(tmp_path, 1, 101, "waiting", announced_at - 5)  # a world still forming
    _write_report(tmp_path, 2, 102, "leaving", announced_at - 5)  # left before the announcement
    _write_report(tmp_path, 3, 103, "waiting", announced_at + 0.01)  # rejoined after it
    _write_report(tmp_path, 4, 99, "running", announced_at - 60)  # an earlier process's report
    agent = _Agent(tmp_path, pids)
    assert not agent._await_workers("the hand-off", _left_since(announced_at), 0.1)
    (expired,) = agent_log.named(WAIT_EXPIRED)
    assert (expired["waited_for"], expired["timeout_s"]) == ("the hand-off", 0.1)
    assert (expired["node"], expired["round"]) == ("c", 4)
    assert [(w["local_rank"], w["pid"], w["last_state"]) for w in expired["not_answered"]] == [
        (0, 100, "running"),
        (1, 101, "waiting"),
    ]
    assert expired["not_answered"][0]["last_round"] == 4 and expired["not_answered"][0]["reported_s_ago"] >= 5

    # Both leave their world: the wait ends at once, with no warning.
    _write_report(tmp_path, 0, 100, "leaving", time.time())
    _write_report(tmp_path, 1, 101, "leaving", time.time())
    agent_log.events.clear()
    assert agent._await_workers("the hand-off", _left_since(announced_at), 5)
    assert not agent_log.named(WAIT_EXPIRED)


def test_a_start_up_wait_that_runs_out_names_the_workers_without_a_report(tmp_path: Path, agent_log: Recorder) -> None:
    _write_report(tmp_path, 0, 100, "waiting", time.time())
    _write_report(tmp_path, 1, 55, "running", time.time())  # the previous worker's
    agent = _Agent(tmp_path, {0: 100, 1: 101, 2: 102})
    assert not agent._await_workers("start-up", _started, 0.05)
    (expired,) = agent_log.named(WAIT_EXPIRED)
    assert [(w["local_rank"], w["last_state"]) for w in expired["not_answered"]] == [
        (1, "no report (the file is of an earlier process, pid 55)"),
        (2, "no report"),
    ]


class _LeavingAgent(_Agent):
    """An agent of a node that is left out, whose rendezvous is the test's."""

    _reform_in_place = InPlaceAgent._reform_in_place
    _announce = InPlaceAgent._announce
    _write = InPlaceAgent._write
    _let_leaving_workers_end = InPlaceAgent._let_leaving_workers_end

    def __init__(self, channel: Path, pids: dict[int, int], taken_back: bool) -> None:
        super().__init__(channel, pids)
        self.calls: list[str] = []
        self._pcontext.wait = self._workers_end
        self._seq = 0
        self.in_place_reforms = 0
        self.taken_back = taken_back
        self._worker_group.spec.rdzv_handler = SimpleNamespace(
            node="c", round=4, left_out=lambda: True, abandon_round=lambda: self.calls.append("abandon_round")
        )

    def _workers_end(self, timeout: float, period: float) -> object:
        """The workers, all "leaving", end on their own within ``timeout``."""
        self.calls.append(f"wait_for_workers(at most {timeout:g}s)")
        return SimpleNamespace(is_failed=lambda: False)

    def _rendezvous(self, worker_group: Any, publish: bool = True, in_world: bool = False) -> None:
        self.calls.append(f"rendezvous(publish={publish}, in_world={in_world})")
        if not self.taken_back:
            raise agent_module._LeftOut("left out")  # what the agent's own rendezvous does then

    def _restart_workers(self, worker_group: Any) -> None:
        self.calls.append("restart_workers")


@pytest.mark.parametrize("taken_back", [False, True], ids=["left-out", "taken-back"])
def test_a_leaving_nodes_agent_joins_once_its_workers_left(
    tmp_path: Path, agent_log: Recorder, taken_back: bool
) -> None:
    _write_report(tmp_path, 0, 100, "leaving", time.time())
    agent = _LeavingAgent(tmp_path, {0: 100}, taken_back)
    group = agent._worker_group
    group.workers = []
    agent._reform_in_place(group)
    if not taken_back:
        # Left out, not told to stop: its workers (which left their world, some perhaps with
        # exit 0) are replaced by fresh ones, and the agent asks to be let back in.
        # Its workers all reported "leaving": they end on their own (a script's clean-up
        # after LeavingJob runs to its end) before the agent stops and replaces them.
        assert agent.calls == [
            "rendezvous(publish=False, in_world=True)", f"wait_for_workers(at most {LEAVING_EXIT_S:g}s)", "restart_workers"
        ]  # fmt: skip
        assert agent_log.named("leaving workers ended on their own")
    else:
        # The controller took the node back after its workers were told to go: they are not
        # handed the round (some may have exited 0), they are restarted, as a membership change.
        assert agent.calls == ["rendezvous(publish=False, in_world=True)", "abandon_round", "restart_workers"]
        assert agent_log.named("taken into the round after its workers were told this node leaves; restarting them")
    announced = NodeWorld.read(tmp_path)
    assert announced is not None and announced.pending and announced.leaving
    assert agent_log.named("workers left their world; leaving the job") and not agent_log.named(WAIT_EXPIRED)


def test_a_node_is_leaving_when_the_round_formed_already_without_it() -> None:
    # The controller's expected membership is consumed once the survivors' round formed; an
    # agent that notices the re-form only then is still told its node leaves (its join
    # will be refused), so its workers hand their shards over instead of waiting for a world.
    def handler(node: str, joined: int, formed: int, excluded: list[str], expected_says: bool = False) -> Any:
        state = SimpleNamespace(round=formed, excluded=excluded)
        return SimpleNamespace(node=node, round=joined, view=SimpleNamespace(state=state), left_out=lambda: expected_says)

    assert agent_module._left_out(handler("c", 1, 1, [], expected_says=True))
    assert agent_module._left_out(handler("c", 1, 2, ["c@1790000000.25"]))
    assert not agent_module._left_out(handler("c", 1, 2, ["cc@1790000000.25"]))
    assert not agent_module._left_out(handler("c", 2, 2, ["c@1790000000.25"]))  # its own round: nothing new
    assert not agent_module._left_out(handler("c", 1, 2, []))  # formed without it: it joins the next one
