"""``bench reform``'s torchft modes: the same scenario played on torchft 0.2.0, as a peer
to compare regroup's re-form times with, on the same kill and rejoin in the same run.

One torchft lighthouse (``bench.reform.torchft_lighthouse``) and one replica group per
scenario node (``bench.reform.torchft_replica``: a single process, 1 rank, gloo, CPU),
everything on 127.0.0.1, each replica started with ``subprocess`` in a session of its own.
Every replica trains the demo's model at the demo's step-time floor and appends one line
per committed step to ``steps.jsonl``; the scenario's events go to ``events.jsonl`` in the
demo's shape, and ``run.json`` holds the run's facts, so ``--runs`` measures the folder
again (``bench.reform.torchft_measure``).

The events, at their scripted times from the first committed step at the full count
(churn does not wait for torchft to recover, as for plain torchrun):

- ``lose``: SIGKILL of the node's replica;
- ``restore``: a fresh replica process for each node, its launch recorded;
- ``reclaim``: torchft has no planned leave, so the replica is SIGKILLed when the notice
  ends;
- ``flaky``: the node's replica is SIGKILLed, then restarted at once whenever it exits
  (torchft has no cordon), crashing itself after ``crash_after_steps`` committed steps of
  every incarnation, until the end of the run;
- ``evict``, ``drain``, ``uncordon``: not played (torchft has no eviction, drain or cordon).

The heartbeat timeout (how long the lighthouse still counts a silent replica as alive) is
what a kill costs torchft; ``PEERS`` holds torchft's default and a 1 s variant.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

from bench.reform.torchft_measure import STEPS_LOG, read_steps
from regroup.demo.nodes import DEFAULT_TRAINER, append_jsonl, merge
from regroup.demo.processes import end_agent
from regroup.demo.scenario import ChurnEvent, Scenario, parse_duration

REPO_ROOT = Path(__file__).resolve().parents[2]
INSTALL_HINT = "pip install torchft==0.2.0 (or make bench)"
STARTUP_TIMEOUT = 240.0
"""How long the replicas may take to commit a first step all together (torch imports on a busy machine)."""
POLL = 0.05
"""Seconds between two looks at the script, the flaky replicas and the clock."""


def installed() -> bool:
    """Whether torchft can be imported here (the ``bench`` extra)."""
    return importlib.util.find_spec("torchft") is not None


@dataclass(frozen=True)
class TorchftSettings:
    """How the lighthouse and the replicas are set up."""

    heartbeat_timeout: timedelta = timedelta(seconds=5)
    """The lighthouse's ``heartbeat_timeout_ms``: a replica silent this long is dead; until
    then the survivors wait for it. torchft's default."""
    join_timeout: timedelta = timedelta(seconds=60)
    """The lighthouse's ``join_timeout_ms``: how long a new quorum waits for heartbeating
    replicas that have not asked to join. torchft's default; longer than the heartbeat
    timeout, so a killed replica leaves the quorum when its heartbeat times out."""
    quorum_tick: timedelta = timedelta(milliseconds=100)
    """The lighthouse's ``quorum_tick_ms``: how often it looks for a quorum. torchft's default."""
    replica_timeout: timedelta = timedelta(seconds=30)
    """Each replica's ``Manager`` and gloo timeout (one collective, RPC or checkpoint fetch)."""

    def __post_init__(self) -> None:
        for name in ("heartbeat_timeout", "join_timeout", "quorum_tick", "replica_timeout"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"TorchftSettings.{name}: must be positive, got {getattr(self, name)}")


PEERS: dict[str, TorchftSettings] = {
    "torchft": TorchftSettings(),
    "torchft-hb1": TorchftSettings(heartbeat_timeout=timedelta(seconds=1)),
}
"""The torchft modes of ``--modes``; ``torchft`` is among the default modes when installed."""


