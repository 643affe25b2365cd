"""One pod's run as the kubelet stand-in records it, and the status it writes from that
record: its own conditions, the container's state (running, backing off, terminated),
lastState and restart count, as the kubelet's status manager writes them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kubeapi.registry import timestamp
from kubeapi.server import FakeKubeAPI
from tests.kubeapi.containers import Container

KUBELET_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "Ready", "ContainersReady", "PodScheduled")


@dataclass(eq=False)
class PodRun:
    """What the kubelet does for one pod (by uid): its container, restarts and termination."""

    uid: str
    namespace: str
    name: str
    node: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the pod object changed or the container exited."""
    seen_version: str = ""
    container: Container | None = None
    restart_count: int = 0
    last_termination: dict[str, Any] | None = None
    """The terminated state of the container's latest instance that ended."""
    previous_termination: dict[str, Any] | None = None
    """The one before it (lastState, once the pod is terminal)."""
    start_time: str | None = None
    task: asyncio.Task[None] | None = None

    def note_exit(self) -> None:
        """Records the container's exit (once) as its latest termination."""
        container = self.container
        if container is None or container.running or container.termination is not None:
            return
        code = container.exit_code
        container.termination = {
            "exitCode": code,
            "reason": "Completed" if code == 0 else "Error",
            "startedAt": container.started_at,
            "finishedAt": container.finished_at or container.started_at,
            "containerID": f"process://{container.pid}",
        }
        self.previous_termination, self.last_termination = self.last_termination, container.termination


class StatusWriter:
    """Writes the status of pods' runs into the API stand-in, with times from `clock` (UTC)."""

    def __init__(self, api: FakeKubeAPI, clock: Callable[[], datetime]) -> None:
        self._api = api
        self._clock = clock

    def backing_off(self, run: PodRun, backoff: float) -> None:
        name = container_name(self._api.get("Pod", run.name, run.namespace) or {})
        self.write(
            run,
            phase="Running",
            ready=False,
            state={
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {backoff:g}s restarting failed container={name} "
                    f"pod={run.name}_{run.namespace}({run.uid})",
                }
            },
            last_state=terminated(run.last_termination),
        )

    def terminal(self, run: PodRun) -> None:
        """A terminal phase by the last exit code: that instance as the state, the one before
        it as lastState."""
        assert run.last_termination is not None
        self.write(
            run,
            phase="Succeeded" if run.last_termination["exitCode"] == 0 else "Failed",
            ready=False,
            state=terminated(run.last_termination),
            last_state=terminated(run.previous_termination),
        )

    def write(
        self, run: PodRun, *, phase: str, ready: bool, state: dict[str, Any], last_state: dict[str, Any]
    ) -> None:
        """Writes the pod's status as the kubelet's status manager does: its own conditions,
        the others (DisruptionTarget, ...) kept; the container's status replaced."""
        pod = self._api.get("Pod", run.name, run.namespace)
        if pod is None or pod["metadata"]["uid"] != run.uid:
            return
        now = timestamp(self._clock())
        old = pod.get("status") or {}
        terminal = phase in ("Succeeded", "Failed")
        name = container_name(pod)
        wanted = {
            "PodReadyToStartContainers": not terminal,
            "Initialized": True,
            "Ready": ready,
            "ContainersReady": ready,
            "PodScheduled": True,
        }
        by_type = {c.get("type"): c for c in old.get("conditions") or []}
        conditions = []
        for kind in KUBELET_CONDITIONS:
            value = "True" if wanted[kind] else "False"
            before = by_type.get(kind) or {}
            condition: dict[str, Any] = {
                "type": kind,
                "status": value,
                "lastProbeTime": None,
                "lastTransitionTime": before.get("lastTransitionTime", now) if before.get("status") == value else now,
            }
            if kind in ("Ready", "ContainersReady") and not ready:
                condition["reason"] = "PodCompleted" if terminal else "ContainersNotReady"
                if not terminal:
                    condition["message"] = f"containers with unready status: [{name}]"
            conditions.append(condition)
        conditions += [c for c in old.get("conditions") or [] if c.get("type") not in KUBELET_CONDITIONS]
        container = run.container
        image = ((pod.get("spec") or {}).get("containers") or [{}])[0].get("image", "")
        status: dict[str, Any] = {
            "phase": phase,
            "conditions": conditions,
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "startTime": old.get("startTime") or run.start_time or now,
            "containerStatuses": [
                {
                    "name": name,
                    "image": image,
                    "imageID": "",
                    "containerID": f"process://{container.pid}" if container is not None else "",
                    "ready": ready,
                    "started": "running" in state,
                    "restartCount": run.restart_count,
                    "state": state,
                    "lastState": last_state,
                }
            ],
        }
        written = self._api.patch("Pod", run.name, {"metadata": {"uid": run.uid}, "status": status}, run.namespace)
        run.seen_version = written["metadata"]["resourceVersion"]  # our own write wakes nobody


def container_name(pod: dict[str, Any]) -> str:
    containers = (pod.get("spec") or {}).get("containers") or [{}]
    return containers[0].get("name") or "main"


def terminated(termination: dict[str, Any] | None) -> dict[str, Any]:
    return {"terminated": dict(termination)} if termination else {}
