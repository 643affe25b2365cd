"""Object semantics through the real client: status subresource, deletion, eviction, Events, Leases."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
from kubernetes_asyncio import client, config, watch
from kubernetes_asyncio.dynamic import DynamicClient

from regroup.demo.etcd_server import make_tls_files
from kubeapi import objects
from kubeapi.server import FakeKubeAPI


async def test_status_subresource_isolates_status_from_spec(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    created = kube_api.create(objects.pod("ml", "p", job="j", node="n1"))
    assert created["metadata"]["generation"] == 1
    # The main resource ignores status ...
    pod = await v1.patch_namespaced_pod(
        "p", "ml", {"metadata": {"annotations": {"a": "1"}}, "status": {"phase": "Failed"}}
    )
    assert pod.status.phase == "Running" and pod.metadata.annotations == {"a": "1"}
    assert pod.metadata.generation == 1  # metadata-only changes keep the generation
    # ... and /status changes nothing but status.
    pod = await v1.patch_namespaced_pod_status(
        "p",
        "ml",
        {"metadata": {"labels": {"sneaky": "yes"}}, "spec": {"nodeName": "n9"}, "status": {"phase": "Failed"}},
    )
    assert pod.status.phase == "Failed" and pod.spec.node_name == "n1" and "sneaky" not in pod.metadata.labels
    # Status conditions merge by type; the Ready condition keeps its other fields.
    node = kube_api.create(objects.node("n1"))
    patched = await v1.patch_node_status(
        "n1", {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "KubeletNotReady"}]}}
    )
    assert [(c.type, c.status) for c in patched.status.conditions] == [("Ready", "False")]
    assert patched.status.conditions[0].message == node["status"]["conditions"][0]["message"]
    spec_change = await v1.patch_node("n1", {"spec": {"unschedulable": True}})
    assert spec_change.metadata.generation == 2


async def test_http_create_fills_server_fields_and_resets_pod_status(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    body = objects.pod("default", "p", job="j", node="n1")
    body["metadata"]["uid"] = "client-chosen"
    pod = await v1.create_namespaced_pod("default", body)
    assert pod.status.phase == "Pending"
    assert pod.metadata.uid != "client-chosen" and pod.metadata.creation_timestamp is not None
    assert int(pod.metadata.resource_version) == kube_api.resource_version
    with pytest.raises(client.ApiException) as exists:
        await v1.create_namespaced_pod("default", body)
    assert exists.value.status == 409
    assert json.loads(exists.value.body)["reason"] == "AlreadyExists"
    with pytest.raises(client.ApiException) as missing_ns:
        await v1.create_namespaced_pod("nowhere", objects.pod("nowhere", "p", job="j", node="n1"))
    assert missing_ns.value.status == 404
    with pytest.raises(client.ApiException) as unnamed:
        await v1.create_namespaced_pod("default", {"metadata": {}, "spec": {"containers": []}})
    assert unnamed.value.status == 422 and "metadata.name" in unnamed.value.body
    with pytest.raises(client.ApiException) as missing:
        await v1.read_namespaced_pod("absent", "default")
    status = json.loads(missing.value.body)
    assert (missing.value.status, status["kind"], status["reason"]) == (404, "Status", "NotFound")
    assert status["message"] == 'pods "absent" not found' and status["details"] == {"name": "absent", "kind": "pods"}


async def test_delete_emits_deleted_and_honours_preconditions(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "p", job="j", node="n1"))
    with pytest.raises(client.ApiException) as conflict:
        await v1.delete_namespaced_pod(
            "p", "ml", body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="x"))
        )
    assert conflict.value.status == 409
    start = str(kube_api.resource_version)
    deleted = await v1.delete_namespaced_pod("p", "ml", grace_period_seconds=30)
    assert kube_api.get("Pod", "p", "ml") is None
    async with asyncio.timeout(5), watch.Watch() as w:
        event = await anext(w.stream(v1.list_namespaced_pod, "ml", resource_version=start))
    assert (event["type"], event["object"].metadata.name) == ("DELETED", "p")
    assert event["object"].metadata.resource_version == str(kube_api.resource_version)
    assert deleted.metadata.name == "p"


@pytest.fixture
async def graceful_api(tmp_path: Path) -> AsyncIterator[tuple[FakeKubeAPI, client.CoreV1Api]]:
    api = FakeKubeAPI(graceful_pod_deletion=True)
    await api.start()
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(api.write_kubeconfig(tmp_path / "graceful")), client_configuration=configuration
    )
    api_client = client.ApiClient(configuration)
    try:
        yield api, client.CoreV1Api(api_client)
    finally:
        await api_client.close()
        await api.stop()
    assert not api.internal_errors


async def test_graceful_pod_deletion_marks_then_the_test_finishes_it(
    graceful_api: tuple[FakeKubeAPI, client.CoreV1Api],
) -> None:
    api, v1 = graceful_api
    api.create(objects.pod("ml", "p", job="j", node="n1"))
    api.create(objects.pod("ml", "unscheduled", job="j", node=""))
    before = datetime.now(UTC).replace(microsecond=0)
    marked = await v1.delete_namespaced_pod("p", "ml", grace_period_seconds=20)
    assert marked.metadata.deletion_grace_period_seconds == 20
    assert (marked.metadata.deletion_timestamp - before).total_seconds() >= 20
    assert api.get("Pod", "p", "ml") is not None
    await v1.delete_namespaced_pod("unscheduled", "ml")  # no kubelet to wait for: gone at once
    assert api.get("Pod", "unscheduled", "ml") is None
    api.delete("Pod", "p", "ml")
    assert api.get("Pod", "p", "ml") is None


async def test_finalizers_hold_deletion_until_removed(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    node = objects.node("n1")
    node["metadata"]["finalizers"] = ["example.com/hold"]
    kube_api.create(node)
    await v1.delete_node("n1")
    held = kube_api.get("Node", "n1")
    assert held is not None and held["metadata"]["deletionTimestamp"]
    await v1.patch_node("n1", [{"op": "remove", "path": "/metadata/finalizers"}])
    assert kube_api.get("Node", "n1") is None


async def test_eviction_deletes_the_pod_unless_a_budget_blocks_it(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "a", job="j", node="n1"))
    kube_api.create(objects.pod("ml", "b", job="j", node="n1"))
    kube_api.block_eviction("ml", "b", budget="workers")

    def eviction(name: str) -> client.V1Eviction:
        return client.V1Eviction(metadata=client.V1ObjectMeta(name=name, namespace="ml"))

    await v1.create_namespaced_pod_eviction("a", "ml", eviction("a"))
    assert kube_api.get("Pod", "a", "ml") is None
    assert kube_api.requests[-1].path == "/api/v1/namespaces/ml/pods/a/eviction"
    with pytest.raises(client.ApiException) as blocked:
        await v1.create_namespaced_pod_eviction("b", "ml", eviction("b"))
    assert blocked.value.status == 429
    assert json.loads(blocked.value.body)["details"]["causes"][0]["reason"] == "DisruptionBudget"
    assert kube_api.get("Pod", "b", "ml") is not None
    with pytest.raises(client.ApiException) as mismatch:
        await v1.create_namespaced_pod_eviction("b", "ml", eviction("a"))
    assert mismatch.value.status == 400
    kube_api.unblock_eviction("ml", "b")
    await v1.create_namespaced_pod_eviction("b", "ml", eviction("b"))
    with pytest.raises(client.ApiException) as gone:
        await v1.create_namespaced_pod_eviction("b", "ml", eviction("b"))
    assert gone.value.status == 404


async def test_events_are_posted_listed_and_validated(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    pod_ref = client.V1ObjectReference(kind="Pod", name="p", namespace="ml", api_version="v1")
    kube_api.create(objects.pod("ml", "p", job="j", node="n1"))
    posted = await v1.create_namespaced_event(
        "ml",
        client.CoreV1Event(
            metadata=client.V1ObjectMeta(generate_name="p."),
            involved_object=pod_ref,
            reason="BadAnnotation",
            message="regroup.dev/min-nodes: not a number",
            type="Warning",
            count=1,
        ),
    )
    assert posted.metadata.name.startswith("p.")
    await v1.patch_namespaced_event(posted.metadata.name, "ml", {"count": 2})
    # An Event about a cluster-scoped object must live in "default", as the real validation demands.
    node_ref = client.V1ObjectReference(kind="Node", name="n1")
    with pytest.raises(client.ApiException) as misplaced:
        await v1.create_namespaced_event(
            "ml", client.CoreV1Event(metadata=client.V1ObjectMeta(name="n1.x"), involved_object=node_ref, reason="R")
        )
    assert misplaced.value.status == 422 and "involvedObject.namespace" in misplaced.value.body
    await client.EventsV1Api(kube_client).create_namespaced_event(
        "default",
        client.EventsV1Event(
            metadata=client.V1ObjectMeta(name="n1.cordon"),
            event_time=datetime.now(UTC),
            regarding=node_ref,
            note="restart storm",
            reason="Cordoned",
            type="Warning",
            action="Cordon",
            reporting_controller="regroup.dev/controller",
            reporting_instance="controller-0",
        ),
    )
    assert [(e["reason"], e["count"]) for e in kube_api.events("ml")] == [("BadAnnotation", 2)]
    cordon = kube_api.events("default")[0]
    assert (cordon["involvedObject"]["name"], cordon["message"]) == ("n1", "restart storm")
    listed = await v1.list_namespaced_event("ml", field_selector="involvedObject.name=p,reason=BadAnnotation")
    assert [e.count for e in listed.items] == [2]
    via_events_api = await client.EventsV1Api(kube_client).list_namespaced_event("default")
    assert [(e.note, e.regarding.name) for e in via_events_api.items] == [("restart storm", "n1")]


async def test_lease_updates_are_optimistic(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    leases = client.CoordinationV1Api(kube_client)
    spec = client.V1LeaseSpec(holder_identity="a", lease_duration_seconds=15)
    lease = await leases.create_namespaced_lease(
        "kube-system", client.V1Lease(metadata=client.V1ObjectMeta(name="regroup-controller"), spec=spec)
    )
    with pytest.raises(client.ApiException) as exists:
        await leases.create_namespaced_lease("kube-system", lease)
    assert exists.value.status == 409
    # Two replicas read the same version; the first write wins, the second conflicts.
    mine = await leases.read_namespaced_lease("regroup-controller", "kube-system")
    theirs = await leases.read_namespaced_lease("regroup-controller", "kube-system")
    mine.spec.holder_identity = "b"
    updated = await leases.replace_namespaced_lease("regroup-controller", "kube-system", mine)
    assert int(updated.metadata.resource_version) > int(lease.metadata.resource_version)
    theirs.spec.holder_identity = "c"
    with pytest.raises(client.ApiException) as conflict:
        await leases.replace_namespaced_lease("regroup-controller", "kube-system", theirs)
    assert conflict.value.status == 409 and json.loads(conflict.value.body)["reason"] == "Conflict"
    # Leases take no unconditional update.
    theirs.metadata.resource_version = None
    with pytest.raises(client.ApiException) as unconditional:
        await leases.replace_namespaced_lease("regroup-controller", "kube-system", theirs)
    assert unconditional.value.status == 422
    final = await leases.read_namespaced_lease("regroup-controller", "kube-system")
    assert final.spec.holder_identity == "b"
    with pytest.raises(client.ApiException) as missing:
        await leases.read_namespaced_lease("other", "kube-system")
    assert json.loads(missing.value.body)["message"] == 'leases.coordination.k8s.io "other" not found'


async def test_namespaces_list_and_deleting_one_removes_its_objects(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "p", job="j", node="n1"))
    names = [n.metadata.name for n in (await v1.list_namespace()).items]
    assert names == ["default", "kube-node-lease", "kube-public", "kube-system", "ml"]
    assert (await v1.read_namespace("ml")).status.phase == "Active"
    await v1.delete_namespace("ml")
    assert kube_api.get("Pod", "p", "ml") is None and kube_api.get("Namespace", "ml") is None


async def test_wait_for_wakes_on_client_writes(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.node("n1"))
    waiter = asyncio.create_task(
        kube_api.wait_for(lambda api: (n := api.get("Node", "n1")) and n["spec"].get("unschedulable"), timeout=5)
    )
    await v1.patch_node("n1", {"spec": {"unschedulable": True}})
    assert await waiter is True


async def test_put_keeps_status_and_counts_spec_generations(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "p", job="j", node="n1"))
    pod = await v1.read_namespaced_pod("p", "ml")
    pod.status.phase = "Failed"
    pod.spec.active_deadline_seconds = 60
    replaced = await v1.replace_namespaced_pod("p", "ml", pod)
    assert replaced.status.phase == "Running" and replaced.metadata.generation == 2
    pod.spec.active_deadline_seconds = 30
    with pytest.raises(client.ApiException) as stale:
        await v1.replace_namespaced_pod("p", "ml", pod)
    assert stale.value.status == 409


def test_a_seed_makes_generated_fields_reproducible() -> None:
    def uids(seed: int) -> list[str]:
        api = FakeKubeAPI(seed=seed)
        return [api.create(objects.node(f"n{i}"))["metadata"]["uid"] for i in range(3)]

    assert uids(7) == uids(7) != uids(8)
    assert len(set(uids(7))) == 3


async def test_events_api_requires_what_the_real_validation_requires(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    events = client.EventsV1Api(kube_client)
    node_ref = client.V1ObjectReference(kind="Node", name="n1")

    def event(**fields: object) -> client.EventsV1Event:
        values: dict[str, object] = {
            "metadata": client.V1ObjectMeta(name="n1.e"),
            "event_time": datetime.now(UTC),
            "regarding": node_ref,
            "reason": "Cordoned",
            "type": "Warning",
            "action": "Cordon",
            "reporting_controller": "regroup.dev/controller",
            "reporting_instance": "controller-0",
        }
        values.update(fields)
        return client.EventsV1Event(**values)

    for fields, field in (
        ({"reporting_instance": None}, "reportingInstance"),
        ({"action": None}, "action"),
        ({"type": "Info"}, "type"),
        ({"deprecated_count": 3}, "deprecatedCount"),
    ):
        with pytest.raises(client.ApiException) as invalid:
            await events.create_namespaced_event("default", event(**fields))
        causes = json.loads(invalid.value.body)["details"]["causes"]
        assert invalid.value.status == 422 and [c["field"] for c in causes] == [field]
    kube_api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "ml"}})
    with pytest.raises(client.ApiException) as misplaced:
        await events.create_namespaced_event("ml", event())
    assert misplaced.value.status == 422 and "regarding.namespace" in misplaced.value.body
    assert kube_api.events() == []


async def test_discovery_lets_the_dynamic_client_find_resources(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient, tmp_path: Path
) -> None:
    kube_api.create(objects.node("n1"))
    kube_api.create(objects.pod("ml", "p", job="j", node="n1"))
    async with DynamicClient(kube_client, cache_file=str(tmp_path / "discovery.json")) as dynamic:
        nodes = await dynamic.resources.get(api_version="v1", kind="Node")
        listed = await nodes.get()
        assert [n.metadata.name for n in listed.items] == ["n1"]
        leases = await dynamic.resources.get(api_version="coordination.k8s.io/v1", kind="Lease")
        assert leases.namespaced and leases.group == "coordination.k8s.io"
        pods = await dynamic.resources.get(api_version="v1", kind="Pod")
        assert "status" in pods.subresources and "eviction" in pods.subresources
        pod = await pods.get(name="p", namespace="ml")
        assert pod.spec.nodeName == "n1"


async def test_serves_https_with_the_ca_in_the_kubeconfig(tmp_path: Path) -> None:
    api = FakeKubeAPI(tls=make_tls_files(tmp_path / "tls"))
    await api.start()
    try:
        assert api.url.startswith("https://127.0.0.1:")
        api.create(objects.node("n1"))
        configuration = client.Configuration()
        await config.load_kube_config(
            config_file=str(api.write_kubeconfig(tmp_path / "kubeconfig")), client_configuration=configuration
        )
        async with client.ApiClient(configuration) as api_client:
            nodes = await client.CoreV1Api(api_client).list_node()
        assert [n.metadata.name for n in nodes.items] == ["n1"]
    finally:
        await api.stop()
    assert not api.internal_errors
