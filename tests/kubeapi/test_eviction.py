"""Eviction and graceful deletion through the real client: the DisruptionTarget condition,
grace periods, and PodDisruptionBudgets (policy/v1) as the eviction handler applies them."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes_asyncio import client, watch

from kubeapi import discovery, objects
from kubeapi.server import FakeKubeAPI


def _eviction(name: str, namespace: str = "ml", grace: int | None = None) -> client.V1Eviction:
    options = client.V1DeleteOptions(grace_period_seconds=grace) if grace is not None else None
    return client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace=namespace), delete_options=options)


def _when(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _budget(name: str, *, selector: dict[str, Any] | None, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": name, "namespace": "ml"},
        "spec": {"selector": selector, **spec},
    }


def _pods(api: FakeKubeAPI, count: int, *, unready: int = 0, job: str = "llm") -> list[str]:
    """`count` running pods of `job` on n1 (the last `unready` of them not Ready)."""
    names = []
    for i in range(count):
        pod = objects.pod("ml", f"{job}-{i}", job=job, node="n1")
        if i >= count - unready:
            pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
        api.create(pod)
        names.append(pod["metadata"]["name"])
    return names


def _disruption_target(pod: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in pod["status"].get("conditions", []) if c["type"] == "DisruptionTarget"), None)


async def test_eviction_writes_the_disruption_condition_then_marks_the_pod_for_deletion(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    # The handler (addConditionAndDeletePod) updates the pod with the condition, then deletes
    # it gracefully: two writes, so a watcher sees the condition first, then the deletion.
    kube_api.graceful_pod_deletion = True
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "w-0", job="llm", node="n1", termination_grace_period=45))
    start = kube_api.resource_version
    events: list[tuple[str, dict[str, Any]]] = []

    async def watch_until_deleting() -> None:
        async with watch.Watch() as w:
            async for event in w.stream(v1.list_namespaced_pod, "ml", resource_version=str(start), timeout_seconds=30):
                events.append((event["type"], event["raw_object"]))
                if event["raw_object"]["metadata"].get("deletionTimestamp"):
                    return

    async with asyncio.timeout(30), asyncio.TaskGroup() as tasks:
        tasks.create_task(watch_until_deleting())
        await kube_api.wait_for(lambda api: api.open_watches("pods") == 1)
        before = datetime.now(UTC).replace(microsecond=0)
        await v1.create_namespaced_pod_eviction("w-0", "ml", _eviction("w-0"))
    assert [t for t, _ in events] == ["MODIFIED", "MODIFIED"]
    (_, marked), (_, deleting) = events
    assert _disruption_target(marked) is not None and "deletionTimestamp" not in marked["metadata"]
    condition = _disruption_target(deleting)
    assert condition is not None
    assert {k: condition[k] for k in ("status", "reason", "message")} == {
        "status": "True",
        "reason": "EvictionByEvictionAPI",
        "message": "Eviction API: evicting",
    }
    assert _when(condition["lastTransitionTime"]) >= before
    assert deleting["metadata"]["deletionGracePeriodSeconds"] == 45
    assert _when(deleting["metadata"]["deletionTimestamp"]) - before >= timedelta(seconds=45)
    assert int(deleting["metadata"]["resourceVersion"]) == int(marked["metadata"]["resourceVersion"]) + 1
    assert kube_api.resource_version == int(deleting["metadata"]["resourceVersion"])  # nothing else was written
    # The other conditions stay; the pod is still there for its kubelet to stop.
    assert [c["type"] for c in deleting["status"]["conditions"]] == ["Ready", "DisruptionTarget"]
    assert kube_api.get("Pod", "w-0", "ml") == deleting


async def test_eviction_takes_the_grace_period_from_delete_options_else_the_pod(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    kube_api.graceful_pod_deletion = True
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "given", job="llm", node="n1", termination_grace_period=45))
    kube_api.create(objects.pod("ml", "unset", job="llm", node="n1"))
    kube_api.create(objects.pod("ml", "unscheduled", job="llm", node="", phase="Pending"))
    await v1.create_namespaced_pod_eviction("given", "ml", _eviction("given", grace=7))
    await v1.create_namespaced_pod_eviction("unset", "ml", _eviction("unset"))
    await v1.create_namespaced_pod_eviction("unscheduled", "ml", _eviction("unscheduled"))
    given, unset = kube_api.get("Pod", "given", "ml"), kube_api.get("Pod", "unset", "ml")
    assert given is not None and given["metadata"]["deletionGracePeriodSeconds"] == 7
    assert unset is not None and unset["metadata"]["deletionGracePeriodSeconds"] == 30
    assert kube_api.get("Pod", "unscheduled", "ml") is None  # no kubelet to wait for: gone at once


async def test_evicting_a_terminating_pod_skips_budgets_and_only_adds_the_condition_or_a_shorter_grace(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    kube_api.graceful_pod_deletion = True
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "w-0", job="llm", node="n1"))
    kube_api.create(_budget("all", selector={}, maxUnavailable=0))
    await v1.delete_namespaced_pod("w-0", "ml", grace_period_seconds=20)
    deleted = kube_api.get("Pod", "w-0", "ml")
    assert deleted is not None and _disruption_target(deleted) is None
    # A budget that allows nothing does not hold back a pod that is already going.
    await v1.create_namespaced_pod_eviction("w-0", "ml", _eviction("w-0"))
    evicted = kube_api.get("Pod", "w-0", "ml")
    assert evicted is not None and _disruption_target(evicted) is not None
    assert evicted["metadata"]["deletionTimestamp"] == deleted["metadata"]["deletionTimestamp"]
    assert evicted["metadata"]["deletionGracePeriodSeconds"] == 20
    # A shorter grace moves the deletion forward from the original request's time.
    await v1.create_namespaced_pod_eviction("w-0", "ml", _eviction("w-0", grace=5))
    shorter = kube_api.get("Pod", "w-0", "ml")
    assert shorter is not None and shorter["metadata"]["deletionGracePeriodSeconds"] == 5
    moved = _when(deleted["metadata"]["deletionTimestamp"]) - _when(shorter["metadata"]["deletionTimestamp"])
    assert moved == timedelta(seconds=15)
    assert shorter["metadata"]["generation"] == deleted["metadata"]["generation"]
    assert _disruption_target(shorter) == _disruption_target(evicted)  # unchanged, transition time kept


async def test_a_second_delete_may_only_shorten_the_grace_and_zero_removes_the_pod(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    kube_api.graceful_pod_deletion = True
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "w-0", job="llm", node="n1", termination_grace_period=5))
    first = await v1.delete_namespaced_pod("w-0", "ml", grace_period_seconds=30)
    rv = kube_api.resource_version
    await v1.delete_namespaced_pod("w-0", "ml")  # no grace given: the pending deletion stands
    await v1.delete_namespaced_pod("w-0", "ml", grace_period_seconds=60)  # longer: ignored
    assert kube_api.resource_version == rv
    shorter = await v1.delete_namespaced_pod("w-0", "ml", grace_period_seconds=10)
    assert shorter.metadata.deletion_grace_period_seconds == 10
    assert first.metadata.deletion_timestamp - shorter.metadata.deletion_timestamp == timedelta(seconds=20)
    await v1.delete_namespaced_pod("w-0", "ml", grace_period_seconds=0)
    assert kube_api.get("Pod", "w-0", "ml") is None


@pytest.mark.parametrize(
    ("spec", "pods", "evictable"),
    [
        ({"minAvailable": 2}, 3, 1),
        ({"minAvailable": 3}, 3, 0),
        ({"minAvailable": "50%"}, 3, 1),  # 1.5 pods rounds up to 2
        ({"minAvailable": "100%"}, 3, 0),
        ({"maxUnavailable": 1}, 3, 1),
        ({"maxUnavailable": 0}, 3, 0),
        ({"maxUnavailable": "34%"}, 3, 2),  # 1.02 pods rounds up to 2
        ({"maxUnavailable": "50%"}, 4, 2),
    ],
)
async def test_a_budget_lets_evictions_through_while_enough_pods_stay_healthy(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient, spec: dict[str, Any], pods: int, evictable: int
) -> None:
    kube_api.graceful_pod_deletion = True  # evicted pods stay, terminating: no longer healthy
    v1 = client.CoreV1Api(kube_client)
    names = _pods(kube_api, pods)
    _pods(kube_api, 2, job="other")  # outside the selector
    await client.PolicyV1Api(kube_client).create_namespaced_pod_disruption_budget(
        "ml", _budget("llm-budget", selector={"matchLabels": {objects.JOB_LABEL: "llm"}}, **spec)
    )
    for name in names[:evictable]:
        await v1.create_namespaced_pod_eviction(name, "ml", _eviction(name))
    with pytest.raises(client.ApiException) as refused:
        await v1.create_namespaced_pod_eviction(names[evictable], "ml", _eviction(names[evictable]))
    status = json.loads(refused.value.body)
    assert (refused.value.status, status["reason"]) == (429, "TooManyRequests")
    assert status["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    healthy = pods - evictable
    assert status["details"]["causes"] == [
        {
            "reason": "DisruptionBudget",
            "message": f"The disruption budget llm-budget needs {healthy} healthy pods and has {healthy} currently",
        }
    ]
    assert "deletionTimestamp" not in kube_api.get("Pod", names[evictable], "ml")["metadata"]  # type: ignore[index]
    await v1.create_namespaced_pod_eviction("other-0", "ml", _eviction("other-0"))  # no budget covers it


async def test_unready_and_not_running_pods_may_be_evicted_while_the_budget_holds(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    policy = client.PolicyV1Api(kube_client)
    selector = {"matchExpressions": [{"key": objects.JOB_LABEL, "operator": "In", "values": ["llm"]}]}
    _pods(kube_api, 3, unready=1)  # llm-0 and llm-1 ready, llm-2 not
    await policy.create_namespaced_pod_disruption_budget("ml", _budget("b", selector=selector, minAvailable=2))
    kube_api.create(objects.pod("ml", "pending", job="llm", node="", phase="Pending"))
    kube_api.create(objects.pod("ml", "done", job="llm", node="n1", phase="Succeeded"))
    with pytest.raises(client.ApiException) as refused:
        await v1.create_namespaced_pod_eviction("llm-0", "ml", _eviction("llm-0"))
    assert refused.value.status == 429
    # Unready, Pending and finished pods are not healthy: taking them costs the budget nothing.
    for name in ("llm-2", "pending", "done"):
        await v1.create_namespaced_pod_eviction(name, "ml", _eviction(name))
        assert kube_api.get("Pod", name, "ml") is None


@pytest.mark.parametrize(("policy", "allowed"), [(None, False), ("IfHealthyBudget", False), ("AlwaysAllow", True)])
async def test_an_unready_pod_of_a_disrupted_application_follows_the_unhealthy_pod_eviction_policy(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient, policy: str | None, allowed: bool
) -> None:
    v1 = client.CoreV1Api(kube_client)
    spec: dict[str, Any] = {"minAvailable": 3}
    if policy is not None:
        spec["unhealthyPodEvictionPolicy"] = policy
    kube_api.create(_budget("b", selector={"matchLabels": {objects.JOB_LABEL: "llm"}}, **spec))
    _pods(kube_api, 3, unready=1)  # 2 healthy of the 3 wanted: already disrupted
    if allowed:
        await v1.create_namespaced_pod_eviction("llm-2", "ml", _eviction("llm-2"))
        assert kube_api.get("Pod", "llm-2", "ml") is None
    else:
        with pytest.raises(client.ApiException) as refused:
            await v1.create_namespaced_pod_eviction("llm-2", "ml", _eviction("llm-2"))
        assert refused.value.status == 429
        assert "needs 3 healthy pods and has 2 currently" in refused.value.body


async def test_a_pod_under_two_budgets_cannot_be_evicted(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    _pods(kube_api, 2)
    kube_api.create(_budget("by-job", selector={"matchLabels": {objects.JOB_LABEL: "llm"}}, maxUnavailable=1))
    kube_api.create(_budget("everything", selector={}, maxUnavailable=1))
    kube_api.create(_budget("nothing", selector=None, maxUnavailable=0))  # a null selector matches no pod
    with pytest.raises(client.ApiException) as failed:
        await v1.create_namespaced_pod_eviction("llm-0", "ml", _eviction("llm-0"))
    status = json.loads(failed.value.body)
    assert (failed.value.status, status["code"], status["status"]) == (500, 500, "Failure")
    assert status["message"] == (
        "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
    )
    assert kube_api.get("Pod", "llm-0", "ml") is not None
    kube_api.delete("PodDisruptionBudget", "everything", "ml")
    await v1.create_namespaced_pod_eviction("llm-0", "ml", _eviction("llm-0"))


async def test_budgets_are_served_and_validated_like_the_real_resource(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    policy = client.PolicyV1Api(kube_client)
    kube_api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
    body = _budget("b", selector={"matchLabels": {"app": "x"}}, minAvailable="50%")
    body["status"] = {"disruptionsAllowed": 9, "currentHealthy": 9, "desiredHealthy": 9, "expectedPods": 9}
    created = await policy.create_namespaced_pod_disruption_budget("ml", body)
    assert created.spec.min_available == "50%" and created.metadata.generation == 1
    assert (created.status.disruptions_allowed, created.status.expected_pods) == (0, 0)  # reset on create
    start = str(kube_api.resource_version)
    patched = await policy.patch_namespaced_pod_disruption_budget("b", "ml", {"spec": {"minAvailable": 2}})
    assert patched.spec.min_available == 2 and patched.metadata.generation == 2
    listed = await policy.list_namespaced_pod_disruption_budget("ml")
    assert [b.metadata.name for b in listed.items] == ["b"]
    async with watch.Watch() as w:
        event = await anext(w.stream(policy.list_namespaced_pod_disruption_budget, "ml", resource_version=start))
    assert (event["type"], event["object"].spec.min_available) == ("MODIFIED", 2)
    for bad, field in [
        ({"minAvailable": 1, "maxUnavailable": 1}, "spec"),
        ({"minAvailable": "150%"}, "spec.minAvailable"),
        ({"maxUnavailable": "five"}, "spec.maxUnavailable"),
        ({"maxUnavailable": -1}, "spec.maxUnavailable"),
        ({"maxUnavailable": 1, "unhealthyPodEvictionPolicy": "Never"}, "spec.unhealthyPodEvictionPolicy"),
    ]:
        with pytest.raises(client.ApiException) as invalid:
            await policy.create_namespaced_pod_disruption_budget("ml", _budget("bad", selector={}, **bad))
        assert invalid.value.status == 422
        assert [c["field"] for c in json.loads(invalid.value.body)["details"]["causes"]] == [field]
    bad_selector = {"matchExpressions": [{"key": "app", "operator": "In", "values": []}]}
    with pytest.raises(client.ApiException) as invalid:
        await policy.create_namespaced_pod_disruption_budget("ml", _budget("bad", selector=bad_selector))
    assert invalid.value.status == 422 and "spec.selector.matchExpressions[0].values" in invalid.value.body
    await policy.delete_namespaced_pod_disruption_budget("b", "ml")
    assert kube_api.list("PodDisruptionBudget") == []
    served = discovery.document("/apis/policy/v1", "127.0.0.1")
    assert served is not None
    assert {(r["name"], tuple(r.get("shortNames", ()))) for r in served["resources"]} == {
        ("poddisruptionbudgets", ("pdb",)),
        ("poddisruptionbudgets/status", ()),
    }
