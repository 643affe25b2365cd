"""One local job under chaos: a real etcd, the local cluster, the controller in this
process, and the observers; started, changed by the faults, and shut down in order.

It is the demo's job (``demo``: the same launcher, trainer config, recorder and
task ownership) with the knobs a fault campaign needs: checkpoints every few steps, the
sample log on, a short join window, and the restart-storm rule out of the way (the
campaign crashes ranks on purpose; cordoning the nodes for it would only shrink the
cluster it plays on).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any, TypeVar

import structlog

from bench.chaos.observe import (
    RUN_MARKER_ENV,
    Changes,
    CheckpointWatcher,
    JobWatcher,
    ProcessLedger,
    marked_processes,
)
from regroup.demo.local_cluster import ClusterEvent, LocalCluster
from regroup.demo.processes import AgentCommand
from regroup.controller.runtime import run_controller
from regroup.controller.settings import ControllerSettings, RuntimeSettings
from regroup.demo.nodes import NAMESPACE, RunLayout, append_jsonl, make_launcher, write_trainer_config
from regroup.demo.runner import STARTUP_TIMEOUT, await_vital
from regroup.demo.scenario import JobSpec, Scenario
from regroup.etcd import EtcdSettings, connect
from regroup.demo.etcd_server import EtcdServer
from regroup.keys import JobKeys

log = structlog.get_logger("bench.chaos")

T = TypeVar("T")

JOB = "chaos"
CHECKPOINT_EVERY = 5
KEEP_LAST = 3
GLOBAL_BATCH = 12
"""Divides by every world size from 1 to 4."""
AGENT_LEASE_TTL = 5.0
"""The rendezvous' default member lease TTL: a dead agent's keys are gone this long after."""
CONTROLLER_READY_TIMEOUT = 60.0
CONTROLLER_STOP_TIMEOUT = 30.0
"""A cancelled controller must be gone by then; one that is not is a defect, reported with
every task's stack instead of stalling the campaign."""

# The trainer of the demo (tiny model, CPU, gloo) with what the campaign checks switched on.
TRAINER: dict[str, Any] = {
    "batch": {"global_batch_size": GLOBAL_BATCH},
    "checkpoint": {"every_steps": CHECKPOINT_EVERY, "keep_last": KEEP_LAST, "async_save": True},
    "etcd": {"progress_interval": "200ms"},
    # Steps of at least 100 ms: four ranks share two cores with the agents, etcd and the
    # controller, and a fault lands in a step, not in a sleep between steps, most of the time.
    "step_time_floor": "100ms",
    "log_every": 20,
}

# What the job leaves in etcd once it ended and its agents exited (see ``left_keys``).
EXPECTED_KEYS: tuple[str, ...] = ("progress", "control/", "acks/", "rdzv/state", "rdzv/rounds/")
LEAKED_KEYS: tuple[str, ...] = ("members/", "rdzv/joins/", "control/controller")


@dataclass(frozen=True)
class JobShape:
    """The cluster and the job's size limits, in nodes (one rank per node)."""

    nodes: int = 4
    min_nodes: int = 2
    max_nodes: int = 4

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"node-{i}" for i in range(1, self.nodes + 1))


def chaos_scenario(shape: JobShape, layout: RunLayout) -> Scenario:
    """The demo's scenario types describe the job; the campaign plays no script."""
    job = JobSpec(
        name=JOB,
        min_nodes=shape.min_nodes,
        max_nodes=shape.max_nodes,
        nproc_per_node=1,
        max_restarts=10_000,
        checkpoint_timeout="20s",
        join_window="1s",
        restart_storm="10000/1m",
    )
    trainer = {**TRAINER, "data": {"sample_log": str(layout.root / "samples")}}
    return Scenario(name="chaos", nodes=shape.names, duration=timedelta(hours=1), job=job, events=(), trainer=trainer)


@dataclass
class Shutdown:
    """What the orderly end of the job left behind."""

    keys_left: dict[str, int] = field(default_factory=dict)
    """Key groups under the job's root still in etcd, with their counts."""
    leaked_keys: list[str] = field(default_factory=list)
    processes_left: list[str] = field(default_factory=list)


