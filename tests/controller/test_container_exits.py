"""A member whose agent's container exited after the agent registered is lost at once, from
its pod's status, not a lease TTL later; the exit of an agent that announced its leave is
the end of that leave; and an unplanned re-form counts from the first evidence of its loss."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from typing import Any

import pytest

from regroup.controller.cluster import ContainerRestarts, termination_failed
from regroup.controller.kube.convert import pod_info
from regroup.controller.model import ClusterModel
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import WriteExpected, WritePlan, WriteReform
from regroup.exit_codes import LEFT_JOB
from regroup.records import Progress, ReformPlan
from kubeapi import objects

from .builders import JOB, NS, T0, Scene, decide, job, leaving, member, of, pod, registered, with_deletion
from .builders import step as reconcile

S = ControllerSettings()
J = T0 - 600.25
"""When the job's agents registered (``joined_at``)."""


def step(s: Scene, now: float):
    return reconcile(s, now, S)


def running() -> Scene:
    """Three nodes training; each agent registered at ``J``, the round's record names them."""
    return registered(job(), J)


def exited(code: int = 137, at: float = T0 + 1, reason: str = "Error", name: str = "worker",
           running_since: float | None = None) -> ContainerRestarts:
    """A container whose latest termination finished at ``at`` (whole seconds, as the API gives it)."""
    failed = termination_failed(code, reason)
    return ContainerRestarts(name, 0, failed, running_since=running_since, exited_at=at, exit_code=code,
                             exit_reason=reason, exit_failed=failed)


def container_exit(s: Scene, node: str = "n2", seen: float = T0 + 1.4, *containers: ContainerRestarts) -> Scene:
    """The kubelet reports ``node``'s pod's containers as ``containers`` (default: the agent's
    killed, exit 137, at ``T0 + 1``); the controller sees it at ``seen``."""
    return s.changed_pod(node, at=seen, containers=containers or (exited(),), agent_container="worker")


def planned(d: Any) -> ReformPlan:
    [write] = of(d.actions, WritePlan)
    return write.plan


# --- the rule -------------------------------------------------------------------------------


def test_a_container_killed_after_its_agent_registered_is_a_loss_at_once() -> None:
    s = container_exit(running())
    d = decide(s, T0 + 1.4, S)
    plan = planned(d)
    assert plan.cause == "node-lost" and not plan.planned and plan.nodes_after == ["n1", "n3"]
    assert plan.reason == "lost n2 (pod llama-n2 container exited (code 137))"
    # The trace starts when the kubelet says the container ended, not when the controller looked.
    assert plan.detected_at == T0 + 1 and plan.decided_at == T0 + 1.4
    assert of(d.actions, WriteExpected)[0].expected.nodes == ["n1", "n3"] and of(d.actions, WriteReform)
    # The member record is still there (its lease has not expired): the pod's status decided.
    assert s.members["n2"].joined_at == J


@pytest.mark.parametrize(
    "container",
    [
        exited(at=J - 30),  # an earlier instance crashed before this agent registered
        exited(at=float(int(J))),  # within the second the agent registered: the API cuts it to that second
        exited(at=T0 + 1, name="istio-proxy"),  # a sidecar: the agent runs on
        dataclasses.replace(exited(at=J - 30), running_since=J - 20),  # the agent's own instance
    ],
    ids=["before-registration", "same-second", "sidecar", "running-since-before"],
)
def test_a_container_exit_that_did_not_end_the_agent_is_no_loss(container: ContainerRestarts) -> None:
    s = container_exit(running(), "n2", T0 + 1.4, container)
    d = decide(s, T0 + 1.4, S)
    assert not of(d.actions, WritePlan) and d.reason == "steady at 3 nodes"


def test_a_restarted_container_whose_termination_was_not_kept_is_a_loss() -> None:
    container = ContainerRestarts("worker", 1, True, running_since=T0 + 2)
    plan = planned(decide(container_exit(running(), "n2", T0 + 2.5, container), T0 + 2.5, S))
    assert plan.reason == "lost n2 (pod llama-n2 container restarted)" and plan.detected_at == T0 + 2


