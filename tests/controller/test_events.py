"""The Event recorder: decisions never wait on Events, and a storm cannot flood the API."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest
import structlog

from regroup.controller.cluster import ObjectRef
from regroup.controller.events import EVENT_MEMORY, SPAM_BURST, SPAM_REFILL, EventRecorder
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.model import ClusterModel
from regroup.controller.reconciler import Reconciler
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import PostPodEvents

from .builders import JOB, NS, T0, pod
from .harness import sample


class Api:
    """An actuator that records the Events posted; ``gate`` holds every post until set."""

    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: set[str] = set()

    async def post_event(self, ref: ObjectRef, type_: str, reason: str, message: str) -> None:
        await self.gate.wait()
        if message in self.fail:
            raise RuntimeError("the API server said no")
        self.posted.append((ref.name, reason, message))


@pytest.fixture
async def running() -> AsyncIterator[tuple[EventRecorder, Api, ControllerMetrics]]:
    api, metrics = Api(), ControllerMetrics()
    recorder = EventRecorder(api, metrics, capacity=100)  # type: ignore[arg-type]
    task = asyncio.create_task(recorder.run())
    yield recorder, api, metrics
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def ref(name: str) -> ObjectRef:
    return ObjectRef("Pod", name, NS)


async def test_the_same_event_is_posted_once_per_memory(running) -> None:
    recorder, api, _ = running
    memory = EVENT_MEMORY.total_seconds()
    recorder.record(ref("p"), "Normal", "Test", "a", T0)
    recorder.record(ref("p"), "Normal", "Test", "a", T0 + memory - 1)
    recorder.record(ref("q"), "Normal", "Test", "a", T0 + memory - 1)  # another object: its own Event
    recorder.record(ref("p"), "Normal", "Test", "a", T0 + memory)
    await recorder.posted()
    assert api.posted == [("p", "Test", "a"), ("q", "Test", "a"), ("p", "Test", "a")]
    # Once every other Event's memory has passed, only the one posted last is remembered.
    recorder.record(ref("r"), "Normal", "Test", "c", T0 + 3 * memory)
    assert list(recorder._seen) == [("Pod", NS, "r", "Test", "c")]


async def test_a_subject_posts_a_burst_then_one_per_refill(running) -> None:
    recorder, api, metrics = running
    for i in range(SPAM_BURST + 10):
        recorder.record(ref("p"), "Warning", "Flap", f"flap {i}", T0 + i * 0.01)
    recorder.record(ref("other"), "Warning", "Flap", "flap", T0 + 1)
    await recorder.posted()
    assert [m for name, _, m in api.posted if name == "p"] == [f"flap {i}" for i in range(SPAM_BURST)]
    assert ("other", "Flap", "flap") in api.posted
    assert sample(metrics, "regroup_events_dropped_total", cause="rate-limited") == 10
    # One refill later, one more; not two.
    later = T0 + SPAM_REFILL.total_seconds() + 1
    recorder.record(ref("p"), "Warning", "Flap", "after", later)
    recorder.record(ref("p"), "Warning", "Flap", "after 2", later)
    await recorder.posted()
    assert [m for name, _, m in api.posted if name == "p"][-1] == "after"
    assert sample(metrics, "regroup_events_dropped_total", cause="rate-limited") == 11


async def test_a_job_level_event_goes_on_every_pod_and_spends_one_token_of_the_job(running) -> None:
    recorder, api, _ = running
    pods = [pod(n) for n in ("n1", "n2", "n3")]
    for i in range(SPAM_BURST + 5):
        recorder.record_on_pods((NS, JOB), pods, "Warning", "ReformAbandoned", f"re-form {i} abandoned", T0 + i)
    await recorder.posted()
    assert len(api.posted) == 3 * SPAM_BURST
    assert {name for name, _, _ in api.posted} == {p.name for p in pods}
    # Each pod's own budget is untouched: an Event about one pod still goes out.
    recorder.record(pods[0].ref, "Warning", "BadConfig", "bad", T0 + 100)
    await recorder.posted()
    assert api.posted[-1] == (pods[0].name, "BadConfig", "bad")


async def test_a_full_queue_drops_the_newest_and_a_failed_post_drops_only_itself(running) -> None:
    recorder, api, metrics = running
    api.gate.clear()  # the API server stops answering
    api.fail.add("m1")
    for i in range(110):
        recorder.record(ref(f"p{i}"), "Normal", "Test", f"m{i}", T0)
    assert sample(metrics, "regroup_events_dropped_total", cause="queue-full") == 10
    api.gate.set()
    await recorder.posted()
    assert [m for _, _, m in api.posted] == [f"m{i}" for i in range(100) if i != 1]
    assert sample(metrics, "regroup_events_dropped_total", cause="error") == 1


async def test_a_decision_does_not_wait_for_its_events() -> None:
    """The API server sits on every Event: the reconcile that tells a re-form's end on
    50 pods returns at once, and the Events go out when the server answers."""
    api, metrics = Api(), ControllerMetrics()
    api.gate.clear()
    reconciler = Reconciler(ClusterModel(lambda: T0, lambda job: None), ControllerSettings(), None, api,  # type: ignore[arg-type]
                            metrics)
    task = asyncio.create_task(reconciler.events.run())
    try:
        pods = tuple(pod(f"n{i}") for i in range(50))
        action = PostPodEvents(pods, "Normal", "Resized", "50 → 49 nodes")
        await asyncio.wait_for(reconciler._apply((NS, JOB), action, T0), timeout=5)
        assert api.posted == []
        api.gate.set()
        await asyncio.wait_for(reconciler.events.posted(), timeout=5)
        assert sorted(name for name, _, _ in api.posted) == sorted(p.name for p in pods)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_abandoned_re_forms_are_all_counted_and_logged_within_a_budget_per_job() -> None:
    """A storm supersedes a job's plans many times a second: metrics count each one, the
    warning log takes a burst per job and then says how many it left out."""
    import dataclasses

    from structlog.testing import capture_logs

    from regroup.records import ReformCause, ReformOutcome, ReformPhase, ReformPlan

    metrics = ControllerMetrics()
    reconciler = Reconciler(ClusterModel(lambda: T0, lambda job: None), ControllerSettings(), None, Api(),  # type: ignore[arg-type]
                            metrics)
    plan = ReformPlan(generation=1, cause=ReformCause.NODE_LOST, planned=False, reason="lost n3", nodes_before=["n1", "n2"],
                      nodes_after=["n1"], trace_id="1" * 32, detected_at=T0, decided_at=T0, round_before=1,
                      phase=ReformPhase.DONE, reform_requested_at=T0, outcome=ReformOutcome.SUPERSEDED, why="n2 lost")

    def abandon(generation: int, at: float, job: str = JOB) -> None:
        reconciler._finished((NS, job), dataclasses.replace(plan, generation=generation, finished_at=at))

    saved = structlog.get_config()
    try:
        # Whatever level the suite's other in-process runs configured, warnings are let through.
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
                            cache_logger_on_first_use=False)
        with capture_logs() as logs:
            for g in range(SPAM_BURST + 5):
                abandon(g, T0 + g * 0.01)
            abandon(0, T0 + 1, job="other")  # another job has its own budget
            abandon(99, T0 + 1 + SPAM_REFILL.total_seconds())
    finally:
        structlog.configure(**saved)
    lines = [e for e in logs if e["event"] == "re-form abandoned"]
    assert [e["generation"] for e in lines if e["job"] == JOB] == [*range(SPAM_BURST), 99]
    assert "unlogged_before" not in lines[0] and lines[-1]["unlogged_before"] == 5
    assert [e["job"] for e in lines].count("other") == 1
    counted = sample(metrics, "regroup_reforms_abandoned_total", namespace=NS, job=JOB, cause="node-lost",
                     phase="rendezvous", outcome="superseded")
    assert counted == SPAM_BURST + 6
