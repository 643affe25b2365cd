"""The controller's API calls against deploy/base/rbac.yaml: each is allowed, each verb is needed.

``harness.controller`` and ``harness.replica`` check every run's calls on their own; this
test shows the check has teeth: with any one verb the controller used taken out of the
parsed rules, it fails and names a call that needed it.
"""

from __future__ import annotations

import pytest

from regroup.keys import JobKeys
from regroup.records import JobStatus, ReformRequest
from kubeapi.rbac import request_info

from .harness import NS, Cluster, controller_rbac, fast_settings, notes, replica, until

JOB = "llama"
KEYS = JobKeys(NS, JOB)


async def test_every_verb_the_controller_uses_is_granted_and_needed(kube_api, kubeconfig, etcd_settings, etcd_client) -> None:
    cluster = Cluster(kube_api, etcd_client)
    await cluster.job(JOB, ["n1", "n2", "n3"], notes(1, 3, restart_storm="2/10m"))
    first = len(kube_api.requests)
    # Leader election, list+watch, a restart storm: cordon (get, patch), pod delete, Events.
    async with replica(kube_api, kubeconfig, etcd_settings, fast_settings("ctl-rbac")) as (elector, _, _):
        await until(lambda: elector.leading)
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.node_count == 3)
        await cluster.member(JOB, "n2", 1, restarts=2)
        await kube_api.wait_for(lambda api: api.get("Pod", f"{JOB}-n2", NS) is None)
        await cluster.wait_record(KEYS.reform, ReformRequest, lambda r: r.cause == "restart-storm")
        await kube_api.wait_for(lambda api: [e for e in api.events() if e["reason"] == "RestartStorm"])
    calls = kube_api.requests[first:]
    rbac = controller_rbac()
    rbac.check(calls)

    used: dict[tuple[str, str, str], str] = {}
    for method, path, query in calls:
        info = request_info(method, path, query)
        resource = info.resource + (f"/{info.subresource}" if info.subresource else "")
        used.setdefault((info.api_group, resource, info.verb), info.describe())
    assert set(used) >= {
        ("", "nodes", "list"), ("", "nodes", "watch"), ("", "nodes", "get"), ("", "nodes", "patch"),
        ("", "pods", "list"), ("", "pods", "watch"), ("", "pods", "delete"), ("", "events", "create"),
        ("coordination.k8s.io", "leases", "get"), ("coordination.k8s.io", "leases", "create"),
        ("coordination.k8s.io", "leases", "update"),
    }  # fmt: skip
    for (group, resource, verb), call in sorted(used.items()):
        with pytest.raises(AssertionError) as refused:
            rbac.without(verb, resource, group).check(calls)
        assert call in str(refused.value), (verb, resource)
