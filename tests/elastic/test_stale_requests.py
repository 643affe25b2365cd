"""A checkpoint request never outlives its plan, and a re-form's lost steps come from the
trainers' own facts.

A plan whose leaving node vanished before the ack falls back to the unplanned path: the
controller asks for the re-form with the plan's generation and (once it withdraws it) the
request is gone. Before that, the survivors of the fallback re-form found the request
still in etcd, saved, acked and held at the boundary until its deadline: a 32-34 s stall
on a real cluster. Here the request is left in place on purpose (as a controller that
failed to withdraw it would): the trainers alone must not hold on it.

Real etcd, real ``regroup-run`` agents, the built-in trainer on gloo; the test plays the
controller by writing its etcd records.
"""

from __future__ import annotations

import time

import pytest

from regroup.records import CheckpointRequest
from tests.rendezvous.inplace_job import InPlaceJob
from tests.rendezvous.test_inplace import job  # noqa: F401 - the fixture: agents of the built-in trainer

pytestmark = pytest.mark.slow

HOLD_DEADLINE_S = 120.0
"""The stale request's deadline: a trainer that held on it would hold this long."""


def test_survivors_of_a_fallback_reform_never_hold_on_the_plans_request(job: InPlaceJob) -> None:
    job.claim_control()
    job.expect(0, ["a", "b", "c"], "start")
    for node in ("a", "b", "c"):
        job.start(node)
    before = job.await_progress("3 ranks training", lambda p: p.world_size == 3 and p.step >= 5)

    # The plan of generation 1 asked for a checkpoint; c vanished before the ack; the plan
    # fell back: the re-form without c is asked for, and the request is still there.
    job.kill_node("c")
    job.reform(1, ["a", "b"], cause="node-lost")
    stale = CheckpointRequest(generation=1, deadline=time.time() + HOLD_DEADLINE_S, hold=True, reason="reclaim of c")
    job._put(job.keys.checkpoint, stale.to_json())

    shrunk = job.await_progress("training at 2 ranks", lambda p: p.world_size == 2 and p.step > p.resumed_from_step)
    # Training goes on at once: 20 more steps (50 ms each at the least) well inside the deadline.
    trained = job.await_progress(
        "20 steps after the re-form", lambda p: p.world_size == 2 and p.step >= shrunk.step + 20, timeout=HOLD_DEADLINE_S / 3
    )
    assert trained.extra["requests_honoured"] == 0, trained.extra
    assert job._get(job.keys.ack(1)) is None, "no rank saved or acked for the stale request"
    for node in ("a", "b"):
        assert not job.events(node, "holding for the re-form"), job.log(node)[-3000:]

    # The lost steps are the trainers' own count: the newest step the survivors completed
    # before the re-form, against the step they resumed from.
    assert shrunk.last_step >= before.step, (shrunk.last_step, before.step)
    assert shrunk.last_step >= shrunk.resumed_from_step
