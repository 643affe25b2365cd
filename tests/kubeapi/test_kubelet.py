"""The kubelet stand-in with real processes: statuses, restart policies, graceful termination,
dead nodes. Each container reports over TCP (reporting_container.py), so the tests await what
happens to the processes instead of polling for it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client, watch

from kubeapi import objects
from kubeapi.server import FakeKubeAPI
from tests.kubeapi.kubelet import ContainerCommand, Kubelet

CONTAINER = Path(__file__).with_name("reporting_container.py")
WAIT = 20.0
"""Seconds to await anything the processes do; generous for a busy machine."""


class Beacon:
    """Where the containers report: (loop time, word, pid) for each line, and ``gone`` when a
    process's connection ends (it died)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, int]] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._readers: set[asyncio.Task[Any]] = set()
        self._waiters: set[asyncio.Future[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._readers:
            task.cancel()
        await asyncio.gather(*self._readers, return_exceptions=True)
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._readers.add(asyncio.current_task())  # type: ignore[arg-type]
        pid = None
        try:
            with contextlib.suppress(ConnectionError):
                while line := await reader.readline():
                    word, number = line.decode().split()
                    pid = int(number)
                    self._record(word, pid)
            if pid is not None:
                self._record("gone", pid)
        finally:
            writer.close()
            self._readers.discard(asyncio.current_task())  # type: ignore[arg-type]

    def _record(self, word: str, pid: int) -> None:
        self.events.append((asyncio.get_running_loop().time(), word, pid))
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def when(self, word: str, pid: int) -> float | None:
        """Loop time of the first `word` from `pid`, or None."""
        return next((t for t, w, p in self.events if (w, p) == (word, pid)), None)

    def pids(self, word: str = "started") -> list[int]:
        return [p for _, w, p in self.events if w == word]

    async def wait(self, predicate: Callable[[Beacon], Any], timeout: float = WAIT) -> Any:
        """Awaits predicate(self), re-checked at each report; returns its value."""
        async with asyncio.timeout(timeout):
            while not (result := predicate(self)):
                waiter = asyncio.get_running_loop().create_future()
                self._waiters.add(waiter)
                try:
                    await waiter
                finally:
                    self._waiters.discard(waiter)
        return result

    async def started(self, count: int) -> list[int]:
        """The pids of the first `count` processes that started."""
        return await self._first(count, "started")

    async def ready(self, count: int) -> list[int]:
        """The pids of the first `count` processes that are running on in their mode."""
        return await self._first(count, "ready")

    async def _first(self, count: int, word: str) -> list[int]:
        pids: list[int] = await self.wait(lambda b: b.pids(word)[:count] if len(b.pids(word)) >= count else None)
        return pids

    async def gone(self, pid: int) -> float:
        return await self.wait(lambda b: b.when("gone", pid))  # type: ignore[no-any-return]


@pytest.fixture
async def beacon() -> AsyncIterator[Beacon]:
    reports = Beacon()
    await reports.start()
    try:
        yield reports
    finally:
        await reports.close()


@pytest.fixture
async def kubelet(kube_api: FakeKubeAPI, beacon: Beacon, tmp_path: Path) -> AsyncIterator[Kubelet]:
    """A kubelet for n1 and n2 whose pods run reporting_container.py with the arguments in
    their `test/container` annotation (`{counter}` becomes a file of the test's own)."""

    def launch(pod: dict[str, Any]) -> ContainerCommand:
        args = pod["metadata"]["annotations"]["test/container"].format(counter=tmp_path / "counter").split()
        return ContainerCommand(
            argv=[sys.executable, str(CONTAINER), str(beacon.port), *args],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            log_path=tmp_path / "logs" / f"{pod['metadata']['name']}.log",
        )

    kube_api.graceful_pod_deletion = True
    node_kubelet = Kubelet(
        kube_api,
        ["n1", "n2"],
        launch,
        restart_backoff=timedelta(seconds=0.2),
        max_restart_backoff=timedelta(seconds=0.4),
        stop_grace=timedelta(seconds=1),
    )
    await node_kubelet.start()
    try:
        yield node_kubelet
    finally:
        await node_kubelet.stop()


def _pod(
    name: str, container: str, *, node: str = "n1", restart: str = "Always", grace: int | None = None
) -> dict[str, Any]:
    pod = objects.pod(
        "ml",
        name,
        job="llm",
        node=node,
        annotations={"test/container": container},
        phase="Pending",
        termination_grace_period=grace,
    )
    pod["spec"]["restartPolicy"] = restart
    del pod["status"]["containerStatuses"]
    return pod


def _container(pod: dict[str, Any] | None) -> dict[str, Any]:
    assert pod is not None
    return pod["status"]["containerStatuses"][0]  # type: ignore[no-any-return]


def _condition(pod: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in pod["status"].get("conditions", []) if c["type"] == kind), None)


async def _status(api: FakeKubeAPI, name: str, predicate: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The pod once predicate(pod) holds."""
    return await api.wait_for(  # type: ignore[no-any-return]
        lambda a: (pod := a.get("Pod", name, "ml")) is not None and "containerStatuses" in pod["status"]
        and predicate(pod) and pod,
        timeout=WAIT,
    )


async def _history(v1: client.CoreV1Api, since: int, name: str) -> list[tuple[str, dict[str, Any]]]:
    """The pod's watch events from resourceVersion `since` up to its deletion."""
    events = []
    async with asyncio.timeout(WAIT), watch.Watch() as w:
        async for event in w.stream(v1.list_namespaced_pod, "ml", resource_version=str(since)):
            if event["raw_object"]["metadata"]["name"] == name:
                events.append((event["type"], event["raw_object"]))
                if event["type"] == "DELETED":
                    return events
    raise AssertionError("unreachable")


async def test_a_bound_pod_runs_and_is_reported_running_and_ready(
    kube_api: FakeKubeAPI, kubelet: Kubelet, beacon: Beacon
) -> None:
    kube_api.create(_pod("w-0", "sleep"))
    kube_api.create(_pod("elsewhere", "sleep", node="n9"))  # no kubelet here for n9
    [pid] = await beacon.started(1)
    pod = await _status(kube_api, "w-0", lambda p: p["status"]["phase"] == "Running")
    assert kubelet.container_pid("ml", "w-0") == pid and kubelet.container_pid("ml", "elsewhere") is None
    status = _container(pod)
    assert (status["name"], status["ready"], status["started"], status["restartCount"]) == ("worker", True, True, 0)
    assert set(status["state"]) == {"running"} and status["state"]["running"]["startedAt"]
    assert status["lastState"] == {}
    assert (_condition(pod, "Ready"), _condition(pod, "ContainersReady")) == ("True", "True")
    assert pod["status"]["podIP"] == "127.0.0.1" and pod["status"]["startTime"]
    assert kube_api.get("Pod", "elsewhere", "ml")["status"]["phase"] == "Pending"  # type: ignore[index]
    assert kube_api.get("Node", "n2") is not None  # a kubelet registers its nodes


async def test_restart_policy_always_restarts_after_a_back_off_and_counts_restarts(
    kube_api: FakeKubeAPI, kubelet: Kubelet, beacon: Beacon
) -> None:
    kube_api.create(_pod("w-0", "codes {counter} 3,0"))
    seen: list[tuple[int, str, int | None]] = []

    def restarted_twice(pod: dict[str, Any]) -> bool:
        status = _container(pod)
        last = status["lastState"].get("terminated", {})
        seen.append((status["restartCount"], next(iter(status["state"])), last.get("exitCode")))
        return status["restartCount"] == 2 and "running" in status["state"]

    pod = await _status(kube_api, "w-0", restarted_twice)
    status = _container(pod)
    assert status["lastState"]["terminated"]["exitCode"] == 0
    assert status["lastState"]["terminated"]["reason"] == "Completed"
    assert pod["status"]["phase"] == "Running" and _condition(pod, "Ready") == "True"
    # In between: backing off after the failure (not ready), then running with it as lastState.
    assert (0, "waiting", 3) in seen and (1, "running", 3) in seen and (1, "waiting", 0) in seen
    await beacon.started(3)


async def test_a_container_killed_by_a_signal_exits_with_128_plus_the_signal(
    kube_api: FakeKubeAPI, kubelet: Kubelet, beacon: Beacon
) -> None:
    kube_api.create(_pod("w-0", "sleep"))
    [first] = await beacon.started(1)
    await _status(kube_api, "w-0", lambda p: "running" in _container(p)["state"])
    await kubelet.kill_container("ml", "w-0")
    pod = await _status(
        kube_api, "w-0", lambda p: _container(p)["restartCount"] == 1 and "running" in _container(p)["state"]
    )
    terminated = _container(pod)["lastState"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (137, "Error")
    assert terminated["startedAt"] and terminated["finishedAt"]
    await beacon.gone(first)
    assert kubelet.container_pid("ml", "w-0") not in (None, first)


async def test_restart_policy_on_failure_restarts_failures_and_succeeds_on_exit_zero(
    kube_api: FakeKubeAPI, kubelet: Kubelet, beacon: Beacon
) -> None:
    kube_api.create(_pod("w-0", "codes {counter} 2,0", restart="OnFailure"))
    pod = await _status(kube_api, "w-0", lambda p: p["status"]["phase"] == "Succeeded")
    status = _container(pod)
    assert status["restartCount"] == 1 and not status["ready"]
    assert (status["state"]["terminated"]["exitCode"], status["state"]["terminated"]["reason"]) == (0, "Completed")
    assert status["lastState"]["terminated"]["exitCode"] == 2
    assert _condition(pod, "Ready") == "False"
    assert kube_api.get("Pod", "w-0", "ml") is not None  # a finished pod stays until deleted
    assert len(beacon.pids()) == 2


async def test_restart_policy_never_fails_the_pod_on_a_non_zero_exit(
    kube_api: FakeKubeAPI, kubelet: Kubelet, beacon: Beacon
) -> None:
    kube_api.create(_pod("w-0", "exit 5", restart="Never"))
    kube_api.create(_pod("w-1", "exit 0", restart="Never"))
    failed = await _status(kube_api, "w-0", lambda p: p["status"]["phase"] == "Failed")
    succeeded = await _status(kube_api, "w-1", lambda p: p["status"]["phase"] == "Succeeded")
    status = _container(failed)
    assert (status["state"]["terminated"]["exitCode"], status["state"]["terminated"]["reason"]) == (5, "Error")
    assert (status["restartCount"], status["lastState"], status["ready"]) == (0, {}, False)
    assert _condition(failed, "Ready") == "False"
    assert _container(succeeded)["state"]["terminated"]["exitCode"] == 0
    assert len(beacon.pids()) == 2  # one start each, no restart


async def test_a_container_that_cannot_start_is_reported_as_a_start_error(
    kube_api: FakeKubeAPI, beacon: Beacon, tmp_path: Path
) -> None:
    kube_api.graceful_pod_deletion = True

    def launch(pod: dict[str, Any]) -> ContainerCommand:
        return ContainerCommand(argv=[str(tmp_path / "missing")], env={}, log_path=tmp_path / "w-0.log")

    async with Kubelet(kube_api, ["n1"], launch):
        kube_api.create(_pod("w-0", "sleep", restart="Never"))
        pod = await _status(kube_api, "w-0", lambda p: p["status"]["phase"] == "Failed")
    terminated = _container(pod)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (128, "StartError")


async def test_an_eviction_sigterms_at_once_then_sigkills_the_tree_at_the_grace_end(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient, kubelet: Kubelet, beacon: Beacon
) -> None:
    v1 = client.CoreV1Api(kube_client)
    # The container ignores SIGTERM; its child lives in a session of its own, as torch's workers do.
    kube_api.create(_pod("w-0", "parent new ignore"))
    main, child = await beacon.started(2)
    await beacon.wait(lambda b: b.when("ready", main))
    await _status(kube_api, "w-0", lambda p: "running" in _container(p)["state"])
    since = kube_api.resource_version
    loop = asyncio.get_running_loop()
    evicted_at = loop.time()
    body = client.V1Eviction(
        metadata=client.V1ObjectMeta(name="w-0", namespace="ml"),
        delete_options=client.V1DeleteOptions(grace_period_seconds=2),
    )
    await v1.create_namespaced_pod_eviction("w-0", "ml", body)
    termed = await beacon.wait(lambda b: b.when("term", main))
    assert termed - evicted_at < 1.0  # at once
    main_gone, child_gone = await beacon.gone(main), await beacon.gone(child)
    assert 2.0 <= main_gone - evicted_at < 2.0 + 5.0 and 2.0 <= child_gone - evicted_at
    assert beacon.when("term", child) is None  # SIGTERM goes to the main process only
    await kube_api.wait_for(lambda api: api.get("Pod", "w-0", "ml") is None, timeout=WAIT)
    events = await _history(v1, since, "w-0")
    assert [t for t, _ in events][-1] == "DELETED"
    final = events[-2][1]
    assert final["status"]["phase"] == "Failed"
    assert _container(final)["state"]["terminated"]["exitCode"] == 137
    assert any(c["type"] == "DisruptionTarget" for c in final["status"]["conditions"])  # kept by the kubelet


async def test_a_container_that_exits_on_sigterm_is_removed_long_before_its_grace_ends(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient, kubelet: Kubelet, beacon: Beacon
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(_pod("w-0", "trap", grace=60))
    [pid] = await beacon.ready(1)
    await _status(kube_api, "w-0", lambda p: "running" in _container(p)["state"])
    since = kube_api.resource_version
    await v1.delete_namespaced_pod("w-0", "ml")
    await beacon.gone(pid)
    await kube_api.wait_for(lambda api: api.get("Pod", "w-0", "ml") is None, timeout=WAIT)  # not 60 s
    final = (await _history(v1, since, "w-0"))[-2][1]
    terminated = _container(final)["state"]["terminated"]
    assert (final["status"]["phase"], terminated["exitCode"], terminated["reason"]) == ("Succeeded", 0, "Completed")


async def test_a_shorter_grace_brings_the_kill_forward(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient, kubelet: Kubelet, beacon: Beacon
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(_pod("w-0", "ignore"))
    [pid] = await beacon.ready(1)
    await _status(kube_api, "w-0", lambda p: "running" in _container(p)["state"])
    await v1.delete_namespaced_pod("w-0", "ml", grace_period_seconds=600)
    await beacon.wait(lambda b: b.when("term", pid))
    shortened_at = asyncio.get_running_loop().time()
    await v1.delete_namespaced_pod("w-0", "ml", grace_period_seconds=2)
    gone = await beacon.gone(pid)
    assert 2.0 <= gone - shortened_at < 2.0 + 5.0
    await kube_api.wait_for(lambda api: api.get("Pod", "w-0", "ml") is None, timeout=WAIT)


async def test_a_pod_deleted_while_backing_off_is_removed_without_a_new_start(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient, beacon: Beacon, tmp_path: Path
) -> None:
    kube_api.graceful_pod_deletion = True

    def launch(pod: dict[str, Any]) -> ContainerCommand:
        argv = [sys.executable, str(CONTAINER), str(beacon.port), "exit", "1"]
        return ContainerCommand(argv, dict(os.environ), tmp_path / "w.log")

    async with Kubelet(kube_api, ["n1"], launch, restart_backoff=timedelta(minutes=5)):
        kube_api.create(_pod("w-0", "exit 1"))
        await _status(kube_api, "w-0", lambda p: "waiting" in _container(p)["state"])
        await client.CoreV1Api(kube_client).delete_namespaced_pod("w-0", "ml")
        await kube_api.wait_for(lambda api: api.get("Pod", "w-0", "ml") is None, timeout=WAIT)
    assert len(beacon.pids()) == 1


async def test_what_outlives_a_container_main_process_is_killed(
    kube_api: FakeKubeAPI, kubelet: Kubelet, beacon: Beacon
) -> None:
    kube_api.create(_pod("w-0", "parent same exit 1", restart="Never"))
    main, child = await beacon.started(2)
    await beacon.gone(main)
    await beacon.gone(child)  # left behind in the container's session: ended as the runtime does
    pod = await _status(kube_api, "w-0", lambda p: p["status"]["phase"] == "Failed")
    assert _container(pod)["state"]["terminated"]["exitCode"] == 1


async def test_kill_node_kills_its_processes_and_leaves_its_pods_as_they_are(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient, kubelet: Kubelet, beacon: Beacon
) -> None:
    kube_api.create(_pod("a", "parent new ignore"))
    kube_api.create(_pod("b", "ignore"))
    kube_api.create(_pod("c", "ignore", node="n2"))
    await beacon.ready(4)
    for name in ("a", "b", "c"):
        await _status(kube_api, name, lambda p: "running" in _container(p)["state"])
    on_n1 = [p for p in beacon.pids() if p != kubelet.container_pid("ml", "c")]
    before = {name: kube_api.get("Pod", name, "ml") for name in ("a", "b")}
    await kubelet.kill_node("n1")
    for pid in on_n1:
        await beacon.gone(pid)
        assert beacon.when("term", pid) is None  # SIGKILL, no SIGTERM first
    assert kubelet.nodes == {"n2"}
    node = kube_api.get("Node", "n1")
    assert node is not None
    assert [(c["type"], c["status"]) for c in node["status"]["conditions"]] == [("Ready", "Unknown")]
    assert {name: kube_api.get("Pod", name, "ml") for name in ("a", "b")} == before
    # Nothing stops a dead node's pods: a deleted one stays terminating.
    await client.CoreV1Api(kube_client).delete_namespaced_pod("a", "ml", grace_period_seconds=1)
    assert kube_api.get("Pod", "a", "ml")["metadata"]["deletionTimestamp"]  # type: ignore[index]
    c = kubelet.container_pid("ml", "c")
    assert c is not None and beacon.when("gone", c) is None
    os.kill(c, 0)  # n2's container is still running


async def test_stop_ends_every_container_and_leaves_the_pods(
    kube_api: FakeKubeAPI, beacon: Beacon, tmp_path: Path
) -> None:
    kube_api.graceful_pod_deletion = True

    def launch(pod: dict[str, Any]) -> ContainerCommand:
        argv = [sys.executable, str(CONTAINER), str(beacon.port), "parent", "new", "ignore"]
        return ContainerCommand(argv, dict(os.environ), tmp_path / "w.log")

    node_kubelet = Kubelet(kube_api, ["n1"], launch, stop_grace=timedelta(seconds=0.5))
    await node_kubelet.start()
    kube_api.create(_pod("w-0", "n/a"))
    main, child = await beacon.started(2)
    await beacon.wait(lambda b: b.when("ready", main))
    await node_kubelet.stop()
    assert beacon.when("gone", main) is not None or await beacon.gone(main)
    await beacon.gone(child)
    assert beacon.when("term", main) is not None  # SIGTERM first, then SIGKILL after stop_grace
    assert kube_api.get("Pod", "w-0", "ml") is not None


async def test_a_kubelet_needs_graceful_pod_deletion(kube_api: FakeKubeAPI, tmp_path: Path) -> None:
    node_kubelet = Kubelet(kube_api, ["n1"], lambda pod: ContainerCommand(["true"], {}, tmp_path / "log"))
    with pytest.raises(ValueError, match="graceful_pod_deletion"):
        await node_kubelet.start()
