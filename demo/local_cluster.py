"""The local cluster adapter: nodes are local process groups (behind ``regroup demo``).

Each node runs one worker "pod": a torchrun agent started in its own session, whose
workers torchrun starts in sessions of their own. The signals are the ones a
Kubernetes cluster gives the controller:

- a reclaim notice is a taint on the node, followed after the notice window by the
  node's death;
- a node loss is SIGKILL of everything on the node (agent and workers: the whole
  process tree, frozen first so nothing forks in between), and the node disappears;
- a node return is a new node with a new agent;
- an agent that exits non-zero is restarted in place (the pod's restart count goes up,
  its last exit code is kept, ``restartPolicy: Always``), as a kubelet would; one that
  exits 0 (the job finished) has its pod replaced by a fresh one, and a ``Completed``
  event says so;
- a deletion (``delete_pod``, ``evict``, ``drain``) is graceful, as the API server and the
  kubelet carry it out: the pod is marked with its deletion's deadline and grace, its agent
  gets SIGTERM, its tree SIGKILL at the deadline; then the pod is gone, and a fresh pod
  starts on the node if the node is schedulable, as a workload controller would;
- a watch that breaks (the API server's ``410 Gone``) is ``drop_watches``: the
  subscribers get no changes until ``relist`` sends each a full list, so whatever
  happened in the gap reaches them only through that list.

Only processes this adapter started, and their descendants, are ever signalled.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Literal

import structlog

from regroup.controller.cluster import (
    JOB_LABEL,
    ClusterSink,
    ContainerRestarts,
    NodeInfo,
    ObjectRef,
    PodDisruption,
    PodInfo,
    Taint,
    termination_failed,
)
from regroup.demo.processes import AgentLauncher, end_agent, kill_tree, kill_workers

log = structlog.get_logger("regroup.local_cluster")

CORDON_ANNOTATION = "regroup.dev/cordon-reason"
AGENT_CONTAINER = "worker"
"""The name of a local pod's one container (the agent)."""
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
"""The taint ``kubectl cordon`` (and a drain) puts on the node, beside ``spec.unschedulable``."""


def _deleted(info: PodInfo, now: float, grace: float) -> PodInfo:
    """``info`` as the API server marks a graceful deletion: ``deletionTimestamp`` = now +
    grace (the kubelet SIGKILLs then), ``deletionGracePeriodSeconds`` = grace."""
    return replace(info, deleting=True, deletion_deadline=now + grace, deletion_grace_seconds=grace)


@dataclass(frozen=True)
class ClusterEvent:
    """An Event as the controller posted it (or the adapter, for what it did itself)."""

    time: float
    kind: Literal["Pod", "Node"]
    name: str
    type: Literal["Normal", "Warning"]
    reason: str
    message: str
    source: str = "controller"


# ---------------------------------------------------------------- process trees


# ---------------------------------------------------------------- the cluster


@dataclass
class _Node:
    name: str
    taints: list[Taint] = field(default_factory=list)
    unschedulable: bool = False
    annotations: dict[str, str] = field(default_factory=dict)

    def info(self) -> NodeInfo:
        return NodeInfo(
            name=self.name,
            taints=tuple(self.taints),
            ready=True,
            unschedulable=self.unschedulable,
            annotations=dict(self.annotations),
        )

    @property
    def schedulable(self) -> bool:
        return not self.unschedulable and not any(t.effect in ("NoSchedule", "NoExecute") for t in self.taints)


@dataclass
class _Pod:
    info: PodInfo
    process: asyncio.subprocess.Process | None = None
    supervisor: asyncio.Task[None] | None = None
    exit_codes: list[int] = field(default_factory=list)


_Change = tuple[str, object]
_RESYNC = "resync"
"""A queued change that makes the subscriber's loop send its sink a full list."""