class ChaosJob:
    """Owns everything the campaign starts; ``close`` tears it all down however it ends."""

    def __init__(self, layout: RunLayout, shape: JobShape, marker: str) -> None:
        self.layout = layout
        self.shape = shape
        self.marker = marker
        self.scenario = chaos_scenario(shape, layout)
        self.keys = JobKeys(NAMESPACE, JOB)
        self.changes = Changes()
        self.etcd = EtcdServer(data_dir=layout.root / "etcd-data", log_path=layout.logs / "etcd.log")
        self.ledger = ProcessLedger()
        self.checkpoints = CheckpointWatcher(layout.checkpoints, KEEP_LAST, self.changes)
        self.cluster: LocalCluster | None = None
        self.watcher: JobWatcher | None = None
        self.controller: asyncio.Task[None] | None = None
        self.controllers = 0
        self.restored: list[tuple[float, str]] = []
        """(when, node) of every node brought back."""
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False

    # ------------------------------------------------------------ start

    async def start(self) -> None:
        """etcd, the observers, the controller, then every node; returns once the job trains
        at its largest size."""
        self.layout.logs.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.etcd.start)
        self.ledger.add(self.etcd.pid)
        settings = EtcdSettings.from_endpoint_string(self.etcd.endpoint)
        config = write_trainer_config(self.scenario, self.layout, self.etcd.endpoint)
        annotations = {**self.scenario.job.annotations(), "regroup.dev/rdzv-endpoint": self.etcd.endpoint}
        base = make_launcher(self.scenario, "regroup", self.layout, self.etcd.endpoint, config)

        def launch(node: str, pod: str, attempt: int) -> AgentCommand:
            command = base(node, pod, attempt)
            return replace(command, env={**command.env, RUN_MARKER_ENV: self.marker})

        self.cluster = LocalCluster(NAMESPACE, JOB, annotations, launch, on_event=self._on_event)
        self.watcher = JobWatcher(settings, self.keys, self.layout, self.changes)
        self._own(self.watcher.run(), "recorder")
        self._own(self.checkpoints.run(), "checkpoints")
        self._own(self.ledger.run(self.cluster, list(self.shape.names)), "ledger")
        await self.start_controller()
        for node in self.shape.names:
            await self.cluster.add_node(node)
        if await self.until(self._settled, STARTUP_TIMEOUT) is None:
            raise TimeoutError(
                f"the job did not train at {self.shape.max_nodes} ranks with a committed checkpoint within "
                f"{STARTUP_TIMEOUT:.0f}s (logs in {self.layout.logs})"
            )

    def _settled(self) -> bool:
        """Where the first fault may strike: the job trains at its largest size and has
        committed a checkpoint there (so the controller, which plans from progress, has
        seen it train for a while)."""
        assert self.watcher is not None
        progress = self.watcher.progress
        full = self.shape.max_nodes
        if not progress or progress[-1].world_size != full:
            return False
        return self.checkpoints.newest_committed_before(progress[-1].time) is not None

    def _own(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.append(task)
        return task

    def _on_event(self, event: ClusterEvent) -> None:
        body = {
            "time": event.time, "source": event.source, "reason": event.reason, "message": event.message,
            "nodes": [event.name.removesuffix("-worker")], "type": event.type,
        }  # fmt: skip
        append_jsonl(self.layout.events, body)
        self.changes.notify()

    # ------------------------------------------------------------ waiting

    def world(self) -> list[str]:
        """Nodes of the rendezvous round formed now."""
        return self.watcher.world if self.watcher is not None else []

    def vital(self) -> list[asyncio.Task[Any]]:
        """Tasks whose end (a crash) ends the campaign with an error, not a silent stall."""
        return [t for t in (*self._tasks, self.controller) if t is not None]

    async def until(self, predicate: Callable[[], T], timeout: float) -> T | None:
        """``Changes.until``, failing at once if a vital task stopped."""
        waiter = asyncio.ensure_future(self.changes.until(predicate, timeout))
        try:
            done, _ = await asyncio.wait({waiter, *self.vital()}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not waiter.done():
                waiter.cancel()
                await asyncio.gather(waiter, return_exceptions=True)
        for task in self.vital():
            if task in done:
                raise RuntimeError(f"{task.get_name()} stopped: {task.exception()!r}") from task.exception()
        return waiter.result()

    # ------------------------------------------------------------ faults' tools

    async def start_controller(self) -> str:
        """A controller instance with an identity of its own; returns once it is ready."""
        assert self.cluster is not None
        self.controllers += 1
        identity = f"regroup-controller-{self.controllers}"
        settings = ControllerSettings(runtime=RuntimeSettings(identity=identity))
        ready = asyncio.Event()
        etcd = EtcdSettings.from_endpoint_string(self.etcd.endpoint)
        self.controller = asyncio.create_task(
            run_controller(settings, self.cluster, self.cluster, etcd, ready=ready), name=identity
        )
        await await_vital(ready.wait(), self.vital(), CONTROLLER_READY_TIMEOUT, f"{identity} to be ready")
        return identity

    async def stop_controller(self) -> None:
        """Cancel the controller as a crashed replica stops: mid-step, wherever it is."""
        task, self.controller = self.controller, None
        if task is None:
            return
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=CONTROLLER_STOP_TIMEOUT)
        if not done:
            log.error("controller did not stop", controller=task.get_name(), stacks=_task_stacks())
            raise RuntimeError(
                f"{task.get_name()} did not stop within {CONTROLLER_STOP_TIMEOUT:.0f}s of its cancel "
                "(every task's stack is in logs/chaos.log)"
            )
        if not task.cancelled() and task.exception() is not None:
            log.warning("controller ended with an error", controller=task.get_name(), error=repr(task.exception()))

    async def restart_etcd(self, crash: bool) -> None:
        """Stop etcd (SIGKILL or SIGTERM) and start it again on the same ports and data."""
        if crash:
            await asyncio.to_thread(self.etcd.kill)
            await asyncio.to_thread(self.etcd.start)
        else:
            await asyncio.to_thread(self.etcd.restart)
        self.ledger.add(self.etcd.pid)

    async def restore(self) -> list[str]:
        """Bring back every node that is gone, as a fresh node with a new agent (the demo's
        ``restore``); a node cordoned for a restart storm is replaced by a fresh one. A node
        under a reclaim notice is left to die first."""
        assert self.cluster is not None
        added = []
        for name in self.shape.names:
            node = self.cluster.node(name)
            if node is not None and node.unschedulable:
                await self.cluster.remove_node(name, reason="replaced after its cordon")
                node = None
            if node is None:
                await self.cluster.add_node(name)
                added.append(name)
                self.restored.append((time.time(), name))
        return added

    def missing(self) -> list[str]:
        """Nodes of the cluster that are gone (``restore`` brings them back)."""
        assert self.cluster is not None
        return [n for n in self.shape.names if self.cluster.node(n) is None]

    async def restore_until(self, predicate: Callable[[], T], timeout: float) -> T | None:
        """``until``, bringing back every node the moment it is gone (a node under a reclaim
        notice dies while this waits): the job has all its capacity to get there with."""
        deadline = time.monotonic() + timeout
        while True:
            await self.restore()
            value = await self.until(lambda: predicate() or self.missing(), max(0.0, deadline - time.monotonic()))
            if value is None or predicate() or time.monotonic() >= deadline:
                return predicate() or None

    # ------------------------------------------------------------ the end

    async def shut_down(self) -> Shutdown:
        """End the job in order and see what it left: the controller goes (its lease with
        it), every agent is stopped (SIGTERM, SIGKILL after the grace), the member and join
        keys must be gone within the lease TTL, then etcd stops and no process may be left."""
        assert self.cluster is not None and self.watcher is not None
        out = Shutdown()
        await self.stop_controller()
        await self.cluster.stop()
        watcher = self.watcher
        await self.until(lambda: not watcher.view.members and not watcher.live_joins, AGENT_LEASE_TTL + 5.0)
        out.keys_left, out.leaked_keys = await self._left_keys()
        await self._stop_tasks()
        await asyncio.to_thread(self.etcd.stop)
        out.processes_left = await self._processes_left()
        self._closed = True
        return out

    async def _left_keys(self) -> tuple[dict[str, int], list[str]]:
        client = await connect(EtcdSettings.from_endpoint_string(self.etcd.endpoint))
        try:
            found = await client.get_prefix(self.keys.root.encode())
        finally:
            await client.close()
        groups: dict[str, int] = {}
        leaked = []
        for kv in found:
            rest = kv.key.decode().removeprefix(self.keys.root)
            group = next((g for g in (*LEAKED_KEYS, *EXPECTED_KEYS) if rest.startswith(g)), "other")
            if group in ("control/",):
                group = rest  # each control key on its own
            groups[group] = groups.get(group, 0) + 1
            if any(rest.startswith(g) for g in LEAKED_KEYS):
                leaked.append(rest)
        return dict(sorted(groups.items())), leaked

    async def _processes_left(self, grace: float = 10.0) -> list[str]:
        """Processes of this run still alive once everything was stopped; killed ones may
        take a moment to be reaped, so this waits (up to ``grace``) for the list to empty."""
        deadline = time.monotonic() + grace
        while True:
            left = sorted(set(self.ledger.alive()) | set(marked_processes(self.marker)))
            if not left or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.2)

    async def _stop_tasks(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await task
                except Exception as exc:  # noqa: BLE001 - logged, the job is ending anyway
                    log.error("task failed", task=task.get_name(), error=repr(exc))

    async def close(self) -> None:
        """Tear everything down (idempotent; after ``shut_down`` there is nothing left)."""
        if self._closed:
            return
        self._closed = True
        await self.stop_controller()
        if self.cluster is not None:
            await self.cluster.stop()
        await self._stop_tasks()
        await asyncio.to_thread(self.etcd.stop)


def _task_stacks() -> str:
    """Every task of this loop with the stack it waits in."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        print(repr(task)[:300], file=out)
        task.print_stack(file=out)
    return out.getvalue()
