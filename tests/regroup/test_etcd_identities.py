"""One etcd, many tenants: each job's etcd identity lets its workers touch only their own
job's keys, and only those a worker writes (real etcd 3.4 with TLS and client-certificate
auth, bootstrapped by the real ``regroup etcd-auth bootstrap``; no mocks)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from regroup.etcd import EtcdSettings, PermissionDenied, connect, is_permission_denied, open_watch
from regroup.etcd.auth import (
    Access,
    Grant,
    auth_enabled,
    ensure_job_identity,
    ensure_role,
    ensure_user,
    job_grants,
    job_identities,
    job_of_user,
    job_user,
    remove_job_identity,
)
from regroup.etcd.settings import certificate_cn
from regroup.keys import JobKeys
from tests.etcd_helpers import AuthEtcd, auth_etcd, bootstrap_cli
from tests.scratch import scratch

NS = "ml"


@pytest.fixture(scope="module")
def auth(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthEtcd]:
    """One authenticated etcd for the module; each test uses jobs of its own."""
    with scratch(request, tmp_path_factory, "auth-etcd") as root, auth_etcd(root) as server:
        yield server


async def denied(call: Any) -> PermissionDenied:
    """What ``call`` (an awaitable etcd request) raised: it must be a permission denial."""
    with pytest.raises(PermissionDenied) as raised:
        await call
    return raised.value


def test_a_jobs_role_grants_exactly_what_its_workers_write() -> None:
    keys = JobKeys(NS, "llama")
    assert job_user(keys) == "regroup:job:ml:llama"
    assert job_of_user("regroup:job:ml:llama") == keys
    assert job_of_user("regroup:job:ml:a:b") == JobKeys(NS, "a:b")
    assert job_of_user("regroup-controller") is None and job_of_user("regroup:job:ml") is None
    r = "/regroup/jobs/ml/llama/"
    assert set(job_grants(keys)) == {
        Grant(Access.READ, r, prefix=True),
        Grant(Access.READWRITE, r + "members/", prefix=True),
        Grant(Access.READWRITE, r + "rdzv/", prefix=True),
        Grant(Access.READWRITE, r + "acks/", prefix=True),
        Grant(Access.READWRITE, r + "progress"),
        Grant(Access.READ, "/regroup/finished/ml/llama"),
    }
    assert Grant(Access.READ, r, prefix=True).range_end == b"/regroup/jobs/ml/llama0"
    assert Grant(Access.READ, r + "progress").range_end == b""


def test_bootstrap_is_idempotent_and_refuses_any_identity_but_root(auth: AuthEtcd, capsys: Any) -> None:
    first = auth.bootstrapped.splitlines()
    assert first[:2] == ["role root created", "user root created (no password: its certificate's CN)"], first
    assert f"user {auth.CONTROLLER}: role root granted" in first and "authentication enabled" in first
    code, said = bootstrap_cli(auth)
    assert code == 0 and "nothing to do" in said, said
    from regroup import cli

    cert, key = auth.pki.client(auth.CONTROLLER)
    assert certificate_cn(cert) == auth.CONTROLLER
    args = ["etcd-auth", "bootstrap", "--etcd", auth.endpoint, "--etcd-cacert", str(auth.pki.ca),
            "--etcd-cert", str(cert), "--etcd-key", str(key)]  # fmt: skip
    assert cli.main(args) == 2
    assert f"CN is root (this one is {auth.CONTROLLER!r})" in capsys.readouterr().err


async def test_a_workers_of_one_job_cannot_touch_another_jobs_keys(auth: AuthEtcd) -> None:
    a, b = JobKeys(NS, "tenant-a"), JobKeys(NS, "tenant-b")
    async with auth.client(auth.CONTROLLER) as controller:
        assert await auth_enabled(controller)
        for keys in (a, b):
            await ensure_job_identity(controller, keys)
        await controller.put(a.member("n0").encode(), b"a's member")
    async with auth.client(job_user(b)) as worker_b:
        assert worker_b.identity == job_user(b)
        with capture_logs() as logs:
            calls = {
                "range of the prefix": lambda: worker_b.get_prefix(a.root.encode()),
                "get": lambda: worker_b.get(a.member("n0").encode()),
                "put": lambda: worker_b.put(a.member("n1").encode(), b"b's"),
                "delete": lambda: worker_b.delete(a.member("n0").encode()),
            }
            for operation, call in calls.items():
                error = await denied(call())
                assert error.operation == operation and error.key.startswith(a.root) and is_permission_denied(error)
                assert f"etcd denied {operation} on {a.root}" in str(error) and job_user(b) in str(error)
            await denied(worker_b.get(a.member("n0").encode()))  # a second time: not logged again
        assert len([e for e in logs if "etcd denied" in e["event"]]) == 4, logs
        # A refused watch is "created" with id -1 and would never deliver: it is raised.
        error = await denied(open_watch(worker_b, a.root.encode(), start_revision=1))
        assert error.operation == "watch" and error.key == f"{a.root} (prefix)"
        # Its own job is open to it.
        await worker_b.put(b.member("n0").encode(), b"b's member")
        assert (await worker_b.get(b.member("n0").encode())).value == b"b's member"
    async with auth.client(auth.CONTROLLER) as controller:
        assert (await controller.get(a.member("n0").encode())).value == b"a's member"
        assert await controller.get(a.member("n1").encode()) is None


async def test_a_worker_reads_its_control_keys_and_tombstone_but_writes_none(auth: AuthEtcd) -> None:
    own, other = JobKeys(NS, "writer"), JobKeys(NS, "neighbour")
    async with auth.client(auth.CONTROLLER) as controller:
        await ensure_job_identity(controller, own)
        await controller.put(own.checkpoint.encode(), b"checkpoint now")
        await controller.put(own.tombstone.encode(), b"finished")
    async with auth.client(job_user(own)) as worker, auth.client(auth.CONTROLLER) as controller:
        for call in (
            worker.put(own.status.encode(), b"x"),
            worker.put(own.controller.encode(), b"x"),
            worker.delete(own.checkpoint.encode()),
            worker.put(own.tombstone.encode(), b"x"),
            worker.delete(own.tombstone.encode()),
            worker.put(other.tombstone.encode(), b"x"),
            worker.get(other.tombstone.encode()),
        ):
            await denied(call)
        txn = worker.transactions
        error = await denied(worker.transaction(compare=[txn.mod(own.checkpoint.encode()) > 0],
                                                success=[txn.delete(own.checkpoint.encode())], failure=[]))
        assert str(error).startswith(f"etcd denied a transaction on {own.checkpoint} to identity {job_user(own)!r}")
        assert (await worker.get(own.checkpoint.encode())).value == b"checkpoint now"
        assert (await worker.get(own.tombstone.encode())).value == b"finished"
        tombstone = await worker.get_range(own.tombstone.encode(), own.tombstone.encode() + b"\0")
        assert [kv.value for kv in tombstone] == [b"finished"]
        # A watch of a control key delivers what the controller writes.
        watch = await open_watch(worker, own.reform.encode(), start_revision=tombstone.header.revision + 1,
                                 prefix=False)
        try:
            await controller.put(own.reform.encode(), b"re-form now")
            async with asyncio.timeout(10):
                event = await anext(aiter(watch))
            assert event.kv.value == b"re-form now"
        finally:
            await watch.cancel()


async def test_a_jobs_identity_is_made_exact_again_and_removed_idempotently(auth: AuthEtcd) -> None:
    keys = JobKeys(NS, "drifting")
    name = job_user(keys)
    async with auth.client(auth.CONTROLLER) as controller:
        first = await ensure_job_identity(controller, keys)
        assert f"role {name} created" in first and f"user {name} created (no password: its certificate's CN)" in first
        assert await ensure_job_identity(controller, keys) == []
        # Someone widened the role by hand and gave the user root: the next ensure takes both back.
        wider = [*job_grants(keys), Grant(Access.READWRITE, "/regroup/", prefix=True)]
        assert await ensure_role(controller, name, wider) == [f"role {name}: granted READWRITE /regroup/*"]
        assert await ensure_user(controller, name, (name, "root"), exact=True) == [f"user {name}: role root granted"]
        fixed = await ensure_job_identity(controller, keys)
        assert any("revoked /regroup/" in c for c in fixed) and f"user {name}: role root revoked" in fixed, fixed
        assert keys in await job_identities(controller)
        assert await remove_job_identity(controller, keys)
        assert not await remove_job_identity(controller, keys), "nothing left to remove"
        assert keys not in await job_identities(controller)
        # The same job name under another prefix (another controller on this etcd) is not ours.
        elsewhere = JobKeys(NS, "drifting", "/staging/jobs")
        await ensure_job_identity(controller, elsewhere)
        assert not await remove_job_identity(controller, keys)
        assert elsewhere in await job_identities(controller, "/staging/jobs")
        assert await remove_job_identity(controller, elsewhere)
    async with auth.client(name) as worker:
        await denied(worker.put(keys.progress.encode(), b"x"))


def test_a_certificates_cn_is_read_without_cryptography(tmp_path: Path, auth: AuthEtcd) -> None:
    cert, _ = auth.pki.client("regroup:job:ml:tenant-a")
    assert certificate_cn(cert) == "regroup:job:ml:tenant-a"
    assert auth.settings("regroup:job:ml:tenant-a").identity == "regroup:job:ml:tenant-a"
    (tmp_path / "junk.crt").write_text("-----BEGIN CERTIFICATE-----\nnot der\n-----END CERTIFICATE-----\n")
    assert certificate_cn(tmp_path / "junk.crt") is None


# --- the real workers under their job's identity ------------------------------------------

FAST = {"lease_ttl": "2", "last_call_timeout": "0.3", "join_timeout": "20"}


def as_controller(auth: AuthEtcd, action: Any) -> Any:
    """``action(client)`` as the controller's identity, from synchronous code."""

    async def run() -> Any:
        async with auth.client(auth.CONTROLLER) as client:
            return await action(client)

    return asyncio.run(run())


