"""List and watch through the real kubernetes_asyncio client: versions, selectors, bookmarks, 410, faults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kubernetes_asyncio import client, config, watch

from kubeapi import objects
from kubeapi.server import FakeKubeAPI

JOB = "regroup.dev/job"


async def _events(stream: AsyncIterator[dict[str, Any]], count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    got: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        async for event in stream:
            got.append(event)
            if len(got) == count:
                break
    return got


def _summary(events: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return [(e["type"], e["raw_object"]["metadata"].get("name")) for e in events]


async def test_watch_from_list_version_receives_only_later_changes(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "a", job="j", node="n1"))
    listed = await v1.list_namespaced_pod("ml")
    assert [p.metadata.name for p in listed.items] == ["a"]
    async with watch.Watch() as w:
        stream = w.stream(v1.list_namespaced_pod, "ml", resource_version=listed.metadata.resource_version)
        reader = asyncio.create_task(_events(stream, 3))
        await kube_api.wait_for(lambda api: api.open_watches("Pod") == 1)
        kube_api.create(objects.pod("ml", "b", job="j", node="n2"))
        kube_api.patch("Pod", "a", {"metadata": {"annotations": {"x": "1"}}}, namespace="ml")
        kube_api.delete("Pod", "b", namespace="ml")
        events = await reader
    assert _summary(events) == [("ADDED", "b"), ("MODIFIED", "a"), ("DELETED", "b")]
    versions = [int(e["raw_object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(listed.metadata.resource_version)
    assert events[1]["object"].metadata.annotations == {"x": "1"}
    assert w.resource_version == str(versions[-1])


async def test_watch_without_version_starts_with_the_current_objects(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    for name in ("n1", "n2"):
        kube_api.create(objects.node(name))
    async with watch.Watch() as w:
        events = await _events(w.stream(v1.list_node), 2)
    assert _summary(events) == [("ADDED", "n1"), ("ADDED", "n2")]


async def test_initial_events_end_with_a_marked_bookmark(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.node("n1"))
    async with watch.Watch() as w:
        stream = w.stream(
            v1.list_node,
            send_initial_events=True,
            resource_version_match="NotOlderThan",
            allow_watch_bookmarks=True,
        )
        events = await _events(stream, 2)
    assert _summary(events) == [("ADDED", "n1"), ("BOOKMARK", None)]
    assert events[1]["raw_object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


async def test_label_selector_filters_lists_and_watches(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "a", job="alpha", node="n1", labels={"tier": "gpu"}))
    kube_api.create(objects.pod("ml", "b", job="beta", node="n1"))
    kube_api.create(objects.pod("ml", "c", job="gamma", node="n2", labels={"tier": "cpu"}))

    async def names(selector: str) -> list[str]:
        return [p.metadata.name for p in (await v1.list_pod_for_all_namespaces(label_selector=selector)).items]

    assert await names(f"{JOB}=alpha") == ["a"]
    assert await names(f"{JOB}==beta") == ["b"]
    assert await names(f"{JOB}!=alpha") == ["b", "c"]
    assert await names(f"{JOB} in (alpha, gamma)") == ["a", "c"]
    assert await names("tier notin (gpu)") == ["b", "c"]
    assert await names("tier") == ["a", "c"]
    assert await names("!tier") == ["b"]
    assert await names(f"{JOB},tier=cpu") == ["c"]
    with pytest.raises(client.ApiException) as bad:
        await v1.list_pod_for_all_namespaces(label_selector="tier in gpu")
    assert bad.value.status == 400

    listed = await v1.list_pod_for_all_namespaces(label_selector=f"{JOB}=alpha")
    async with watch.Watch() as w:
        stream = w.stream(
            v1.list_pod_for_all_namespaces,
            label_selector=f"{JOB}=alpha",
            resource_version=listed.metadata.resource_version,
        )
        reader = asyncio.create_task(_events(stream, 3))
        await kube_api.wait_for(lambda api: api.open_watches("Pod") == 1)
        kube_api.patch("Pod", "c", {"metadata": {"annotations": {"ignored": "yes"}}}, namespace="ml")
        kube_api.patch("Pod", "b", {"metadata": {"labels": {JOB: "alpha"}}}, namespace="ml")
        kube_api.patch("Pod", "a", {"metadata": {"labels": {JOB: "other"}}}, namespace="ml")
        kube_api.patch("Pod", "b", {"metadata": {"annotations": {"seen": "yes"}}}, namespace="ml")
        events = await reader
    # Entering the selector reads as ADDED and leaving it as DELETED, as from the watch cache.
    assert _summary(events) == [("ADDED", "b"), ("DELETED", "a"), ("MODIFIED", "b")]
    assert events[1]["raw_object"]["metadata"]["labels"][JOB] == "alpha"


async def test_field_selectors_on_node_name_and_phase(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.pod("ml", "a", job="j", node="n1"))
    kube_api.create(objects.pod("ml", "b", job="j", node="n2", phase="Pending"))
    on_n1 = await v1.list_pod_for_all_namespaces(field_selector="spec.nodeName=n1")
    assert [p.metadata.name for p in on_n1.items] == ["a"]
    pending = await v1.list_namespaced_pod("ml", field_selector="status.phase=Pending,metadata.name!=a")
    assert [p.metadata.name for p in pending.items] == ["b"]
    kube_api.create(objects.node("n1"))
    kube_api.create(objects.node("n2", unschedulable=True))
    schedulable = await v1.list_node(field_selector="spec.unschedulable=false")
    assert [n.metadata.name for n in schedulable.items] == ["n1"]
    with pytest.raises(client.ApiException) as bad:
        await v1.list_namespaced_pod("ml", field_selector="spec.priority=1")
    assert bad.value.status == 400 and "field label not supported" in bad.value.body


async def test_bookmarks_carry_the_current_version(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.node("n1"))
    listed = await v1.list_node()
    kube_api.create(objects.pod("ml", "unrelated", job="j", node="n1"))  # moves the global version on
    async with watch.Watch() as w:
        stream = w.stream(v1.list_node, resource_version=listed.metadata.resource_version, allow_watch_bookmarks=True)
        events = await _events(stream, 2, timeout=10 * kube_api.bookmark_interval.total_seconds())
    assert [e["type"] for e in events] == ["BOOKMARK", "BOOKMARK"]
    assert events[-1]["raw_object"]["metadata"]["resourceVersion"] == str(kube_api.resource_version)
    assert w.resource_version == str(kube_api.resource_version)
    assert kube_api.requests[-1].query["allowWatchBookmarks"] == "True"


async def test_watch_from_compacted_version_is_gone(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.node("n1"))
    old = (await v1.list_node()).metadata.resource_version
    kube_api.patch("Node", "n1", {"spec": {"unschedulable": True}})
    kube_api.compact()
    # With timeoutSeconds the client does not retry: the ERROR event surfaces as 410 at once.
    with pytest.raises(client.ApiException) as gone:
        async with watch.Watch() as w:
            await _events(w.stream(v1.list_node, resource_version=old, timeout_seconds=5), 1)
    assert gone.value.status == 410 and "too old resource version" in gone.value.reason
    # Without it, the client retries the same version once, then gives up the same way.
    before = len(kube_api.requests)
    with pytest.raises(client.ApiException) as gone_again:
        async with watch.Watch() as w:
            await _events(w.stream(v1.list_node, resource_version=old), 1)
    assert gone_again.value.status == 410
    assert [r.query.get("resourceVersion") for r in kube_api.requests[before:]] == [old, old]
    # The current version is still good, and a relist gives it.
    current = (await v1.list_node()).metadata.resource_version
    async with watch.Watch() as w:
        stream = w.stream(v1.list_node, resource_version=current, timeout_seconds=5)
        reader = asyncio.create_task(_events(stream, 1))
        await kube_api.wait_for(lambda api: api.open_watches("Node") == 1)
        kube_api.delete("Node", "n1")
        assert _summary(await reader) == [("DELETED", "n1")]


async def test_history_window_expires_old_versions(tmp_path: Path) -> None:
    api = FakeKubeAPI(history_limit=3)
    await api.start()
    try:
        api_client = await _client_for(api, tmp_path)
        try:
            v1 = client.CoreV1Api(api_client)
            start = api.resource_version
            for i in range(4):
                api.create(objects.node(f"n{i}"))
            with pytest.raises(client.ApiException) as gone:
                async with watch.Watch() as w:
                    await _events(w.stream(v1.list_node, resource_version=str(start), timeout_seconds=5), 1)
            assert gone.value.status == 410
            async with watch.Watch() as w:
                events = await _events(w.stream(v1.list_node, resource_version=str(start + 1), timeout_seconds=5), 3)
            assert _summary(events) == [("ADDED", "n1"), ("ADDED", "n2"), ("ADDED", "n3")]
        finally:
            await api_client.close()
    finally:
        await api.stop()


async def test_exact_list_and_continue_tokens_expire_with_history(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    for i in range(5):
        kube_api.create(objects.node(f"n{i}"))
    first = await v1.list_node(limit=2)
    assert [n.metadata.name for n in first.items] == ["n0", "n1"]
    assert first.metadata.remaining_item_count == 3
    # Pages come from one consistent snapshot: later writes do not show up in them.
    kube_api.delete("Node", "n2")
    kube_api.create(objects.node("n9"))
    second = await v1.list_node(limit=2, _continue=first.metadata._continue)
    assert [n.metadata.name for n in second.items] == ["n2", "n3"]
    assert second.metadata.resource_version == first.metadata.resource_version
    exact = await v1.list_node(resource_version=first.metadata.resource_version, resource_version_match="Exact")
    assert [n.metadata.name for n in exact.items] == ["n0", "n1", "n2", "n3", "n4"]

    kube_api.compact()
    with pytest.raises(client.ApiException) as gone:
        await v1.list_node(limit=2, _continue=second.metadata._continue)
    assert gone.value.status == 410
    with pytest.raises(client.ApiException) as gone_exact:
        await v1.list_node(resource_version=first.metadata.resource_version, resource_version_match="Exact")
    assert gone_exact.value.status == 410
    # "Any version" is served whole: limit does not apply to it.
    assert len((await v1.list_node(resource_version="0", limit=2)).items) == 5
    # A NotOlderThan read of an old version is satisfied by the newest state, as on the real server.
    latest = await v1.list_node(resource_version=first.metadata.resource_version)
    assert [n.metadata.name for n in latest.items] == ["n0", "n1", "n3", "n4", "n9"]


async def test_dropped_watch_breaks_the_client_stream(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.node("n1"))
    async with watch.Watch() as w:
        stream = w.stream(v1.list_node, allow_watch_bookmarks=True)
        assert _summary(await _events(stream, 1)) == [("ADDED", "n1")]
        reader = asyncio.create_task(_events(stream, 1))
        await kube_api.wait_for(lambda api: api.open_watches("Node") == 1)
        kube_api.drop_watches()
        with pytest.raises(aiohttp.ClientPayloadError):
            await reader
    assert kube_api.open_watches() == 0


async def test_ended_watch_is_resumed_by_the_client_from_its_last_version(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.node("n1"))
    async with watch.Watch() as w:
        stream = w.stream(v1.list_node)
        first = await _events(stream, 1)
        reader = asyncio.create_task(_events(stream, 1))
        await kube_api.wait_for(lambda api: api.open_watches("Node") == 1)
        kube_api.end_watches()
        await kube_api.wait_for(lambda api: api.open_watches("Node") == 1)
        kube_api.create(objects.node("n2"))
        assert _summary(await reader) == [("ADDED", "n2")]
    resumed = [r for r in kube_api.requests if r.query.get("watch") == "True"][-1]
    assert resumed.query["resourceVersion"] == first[0]["raw_object"]["metadata"]["resourceVersion"]


async def test_watch_timeout_ends_the_stream(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    async with asyncio.timeout(5):
        async with watch.Watch() as w:
            got = [
                e
                async for e in w.stream(
                    v1.list_node, resource_version=str(kube_api.resource_version), timeout_seconds=1
                )
            ]
    assert got == []


async def test_injected_failures_hit_only_matching_requests(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.fail_next("GET", r"^/api/v1/nodes$", 503, times=2, watch=False)
    for _ in range(2):
        with pytest.raises(client.ApiException) as failed:
            await v1.list_node()
        assert failed.value.status == 503
    await v1.list_node()
    kube_api.fail_next("get", r"/pods", 500, watch=True)
    await v1.list_pod_for_all_namespaces()
    with pytest.raises(client.ApiException) as failed_watch:
        async with watch.Watch() as w:
            await _events(w.stream(v1.list_pod_for_all_namespaces, timeout_seconds=1), 1)
    assert failed_watch.value.status == 500


async def test_wait_for_times_out_naming_recent_requests(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    await client.CoreV1Api(kube_client).list_node()
    with pytest.raises(TimeoutError, match="GET /api/v1/nodes"):
        await kube_api.wait_for(lambda api: api.get("Node", "never") is not None, timedelta(milliseconds=50))


async def test_wrong_token_is_unauthorized(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    kube_client.configuration.api_key = {"authorization": "Bearer wrong"}
    with pytest.raises(client.ApiException) as denied:
        await client.CoreV1Api(kube_client).list_node()
    assert denied.value.status == 401


async def _client_for(api: FakeKubeAPI, tmp_path: Path) -> client.ApiClient:
    configuration = client.Configuration()
    await config.load_kube_config(
        config_file=str(api.write_kubeconfig(tmp_path / "other-kubeconfig")), client_configuration=configuration
    )
    return client.ApiClient(configuration)


async def test_exact_list_shows_objects_as_they_were(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    created = kube_api.create(objects.node("n1", labels={"pool": "a"}))
    created["metadata"]["labels"]["pool"] = "changed by the test"  # returned objects are copies
    then = str(kube_api.resource_version)
    kube_api.patch("Node", "n1", {"metadata": {"labels": {"pool": "b"}}})
    await v1.patch_node_status("n1", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    old = await v1.list_node(resource_version=then, resource_version_match="Exact")
    assert old.items[0].metadata.labels["pool"] == "a"
    assert old.items[0].status.conditions[0].status == "True"
    now = await v1.read_node("n1")
    assert now.metadata.labels["pool"] == "b" and now.status.conditions[0].status == "False"


async def test_namespaced_watch_sees_only_its_namespace(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    start = str(kube_api.resource_version)
    kube_api.create(objects.pod("other", "x", job="j", node="n1"))
    kube_api.create(objects.pod("ml", "y", job="j", node="n1"))
    async with watch.Watch() as w:
        events = await _events(w.stream(v1.list_namespaced_pod, "ml", resource_version=start), 1)
    assert _summary(events) == [("ADDED", "y")]
    assert kube_api.requests[-1].path == "/api/v1/namespaces/ml/pods"


async def test_reading_a_future_version_times_out(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    kube_api.too_large_rv_wait = timedelta(milliseconds=50)
    future = str(kube_api.resource_version + 100)
    with pytest.raises(client.ApiException) as too_large:
        await client.CoreV1Api(kube_client).list_node(resource_version=future)
    assert too_large.value.status == 504 and "Too large resource version" in str(too_large.value.body)


async def test_initial_events_need_bookmarks_and_not_older_than(
    kube_api: FakeKubeAPI, kube_client: client.ApiClient
) -> None:
    v1 = client.CoreV1Api(kube_client)
    for query in ({"send_initial_events": True}, {"resource_version_match": "NotOlderThan", "resource_version": "1"}):
        with pytest.raises(client.ApiException) as invalid:
            await v1.list_node(watch=True, timeout_seconds=1, **query)
        assert invalid.value.status == 422