@dataclass(frozen=True)
class PeerAction:
    """One thing the torchft mode does, ``at`` seconds from the start."""

    at: float
    kind: Literal["record", "kill", "launch", "flaky"]
    """``record``: the scenario event itself, into ``events.jsonl``; ``kill``: SIGKILL the
    event's replicas; ``launch``: fresh replicas; ``flaky``: crash and restart them for good."""
    event: ChurnEvent
    why: str


def timeline(scenario: Scenario) -> tuple[list[PeerAction], list[str]]:
    """What the torchft mode does for each scenario event, in time order, and the events
    it cannot play, described."""
    actions: list[PeerAction] = []
    not_played: list[str] = []
    for event in scenario.events:
        at = event.at.total_seconds()
        if event.action in ("evict", "drain", "uncordon"):
            not_played.append(f"{event.describe()} at {at:.0f}s: torchft has no eviction, drain or cordon")
            continue
        actions.append(PeerAction(at, "record", event, event.describe()))
        if event.action == "reclaim":
            end = at + event.notice.total_seconds()
            why = "reclaim notice over: SIGKILL (torchft has no planned leave)"
            actions.append(PeerAction(end, "kill", event, why))
        elif event.action in ("lose", "vanish"):
            actions.append(PeerAction(at, "kill", event, "abrupt loss: SIGKILL"))
        elif event.action == "restore":
            actions.append(PeerAction(at, "launch", event, "back: a fresh replica"))
        elif event.action == "flaky":
            actions.append(PeerAction(at, "flaky", event, "crashes and is restarted at once (torchft has no cordon)"))
    # Stable: a scenario event is recorded before what it causes at the same moment.
    return sorted(actions, key=lambda a: a.at), not_played