def agent(auth: AuthEtcd, keys: JobKeys, node: str, cn: str, **conf: str) -> Any:
    """The job's etcd-v3 torchrun agent on ``node``, presenting the certificate of ``cn``
    (blocks until it has listed the job's keys)."""
    from regroup.rendezvous.handler import EtcdV3RendezvousHandler
    from regroup.rendezvous.settings import parse_settings

    return EtcdV3RendezvousHandler(parse_settings(
        endpoint=auth.endpoint, run_id=keys.job, min_nodes=2, max_nodes=2,
        conf={**FAST, **auth.rdzv_conf(cn), **conf},
        env={"NODE_NAME": node, "POD_NAME": f"{keys.job}-{node}", "POD_NAMESPACE": keys.namespace},
        local_addr="127.0.0.1",
    ))  # fmt: skip


def test_a_jobs_agents_and_rank_zero_work_under_its_identity_granted_after_they_started(auth: AuthEtcd) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from regroup.elastic.settings import EtcdConfig
    from regroup.elastic.world.control import JobChannel
    from regroup.records import CheckpointAck, CheckpointRequest, Progress, ReformRequest
    from tests.rendezvous.agents import wait_until

    keys = JobKeys(NS, "rendezvous")
    name = job_user(keys)
    handlers: list[Any] = []

    def join(node: str) -> Any:
        handler = agent(auth, keys, node, name)
        handlers.append(handler)
        return handler.next_rendezvous()

    pool = ThreadPoolExecutor(max_workers=2)
    channel = None
    try:
        with capture_logs() as logs:
            joins = [pool.submit(join, node) for node in ("n0", "n1")]
            # Both agents started before the controller made the job's identity: refused, they wait.
            wait_until(lambda: len({e.get("key") for e in logs if "etcd denied" in e["event"]}) >= 1, 20,
                       "the agents' first denial")
            assert not any(j.done() for j in joins)
            as_controller(auth, lambda c: ensure_job_identity(c, keys))
            infos = [j.result(20) for j in joins]
        assert sorted(i.rank for i in infos) == [0, 1] and {i.world_size for i in infos} == {2}
        # The round's c10d store: set, get, add, check, delete, in rdzv/rounds/.
        infos[0].store.set("master", "127.0.0.1:29500")
        assert infos[1].store.get("master") == b"127.0.0.1:29500"
        assert infos[0].store.add("counter", 2) == 2 and infos[1].store.add("counter", 3) == 5
        assert infos[1].store.check(["master", "counter"])
        assert infos[0].store.delete_key("master")

        # Rank 0's channel: control keys read and watched, ack and progress written.
        cert, key = auth.pki.client(name)
        channel = JobChannel(EtcdConfig(endpoint=auth.endpoint, job=keys.job, namespace=NS, cacert=str(auth.pki.ca),
                                        cert=str(cert), key=str(key)))
        channel.start()
        request = CheckpointRequest(generation=1, deadline=time.time() + 60, reason="reclaim of n1")
        as_controller(auth, lambda c: c.put(keys.checkpoint.encode(), request.to_json()))
        wait_until(lambda: channel.request() == request, 10, "the checkpoint request, watched")
        ack = CheckpointAck(generation=1, step=7, checkpoint_id="step-7", duration_s=0.1, world_size=2)
        assert channel.ack(ack, deadline=request.deadline)
        progress = Progress(step=8, loss=0.5, samples_seen=64, world_size=2, time=time.time())
        channel.publish_progress(progress, wait=True)

        async def written(client: Any) -> tuple[bytes, bytes]:
            return (await client.get(keys.ack(1).encode())).value, (await client.get(keys.progress.encode())).value

        assert as_controller(auth, written) == (ack.to_json(), progress.to_json())

        # A re-form the controller asks for: the agents' watch sees it, the next round closes
        # (deleting the earlier round's store), then the run is closed.
        reform = ReformRequest(generation=2, cause="manual")
        as_controller(auth, lambda c: c.put(keys.reform.encode(), reform.to_json()))
        wait_until(lambda: all(h.num_nodes_waiting() for h in handlers), 10, "the re-form request, watched")
        futures = [pool.submit(h.next_rendezvous) for h in handlers]
        assert {f.result(20).world_size for f in futures} == {2}
        assert handlers[0].round == 2
        handlers[0].set_closed()
        wait_until(handlers[1].is_closed, 10, "the closed run, watched by the other agent")
    finally:
        if channel is not None:
            channel.close()
        for handler in handlers:
            handler.shutdown()
        pool.shutdown(wait=True, cancel_futures=True)


