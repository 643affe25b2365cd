"""``regroup-run`` stopped by a signal at once (SIGINT: the demo's end or Ctrl-C; a second
SIGTERM while it waits for a hand-off) ends with one line, never torch's
``SignalException`` traceback, and the exit code of a planned stop: 130 for SIGINT, 75
(``LEFT_JOB``) for SIGTERM. Only a stop by signal is caught: any other error goes on up.

Real etcd, a real one-node ``regroup-run``, a real worker process that waits to be stopped;
SIGINT takes the same path through torch's agent as the second SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from regroup.demo.etcd_server import EtcdServer
from regroup.etcd import EtcdSettings, LoopThread, connect
from regroup.exit_codes import LEFT_JOB
from regroup.keys import JobKeys
from regroup.records import ControllerPresence
from regroup.rendezvous.inplace.agent_notice import TERM_NOTICE
from regroup.rendezvous.inplace.launcher import STOPPED, stopped_by
from tests.rendezvous.agents import wait_until

pytestmark = pytest.mark.timeout(240)

WORKER = """
import pathlib, signal, sys, time
# Stopped by the agent (its SIGINT or SIGTERM): leave quietly, so the log is the agent's own.
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: sys.exit(0))
pathlib.Path(sys.argv[1]).write_text("up")
while True:
    time.sleep(0.05)
"""


def _agent(etcd: EtcdServer, tmp_path: Path, env: dict[str, str], job: str) -> tuple[subprocess.Popen[str], Path]:
    """A one-node ``regroup-run`` of job ``job``, once its worker is up; its stderr goes to the returned file."""
    script, up, log = tmp_path / "worker.py", tmp_path / f"up-{job}", tmp_path / f"{job}.log"
    script.write_text(WORKER)
    argv = [
        sys.executable, "-m", "regroup.rendezvous.inplace.launcher",
        "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={etcd.endpoint}", f"--rdzv-id={job}",
        "--nnodes=1", "--nproc-per-node=1", "--max-restarts=0", "--monitor-interval=0.1", "--term-grace=120",
        str(script), str(up),
    ]  # fmt: skip
    with open(log, "w") as out:
        agent = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=out, text=True)
    try:
        wait_until(lambda: up.exists() or agent.poll() is not None, 180, f"{job}'s worker up")
    except BaseException:
        agent.kill()
        agent.wait()
        raise
    assert agent.poll() is None, log.read_text()[-3000:]
    return agent, log


def _stopped(agent: subprocess.Popen[str], log: Path) -> tuple[int, str]:
    try:
        code = agent.wait(timeout=60)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    return code, log.read_text(errors="replace")


def test_each_signal_has_the_exit_code_of_a_planned_stop() -> None:
    assert stopped_by(signal.SIGINT).code == 128 + signal.SIGINT  # the demo's end, Ctrl-C
    assert stopped_by(signal.SIGTERM).code == LEFT_JOB  # told to stop: the node leaves a job that goes on


def test_a_second_sigterm_stops_a_node_waiting_to_hand_over_with_one_line(
    etcd: EtcdServer, tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # A controller leads the job: the first SIGTERM is a notice, and the agent trains on
    # while it waits (up to its grace) for the node to be left out.
    loop = LoopThread(name="launcher-signals-etcd")
    try:
        client = loop.run(connect(EtcdSettings.from_endpoint_string(etcd.endpoint)))
        try:
            presence = ControllerPresence(identity="test", since=time.time())
            loop.run(client.put(JobKeys("default", "told-twice").controller.encode(), presence.to_json()))
        finally:
            loop.run(client.close())
    finally:
        loop.close()
    agent, log = _agent(etcd, tmp_path, worker_env, "told-twice")
    agent.send_signal(signal.SIGTERM)
    wait_until(lambda: TERM_NOTICE in log.read_text() or agent.poll() is not None, 60, "the notice taken")
    assert agent.poll() is None and '"hands_over": true' in log.read_text(), log.read_text()[-3000:]
    agent.send_signal(signal.SIGTERM)
    code, text = _stopped(agent, log)
    assert code == LEFT_JOB, text[-3000:]
    assert "Traceback" not in text and "SignalException" not in text, text[-3000:]
    assert text.count(STOPPED) == 1 and '"signal": "SIGTERM"' in text, text[-3000:]
