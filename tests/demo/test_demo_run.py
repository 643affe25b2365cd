"""``regroup demo`` end to end on a shortened scenario: real etcd, torchrun agents, trainers
and the controller on local nodes. Every fact is read from the recorded progress records,
the re-form spans and the cluster actions, never from log text."""

from __future__ import annotations

import itertools

import pytest

from regroup.demo.analysis import (
    RunData,
    continuity_errors,
    event_impacts,
    incarnations,
    resumed_from_memory,
)
from regroup.trace_report import reforms_from_spans
from tests.demo.demo_runs import DEMO_TIMEOUT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(DEMO_TIMEOUT + 90)]


# ``short_run`` (tests/demo/conftest.py): the short scenario, played once per session.


def _scripted(run: RunData, action: str) -> float:
    return next(e.time for e in run.events if e.source == "scenario" and e.reason == action)


def test_the_planned_reclaim_loses_no_step(short_run: RunData) -> None:
    reclaims = [r for r in reforms_from_spans(short_run.spans) if r.cause == "reclaim"]
    assert reclaims, "no regroup.reform trace for the reclaim"
    reclaim = reclaims[0]
    assert reclaim.planned and "checkpoint" in reclaim.phases
    assert reclaim.world_after == reclaim.world_before - 1
    # The span says what it lost once its re-form completed (-1: superseded before that).
    assert reclaim.lost_steps in (0, -1), reclaim
    impact = next(i for i in event_impacts(short_run) if i.event.reason == "reclaim")
    assert impact.interruptions and impact.lost_steps == 0


def test_training_resumes_after_the_abrupt_loss(short_run: RunData) -> None:
    lost_at = _scripted(short_run, "lose")
    restore_at = _scripted(short_run, "restore")
    assert any(r.cause == "node-lost" and not r.planned for r in reforms_from_spans(short_run.spans))
    before = max(p.step for p in short_run.progress if p.time < lost_at)
    after = [p for p in short_run.progress if lost_at < p.time < restore_at]
    assert after and max(p.step for p in after) > before, "no training step after the loss"
    assert after[-1].world_size == 1


def test_the_job_grows_back_to_full_size(short_run: RunData) -> None:
    restore_at = _scripted(short_run, "restore")
    full = len(short_run.meta["nodes"]) * short_run.meta["nproc_per_node"]
    assert any(p.world_size == full for p in short_run.progress if p.time > restore_at)
    assert any(r.cause == "grow" and r.world_after == full for r in reforms_from_spans(short_run.spans))


def test_every_event_found_the_job_settled(short_run: RunData) -> None:
    # The script waits for each re-form to be over (and restored nodes to train in the job)
    # before the next event, and at the end for the flaky node's cordon and the re-form after
    # it: the facts below hold on a busy machine too, unless the job never settled.
    unsettled = [e.message for e in short_run.events if e.reason == "NotSettled"]
    assert not unsettled, unsettled


def test_the_flaky_node_is_cordoned_and_the_job_trains_on(short_run: RunData) -> None:
    cordons = [e for e in short_run.events if e.reason == "Cordoned"]
    flaky = next(e.nodes for e in short_run.events if e.source == "scenario" and e.reason == "flaky")
    assert [e.nodes for e in cordons] == [flaky]
    crashes = [e for e in short_run.events if e.reason == "RankCrashed"]
    assert len(crashes) >= 1
    cordoned_at = cordons[0].time
    later = [p for p in short_run.progress if p.time > cordoned_at]
    assert later and later[-1].step > later[0].step, "no training after the cordon"
    assert later[-1].world_size == 2, f"world sizes after the cordon: {[p.world_size for p in later]}"


def test_no_loop_thread_of_an_agent_or_trainer_recorded_a_problem(short_run: RunData) -> None:
    # The agents' rendezvous and the trainers' etcd channel run asyncio loops in threads
    # (``regroup.etcd.LoopThread``); what goes wrong there unseen by a caller is logged.
    problems = [
        f"{log.name}: {line.strip()[:300]}"
        for log in sorted((short_run.root / "logs").glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "loop thread problem" in line
    ]
    assert not problems, problems


def test_the_loss_curve_is_continuous(short_run: RunData) -> None:
    assert continuity_errors(short_run.progress) == []
    parts = incarnations(short_run.progress)
    assert len(parts) >= 4, "the scenario re-forms at least four times"
    for before, after in itertools.pairwise(parts):
        # Each incarnation resumes from a step the run had reached; its first progress is the
        # step right after it (a new world publishes once its first step is done), unless
        # that world re-formed again before its first step (likelier on a busy machine): its
        # rank 0 then recorded the step it left at, its resume point, as the world's only
        # record, and the next world resumed from that same step.
        at_resume = [i for i, s in enumerate(after.samples) if s.step == after.resumed_from_step]
        assert after.first_step == after.resumed_from_step + (0 if at_resume else 1), after
        for i in at_resume:
            left, following = after.samples[i], after.samples[i + 1 : i + 2]
            assert all(f.round != left.round for f in following), f"a world recorded its resume point, trained on: {after}"
        # Past the last record only from the survivors' memory (see ``continuity_errors``).
        assert after.resumed_from_step <= before.last_step or resumed_from_memory(after)
        steps = [s.step for s in after.samples]
        assert steps == sorted(steps) and len(set(steps)) == len(steps)


def test_no_node_log_ends_in_a_traceback(short_run: RunData) -> None:
    # An agent stopped by a signal says so in one line (regroup-run), not with torch's
    # SignalException traceback.
    for log in sorted((short_run.root / "logs").glob("node-*.log")):
        tail = log.read_text(errors="replace").splitlines()[-20:]
        assert tail and not any("Traceback" in line or "SignalException" in line for line in tail), (log.name, tail)


def test_a_healthy_run_raises_no_flapping_nor_stall(short_run: RunData) -> None:
    # Every round of it trained (the controller's re-forms and the agents' own around the
    # flaky node's crashes alike), and it never went below its min.
    alerts = [f"{e.reason}: {e.message}" for e in short_run.events if e.reason in ("RendezvousFlapping", "JobStalled")]
    assert not alerts, alerts


def test_the_reports_reform_table_adds_up_and_its_events_are_one_row_each(short_run: RunData) -> None:
    from regroup.demo.analysis import event_rows, reform_rows
    from regroup.demo.report import summarize

    rows = reform_rows(short_run)
    assert sum(r.lost_steps for r in rows) == summarize(short_run).lost_steps
    # The flaky node's crashes are rows of their own (the agents re-formed without it).
    assert any(r.cause == "crash" for r in rows), [r.label for r in rows]
    # A job-level Event, told on each of the job's pods, is one row.
    resized = [r for r in event_rows(short_run) if r.reason in ("Resized", "NodeMigrated", "NodeReplaced")]
    assert resized and len({(r.message, r.time) for r in resized}) == len(resized)
    assert all(len(r.nodes) >= 1 for r in resized) and max(len(r.nodes) for r in resized) > 1