def test_an_agent_whose_identity_is_never_granted_gives_up_naming_the_denial(auth: AuthEtcd) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousConnectionError

    keys = JobKeys(NS, "ungranted")
    with pytest.raises(RendezvousConnectionError) as raised:
        agent(auth, keys, "n0", job_user(keys), join_timeout="1")
    text = str(raised.value)
    assert "kept denying this agent the job's keys for 1s" in text
    assert f"etcd denied range on {keys.tombstone} to identity {job_user(keys)!r}" in text, text


async def test_a_workers_calls_that_overlap_other_jobs_identity_changes_go_through(auth: AuthEtcd) -> None:
    # etcd 3.4 refuses a request whose permission check overlapped a change of its users or
    # roles ("revision of auth store is old"); with 50 jobs appearing at once, that is most
    # of a job's first calls. The client sends them again: none reaches the caller.
    mine = JobKeys("ml", "steady")
    async with auth.client(AuthEtcd.CONTROLLER) as root:
        await ensure_job_identity(root, mine)
        async with auth.client(job_user(mine)) as worker:
            changes = 0

            async def churn() -> None:
                nonlocal changes
                while True:
                    other = JobKeys("ml", f"churn-{changes % 3}")
                    await ensure_job_identity(root, other)
                    await remove_job_identity(root, other)
                    changes += 2

            async def work() -> int:
                done = 0
                for _ in range(150):
                    await worker.put(mine.progress.encode(), b"{}")
                    await worker.get(mine.progress.encode())
                    done += 1
                return done

            churning = asyncio.create_task(churn())
            try:
                assert await asyncio.gather(work(), work()) == [150, 150]
            finally:
                churning.cancel()
                await asyncio.gather(churning, return_exceptions=True)
            assert changes >= 10, "the auth store did not change under the calls"


