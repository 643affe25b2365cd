"""A kubelet for the Kubernetes API stand-in: the pods bound to some nodes run as real processes.

``Kubelet`` plays the kubelets of the nodes it is given against an in-process ``FakeKubeAPI``
(same event loop): each pod bound to one of them gets its container started as a process
(a new session; stdout and stderr appended to a log), its status written as a kubelet
writes it, restarts by ``spec.restartPolicy`` with a back-off, and graceful termination when
the pod gets a ``deletionTimestamp`` (SIGTERM to the main process, SIGKILL of the whole tree
at the grace period's end), after which it removes the pod object. ``kill_node`` ends a node
as a crash does. docs/testing-kubeapi.md shows how to use it.

It lives beside the tests rather than in ``kubeapi/`` because it reuses the demo's process
tools (``regroup.demo.processes``), which the import contracts keep out of ``kubeapi``.
Only processes it started, and their descendants, are ever signalled.

Its parts: this module plays the pods' lifecycle (watching the API, starting, restarting
and terminating each pod's container, ending nodes); ``containers`` runs a container's
processes; ``pod_status`` records each pod's run and writes its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from kubeapi import objects
from kubeapi.registry import timestamp
from kubeapi.server import FakeKubeAPI
from regroup.demo.processes import end_agent, kill_tree, process_tree, signal_known
from tests.kubeapi.containers import Container, ContainerCommand, ContainerLauncher, end_leftovers, start_process
from tests.kubeapi.pod_status import PodRun, StatusWriter, terminated

__all__ = ["MINIMUM_KILL_GRACE", "ContainerCommand", "ContainerLauncher", "Kubelet"]
"""``ContainerCommand`` and ``ContainerLauncher``, how a test runs a pod's container, live
beside the container processes; they are imported from here as part of the kubelet's
interface."""

MINIMUM_KILL_GRACE = timedelta(seconds=2)
"""The runtime always gives a container this long between SIGTERM and SIGKILL, even when the
pod's grace period is shorter (kuberuntime's minimumGracePeriodInSeconds)."""


class Kubelet:
    """The kubelets of `nodes`, running their pods' containers as processes from `launch`."""

    def __init__(
        self,
        api: FakeKubeAPI,
        nodes: Iterable[str],
        launch: ContainerLauncher,
        *,
        restart_backoff: timedelta = timedelta(seconds=10),
        max_restart_backoff: timedelta = timedelta(minutes=5),
        stop_grace: timedelta = timedelta(seconds=2),
        clock: Callable[[], datetime] | None = None,
    ) -> None:
        """
        api: the stand-in, in this process and event loop; it needs graceful_pod_deletion on,
            so that deleted pods wait for their containers to stop.
        nodes: the nodes whose kubelets this plays (made, Ready, if missing at start).
        launch: how to run a pod's container.
        restart_backoff: wait before the first restart of a container; it doubles with each
            restart up to max_restart_backoff (the kubelet's CrashLoopBackOff: 10 s to 5 min).
        stop_grace: how long `stop` gives each container between SIGTERM and SIGKILL.
        clock: the time written into statuses (UTC); defaults to the wall clock.
        """
        self._api = api
        self._nodes = set(nodes)
        if not self._nodes:
            raise ValueError("nodes: a kubelet needs at least one node")
        if restart_backoff <= timedelta(0) or max_restart_backoff < restart_backoff:
            raise ValueError(
                f"restart_backoff: must be positive and at most max_restart_backoff, got {restart_backoff} "
                f"and {max_restart_backoff}"
            )
        self._launch = launch
        self._restart_backoff = restart_backoff.total_seconds()
        self._max_restart_backoff = max_restart_backoff.total_seconds()
        self._stop_grace = stop_grace
        self._clock = clock or (lambda: datetime.now(UTC))
        self._status = StatusWriter(api, self._clock)
        self._runs: dict[str, PodRun] = {}
        self._watcher: asyncio.Task[None] | None = None
        self.errors: list[BaseException] = []
        """What went wrong inside the kubelet (not in its containers); `stop` raises the first."""

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Registers missing nodes and starts running their pods, reacting to every change."""
        if not self._api.graceful_pod_deletion:
            raise ValueError(
                "api.graceful_pod_deletion is off: deleted pods would vanish at once instead of waiting "
                "for their containers to stop; set it to True before starting a Kubelet"
            )
        if self._watcher is not None:
            raise RuntimeError("Kubelet.start: already started")
        for node in sorted(self._nodes):
            if self._api.get("Node", node) is None:
                self._api.create(objects.node(node))
        self._sync()
        # The version synced is taken now: writes made before the task first runs still count.
        self._watcher = asyncio.create_task(self._watch(self._api.resource_version), name="kubelet-watch")
        self._watcher.add_done_callback(self._record_failure)

    async def stop(self) -> None:
        """Ends every container it started (SIGTERM, `stop_grace`, SIGKILL of what is left)
        and its own tasks. Pods stay as they are in the API. Raises the kubelet's first error."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        runs = list(self._runs.values())
        self._runs.clear()
        await self._cancel(runs)
        await asyncio.gather(*(self._end(run, graceful=True) for run in runs))
        if self.errors:
            raise RuntimeError(f"the kubelet stand-in failed: {self.errors[0]!r}") from self.errors[0]

    async def __aenter__(self) -> Kubelet:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- what tests do to nodes and containers ----------------------------------------

    @property
    def nodes(self) -> frozenset[str]:
        """The nodes still served (not killed)."""
        return frozenset(self._nodes)

    def container_pid(self, namespace: str, name: str) -> int | None:
        """The pid of the pod's running container process, or None."""
        run = self._run_named(namespace, name)
        return run.container.pid if run and run.container and run.container.running else None

    async def kill_container(self, namespace: str, name: str) -> None:
        """SIGKILLs the pod's running container (its whole process tree), as an OOM kill does;
        the kubelet then reports exit code 137 and restarts it as its restartPolicy says.
        Returns once the process is gone."""
        run = self._run_named(namespace, name)
        if run is None or run.container is None or not run.container.running:
            raise ValueError(f"kill_container: pod {namespace}/{name} has no running container here")
        container = run.container
        container.known.update(kill_tree(container.pid))
        await asyncio.shield(container.exited)

    async def kill_node(self, name: str, *, status_unknown: bool = True) -> None:
        """Ends node `name` as a crash does: every process of its pods is SIGKILLed (frozen
        first, so none forks in between), its conditions turn Unknown as the node controller
        sets them when the kubelet stops posting, and its pods stay as they are in the API.
        ``status_unknown=False``: the first 40 s of a dead node, before the node controller
        notices: nothing at all is written to the API (the node reads Ready)."""
        if name not in self._nodes:
            raise ValueError(f"kill_node: {name!r} is not one of this kubelet's nodes {sorted(self._nodes)}")
        self._nodes.discard(name)
        runs = [run for run in self._runs.values() if run.node == name]
        for run in runs:
            del self._runs[run.uid]
        await self._cancel(runs)
        await asyncio.gather(*(self._end(run, graceful=False) for run in runs))
        node = self._api.get("Node", name) if status_unknown else None
        if node is not None:
            now = timestamp(self._clock())
            unknown = [
                {
                    "type": c["type"],
                    "status": "Unknown",
                    "reason": "NodeStatusUnknown",
                    "message": "Kubelet stopped posting node status.",
                    "lastTransitionTime": now,
                }
                for c in (node.get("status") or {}).get("conditions") or []
            ]
            if unknown:
                self._api.patch("Node", name, {"status": {"conditions": unknown}}, patch_type="strategic")

    # --- watching the API --------------------------------------------------------------

    async def _watch(self, seen: int) -> None:
        while True:
            try:
                await self._api.wait_for(lambda api: api.resource_version != seen, timeout=3600)
            except TimeoutError:
                continue
            seen = self._api.resource_version
            self._sync()

    def _sync(self) -> None:
        """Starts runs for new pods on the served nodes, wakes the runs whose pod changed or
        went, and removes terminating pods that have nothing running here."""
        present = set()
        for pod in self._api.list("pods"):
            meta, spec = pod["metadata"], pod.get("spec") or {}
            if spec.get("nodeName") not in self._nodes:
                continue
            present.add(meta["uid"])
            run = self._runs.get(meta["uid"])
            if run is not None:
                if run.seen_version != meta["resourceVersion"]:
                    run.wake.set()
            elif meta.get("deletionTimestamp"):
                self._api.delete("Pod", meta["name"], meta["namespace"])  # nothing to stop: the final delete
            elif (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                self._begin(pod)
        for uid, run in self._runs.items():
            if uid not in present:
                run.wake.set()

    def _begin(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        run = PodRun(meta["uid"], meta["namespace"], meta["name"], pod["spec"]["nodeName"])
        self._runs[run.uid] = run
        run.task = asyncio.create_task(self._run(run), name=f"kubelet-pod-{run.namespace}/{run.name}")
        run.task.add_done_callback(self._record_failure)

    def _record_failure(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.errors.append(task.exception())  # type: ignore[arg-type]

    # --- one pod -----------------------------------------------------------------------

    async def _run(self, run: PodRun) -> None:
        await self._live(run)
        await self._terminate(run)
        if self._runs.get(run.uid) is run:
            del self._runs[run.uid]

    def _current(self, run: PodRun) -> dict[str, Any] | None:
        """The pod as it is now (None once it is gone); clears the wake-up it answers."""
        run.wake.clear()
        pod = self._api.get("Pod", run.name, run.namespace)
        if pod is None or pod["metadata"]["uid"] != run.uid:
            return None
        run.seen_version = pod["metadata"]["resourceVersion"]
        return pod

    def _leaving(self, run: PodRun) -> bool:
        pod = self._current(run)
        return pod is None or bool(pod["metadata"].get("deletionTimestamp"))

    @staticmethod
    async def _woken(run: PodRun, until: float | None = None) -> None:
        """Until the pod changes, its container exits, or loop time `until`."""
        if until is None:
            await run.wake.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(until):
                await run.wake.wait()

    async def _live(self, run: PodRun) -> None:
        """Runs and restarts the container until the pod is being deleted or is gone."""
        loop = asyncio.get_running_loop()
        backoff = self._restart_backoff
        while (pod := self._current(run)) is not None and not pod["metadata"].get("deletionTimestamp"):
            await self._start_container(run, pod)
            while run.container is not None and run.container.running:
                if self._leaving(run):
                    return
                await self._woken(run)
            self._container_ended(run)
            if self._leaving(run):
                return
            assert run.last_termination is not None
            policy = (pod.get("spec") or {}).get("restartPolicy") or "Always"
            if policy == "Never" or (policy == "OnFailure" and run.last_termination["exitCode"] == 0):
                self._status.terminal(run)
                while not self._leaving(run):
                    await self._woken(run)
                return
            self._status.backing_off(run, backoff)
            until = loop.time() + backoff
            while loop.time() < until:
                if self._leaving(run):
                    return
                await self._woken(run, until)
            backoff = min(backoff * 2, self._max_restart_backoff)
            run.restart_count += 1

    async def _start_container(self, run: PodRun, pod: dict[str, Any]) -> None:
        started_at = timestamp(self._clock())
        run.start_time = run.start_time or started_at
        run.container = None
        try:
            process = await start_process(self._launch(pod))
        except (OSError, ValueError) as e:
            # The runtime could not start it: reported as a terminated container (StartError).
            run.previous_termination, run.last_termination = run.last_termination, {
                "exitCode": 128,
                "reason": "StartError",
                "message": str(e),
                "startedAt": started_at,
                "finishedAt": timestamp(self._clock()),
            }
            return
        start_ticks = process_tree(process.pid).get(process.pid, 0)
        exited = asyncio.create_task(process.wait(), name=f"kubelet-container-{run.namespace}/{run.name}")
        container = Container(process, start_ticks, started_at, exited, {process.pid: start_ticks})
        run.container = container

        def finished(_: object) -> None:
            container.finished_at = timestamp(self._clock())
            run.wake.set()

        exited.add_done_callback(finished)
        self._status.write(
            run,
            phase="Running",
            ready=True,
            state={"running": {"startedAt": started_at}},
            last_state=terminated(run.last_termination),
        )

    @staticmethod
    def _container_ended(run: PodRun) -> None:
        """Notes the main process's exit and ends what it left behind."""
        run.note_exit()
        if run.container is not None:
            end_leftovers(run.container)

    async def _terminate(self, run: PodRun) -> None:
        """Graceful termination: SIGTERM to the main process, SIGKILL of the tree at the grace
        period's end (counted from when it is seen, as the kubelet counts it; a shorter grace
        seen later brings it forward), then the final status and the final delete."""
        loop = asyncio.get_running_loop()
        container = run.container
        if container is not None and container.running:
            container.known.update(process_tree(container.pid))
            signal_known({container.pid: container.start_ticks}, signal.SIGTERM)
            deadline = math.inf
            while container.running:
                pod = self._current(run)
                grace = float(((pod or {}).get("metadata") or {}).get("deletionGracePeriodSeconds") or 0)
                deadline = min(deadline, loop.time() + max(grace, MINIMUM_KILL_GRACE.total_seconds()))
                if loop.time() >= deadline:
                    container.known.update(kill_tree(container.pid))
                    await asyncio.shield(container.exited)
                    break
                await self._woken(run, deadline)
        self._container_ended(run)
        if self._current(run) is None:
            return
        if run.last_termination is not None:
            self._status.terminal(run)
        self._api.delete("Pod", run.name, run.namespace)

    async def _cancel(self, runs: list[PodRun]) -> None:
        tasks = [run.task for run in runs if run.task is not None and not run.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _end(self, run: PodRun, *, graceful: bool) -> None:
        """Ends a run's container for good, writing nothing (a cancelled run, its task done)."""
        container = run.container
        if container is None:
            return
        if container.running:
            container.known.update(process_tree(container.pid))
            if graceful:
                await end_agent(container.process, self._stop_grace)
            else:
                container.known.update(kill_tree(container.pid))
        with contextlib.suppress(asyncio.CancelledError):
            await container.exited
        end_leftovers(container)  # writes nothing: the pod stays as the API has it

    def _run_named(self, namespace: str, name: str) -> PodRun | None:
        return next((r for r in self._runs.values() if (r.namespace, r.name) == (namespace, name)), None)
