"""Watches that break, a leader that goes away, and what users read back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess

import aiohttp
import pytest

from regroup.controller.status import job_status
from regroup.keys import JobKeys
from regroup.ports import start_on_free_ports_async
from regroup.records import (
    CheckpointRequest,
    ExpectedMembership,
    JobStatus,
    ReformPlan,
    ReformRequest,
)
from kubeapi import objects

from .harness import (
    NS,
    Cluster,
    check_rbac,
    controller,
    controller_namespace,
    fast_settings,
    notes,
    replace_settings,
    sample,
    until,
)
from .harness import replica as harness_replica

JOB = "llama"
KEYS = JobKeys(NS, JOB)


@pytest.fixture
def cluster(kube_api, etcd_client) -> Cluster:
    return Cluster(kube_api, etcd_client)


async def test_dropped_watch_and_410_gone_relist_without_missing_a_taint(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2", "n3"], notes(2, 4))
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, _):
        await kube_api.wait_for(lambda api: api.open_watches("Node") == 1 and api.open_watches("Pod") == 1)
        # Cut every watch, forget history, and taint a node while nobody watches.
        kube_api.fail_next("GET", r"/api/v1/nodes$", 503, times=1, watch=False)
        kube_api.drop_watches()
        kube_api.patch("Node", "n1", {"spec": {"taints": [objects.taint("karpenter.sh/disrupted")]}})
        kube_api.compact()
        request = await cluster.wait_record(KEYS.checkpoint, CheckpointRequest)
        plan = await cluster.read(KEYS.plan, ReformPlan)
        assert plan.nodes_after == ["n2", "n3"] and request.generation == plan.generation
        assert sample(metrics, "regroup_watch_restarts_total", source="nodes") >= 1
        # A clean end of the watch (server timeout) resumes from the last version; a later
        # change is still seen.
        kube_api.end_watches()
        await kube_api.wait_for(lambda api: api.open_watches("Node") == 1)
        kube_api.patch("Node", "n2", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        # n2 lost before the ack leaves only n3 of the target, below min 2: the job stalls.
        status = await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "stalled")
        assert "n2" in status.reason
        plan = await cluster.read(KEYS.plan, ReformPlan)
        assert plan.outcome == "superseded"


async def test_etcd_restart_is_ridden_out(cluster, kube_api, kubeconfig, etcd, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2"], notes(1, 4))
    async with controller(kube_api, kubeconfig, etcd_settings) as (metrics, _):
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.node_count == 2)
        etcd.restart()
        await until(lambda: sample(metrics, "regroup_watch_restarts_total", source="etcd") >= 1)
        kube_api.delete("Pod", f"{JOB}-n2", namespace=NS)
        reform = await cluster.wait_record(KEYS.reform, ReformRequest)
        assert reform.cause == "node-lost"


async def run_cli(argv: list[str], env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    return out.decode()


@contextlib.asynccontextmanager
async def replica(kube_api, kubeconfig, etcd_settings, identity: str):
    """One controller replica behind leader election (``harness.replica``)."""
    async with harness_replica(kube_api, kubeconfig, etcd_settings, fast_settings(identity)) as (elector, task, _):
        yield elector, task


async def test_leader_failover_mid_reform_repeats_nothing_and_forgets_nothing(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2", "n3"], notes(2, 4))
    async with replica(kube_api, kubeconfig, etcd_settings, "ctl-a") as (a, a_task):
        await until(lambda: a.leading)
        async with replica(kube_api, kubeconfig, etcd_settings, "ctl-b") as (b, _):
            kube_api.patch("Node", "n2", {"spec": {"taints": [objects.taint("aws-node-termination-handler/spot-itn")]}})
            request = await cluster.wait_record(KEYS.checkpoint, CheckpointRequest)
            assert not b.leading
            # The leader goes away in the middle of the re-form; the standby takes the Lease.
            a_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await a_task
            await until(lambda: b.leading)
            lease = kube_api.get("Lease", "regroup-controller", controller_namespace(kube_api))
            assert lease["spec"]["holderIdentity"] == "ctl-b"
            # The new leader waits for the same checkpoint: no second request, same generation.
            await cluster.ack(JOB, request.generation, 10, 6)
            reform = await cluster.wait_record(KEYS.reform, ReformRequest)
            assert reform.generation == request.generation
            again = await cluster.read(KEYS.checkpoint, CheckpointRequest)
            assert again == request
            assert (await cluster.read(KEYS.expected, ExpectedMembership)).nodes == ["n1", "n3"]
            presence = await cluster.wait_record(KEYS.controller, __import__("regroup.records", fromlist=["x"]).ControllerPresence,
                                                 lambda p: p.identity == "ctl-b")
            assert presence.identity == "ctl-b"


async def test_status_shows_members_progress_and_the_last_reform(cluster, kube_api, kubeconfig, etcd_settings, worker_env, python) -> None:
    await cluster.job(JOB, ["n1", "n2", "n3"], notes(2, 4))
    async with controller(kube_api, kubeconfig, etcd_settings):
        kube_api.delete("Pod", f"{JOB}-n3", namespace=NS)
        await cluster.wait_record(KEYS.reform, ReformRequest)
        await cluster.drop_member(JOB, "n3")
        await cluster.member(JOB, "n1", 2)
        await cluster.member(JOB, "n2", 2)
        await cluster.wait_record(KEYS.plan, ReformPlan, lambda p: p.phase == "resume")
        await cluster.progress(JOB, 9, 4, resumed_from=8, last_step=10)
        await cluster.wait_record(KEYS.plan, ReformPlan, lambda p: p.phase == "done")
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.state == "healthy" and s.node_count == 2)
    report = await job_status(KEYS, etcd_settings)
    assert report["state"] == "healthy" and report["node_count"] == 2
    assert [m["node"] for m in report["members"]] == ["n1", "n2"]
    last = report["last_reform"]
    assert last["cause"] == "node-lost" and last["outcome"] == "completed" and last["lost_steps"] == 2
    assert set(last["phases_s"]) == {"detect", "rendezvous", "resume"}
    assert last["summary"].startswith("3 → 2 nodes: loss of n3, 2 steps lost, ")  # the Resized Event's message
    # The CLI prints the same, as JSON and as text.
    endpoint = etcd_settings.describe().removeprefix("http://")
    cli = [python, "-m", "regroup.cli", "status", "--job", JOB, "--namespace", NS, "--etcd", endpoint]
    as_json = await run_cli([*cli, "--json"], worker_env)
    assert json.loads(as_json)["last_reform"]["generation"] == last["generation"]
    text = await run_cli(cli, worker_env)
    assert "healthy" in text and "last re-form" in text and "node-lost" in text
    assert "    Resized: " + last["summary"] in text.splitlines()


async def test_http_serves_metrics_and_probes(cluster, kube_api, kubeconfig, etcd_settings) -> None:
    await cluster.job(JOB, ["n1", "n2"], notes(1, 4))
    async with contextlib.AsyncExitStack() as running:

        async def serve(ports: tuple[int, ...]) -> int:
            settings = replace_settings(fast_settings(), http_port=ports[0], http_host="127.0.0.1")
            await running.enter_async_context(controller(kube_api, kubeconfig, etcd_settings, settings))
            return ports[0]

        port = await start_on_free_ports_async(serve, "the controller's HTTP server")
        await cluster.wait_record(KEYS.status, JobStatus, lambda s: s.node_count == 2)
        async with aiohttp.ClientSession() as http:
            for probe in ("healthz", "readyz"):
                async with http.get(f"http://127.0.0.1:{port}/{probe}") as response:
                    assert response.status == 200
            async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                body = await response.text()
    assert f'regroup_job_nodes{{job="{JOB}",namespace="{NS}"}} 2.0' in body
    assert "regroup_reform_duration_seconds" in body and "regroup_leader" in body


async def test_the_controller_process_runs_against_the_api_and_etcd(cluster, kube_api, kubeconfig, etcd_settings, worker_env, python, tmp_path) -> None:
    await cluster.job(JOB, ["n1", "n2", "n3"], notes(2, 4))
    endpoint = etcd_settings.describe().removeprefix("http://")
    lease_ns = controller_namespace(kube_api)
    first = len(kube_api.requests)
    env = {**worker_env, "POD_NAME": "ctl-proc", "POD_NAMESPACE": lease_ns, "REGROUP_SPANS_FILE": str(tmp_path / "spans.jsonl")}

    async def start(ports: tuple[int, ...]) -> tuple[asyncio.subprocess.Process, int]:
        return await _controller_process(
            [python, "-m", "regroup.cli", "controller", "--kubeconfig", str(kubeconfig), "--etcd", endpoint,
             "--http-port", str(ports[0])], env, kube_api, lease_ns,
        ), ports[0]  # fmt: skip

    # It listens on every interface: the port must be free on all of them.
    proc, port = await start_on_free_ports_async(start, "regroup controller's HTTP server", host="0.0.0.0")
    try:
        lease = kube_api.get("Lease", "regroup-controller", lease_ns)
        assert lease["spec"]["holderIdentity"] == "ctl-proc"
        kube_api.patch("Node", "n1", {"spec": {"taints": [objects.taint("karpenter.sh/disrupted")]}})
        request = await cluster.wait_record(KEYS.checkpoint, CheckpointRequest)
        await cluster.ack(JOB, request.generation, 10, 6)
        assert (await cluster.wait_record(KEYS.expected, ExpectedMembership)).nodes == ["n2", "n3"]
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/readyz") as response:
                assert response.status == 200
            async with http.get(f"http://127.0.0.1:{port}/metrics") as response:
                assert "regroup_leader 1.0" in await response.text()
    finally:
        if proc.returncode is None:
            proc.terminate()
        async with asyncio.timeout(20):
            _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
    # A clean shutdown hands the Lease back at once.
    assert kube_api.get("Lease", "regroup-controller", lease_ns)["spec"]["holderIdentity"] == ""
    check_rbac(kube_api, first, "regroup controller")


async def _controller_process(argv: list[str], env: dict[str, str], kube_api, lease_ns: str) -> asyncio.subprocess.Process:
    """``regroup controller`` started, once it holds the Lease (it serves HTTP before it
    campaigns). Raises, the process gone, if it exited first (its stderr in the message:
    ``start_on_free_ports_async`` starts it again if that says its port was taken)."""
    proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    leased = asyncio.ensure_future(kube_api.wait_for(lambda api: api.get("Lease", "regroup-controller", lease_ns), timeout=30))
    exited = asyncio.ensure_future(proc.wait())
    try:
        await asyncio.wait({leased, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        leased.cancel()
        exited.cancel()
        outcome, _ = await asyncio.gather(leased, exited, return_exceptions=True)
    if proc.returncode is None and not isinstance(outcome, BaseException):
        return proc
    if proc.returncode is None:
        proc.kill()
    async with asyncio.timeout(20):
        _, err = await proc.communicate()
    raise RuntimeError(f"regroup controller exited {proc.returncode} before holding the Lease: {err.decode()[-2000:]}")
