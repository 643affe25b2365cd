"""Merge, strategic-merge and JSON patches: the RFC examples, and through the real client."""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from kubeapi import objects
from kubeapi.errors import ApiError
from kubeapi.patches import json_patch, merge_patch, strategic_merge_patch
from kubeapi.resources import NODES, PODS
from kubeapi.server import FakeKubeAPI

MERGE = "application/merge-patch+json"


def test_merge_patch_follows_rfc_7386() -> None:
    target = {"title": "Goodbye!", "author": {"givenName": "John", "familyName": "Doe"}, "tags": ["example", "sample"]}
    patch = {"title": "Hello!", "phoneNumber": "+01-123-456-7890", "author": {"familyName": None}, "tags": ["example"]}
    assert merge_patch(target, patch) == {
        "title": "Hello!",
        "author": {"givenName": "John"},
        "tags": ["example"],
        "phoneNumber": "+01-123-456-7890",
    }
    assert target["author"] == {"givenName": "John", "familyName": "Doe"}  # inputs untouched
    assert merge_patch({"a": "b"}, ["c"]) == ["c"]
    assert merge_patch({"e": None}, {"a": 1}) == {"e": None, "a": 1}


def test_json_patch_applies_the_six_operations() -> None:
    doc = {"a": {"b": [1, 2]}, "c": "x", "~/": 0}
    patched = json_patch(
        doc,
        [
            {"op": "test", "path": "/c", "value": "x"},
            {"op": "add", "path": "/a/b/1", "value": 9},
            {"op": "add", "path": "/a/b/-", "value": 3},
            {"op": "remove", "path": "/a/b/0"},
            {"op": "replace", "path": "/c", "value": "y"},
            {"op": "copy", "from": "/a/b", "path": "/d"},
            {"op": "move", "from": "/~0~1", "path": "/e"},
        ],
    )
    assert patched == {"a": {"b": [9, 2, 3]}, "c": "y", "d": [9, 2, 3], "e": 0}
    assert doc == {"a": {"b": [1, 2]}, "c": "x", "~/": 0}


@pytest.mark.parametrize(
    ("ops", "code"),
    [
        ([{"op": "test", "path": "/c", "value": "other"}], 422),
        ([{"op": "remove", "path": "/missing"}], 422),
        ([{"op": "replace", "path": "/a/5", "value": 1}], 422),
        ([{"op": "add", "path": "/a/01", "value": 1}], 422),
        ([{"op": "move", "from": "/a", "path": "/a/0"}], 422),
        ([{"op": "frobnicate", "path": "/c"}], 400),
        ([{"op": "add", "path": "/c"}], 400),
        ({"op": "add"}, 400),
    ],
)
def test_json_patch_rejects_what_cannot_apply(ops: object, code: int) -> None:
    with pytest.raises(ApiError) as error:
        json_patch({"a": [0], "c": "x"}, ops)
    assert error.value.code == code


def test_strategic_merge_uses_the_pod_merge_keys() -> None:
    pod = objects.pod("ml", "p", job="j", node="n1")
    pod["spec"]["containers"][0]["env"] = [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]
    pod["metadata"]["finalizers"] = ["one"]
    patched = strategic_merge_patch(
        pod,
        {
            "metadata": {"finalizers": ["two"]},
            "spec": {
                "containers": [
                    {"name": "worker", "env": [{"name": "B", "value": "3"}, {"name": "A", "$patch": "delete"}]},
                    {"name": "sidecar", "image": "s"},
                ],
                "tolerations": [{"key": "t", "operator": "Exists"}],
            },
            "status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "Scheduled", "status": "True"}]},
        },
        PODS.merge_lists,
    )
    worker, sidecar = patched["spec"]["containers"]
    assert worker["image"] == "regroup:test" and worker["env"] == [{"name": "B", "value": "3"}]
    assert sidecar == {"name": "sidecar", "image": "s"}
    assert patched["metadata"]["finalizers"] == ["one", "two"]
    assert patched["status"]["conditions"] == [
        {"type": "Ready", "status": "False"},
        {"type": "Scheduled", "status": "True"},
    ]
    assert patched["spec"]["tolerations"] == [{"key": "t", "operator": "Exists"}]


def test_strategic_merge_replaces_node_taints_and_honours_directives() -> None:
    node = objects.node("n1", taints=[objects.taint("a"), objects.taint("b")])
    patched = strategic_merge_patch(node, {"spec": {"taints": [objects.taint("c")]}}, NODES.merge_lists)
    assert patched["spec"]["taints"] == [{"key": "c", "effect": "NoSchedule"}]
    replaced = strategic_merge_patch(
        node, {"metadata": {"labels": {"$patch": "replace", "only": "this"}}}, NODES.merge_lists
    )
    assert replaced["metadata"]["labels"] == {"only": "this"}
    conditions = strategic_merge_patch(
        node,
        {"status": {"conditions": [{"$patch": "replace"}, {"type": "Ready", "status": "Unknown"}]}},
        NODES.merge_lists,
    )
    assert conditions["status"]["conditions"] == [{"type": "Ready", "status": "Unknown"}]
    with pytest.raises(ApiError) as missing_key:
        strategic_merge_patch(node, {"status": {"conditions": [{"status": "True"}]}}, NODES.merge_lists)
    assert missing_key.value.code == 400


async def test_patch_content_types_through_the_client(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    kube_api.create(objects.node("n1", taints=[objects.taint("keep"), objects.taint("other")]))
    # A dict body goes as a strategic merge patch: the taint list is replaced, not merged.
    node = await v1.patch_node("n1", {"spec": {"taints": [objects.taint("regroup.dev/restart-storm")]}})
    assert [t.key for t in node.spec.taints] == ["regroup.dev/restart-storm"]
    assert kube_api.requests[-1].method == "PATCH"
    # A list body goes as a JSON patch.
    node = await v1.patch_node("n1", [{"op": "add", "path": "/spec/unschedulable", "value": True}])
    assert node.spec.unschedulable is True
    node = await v1.patch_node("n1", {"metadata": {"labels": {"kubernetes.io/hostname": None}}}, _content_type=MERGE)
    assert "kubernetes.io/hostname" not in node.metadata.labels
    with pytest.raises(client.ApiException) as failed:
        await v1.patch_node("n1", [{"op": "test", "path": "/spec/unschedulable", "value": False}])
    assert failed.value.status == 422
    with pytest.raises(client.ApiException) as unsupported:
        await v1.patch_node("n1", {"spec": {}}, _content_type="application/apply-patch+yaml")
    assert unsupported.value.status == 415


async def test_noop_patch_writes_nothing(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    kube_api.create(objects.node("n1", unschedulable=True))
    before = kube_api.resource_version
    node = await client.CoreV1Api(kube_client).patch_node("n1", {"spec": {"unschedulable": True}})
    assert kube_api.resource_version == before
    assert node.metadata.resource_version == str(before)


async def test_patch_carrying_a_stale_version_conflicts(kube_api: FakeKubeAPI, kube_client: client.ApiClient) -> None:
    v1 = client.CoreV1Api(kube_client)
    stale = kube_api.create(objects.node("n1"))["metadata"]["resourceVersion"]
    kube_api.patch("Node", "n1", {"metadata": {"labels": {"moved": "on"}}})
    with pytest.raises(client.ApiException) as conflict:
        await v1.patch_node("n1", {"metadata": {"resourceVersion": stale, "labels": {"x": "y"}}})
    assert conflict.value.status == 409
    current = kube_api.get("Node", "n1")
    assert current is not None and "x" not in current["metadata"]["labels"]