def replica_settings(scenario: Scenario) -> dict[str, Any]:
    """The demo's trainer settings that a replica copies: the model, its share of the
    global batch at the full size (torchft keeps it per replica), the learning rate, the
    step-time floor."""
    trainer = merge(DEFAULT_TRAINER, scenario.trainer)
    floor = parse_duration(trainer.get("step_time_floor", 0), "trainer.step_time_floor").total_seconds()
    return {
        "model": dict(trainer["model"]),
        "batch": max(1, int(trainer["batch"]["global_batch_size"]) // scenario.job.max_nodes),
        "lr": float(trainer["optim"]["lr"]),
        "step_floor": floor,
    }


class Replicas:
    """The replica processes this mode started, by node. Ends them, and only them."""

    def __init__(self, root: Path, scenario: Scenario, settings: TorchftSettings, lighthouse_port: int) -> None:
        self.root = root
        self.scenario = scenario
        self.settings = settings
        self.lighthouse = f"http://127.0.0.1:{lighthouse_port}"
        self.trainer = replica_settings(scenario)
        self.running: dict[str, asyncio.subprocess.Process] = {}
        self.started: list[asyncio.subprocess.Process] = []
        self.launches: dict[str, int] = {}
        self.crashes: dict[str, int] = {}
        """Flaky nodes: how often their replica was crashed (at the flaky event included)."""

    def _command(self, node: str, crash_after: int) -> list[str]:
        return [
            sys.executable, "-m", "bench.reform.torchft_replica",
            "--replica", node, "--index", str(self.scenario.nodes.index(node)),
            "--nodes", str(len(self.scenario.nodes)),
            "--lighthouse", self.lighthouse, "--steps-log", str(self.root / STEPS_LOG),
            "--min-replicas", str(self.scenario.job.min_nodes), "--model", json.dumps(self.trainer["model"]),
            "--batch", str(self.trainer["batch"]), "--lr", str(self.trainer["lr"]),
            "--step-floor", str(self.trainer["step_floor"]),
            "--timeout", str(self.settings.replica_timeout.total_seconds()),
            "--crash-after-steps", str(crash_after),
        ]  # fmt: skip

    async def launch(self, node: str, crash_after: int = 0) -> None:
        """Start a fresh replica process for ``node`` (its output appended to the node's log)."""
        self.launches[node] = self.launches.get(node, 0) + 1
        log_path = self.root / "logs" / f"{node}.log"
        with open(log_path, "ab") as log:
            log.write(f"--- launch {self.launches[node]} at {time.time():.3f}\n".encode())
            log.flush()
            process = await asyncio.create_subprocess_exec(
                *self._command(node, crash_after), cwd=REPO_ROOT, env=replica_env(),
                stdout=log, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        self.running[node] = process
        self.started.append(process)
        record(self.root, "torchft", "Launched", f"{node}: replica launched (#{self.launches[node]})", (node,))

    def kill(self, node: str, why: str) -> bool:
        """SIGKILL the node's replica (its whole session); whether one was running."""
        process = self.running.pop(node, None)
        if process is None or process.returncode is not None:
            return False
        _kill_session(process)
        record(self.root, "torchft", "Killed", f"{node}: {why}", (node,))
        return True

    def exited(self, node: str) -> int | None:
        """The exit status of the node's replica if it is no longer running (None: running or none)."""
        process = self.running.get(node)
        if process is None or process.returncode is None:
            return None
        del self.running[node]
        return process.returncode

    async def end_all(self) -> None:
        """SIGKILL every replica this run started that is still alive, and reap them."""
        for process in self.started:
            if process.returncode is None:
                _kill_session(process)
        await asyncio.gather(*(p.wait() for p in self.started))
        self.running.clear()


def _kill_session(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # start_new_session: its group id is its pid


def replica_env() -> dict[str, str]:
    """The environment of the lighthouse and the replicas: the repository importable, gloo
    on loopback, and no ``TORCHFT_*`` variable from the caller's shell overriding the
    settings stated in the result."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHFT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    if sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def record(root: Path, source: str, reason: str, message: str, nodes: tuple[str, ...] = ()) -> None:
    """One line of ``events.jsonl``, in the demo's shape (``regroup.demo.analysis.ScriptedEvent``)."""
    body = {"time": time.time(), "source": source, "reason": reason, "message": message, "nodes": list(nodes)}
    append_jsonl(root / "events.jsonl", body)


async def _start_lighthouse(
    root: Path, min_replicas: int, settings: TorchftSettings
) -> tuple[asyncio.subprocess.Process, int]:
    def ms(span: timedelta) -> str:
        return str(int(span.total_seconds() * 1000))

    with open(root / "logs" / "lighthouse.log", "ab") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.reform.torchft_lighthouse", "--min-replicas", str(min_replicas),
            "--join-timeout-ms", ms(settings.join_timeout), "--heartbeat-timeout-ms", ms(settings.heartbeat_timeout),
            "--quorum-tick-ms", ms(settings.quorum_tick),
            cwd=REPO_ROOT, env=replica_env(), stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
        )  # fmt: skip
    assert process.stdout is not None
    try:
        async with asyncio.timeout(60):
            said = (await process.stdout.readline()).split()
    except TimeoutError:
        said = []
    if len(said) != 2 or said[0] != b"ready" or not said[1].isdigit():
        await _stop_lighthouse(process)
        raise RuntimeError(f"the torchft lighthouse did not start (see {root / 'logs' / 'lighthouse.log'})")
    return process, int(said[1])


async def _stop_lighthouse(process: asyncio.subprocess.Process) -> None:
    """SIGTERM (it shuts its server down), 5 s, then SIGKILL."""
    await end_agent(process, timedelta(seconds=5))


async def _first_full_step(root: Path, replicas: Replicas, count: int) -> None:
    """Wait for the first step committed by ``count`` replicas together."""
    deadline = time.time() + STARTUP_TIMEOUT
    while not any(r["participants"] >= count for r in read_steps(root / STEPS_LOG)):
        dead = [node for node, p in replicas.running.items() if p.returncode is not None]
        if dead:
            raise RuntimeError(f"torchft replica {dead[0]} exited before training (see {root / 'logs' / dead[0]}.log)")
        if time.time() > deadline:
            raise TimeoutError(f"gave up after {STARTUP_TIMEOUT:.0f}s waiting for {count} torchft replicas to train")
        await asyncio.sleep(0.2)


async def play_on_torchft(scenario: Scenario, mode: str, root: Path) -> Path:
    """Play ``scenario`` on torchft with the settings of ``mode`` (a key of ``PEERS``) into
    the run folder ``root``; returns it. Every process it started is ended however it ends."""
    settings = PEERS[mode]
    (root / "logs").mkdir(parents=True, exist_ok=True)
    actions, not_played = timeline(scenario)
    flaky: dict[str, int] = {}
    lighthouse, port = await _start_lighthouse(root, scenario.job.min_nodes, settings)
    replicas = Replicas(root, scenario, settings, port)
    try:
        launched_at = time.time()
        for node in scenario.nodes:
            await replicas.launch(node)
        await _first_full_step(root, replicas, len(scenario.nodes))
        started_at = time.time()
        pending = deque(actions)
        while (now := time.time()) < started_at + scenario.duration.total_seconds():
            if lighthouse.returncode is not None:
                log = root / "logs" / "lighthouse.log"
                raise RuntimeError(f"the torchft lighthouse exited ({lighthouse.returncode}; see {log})")
            while pending and started_at + pending[0].at <= now:
                action = pending.popleft()
                await _apply(action, replicas, flaky)
            for node, crash_after in flaky.items():
                status = replicas.exited(node)
                if status is not None:
                    replicas.crashes[node] = replicas.crashes.get(node, 0) + 1
                    why = f"replica exited ({status}), crash #{replicas.crashes[node]}: restarted at once"
                    record(root, "fault", "RankCrashed", f"{node}: {why}", (node,))
                    await replicas.launch(node, crash_after)
            await asyncio.sleep(POLL)
        ended_at = time.time()
    finally:
        await replicas.end_all()
        await _stop_lighthouse(lighthouse)
    meta = {
        "mode": "torchft",
        "mode_label": mode,
        "script": None,
        "latest_checkpoint_step": None,
        "scenario": scenario.name,
        "job": scenario.job.name,
        "nodes": list(scenario.nodes),
        "min_nodes": scenario.job.min_nodes,
        "max_nodes": scenario.job.max_nodes,
        "nproc_per_node": 1,
        "duration": scenario.duration.total_seconds(),
        "launched_at": launched_at,
        "started_at": started_at,
        "ended_at": ended_at,
        "script_delay": 0.0,
        "events": [
            {"at": e.at.total_seconds(), "action": e.action, "nodes": list(e.nodes), "description": e.describe()}
            for e in scenario.events
        ],
        "not_played": not_played,
        "flaky_crashes": dict(replicas.crashes),
        "torchft": {
            "version": importlib.metadata.version("torchft"),
            "heartbeat_timeout_s": settings.heartbeat_timeout.total_seconds(),
            "join_timeout_s": settings.join_timeout.total_seconds(),
            "quorum_tick_s": settings.quorum_tick.total_seconds(),
            "replica_timeout_s": settings.replica_timeout.total_seconds(),
            "replica": replica_settings(scenario),
        },
    }
    (root / "run.json").write_text(json.dumps(meta, indent=2))
    return root


async def _apply(action: PeerAction, replicas: Replicas, flaky: dict[str, int]) -> None:
    event = action.event
    if action.kind == "record":
        record(replicas.root, "scenario", event.action, action.why, event.nodes)
        return
    for node in event.nodes:
        if action.kind == "kill":
            replicas.kill(node, action.why)
        elif action.kind == "launch" and node not in replicas.running:
            await replicas.launch(node)
        elif action.kind == "flaky":
            # Far past crash_after_steps into its incarnation already: it crashes now.
            if replicas.kill(node, f"flaky: {action.why}"):
                replicas.crashes[node] = 1
            # A node that cannot run its replica at all (0 steps) is simply not restarted.
            if event.crash_after_steps:
                flaky[node] = event.crash_after_steps
                await replicas.launch(node, event.crash_after_steps)
