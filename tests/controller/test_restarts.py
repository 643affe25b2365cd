"""Only failures count towards a restart storm: a container that exited 0 or left the job
(75) restarted voluntarily; one that failed, was OOM-killed or got a signal did not."""

from __future__ import annotations

import json
from typing import Any

import pytest

from regroup.controller.cluster import ContainerRestarts
from regroup.controller.kube.convert import pod_info
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import Cordon
from regroup.exit_codes import LEFT_JOB
from regroup.keys import JobKeys
from regroup.records import JobStatus
from kubeapi import objects

from .builders import JOB, NS, T0, decide, job, of
from .harness import NS as E2E_NS
from .harness import Cluster, controller, notes

S = ControllerSettings()


def terminated(exit_code: int, reason: str, signal: int | None = None) -> dict[str, Any]:
    """``lastState.terminated`` as the kubelet writes it."""
    state: dict[str, Any] = {"exitCode": exit_code, "reason": reason, "startedAt": "2024-05-01T10:00:00Z",
                             "finishedAt": "2024-05-01T10:01:00Z", "containerID": "containerd://abc"}
    if signal is not None:
        state["signal"] = signal
    return state


@pytest.mark.parametrize(
    ("last", "failed"),
    [
        (terminated(0, "Completed"), False),
        (terminated(LEFT_JOB, "Error"), False),
        (terminated(1, "Error"), True),
        (terminated(137, "Error"), True),
        (terminated(137, "OOMKilled"), True),
        (terminated(0, "OOMKilled"), True),
        (terminated(0, "Completed", signal=9), True),
        (None, True),
    ],
    ids=["exit-0", "exit-75", "exit-1", "exit-137", "oom-killed", "oom-reason", "signal", "no-last-state"],
)
def test_the_source_reads_whether_the_last_termination_failed(last: dict[str, Any] | None, failed: bool) -> None:
    obj = objects.pod(NS, "w-0", job=JOB, node="n1", restart_count=2)
    if last is not None:
        obj["status"]["containerStatuses"][0]["lastState"] = {"terminated": last}
    info = pod_info(obj)
    [container] = info.containers
    assert (container.name, container.count, container.last_failed) == ("worker", 2, failed) and info.restart_count == 2
    # The latest termination is the same one here (the container runs again): its failure too.
    assert container.exit_failed == failed and container.exit_code == (last["exitCode"] if last else None)


def _restarts(node: str, codes: list[tuple[int, str]], start: float = T0):
    """The job's pod on ``node`` restarting once per (exit code, reason), ten seconds apart."""
    s = job(("n1", "n2", "n3"), hosting=20)
    for count, (code, reason) in enumerate(codes, start=1):
        failed = pod_info_failed(code, reason)
        s = s.changed_pod(node, at=start + 10 * count, restart_count=count,
                          containers=(ContainerRestarts("worker", count, failed),))
    return s


def pod_info_failed(code: int, reason: str) -> bool:
    obj = objects.pod(NS, "w", job=JOB, node="n1", restart_count=1)
    obj["status"]["containerStatuses"][0]["lastState"] = {"terminated": terminated(code, reason)}
    return pod_info(obj).containers[0].last_failed


def test_voluntary_restarts_never_make_a_storm() -> None:
    s = _restarts("n2", [(0, "Completed"), (LEFT_JOB, "Error"), (0, "Completed"), (LEFT_JOB, "Error")])
    assert not s.restarts.get("n2") and not of(decide(s, T0 + 60, S).actions, Cordon)


def test_failed_restarts_make_a_storm() -> None:
    s = _restarts("n2", [(1, "Error"), (137, "OOMKilled"), (137, "Error")])
    assert len(s.restarts["n2"]) == 3
    assert [c.node for c in of(decide(s, T0 + 60, S).actions, Cordon)] == ["n2"]


def test_only_the_failed_restarts_of_a_mixed_history_count() -> None:
    s = _restarts("n2", [(0, "Completed"), (1, "Error"), (LEFT_JOB, "Error"), (1, "Error")])
    assert len(s.restarts["n2"]) == 2 and not of(decide(s, T0 + 60, S).actions, Cordon)


def test_without_container_details_every_restart_counts() -> None:
    s = job(("n1", "n2", "n3"), hosting=20)
    for count in (1, 2, 3):
        s = s.changed_pod("n2", at=T0 + count, restart_count=count)
    assert [c.node for c in of(decide(s, T0 + 5, S).actions, Cordon)] == ["n2"]


# --- end to end -----------------------------------------------------------------------------

KEYS = JobKeys(E2E_NS, JOB)


def restart(kube_api, pod: str, count: int, exit_code: int, reason: str) -> None:
    """The kubelet restarted the pod's container: ``restartCount`` and ``lastState`` in one status write."""
    status = kube_api.get("Pod", pod, E2E_NS)["status"]
    container = status["containerStatuses"][0]
    container.update(restartCount=count, lastState={"terminated": terminated(exit_code, reason)},
                     state={"running": {"startedAt": "2024-05-01T10:01:01Z"}})
    kube_api.patch("Pod", pod, {"status": {"containerStatuses": status["containerStatuses"]}}, namespace=E2E_NS)


async def test_exits_0_and_75_do_not_cordon_and_failures_do(kube_api, kubeconfig, etcd_settings, etcd_client) -> None:
    cluster = Cluster(kube_api, etcd_client)
    await cluster.job(JOB, ["n1", "n2", "n3", "n4"], notes(1, 4, restart_storm="3/10m"))
    async with controller(kube_api, kubeconfig, etcd_settings):
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.node_count == 4)
        # n2 restarts three times, each a voluntary exit: finished, left the job, finished.
        for count, (code, reason) in enumerate([(0, "Completed"), (LEFT_JOB, "Error"), (0, "Completed")], start=1):
            restart(kube_api, f"{JOB}-n2", count, code, reason)
        # Then n3 fails three times: an error, the OOM killer, a SIGKILL. The pod watch brings
        # n2's restarts first, and the storm rule looks at n2 before n3: had n2's counted, n2
        # would be the cordoned node (the budget is one).
        for count, (code, reason) in enumerate([(1, "Error"), (137, "OOMKilled"), (137, "Error")], start=1):
            restart(kube_api, f"{JOB}-n3", count, code, reason)
        node = await kube_api.wait_for(lambda api: (n := api.get("Node", "n3"))["spec"].get("unschedulable") and n)
        assert "3 rank restarts" in json.loads(node["metadata"]["annotations"]["regroup.dev/cordoned"])["reason"]
        assert not kube_api.get("Node", "n2")["spec"].get("unschedulable")
        await kube_api.wait_for(lambda api: [e for e in api.events() if e["reason"] == "RestartStorm"])
        storms = [e["involvedObject"]["name"] for e in kube_api.events() if e["reason"] in ("RestartStorm",
                                                                                         "CordonBudgetExhausted")]
        assert storms == ["n3"]
        assert kube_api.get("Pod", f"{JOB}-n2", E2E_NS) is not None