def test_tls_clients_connecting_at_once_in_many_threads_leave_plain_clients_plain(
    auth: AuthEtcd, etcd_settings: EtcdSettings
) -> None:
    # Each agent of a process connects from its own loop thread; a TLS connect must not change
    # how a plain client of another thread (or any later one) opens its channel.
    async def connect_and_read(settings: EtcdSettings) -> None:
        client = await connect(settings)
        try:
            await client.get(b"/regroup/none")
        finally:
            await client.close()

    tls = auth.settings(AuthEtcd.CONTROLLER)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        work = [pool.submit(asyncio.run, connect_and_read(tls if i % 2 else etcd_settings)) for i in range(32)]
        for done in work:
            done.result(timeout=60)
    asyncio.run(connect_and_read(etcd_settings))


SHARED, SHARED_ROLE = "regroup-worker", "regroup"
"""The one identity every job's workers presented before each job had its own, and its
role: read and write on all of ``/regroup/`` (docs/deploy.md, "Upgrading")."""


def remove_user_cli(auth: AuthEtcd, *args: str) -> tuple[int, str]:
    """``regroup etcd-auth remove-user ARGS`` as the controller's identity: (exit code, stdout)."""
    import contextlib
    import io

    from regroup import cli

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["etcd-auth", "remove-user", *args, *auth.tls_args(AuthEtcd.CONTROLLER)])
    return code, out.getvalue()