class LocalCluster:
    """Nodes as local process groups; a ``ClusterSource`` and a ``ClusterActuator``."""

    def __init__(
        self,
        namespace: str,
        job: str,
        annotations: dict[str, str],
        launch: AgentLauncher,
        *,
        restart_backoff: timedelta = timedelta(seconds=1),
        stop_grace: timedelta = timedelta(seconds=5),
        on_event: Callable[[ClusterEvent], None] | None = None,
    ) -> None:
        self.namespace = namespace
        self.job = job
        self._annotations = dict(annotations)
        self._launch = launch
        self._restart_backoff = restart_backoff
        self._stop_grace = stop_grace
        self._on_event = on_event
        self._nodes: dict[str, _Node] = {}
        self._pods: dict[str, _Pod] = {}
        self._subscribers: set[asyncio.Queue[_Change]] = set()
        self._dropped: set[asyncio.Queue[_Change]] = set()
        """Subscribers whose watch is broken: they get nothing until ``relist``."""
        self._tasks: set[asyncio.Task[None]] = set()
        self.events: list[ClusterEvent] = []

    # ------------------------------------------------------------ observation

    def nodes(self) -> list[NodeInfo]:
        return [n.info() for n in self._nodes.values()]

    def pods(self) -> list[PodInfo]:
        return [p.info for p in self._pods.values()]

    def node(self, name: str) -> NodeInfo | None:
        node = self._nodes.get(name)
        return node.info() if node else None

    def pod_on(self, node: str) -> PodInfo | None:
        return next((p.info for p in self._pods.values() if p.info.node == node), None)

    def agent_pid(self, node: str) -> int | None:
        pod = next((p for p in self._pods.values() if p.info.node == node), None)
        if pod is None or pod.process is None or pod.process.returncode is not None:
            return None
        return pod.process.pid

    async def run(self, sink: ClusterSink) -> None:
        """ClusterSource: a full list, then every change, until cancelled."""
        queue: asyncio.Queue[_Change] = asyncio.Queue()
        self._subscribers.add(queue)
        try:
            sink.resynced(self.nodes(), self.pods())
            while True:
                kind, payload = await queue.get()
                if kind == "node":
                    sink.node_changed(payload)  # type: ignore[arg-type]
                elif kind == "node-deleted":
                    sink.node_deleted(payload)  # type: ignore[arg-type]
                elif kind == "pod":
                    sink.pod_changed(payload)  # type: ignore[arg-type]
                elif kind == "pod-deleted":
                    sink.pod_deleted(self.namespace, payload)  # type: ignore[arg-type]
                elif kind == _RESYNC:
                    sink.resynced(self.nodes(), self.pods())
        finally:
            self._subscribers.discard(queue)
            self._dropped.discard(queue)

    def _publish(self, kind: str, payload: object) -> None:
        for queue in self._subscribers - self._dropped:
            queue.put_nowait((kind, payload))

    # ------------------------------------------------------------ broken watches

    def drop_watches(self) -> int:
        """Every current subscriber's watch breaks: no change reaches it until ``relist``,
        as when the API server ends a watch with ``410 Gone`` and the client has to list
        again. Changes already queued are still delivered (they were sent before the
        break). Returns how many watches broke."""
        fresh = self._subscribers - self._dropped
        self._dropped |= fresh
        if fresh:
            message = "watch broke (410 Gone)"
            self._record(ClusterEvent(time.time(), "Node", "watch", "Warning", "WatchDropped", message, "cluster"))
        return len(fresh)

    def relist(self) -> int:
        """Each broken watch is re-established the way a client does after ``410 Gone``:
        one full list (``resynced``), then changes again. Returns how many were relisted."""
        dropped, self._dropped = self._dropped & self._subscribers, set()
        for queue in dropped:
            queue.put_nowait((_RESYNC, None))
        if dropped:
            self._record(
                ClusterEvent(time.time(), "Node", "watch", "Normal", "Relisted", "full list after the gap", "cluster")
            )
        return len(dropped)

    def _record(self, event: ClusterEvent) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    # ------------------------------------------------------------ scripted churn

    async def add_node(self, name: str) -> None:
        """A node joins (or comes back) and its worker pod starts on it."""
        if name in self._nodes:
            raise ValueError(f"node {name!r} already exists")
        self._nodes[name] = _Node(name)
        self._publish("node", self._nodes[name].info())
        self._record(ClusterEvent(time.time(), "Node", name, "Normal", "NodeReady", "node joined", "cluster"))
        await self._create_pod(name)

    async def taint_node(self, name: str, key: str, value: str = "", effect: str = "NoSchedule") -> None:
        node = self._require(name)
        node.taints = [t for t in node.taints if t.key != key] + [Taint(key, value, effect, time.time())]
        self._publish("node", node.info())

    async def reclaim_notice(self, name: str, taint_key: str, notice: timedelta) -> None:
        """Taint the node now; after ``notice`` it dies as ``remove_node`` kills it."""
        deadline = time.time() + notice.total_seconds()
        await self.taint_node(name, taint_key, str(int(deadline)))
        self._record(
            ClusterEvent(
                time.time(), "Node", name, "Warning", "ReclaimNotice",
                f"{taint_key}: node goes away in {notice.total_seconds():.0f}s", "cluster",
            )
        )  # fmt: skip
        self._die_after(name, notice, "reclaimed")

    async def evict(self, name: str, grace: timedelta, reason: str = "EvictionByEvictionAPI") -> None:
        """The Eviction API on the node's pod, as the API server and the kubelet carry it out:
        the pod gets ``DisruptionTarget=True`` and its deletion (``deletionTimestamp``
        = now + ``grace``); its agent gets SIGTERM, and the whole tree SIGKILL once the grace
        is over; once the agent has exited the pod is gone, and its workload starts a new
        pod on the node if the node takes pods."""
        pod = next((p for p in self._pods.values() if p.info.node == name), None)
        if pod is None:
            raise ValueError(f"no pod on node {name!r}")
        if pod.info.deleting:
            return
        now = time.time()
        seconds = grace.total_seconds()
        # The API server's two writes of one eviction: the condition, then the deletion.
        pod.info = replace(pod.info, disruption=PodDisruption(reason, now, seconds))
        self._publish("pod", pod.info)
        pod.info = _deleted(pod.info, now, seconds)
        self._publish("pod", pod.info)
        self._record(
            ClusterEvent(
                time.time(), "Pod", pod.info.name, "Warning", "Evicted",
                f"{reason}: {seconds:.0f}s grace (SIGTERM now, SIGKILL at its end)", "cluster",
            )
        )  # fmt: skip
        self._own(asyncio.create_task(self._delete_gracefully(pod, grace, "evicted"), name=f"evict-{pod.info.name}"))

    async def drain(self, name: str, grace: timedelta) -> None:
        """``kubectl drain``: cordon the node (``spec.unschedulable`` and the
        ``node.kubernetes.io/unschedulable`` taint), then evict its pod with ``grace``."""
        node = self._require(name)
        node.unschedulable = True
        if not any(t.key == UNSCHEDULABLE_TAINT for t in node.taints):
            node.taints.append(Taint(UNSCHEDULABLE_TAINT, "", "NoSchedule", time.time()))
        self._publish("node", node.info())
        self._record(ClusterEvent(time.time(), "Node", name, "Normal", "NodeNotSchedulable", "drained", "cluster"))
        if any(p.info.node == name for p in self._pods.values()):
            await self.evict(name, grace)

    async def uncordon(self, name: str) -> None:
        """The node takes pods again; the workload's pending pod starts there."""
        node = self._require(name)
        node.unschedulable = False
        node.taints = [t for t in node.taints if t.key != UNSCHEDULABLE_TAINT]
        self._publish("node", node.info())
        self._record(ClusterEvent(time.time(), "Node", name, "Normal", "NodeSchedulable", "uncordoned", "cluster"))
        if not any(p.info.node == name for p in self._pods.values()):
            await self._create_pod(name)

    async def _delete_gracefully(self, pod: _Pod, grace: timedelta, why: str) -> None:
        """The kubelet's side of a deletion: SIGTERM, SIGKILL at the grace's end, then the
        pod is gone; a new one starts on its node if the node takes pods."""
        started = time.time()
        await self._terminate(pod, grace)
        code = pod.process.returncode if pod.process is not None else None
        if self._pods.get(pod.info.name) is pod:
            self._pods.pop(pod.info.name)
        self._publish("pod-deleted", pod.info.name)
        message = f"{why}: the agent exited {code} after {time.time() - started:.1f}s of its {grace.total_seconds():.0f}s grace"
        self._record(ClusterEvent(time.time(), "Pod", pod.info.name, "Normal", "Deleted", message, "cluster"))
        node = self._nodes.get(pod.info.node or "")
        if node is not None and node.schedulable:
            await self._create_pod(node.name)

    def _die_after(self, name: str, notice: timedelta, reason: str) -> None:
        """The end of a notice: the node dies as ``remove_node`` kills it (if still there)."""

        async def expire() -> None:
            await asyncio.sleep(notice.total_seconds())
            if name in self._nodes:
                await self.remove_node(name, reason=reason)

        self._own(asyncio.create_task(expire(), name=f"{reason}-{name}"))

    async def remove_node(self, name: str, reason: str = "lost") -> None:
        """The node vanishes: everything on it is SIGKILLed, then it and its pod are gone."""
        self._require(name)
        for pod_name, pod in list(self._pods.items()):
            if pod.info.node == name:
                self._pods.pop(pod_name)
                await self._stop_supervisor(pod)
                killed = kill_tree(pod.process.pid) if pod.process and pod.process.returncode is None else {}
                if pod.process is not None:
                    await pod.process.wait()
                log.info("node killed", node=name, reason=reason, processes=len(killed))
                self._publish("pod-deleted", pod_name)
        self._nodes.pop(name)
        self._publish("node-deleted", name)
        self._record(ClusterEvent(time.time(), "Node", name, "Warning", "NodeGone", reason, "cluster"))

    async def silence_node(self, name: str) -> None:
        """The node dies silently: everything on it is SIGKILLed and nothing is written to
        the API (no restart either): it still reads Ready and its pod Running."""
        self._require(name)
        for pod in [p for p in self._pods.values() if p.info.node == name]:
            await self._stop_supervisor(pod)
            killed = kill_tree(pod.process.pid) if pod.process and pod.process.returncode is None else {}
            if pod.process is not None:
                await pod.process.wait()
            log.info("node died silently", node=name, processes=len(killed))
        self._record(ClusterEvent(time.time(), "Node", name, "Warning", "NodeDiedSilently",
                                  "every process SIGKILLed; nothing written to the API", "cluster"))  # fmt: skip

    def crash_workers(self, node: str) -> int:
        """SIGKILL the workers of the node's agent (not the agent): its ranks crash and the
        agent restarts them. Returns how many processes were killed."""
        pid = self.agent_pid(node)
        return 0 if pid is None else kill_workers(pid)

    async def stop(self) -> None:
        """Stop every agent (SIGINT: at once, with no hand-off; SIGKILL of the tree after
        the grace) and task."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        pods = list(self._pods.values())
        self._pods.clear()
        await asyncio.gather(*(self._terminate(pod, sig=signal.SIGINT) for pod in pods))

    # ------------------------------------------------------------ ClusterActuator

    async def cordon(self, node: str, reason: str, taint_key: str, now: float) -> None:
        target = self._nodes.get(node)
        if target is None:
            return
        already = target.unschedulable and any(t.key == taint_key for t in target.taints)
        target.unschedulable = True
        if not any(t.key == taint_key for t in target.taints):
            target.taints.append(Taint(taint_key, "", "NoSchedule", now))
        target.annotations[CORDON_ANNOTATION] = f"{reason} (at {now:.0f})"
        self._publish("node", target.info())
        if not already:
            self._record(ClusterEvent(time.time(), "Node", node, "Warning", "Cordoned", reason, "cluster"))

    async def delete_pod(self, namespace: str, name: str, reason: str) -> None:
        pod = self._pods.get(name)
        if namespace != self.namespace or pod is None or pod.info.deleting:
            return
        pod.info = _deleted(pod.info, time.time(), self._stop_grace.total_seconds())
        self._publish("pod", pod.info)
        await self._delete_gracefully(pod, self._stop_grace, reason)

    async def post_event(
        self, ref: ObjectRef, type_: Literal["Normal", "Warning"], reason: str, message: str
    ) -> None:
        self._record(ClusterEvent(time.time(), ref.kind, ref.name, type_, reason, message))

    # ------------------------------------------------------------ pods

    def _require(self, name: str) -> _Node:
        node = self._nodes.get(name)
        if node is None:
            raise KeyError(f"no node {name!r}")
        return node

    def _own(self, task: asyncio.Task[None]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("local cluster task failed", task=task.get_name(), error=repr(task.exception()))

    async def _create_pod(self, node: str) -> None:
        name = f"{node}-worker"
        info = PodInfo(
            namespace=self.namespace,
            name=name,
            uid=str(uuid.uuid4()),
            job=self.job,
            node=node,
            annotations=dict(self._annotations),
            created_at=time.time(),
            labels={JOB_LABEL: self.job},
        )
        pod = _Pod(info)
        self._pods[name] = pod
        await self._start_agent(pod)
        self._publish("pod", pod.info)
        pod.supervisor = asyncio.create_task(self._supervise(pod), name=f"supervise-{name}")
        self._own(pod.supervisor)

    async def _start_agent(self, pod: _Pod) -> None:
        command = self._launch(pod.info.node or "", pod.info.name, pod.info.restart_count)
        command.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(command.log_path, "ab") as out:  # noqa: ASYNC230 - a local append-only log file
            pod.process = await asyncio.create_subprocess_exec(
                *command.argv, env=command.env, cwd=command.cwd, stdout=out, stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip

    async def _supervise(self, pod: _Pod) -> None:
        """Restart the agent in place when it fails, as a kubelet restarts a container."""
        while True:
            assert pod.process is not None
            code = await pod.process.wait()
            pod.exit_codes.append(code)
            if self._pods.get(pod.info.name) is not pod or pod.info.deleting:
                return
            if code == 0:
                # The job finished: its workload replaces the finished pod with a fresh one,
                # as long as the node takes new pods.
                pod.info = replace(pod.info, phase="Succeeded")
                self._publish("pod", pod.info)
                message = "the agent exited 0: the job is over"
                self._record(ClusterEvent(time.time(), "Pod", pod.info.name, "Normal", "Completed", message, "cluster"))
                await asyncio.sleep(self._restart_backoff.total_seconds())
                node = self._nodes.get(pod.info.node or "")
                if self._pods.get(pod.info.name) is pod and node is not None and node.schedulable:
                    self._pods.pop(pod.info.name)
                    self._publish("pod-deleted", pod.info.name)
                    await self._create_pod(node.name)
                return
            restarts = pod.info.restart_count + 1
            # As the kubelet reports it: the exit (lastState.terminated), whether it was a
            # failure, and once restarted, when the new instance started (state.running).
            # A signal's exit is 128 + the signal, as a container runtime reports it.
            exit_code = code if code >= 0 else 128 - code
            failed = termination_failed(exit_code)
            exited = ContainerRestarts(
                AGENT_CONTAINER, restarts, last_failed=failed, exited_at=time.time(), exit_code=exit_code,
                exit_reason="Completed" if exit_code == 0 else "Error", exit_failed=failed,
            )  # fmt: skip
            pod.info = replace(pod.info, restart_count=restarts, containers=(exited,))
            log.info("agent exited, restarting", pod=pod.info.name, code=code, restarts=pod.info.restart_count)
            self._publish("pod", pod.info)
            await asyncio.sleep(self._restart_backoff.total_seconds())
            await self._start_agent(pod)
            pod.info = replace(pod.info, containers=(replace(exited, running_since=time.time()),))
            self._publish("pod", pod.info)

    async def _stop_supervisor(self, pod: _Pod) -> None:
        if pod.supervisor is not None and pod.supervisor is not asyncio.current_task():
            pod.supervisor.cancel()
            await asyncio.gather(pod.supervisor, return_exceptions=True)

    async def _terminate(self, pod: _Pod, grace: timedelta | None = None, sig: int = signal.SIGTERM) -> None:
        await self._stop_supervisor(pod)
        if pod.process is not None:
            await end_agent(pod.process, self._stop_grace if grace is None else grace, sig)