def test_an_oom_kill_is_named() -> None:
    plan = planned(decide(container_exit(running(), "n2", T0 + 1.4, exited(137, reason="OOMKilled")), T0 + 1.4, S))
    assert plan.reason == "lost n2 (pod llama-n2 container exited (code 137, OOMKilled))"


def test_an_agent_that_never_said_when_it_registered_waits_for_its_lease() -> None:
    s = container_exit(job())  # joined_at 0: the exit cannot be placed after the registration
    assert not of(decide(s, T0 + 1.4, S).actions, WritePlan)


def test_the_new_agent_of_the_restarted_container_is_no_loss_and_rejoins() -> None:
    s, _ = step(container_exit(running()), T0 + 1.4)
    assert s.plan.nodes_after == ["n1", "n3"]
    # The container runs again, its new agent registers and waits; n1 and n3 form round 2.
    s = container_exit(s, "n2", T0 + 2, exited(running_since=T0 + 2))
    s = s.with_member(member("n2", 0, joined_at=T0 + 3.5), at=T0 + 3.5)
    s, _ = step(s.round_formed(2, ("n1", "n3"), agents={"n1": J, "n3": J}, at=T0 + 4), T0 + 4)
    progress = Progress(step=101, loss=1.0, samples_seen=0, world_size=4, time=T0 + 5, resumed_from_step=100)
    s, _ = step(s.with_progress(progress, 50), T0 + 5)
    assert s.plan.outcome == "completed"
    # The exit is older than the new agent: a joiner, not a loss, and the job grows back.
    s, d = step(s, T0 + 20)
    plan = planned(d)
    assert plan.cause == "grow" and plan.nodes_after == ["n1", "n3", "n2"], d.reason


# --- planned leaves stay planned --------------------------------------------------------------


def _leaving_n2() -> Scene:
    """n2's pod deleted with 30 s of grace, its agent leaving: a planned shrink waiting for the ack."""
    s = leaving(with_deletion(running(), "n2", at=T0, grace=30), "n2", since=T0, by=T0 + 30)
    s, _ = step(s, T0 + 0.5)
    assert s.plan.planned and s.plan.phase == "checkpoint"
    return s


@pytest.mark.parametrize("code", [LEFT_JOB, 0])
def test_the_voluntary_exit_of_a_leaving_agent_ends_its_leave_and_is_no_loss(code: int) -> None:
    reason = "Completed" if code == 0 else "Error"
    s = container_exit(_leaving_n2(), "n2", T0 + 2, exited(code, at=T0 + 2, reason=reason))
    s, d = step(s, T0 + 2)
    assert "waiting for the checkpoint ack" in d.reason and s.plan.planned and not s.plan.fallback
    assert not of(d.actions, WriteReform)


def test_a_leaving_agent_killed_before_its_hand_over_falls_back_at_once() -> None:
    s = container_exit(_leaving_n2(), "n2", T0 + 2, exited(137, at=T0 + 2))
    s, d = step(s, T0 + 2)
    assert s.plan.fallback == "n2 vanished before the checkpoint ack" and of(d.actions, WriteReform)


def test_a_voluntary_exit_of_an_agent_that_announced_no_leave_is_a_loss() -> None:
    plan = planned(decide(container_exit(running(), "n2", T0 + 1.4, exited(LEFT_JOB, at=T0 + 1)), T0 + 1.4, S))
    assert plan.reason == "lost n2 (pod llama-n2 container exited (code 75))"


# --- the first evidence of a loss -------------------------------------------------------------


def test_a_loss_seen_through_the_lease_counts_from_the_container_exit_the_pod_shows() -> None:
    # The controller saw the lease expire (T0 + 2.5) before the pod's status (T0 + 3).
    s = container_exit(running().at(T0 + 2.5).without_member("n2"), "n2", T0 + 3)
    plan = planned(decide(s, T0 + 3, S))
    assert plan.reason == "lost n2 (member lease expired)" and plan.detected_at == T0 + 1


def test_a_restarted_agent_seen_first_counts_from_the_container_exit() -> None:
    s = running().with_member(member("n2", 0, joined_at=T0 + 2.6), at=T0 + 2.7)
    s = container_exit(s, "n2", T0 + 2.8, exited(at=T0 + 1, running_since=T0 + 2))
    plan = planned(decide(s, T0 + 3, S))
    assert plan.reason == "lost n2 (agent on n2 restarted)" and plan.detected_at == T0 + 1


