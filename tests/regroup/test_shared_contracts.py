"""The shared contracts: key layout, versioned records, the etcd access layer."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from datetime import timedelta

import pytest

from regroup.etcd import (
    EtcdSettings,
    EtcdUnavailable,
    LeaseKeeper,
    LoopThread,
    close_watch,
    connect,
    loop_threads,
    open_watch,
    parse_endpoints,
)
from regroup.demo.etcd_server import EtcdServer
from regroup.keys import JobKeys
from regroup.ports import free_port
from regroup.records import (
    TRACED_PHASES,
    CheckpointRequest,
    MemberRecord,
    Progress,
    RecordError,
    ReformCause,
    ReformOutcome,
    ReformPhase,
    ReformPlan,
    ReformRequest,
    evolve,
)


def test_job_keys_are_namespaced_and_parse_back() -> None:
    a, b = JobKeys("team-a", "llama"), JobKeys("team-b", "llama")
    assert a.member("n1") != b.member("n1")
    assert a.member("n1") == "/regroup/jobs/team-a/llama/members/n1"
    assert a.ack(7) == "/regroup/jobs/team-a/llama/acks/7/commit"
    parsed = JobKeys.parse(a.member("n1"))
    assert parsed == (a, "members/n1")
    assert JobKeys.parse("/other/x") is None
    with pytest.raises(ValueError, match="namespace"):
        JobKeys("", "x")


def test_records_roundtrip_and_tolerate_unknown_fields() -> None:
    rec = MemberRecord(node="n1", pod="p", namespace="ns", round=3, local_world_size=2, restart_count=1)
    assert MemberRecord.from_json(rec.to_json()) == rec
    body = json.loads(rec.to_json())
    body["added_by_a_newer_writer"] = 1
    assert MemberRecord.from_json(json.dumps(body)) == rec


def test_progress_from_an_older_trainer_parses_and_the_resume_report_roundtrips() -> None:
    old = b'{"v":1,"kind":"progress","step":5,"loss":2.0,"samples_seen":60,"world_size":4,"time":1.5}'
    progress = Progress.from_json(old)
    assert (progress.step, progress.round, progress.reform_mode, progress.resume_phases) == (5, 0, "", {})
    resumed = Progress(step=6, loss=1.9, samples_seen=72, world_size=2, time=2.5, round=3, reform_mode="in-place",
                       resume_phases={"process_group": 0.4, "reshard": 1.25, "first_step": 0.3})
    body = json.loads(resumed.to_json())
    assert (body["round"], body["reform_mode"], body["resume_phases"]["reshard"]) == (3, "in-place", 1.25)
    assert Progress.from_json(resumed.to_json()) == resumed
    assert set(resumed.resume_phases) <= set(Progress.RESUME_PHASES)
    assert "RESUME_PHASES" not in body, "the phase order is the reader's, not part of the record"


def test_records_refuse_newer_schema_wrong_kind_and_garbage() -> None:
    body = json.loads(ReformRequest(generation=1, cause="manual").to_json())
    with pytest.raises(RecordError, match="expected a checkpoint record"):
        CheckpointRequest.from_json(json.dumps(body))
    body["v"] = 99
    with pytest.raises(RecordError, match="newer than this reader"):
        ReformRequest.from_json(json.dumps(body))
    with pytest.raises(RecordError, match="not JSON"):
        Progress.from_json(b"\x80pickle")
    with pytest.raises(RecordError, match="missing"):
        Progress.from_json(b'{"v": 1, "kind": "progress", "step": 1}')


_STORED_PLAN = (
    b'{"ack_step":-1,"acked_at":0.0,"cause":"node-lost","checkpoint_deadline":0.0,"checkpoint_requested_at":0.0,'
    b'"decided_at":2.0,"detected_at":1.0,"fallback":"","finished_at":0.0,"generation":4,"kind":"plan",'
    b'"lost_steps":-1,"mode":"","nodes_after":["n1"],"nodes_before":["n1","n2"],"outcome":"","phase":"rendezvous",'
    b'"planned":false,"progress_revision":0,"reason":"lost n2","reform_requested_at":0.0,"rendezvous_done_at":0.0,'
    b'"resume_phases":{},"resumed_at":0.0,"resumed_from_step":-1,"round_after":0,"round_before":0,"step_before":-1,'
    b'"trace_id":"cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd","v":1,"why":"","world_size_target":0}'
)
"""A plan in flight as regroup wrote it while phase, cause and outcome were plain strings."""


def test_a_plan_stores_phase_cause_and_outcome_as_the_same_plain_strings() -> None:
    plan = ReformPlan.from_json(_STORED_PLAN)
    assert (plan.phase, plan.cause, plan.outcome) == (ReformPhase.RENDEZVOUS, ReformCause.NODE_LOST, ReformOutcome.PENDING)
    assert type(plan.phase) is ReformPhase and type(plan.cause) is ReformCause and type(plan.outcome) is ReformOutcome
    # Written again, it is the same record plus the fields added since (a re-form's strategy,
    # the workers that exited during it).
    assert json.loads(plan.to_json()) == {
        **json.loads(_STORED_PLAN), "replaced": {}, "strategy": "elastic", "worker_exit": ""
    }
    assert ReformPlan.from_json(plan.to_json()).to_json() == plan.to_json()
    done = ReformPlan.from_json(plan.to_json().replace(b'"phase":"rendezvous"', b'"phase":"done"')
                                .replace(b'"outcome":""', b'"outcome":"completed"'))
    assert (done.phase, done.outcome) == (ReformPhase.DONE, ReformOutcome.COMPLETED)
    assert b'"phase":"done"' in done.to_json() and b'"outcome":"completed"' in done.to_json()


def test_a_plan_with_a_phase_cause_or_outcome_this_reader_does_not_know_is_refused() -> None:
    for field, value in (("phase", "drain"), ("cause", "preempt"), ("outcome", "vanished"), ("phase", None)):
        body = json.loads(_STORED_PLAN)
        body[field] = value
        with pytest.raises(RecordError, match="plan"):
            ReformPlan.from_json(json.dumps(body))


def test_evolve_makes_what_dataclasses_replace_makes() -> None:
    plan = ReformPlan.from_json(_STORED_PLAN)
    changes = {"phase": ReformPhase.DONE, "outcome": "superseded", "finished_at": 12.5, "why": "n3 lost"}
    done = evolve(plan, **changes)
    assert done == dataclasses.replace(plan, **changes) and done.to_json() == dataclasses.replace(plan, **changes).to_json()
    assert type(done.outcome) is ReformOutcome  # __post_init__ ran
    assert plan.phase == ReformPhase.RENDEZVOUS and plan.why == ""  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.why = "changed"  # type: ignore[misc]
    with pytest.raises(TypeError, match="no field phse"):
        evolve(plan, phse=ReformPhase.DONE)
    with pytest.raises(ValueError, match="vanished"):
        evolve(plan, outcome="vanished")


def test_the_traced_phases_are_detect_then_the_plan_phases_before_done() -> None:
    assert TRACED_PHASES == ("detect", "checkpoint", "rendezvous", "resume")
    assert TRACED_PHASES[1:] == tuple(p.value for p in ReformPhase if p is not ReformPhase.DONE)


def test_parse_endpoints() -> None:
    assert [str(e) for e in parse_endpoints("a:1, http://b:2")] == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="bad etcd endpoint"):
        parse_endpoints("a:b")


async def test_connect_names_the_endpoint_when_unreachable() -> None:
    port = free_port()
    settings = EtcdSettings.from_endpoint_string(f"127.0.0.1:{port}", request_timeout=timedelta(seconds=1))
    with pytest.raises(EtcdUnavailable, match=f"127.0.0.1:{port}"):
        await connect(settings)


async def test_lease_keeper_keeps_key_alive_and_revokes(etcd_client) -> None:
    keeper = LeaseKeeper(etcd_client, ttl=timedelta(seconds=2))
    lease = await keeper.start()
    await etcd_client.put(b"/k", b"v", lease=lease)
    # Outlive the TTL twice over: the key must still be there, refreshed by the keeper.
    await asyncio.sleep(4.5)  # deliberately longer than the TTL: this is the property under test
    assert (await etcd_client.get(b"/k")) is not None, "lease expired despite the keeper"
    await keeper.stop(revoke=True)
    assert await etcd_client.get(b"/k") is None


class _CancelLandsAsTheWatchIsCreated:
    """The real client, but its watch is created in the loop turn a cancellation lands in,
    and the cancellation is dropped, as Python 3.11's ``asyncio.wait_for`` inside aetcd's
    ``add_callback`` drops it (CPython gh-86296)."""

    def __init__(self, client: object) -> None:
        self.client = client
        self.watches: list[object] = []

    async def watch_prefix(self, key: bytes, **kwargs: object) -> object:
        watch = await self.client.watch_prefix(key, **kwargs)  # type: ignore[attr-defined]
        self.watches.append(watch)
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            pass  # dropped, as wait_for drops it when its result and the cancellation meet
        return watch


async def test_a_cancellation_that_lands_as_a_watch_is_created_is_not_lost(etcd_client) -> None:
    client = _CancelLandsAsTheWatchIsCreated(etcd_client)
    opened = asyncio.ensure_future(open_watch(client, b"/jobs/", start_revision=1))  # type: ignore[arg-type]
    with pytest.raises(asyncio.CancelledError):
        await opened
    # The watch it had created was closed on the server: a put reaches no one, and a new
    # watch on the same key still works.
    assert len(client.watches) == 1
    watch = await open_watch(etcd_client, b"/jobs/", start_revision=1)
    await etcd_client.put(b"/jobs/a", b"1")
    events = aiter(watch)
    event = await anext(events)
    assert event.kv.key == b"/jobs/a"
    assert await close_watch(watch)


def test_loop_thread_runs_coroutines_for_sync_callers(etcd: EtcdServer) -> None:
    loop = LoopThread()
    try:
        settings = EtcdSettings.from_endpoint_string(etcd.endpoint)
        client = loop.run(connect(settings), timeout=timedelta(seconds=10))
        loop.run(client.put(b"/sync", b"1"))
        assert loop.run(client.get(b"/sync")).value == b"1"
        loop.run(client.close())
    finally:
        loop.close()


class PollerCompletionQueue:
    """Named as gRPC's aio poller, whose ``_handle_events`` forwards a completion to the
    loop its call was made on."""

    def __init__(self, target: asyncio.AbstractEventLoop) -> None:
        self.target = target

    def _handle_events(self) -> None:
        self.target.call_soon_threadsafe(lambda: None)


def test_a_grpc_completion_for_a_closed_loop_is_not_a_problem_of_the_loop_that_forwards_it(
    take_loop_thread_problems: Callable[[], list[str]],
) -> None:
    closed = asyncio.new_event_loop()
    closed.close()
    loop = LoopThread(name="poller")
    try:

        async def forward(target: asyncio.AbstractEventLoop) -> None:
            # The poller's forward raises on the loop running it, as gRPC's does.
            asyncio.get_running_loop().call_soon(PollerCompletionQueue(target)._handle_events)
            asyncio.get_running_loop().call_soon(_raise_in_callback)
            await asyncio.sleep(0.05)

        loop.run(forward(closed))
    finally:
        loop.close()
    recorded = take_loop_thread_problems()
    # The forward to the closed loop is not recorded; any other callback error still is.
    assert len(loop.problems) == 1 and len(recorded) == 1, loop.problems
    assert loop.problems[0].startswith("Exception in callback _raise_in_callback()"), loop.problems


def _raise_in_callback() -> None:
    raise RuntimeError("Event loop is closed")  # same text, but not gRPC's forward


def test_loop_thread_records_what_no_caller_was_told_and_is_listed_until_closed(
    take_loop_thread_problems: Callable[[], list[str]],
) -> None:
    loop = LoopThread(name="checked")
    assert loop in loop_threads.open()

    async def crash() -> None:
        raise ValueError("crashed in the background")

    async def ignores_cancel() -> None:
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                continue  # deliberately deaf to cancellation: what close() must report

    async def raises_when_cancelled() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            raise KeyError("on the way out")

    async def background() -> None:
        loop.supervise(asyncio.create_task(crash(), name="supervised"))
        asyncio.create_task(ignores_cancel(), name="stubborn")
        asyncio.create_task(raises_when_cancelled(), name="messy")
        await asyncio.sleep(0)

    loop.spawn(crash())
    loop.run(background())
    with pytest.raises(ValueError, match="crashed in the background"):
        loop.run(crash())  # told to its caller: not a problem
    loop.close(timeout=timedelta(seconds=0.5))
    assert loop not in loop_threads.open() and loop.closed
    with pytest.raises(RuntimeError, match="closed"):
        loop.run(crash())
    problems = take_loop_thread_problems()
    assert problems == [f"checked#{loop.serial}: {p}" for p in loop.problems]
    assert sorted(p.split(" ")[0:2] for p in loop.problems) == [
        ["spawned", "'test_loop_thread_records_what_no_caller_was_told_and_is_listed_until_closed.<locals>.crash'"],
        ["task", "'messy'"],
        ["task", "'stubborn'"],
        ["task", "'supervised'"],
    ]
    assert any("KeyError('on the way out') when cancelled" in p for p in loop.problems)
    assert any("'stubborn'" in p and "still running 0.5s after being cancelled" in p for p in loop.problems)