def test_a_job_on_the_shared_worker_identity_trains_on_through_the_upgrade_to_its_own(auth: AuthEtcd) -> None:
    # The upgrade as docs/deploy.md tells it: the bootstrap Job runs again and names the
    # shared user; the controller, now with --etcd-job-identities, makes the job's own; the
    # job re-forms on the shared identity, then with its pods rolled one at a time onto the
    # job's certificate, and after the shared user is gone.
    from concurrent.futures import ThreadPoolExecutor

    from regroup.records import ReformRequest
    from tests.rendezvous.agents import wait_until

    keys = JobKeys(NS, "upgraded")

    async def before(client: Any) -> None:
        await ensure_role(client, SHARED_ROLE, [Grant(Access.READWRITE, "/regroup/", prefix=True)])
        await ensure_user(client, SHARED, (SHARED_ROLE,), exact=True)

    as_controller(auth, before)
    pool = ThreadPoolExecutor(max_workers=2)
    handlers = {node: agent(auth, keys, node, SHARED) for node in ("n0", "n1")}
    generation = 1

    def reform(rolled: str | None) -> set[int]:
        """Ask for a re-form (the controller would, seeing a pod replaced); ``rolled``'s agent
        comes back first, presenting the job's own certificate. The world sizes formed."""
        nonlocal generation
        generation += 1
        if rolled is not None:
            handlers[rolled].shutdown()
            handlers[rolled] = agent(auth, keys, rolled, job_user(keys))
        request = ReformRequest(generation=generation, cause="manual")
        as_controller(auth, lambda c: c.put(keys.reform.encode(), request.to_json()))
        stayed = [h for node, h in handlers.items() if node != rolled]
        wait_until(lambda: all(h.num_nodes_waiting() for h in stayed), 20, "the re-form, watched")
        return {f.result(30).world_size for f in [pool.submit(h.next_rendezvous) for h in handlers.values()]}

    try:
        assert {f.result(30).world_size for f in [pool.submit(h.next_rendezvous) for h in handlers.values()]} == {2}
        code, said = bootstrap_cli(auth)
        assert code == 0 and f"warning: user {SHARED} (roles: {SHARED_ROLE}) is none of regroup's identities" in said, said
        as_controller(auth, lambda c: ensure_job_identity(c, keys))
        assert reform(None) == {2}  # still on the shared identity
        assert reform("n1") == {2}  # one pod rolled: both identities in one world
        assert reform("n0") == {2}  # both rolled
        assert remove_user_cli(auth, SHARED, "--role", SHARED_ROLE) == (0, f"user {SHARED} and role {SHARED_ROLE} removed\n")
        assert reform(None) == {2}  # nothing of the job needs the shared user any more
        assert all(h.round == generation for h in handlers.values()), [h.round for h in handlers.values()]
        code, said = bootstrap_cli(auth)
        assert code == 0 and "warning" not in said, said
        assert remove_user_cli(auth, SHARED, "--role", SHARED_ROLE)[1].startswith("no user regroup-worker")
        for ours in (AuthEtcd.CONTROLLER, "root", job_user(keys)):
            assert remove_user_cli(auth, ours)[0] == 2
    finally:
        for handler in handlers.values():
            handler.shutdown()
        pool.shutdown(wait=True, cancel_futures=True)


WATCH_RANGE_FIXED = {(3, 5): (3, 5, 33), (3, 6): (3, 6, 14), (3, 7): (3, 7, 1)}
"""The first release of each line whose watch checks the whole range it asks for
(GHSA-xg4h-6gfc-h4m8); 3.4 has none. docs/deploy.md, "Residual risks", names these."""


async def test_a_watch_past_a_jobs_own_keys_is_refused_only_by_the_etcd_releases_the_guide_names(
    auth: AuthEtcd,
) -> None:
    # The grants are exact (tests above); what a ranged watch may see is etcd's to check. On a
    # release the guide says not to run, a worker's watch from its own tombstone to the end of
    # the keyspace delivers every job's keys (``/regroup/jobs/`` sorts after ``finished/``);
    # on one it names, etcd refuses the watch.
    own, later = JobKeys(NS, "z-watcher"), JobKeys(NS, "a-watched")
    async with auth.client(auth.CONTROLLER) as controller:
        for keys in (own, later):
            await ensure_job_identity(controller, keys)
        version = tuple(int(part) for part in (await controller.status()).version.split(".")[:3])
        revision = (await controller.put(own.progress.encode(), b"{}")).header.revision
    fixed = version >= WATCH_RANGE_FIXED.get(version[:2], (9,))
    async with auth.client(job_user(own)) as worker:
        watch = await worker.watch(own.tombstone.encode(), range_end=b"\0", start_revision=revision + 1)
        try:
            assert (watch.watch_id == -1) is fixed, (version, watch.watch_id)
            if fixed:
                return
            async with auth.client(auth.CONTROLLER) as controller:
                await controller.put(later.member("n0").encode(), b"later's member")
            async with asyncio.timeout(10):
                event = await anext(aiter(watch))
            assert event.kv.key == later.member("n0").encode(), version
        finally:
            await watch.cancel()
