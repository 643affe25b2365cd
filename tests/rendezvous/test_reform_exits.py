"""A worker that exits during an in-place re-form is told apart by its agent, from the files
of the node's channel and the failure folder as the agent and the worker write them: one
line naming the likely cause, in the agent's log and its member record (the controller's
side: tests/controller/test_worker_exits.py)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs
from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from regroup.failures import FAILURE_DIR_ENV, record_failure
from regroup.rendezvous.inplace.agent import InPlaceAgent
from regroup.rendezvous.inplace.channel import (
    REFORMING,
    WORLD_FILE,
    NodeWorld,
    WorkerReport,
    report_name,
    write_atomically,
)
from regroup.rendezvous.inplace.exits import LIKELY_CAUSE, REFORM_EXIT, read_reform_exit

PID = 4242


def agent_wrote(channel: Path, round: int, pending: bool = False) -> None:
    world = NodeWorld(seq=3, round=round, pending=pending, master_addr="", master_port=0, group_rank=0,
                      group_world_size=2, written_at=time.time())  # fmt: skip
    write_atomically(channel / WORLD_FILE, world.to_json())


def worker_wrote(channel: Path, state: str, round: int, pid: int = PID) -> None:
    report = WorkerReport(local_rank=0, pid=pid, round=round, state=state, written_at=time.time())
    write_atomically(channel / report_name(0), report.to_json())


@pytest.mark.parametrize(
    ("agent", "worker", "exitcode", "said"),
    [
        # Told at an agreed boundary that its world ends, then gone: the re-form was taken from it.
        pytest.param((3, False), (REFORMING, 3), 1, True, id="told-at-the-boundary"),
        # Still running when its agent announced the re-form.
        pytest.param((3, True), ("running", 3), 1, True, id="announced"),
        # Left its world, waiting for the next one.
        pytest.param((3, True), ("waiting", 3), 2, True, id="waiting-for-the-next-world"),
        # A newer world was handed out and it never formed it.
        pytest.param((4, False), ("running", 3), 1, True, id="newer-world-handed-out"),
        # A crash in a steady world is a crash: nothing to say.
        pytest.param((3, False), ("running", 3), 1, False, id="steady-world"),
        # Killed by a signal (torch reports it negative): no script caught anything.
        pytest.param((3, True), (REFORMING, 3), -9, False, id="killed"),
        # Waiting for its first world: no re-form of it.
        pytest.param((3, False), ("waiting", 0), 1, False, id="first-world"),
    ],
)
def test_an_exit_during_a_reform_is_told_with_its_likely_cause(
    tmp_path: Path, agent: tuple[int, bool], worker: tuple[str, int], exitcode: int, said: bool
) -> None:
    agent_wrote(tmp_path, *agent)
    worker_wrote(tmp_path, *worker)
    found = read_reform_exit(tmp_path, "", 0, PID, exitcode)
    if not said:
        assert found is None
        return
    assert found is not None and found.round == 3
    assert found.note == f"{REFORM_EXIT} (exit {exitcode}): {LIKELY_CAUSE}"
    assert found.note == (
        f"the worker exited during an in-place re-form (exit {exitcode}): a wrapper or `except` in the script "
        "likely caught the re-form; put @elastic.in_place outermost or let regroup.elastic.Reform through"
    )


def test_an_exit_the_worker_explained_or_of_an_earlier_process_is_not_guessed_at(tmp_path: Path) -> None:
    channel, failures = tmp_path / "channel", tmp_path / "failures"
    channel.mkdir()
    failures.mkdir()
    agent_wrote(channel, 3, pending=True)
    worker_wrote(channel, REFORMING, 3, pid=PID - 1)  # the report of the worker before this one
    assert read_reform_exit(channel, str(failures), 0, PID, 1) is None
    worker_wrote(channel, REFORMING, 3)
    # in_place recorded why it let the process end (a real error, or a re-form it could not complete).
    record_failure(RuntimeError("in-place re-form failed"), {FAILURE_DIR_ENV: str(failures), "LOCAL_RANK": "0"})
    assert read_reform_exit(channel, str(failures), 0, PID, 1) is None


class Handler:
    """Where the agent puts what it found: the rendezvous handler's member record."""

    node = "n2"
    round = 3

    def __init__(self) -> None:
        self.notes: list[tuple[int, str]] = []

    def note_worker_exit(self, round: int, note: str) -> None:
        self.notes.append((round, note))


def test_the_agent_logs_the_line_and_puts_it_in_its_member_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FAILURE_DIR_ENV, str(tmp_path / "failures"))
    (tmp_path / "failures").mkdir()
    agent_wrote(tmp_path, 3, pending=True)
    worker_wrote(tmp_path, REFORMING, 3)
    handler = Handler()
    group = SimpleNamespace(spec=SimpleNamespace(rdzv_handler=handler))
    agent: Any = SimpleNamespace(_in_place=True, _channel=tmp_path, _worker_group=group)  # its state this reads
    failed = RunResult(state=WorkerState.FAILED, failures={5: ProcessFailure(0, PID, 1, "")})
    with capture_logs() as logs:
        InPlaceAgent._note_reform_exits(agent, failed)
    [line] = [e for e in logs if e["event"] == REFORM_EXIT]
    assert (line["node"], line["exit_code"], line["round"], line["last_state"]) == ("n2", 1, 3, REFORMING)
    assert handler.notes == [(3, f"{REFORM_EXIT} (exit 1): {LIKELY_CAUSE}")]
