"""A trainer job under ``regroup-run`` for the in-place tests: agents posing as nodes.

Each node is one ``regroup-run`` agent (``NODE_NAME=<node>``) of the real trainer on a
real etcd. The test reads the job through etcd (``progress``, ``members``) and can act as
the controller by writing its records (checkpoint requests, expected membership, re-form
requests). Waits poll against a deadline and fail naming what they waited for.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regroup.etcd import EtcdSettings, LoopThread, connect
from regroup.keys import JobKeys
from regroup.records import (
    CheckpointAck,
    CheckpointRequest,
    ControllerPresence,
    ExpectedMembership,
    Progress,
    ReformRequest,
)
from regroup.rendezvous.handler import EtcdV3RendezvousHandler
from regroup.rendezvous.settings import parse_settings
from tests.rendezvous.agents import kill_all, wait_until as wait_for
from tests.elastic.harness import events, write_config

JOB = "job"


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
    return found


@dataclass
class InPlaceJob:
    """Agents of one trainer job on this machine, and a view of its etcd keys."""

    endpoint: str
    root: Path
    env: dict[str, str]
    trainer: dict[str, Any] = field(default_factory=dict)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        sections = {
            "batch": {"global_batch_size": 12},
            "checkpoint": {"dir": str(self.root / "ckpt"), "every_steps": 5},
            "etcd": {"endpoint": self.endpoint, "job": JOB, "progress_interval": "100ms"},
            "max_steps": 100000,
            "step_time_floor": "50ms",
            "device": "cpu",
            **self.trainer,
        }
        self.config = write_config(self.root / "train.yaml", **sections)
        self.keys = JobKeys("default", JOB)
        self._loop = LoopThread(name="inplace-test-etcd")
        self._client = self._loop.run(connect(EtcdSettings.from_endpoint_string(self.endpoint)))

    # -- agents ------------------------------------------------------------------------------

    max_restarts = 3
    nnodes = "2:3"
    nproc_per_node = 1
    cwd: Path | None = None
    """Working directory of the agents (None: the test's)."""

    def worker(self) -> list[str]:
        """What each agent runs on its ranks (the built-in trainer here; a script in subclasses)."""
        return ["-m", "regroup.trainer", "--config", str(self.config)]

    def start(
        self,
        node: str,
        *,
        in_place: str = "auto",
        standby: bool = True,
        nnodes: str | None = None,
        flags: tuple[str, ...] = (),
        conf: str = "",
    ) -> None:
        """``flags``: more launcher flags (``--term-grace=6``); ``conf``: more ``--rdzv-conf`` keys."""
        argv = [
            sys.executable, "-m", "regroup.rendezvous.inplace.launcher", f"--in-place={in_place}",
            *(["--standby"] if standby else []), *flags,
            "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={JOB}",
            f"--nnodes={nnodes or self.nnodes}", f"--nproc-per-node={self.nproc_per_node}", f"--max-restarts={self.max_restarts}",
            "--monitor-interval=0.1",
            f"--rdzv-conf=lease_ttl=2,last_call_timeout=1,join_timeout=120{',' + conf if conf else ''}",
            "--local-addr=127.0.0.1", *self.worker(),
        ]  # fmt: skip
        env = {**self.env, "NODE_NAME": node}
        with open(self.root / f"{node}.log", "ab") as log:
            self.procs[node] = subprocess.Popen(
                argv, cwd=self.cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def workers(self, node: str) -> list[int]:
        proc = self.procs[node]
        return children(proc.pid) if proc.poll() is None else []

    def terminate(self, node: str) -> float:
        """SIGTERM the node's agent only, as the kubelet signals a container's PID 1 when its
        pod is deleted, evicted or drained; returns when (unix time)."""
        sent = time.time()
        self.procs[node].send_signal(signal.SIGTERM)
        return sent

    def kill_node(self, node: str) -> None:
        """SIGKILL the node's agent and workers: a node lost without notice."""
        pids = self.workers(node)
        self.procs[node].kill()
        self.procs[node].wait()
        kill_all(pids)

    def log(self, node: str) -> str:
        path = self.root / f"{node}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, node: str, name: str) -> list[dict[str, Any]]:
        return events(self.log(node), name)

    def close(self) -> None:
        for node in list(self.procs):
            if self.procs[node].poll() is None:
                self.kill_node(node)
        try:
            self._loop.run(self._client.close())
        finally:
            self._loop.close()

    # -- the job's keys ----------------------------------------------------------------------

    def _get(self, key: str) -> bytes | None:
        found = self._loop.run(self._client.get(key.encode()))
        return None if found is None else found.value

    def _put(self, key: str, value: bytes) -> None:
        self._loop.run(self._client.put(key.encode(), value))

    def progress(self) -> Progress | None:
        raw = self._get(self.keys.progress)
        return None if raw is None else Progress.from_json(raw)

    def members(self) -> dict[str, dict[str, Any]]:
        found = self._loop.run(self._client.get_prefix(self.keys.members.encode()))
        return {kv.key.decode()[len(self.keys.members) :]: json.loads(kv.value) for kv in found}

    def await_joiner(self, node: str, after: float, timeout: float = 120) -> dict[str, Any]:
        """``node``'s member record once an agent registered after the unix time ``after``
        asks to join: a new agent, or the one left out of a round (it stays, as a new agent
        of its node, and asks to be let back in). Pass the ``joined_at`` of the agent before.
        Once its workers are up (not warming): a controller names only such a joiner, and a
        round does not wait for a member warming up."""

        def asking() -> dict[str, Any] | None:
            member = self.members().get(node)
            if member is None or member["joined_at"] <= after or member["round"] != 0:
                return None
            return member if not member.get("warming_since") else None

        return wait_for(asking, timeout, f"an agent of {node} asking to join")  # type: ignore[no-any-return]

    def await_progress(self, what: str, predicate: Callable[[Progress], bool], timeout: float = 90) -> Progress:
        def ready() -> Progress | None:
            progress = self.progress()
            return progress if progress is not None and predicate(progress) else None

        return wait_for(ready, timeout, what)  # type: ignore[no-any-return]

    # -- acting as the controller ---------------------------------------------------------

    def close_run(self) -> None:
        """Close the job's rendezvous as its last finishing agent does (the job is over)."""
        settings = parse_settings(
            endpoint=self.endpoint, run_id=JOB, min_nodes=1, max_nodes=1, conf={}, env={"NODE_NAME": "test-closer"}
        )
        handler = EtcdV3RendezvousHandler(settings)
        try:
            handler.set_closed()
        finally:
            handler.shutdown()

    def claim_control(self) -> None:
        """Say a controller manages the job: agents then leave joins to it (no self-grow)."""
        self._put(self.keys.controller, ControllerPresence(identity="test", since=time.time()).to_json())

    def checkpoint(self, generation: int, timeout: float = 60, leaving: list[str] | None = None) -> CheckpointAck:
        """Ask for a checkpoint with hold, and wait for its ack."""
        self.ask_checkpoint(generation, timeout, leaving)
        return self.acked(generation, timeout)

    def ask_checkpoint(self, generation: int, timeout: float = 240, leaving: list[str] | None = None) -> None:
        """Ask for a checkpoint with hold, without waiting: the world that reaches a step
        boundary next (the one being formed, say) saves, acks and holds there. ``leaving``:
        the nodes the re-form that follows leaves out, as a controller's planned shrink names them."""
        request = CheckpointRequest(generation=generation, deadline=time.time() + timeout, hold=True, reason="test",
                                    leaving=list(leaving or []))  # fmt: skip
        self._put(self.keys.checkpoint, request.to_json())

    def acked(self, generation: int, timeout: float = 180) -> CheckpointAck:
        """The ack of checkpoint request ``generation``, once written."""

        def ack() -> CheckpointAck | None:
            raw = self._get(self.keys.ack(generation))
            return None if raw is None else CheckpointAck.from_json(raw)

        return wait_for(ack, timeout, f"the ack of checkpoint request {generation}")  # type: ignore[no-any-return]

    def expect(self, generation: int, nodes: list[str], cause: str = "manual") -> None:
        """The next round holds exactly ``nodes`` (it waits for all of them)."""
        self._put(self.keys.expected, ExpectedMembership(generation, nodes, cause).to_json())

    def reform(self, generation: int, nodes: list[str], cause: str = "manual") -> None:
        """The next round holds exactly ``nodes``; every running agent re-forms now."""
        self.expect(generation, nodes, cause)
        self._put(self.keys.reform, ReformRequest(generation, cause, requested_at=time.time()).to_json())