def test_a_deletion_seen_late_counts_from_when_it_was_asked_for() -> None:
    s = with_deletion(running(), "n2", at=T0, grace=0, seen=T0 + 0.7)
    plan = planned(decide(s, T0 + 0.8, S))
    assert plan.reason.startswith("lost n2 (pod llama-n2 deleted or evicted") and plan.detected_at == T0


def test_a_pods_old_deletion_does_not_date_the_loss_of_its_successor() -> None:
    s = running().at(T0 - 3600).without_pod(f"{JOB}-n2")
    s = s.with_pod(dataclasses.replace(pod("n2"), uid="uid-n2-again"), at=T0 - 3500)  # a StatefulSet's new pod
    s = with_deletion(s, "n2", at=T0, grace=0)
    assert planned(decide(s, T0 + 0.2, S)).detected_at == T0


# --- the model ------------------------------------------------------------------------------


def test_the_exit_wakes_the_job_and_makes_the_node_a_suspect_though_it_is_a_restart_alone() -> None:
    woken: list[Any] = []
    clock = [T0]
    model = ClusterModel(lambda: clock[0], woken.append)
    s = running()
    for _, observe in s.history:
        observe(model)
    assert "n2" not in model.snapshot((NS, JOB)).suspects
    pod = model.jobs[(NS, JOB)].pods[f"{JOB}-n2"]
    pod = dataclasses.replace(pod, agent_container="worker", containers=(ContainerRestarts("worker", 0, True),))
    model.pod_changed(pod)
    woken.clear()
    # The kubelet restarts the killed container: its count and its last termination in one write.
    restarted = dataclasses.replace(exited(running_since=T0 + 1), count=1)
    model.pod_changed(dataclasses.replace(pod, restart_count=1, containers=(restarted,)))
    assert woken == [(NS, JOB)] and "n2" in model.snapshot((NS, JOB)).suspects
    # Once its agent is known gone, the container's next crash changes nothing a decision reads.
    woken.clear()
    again = dataclasses.replace(exited(at=T0 + 5, running_since=T0 + 6), count=2)
    model.pod_changed(dataclasses.replace(pod, restart_count=2, containers=(again,)))
    assert woken == []


# --- the pod as the API server gives it -----------------------------------------------------------


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def test_the_source_reads_the_containers_start_and_latest_exit() -> None:
    obj = objects.pod(NS, f"{JOB}-n2", job=JOB, node="n2", restart_count=1)
    obj["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] = "trainer"
    obj["spec"]["containers"] = [{"name": "istio-proxy"}, {"name": "trainer"}]
    agent = {"name": "trainer", "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
             "lastState": {"terminated": {"exitCode": 137, "reason": "Error", "startedAt": rfc3339(T0 - 60),
                                          "finishedAt": rfc3339(T0 + 1.7)}}}
    sidecar = {"name": "istio-proxy", "restartCount": 0, "state": {"running": {"startedAt": rfc3339(T0 - 60)}}}
    obj["status"]["containerStatuses"] = [sidecar, agent]
    info = pod_info(obj)
    assert info.agent_container == "trainer"
    proxy, trainer = info.containers
    assert (proxy.running_since, proxy.exited_at) == (T0 - 60, None)
    assert (trainer.running_since, trainer.exited_at, trainer.exit_code) == (None, T0 + 1, 137) and trainer.exit_failed
    # A terminated container's own state is its latest exit, not the one before it.
    agent["state"] = {"terminated": {"exitCode": LEFT_JOB, "reason": "Error", "finishedAt": rfc3339(T0 + 9)}}
    trainer = pod_info(obj).containers[1]
    assert (trainer.exited_at, trainer.exit_code, trainer.exit_failed) == (T0 + 9, LEFT_JOB, False)
    assert trainer.last_failed  # the restart before it stays a failure
    # Without the annotation, the first container of the spec runs the agent.
    del obj["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"]
    assert pod_info(obj).agent_container == "istio-proxy"
