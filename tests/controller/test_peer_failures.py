"""A survivor's collective that failed on a peer, naming its host, is the first evidence of a
lost node: the node the name points to is lost since that failure, well before its lease
expires, once the other live nodes had time to report theirs. An ambiguous name (agents
sharing a host), the reporter itself, or a node that reported a failure of its own is
never accused."""

from __future__ import annotations

import dataclasses

from regroup.controller.decide.health import PEER_FAILURE_SETTLE_S
from regroup.controller.settings import ControllerSettings
from regroup.controller.snapshot import WritePlan
from regroup.records import ReformPlan

from .builders import T0, Scene, decide, job, of, registered

S = ControllerSettings()
J = T0 - 600.25
FAILED_AT = T0 + 1.0


def running(hosts: dict[str, str] | None = None, pod_ips: dict[str, str] | None = None) -> Scene:
    """n1, n2, n3 training in round 1; each agent's address and pod IP as given."""
    s = registered(job(), J)
    hosts = hosts if hosts is not None else {"n1": "10.0.0.1", "n2": "10.0.0.2", "n3": "10.0.0.3"}
    s = s.with_members(dataclasses.replace(m, host=hosts.get(m.node, "")) for m in s.members.values())
    for node, ip in (pod_ips or {}).items():
        s = s.changed_pod(node, ip=ip)
    return s


def reported(
    s: Scene, node: str, peer: str, at: float = FAILED_AT, round_: int = 1, seen: float | None = None,
    silent: tuple[str, ...] = (),
) -> Scene:  # fmt: skip
    """``node``'s agent records that a collective of ``round_`` failed on ``peer`` at ``at``
    (and, with ``silent``, that those members' leases then went unrenewed)."""
    m = dataclasses.replace(s.members[node], peer_failure_round=round_, peer_failure_at=at, failed_peer=peer,
                            silent_peers=list(silent))  # fmt: skip
    return s.with_member(m, at=seen if seen is not None else at + 0.1)


def plan_of(d: object) -> ReformPlan | None:
    writes = of(d.actions, WritePlan)  # type: ignore[attr-defined]
    return writes[0].plan if writes else None


SETTLED = FAILED_AT + PEER_FAILURE_SETTLE_S + 0.01


def test_the_named_node_is_lost_from_the_failure_once_the_round_had_time_to_report() -> None:
    s = reported(running(), "n1", "10.0.0.2")
    early = decide(s, FAILED_AT + 0.2, S)
    assert plan_of(early) is None, "not before the other live nodes could report theirs"
    assert early.requeue_after is not None
    assert early.requeue_after.total_seconds() <= FAILED_AT + PEER_FAILURE_SETTLE_S - (FAILED_AT + 0.2) + 1e-6
    plan = plan_of(decide(s, SETTLED, S))
    assert plan is not None and plan.cause == "node-lost" and not plan.planned
    assert plan.nodes_after == ["n1", "n3"]
    assert plan.reason == "lost n2 (a collective of round 1 failed on it (seen by n1))"
    # The trace starts at the survivor's failure, not when the controller looked.
    assert plan.detected_at == FAILED_AT


def test_a_pod_ip_names_the_node_where_the_agent_address_is_a_name() -> None:
    hosts = {"n1": "llama-0.llama", "n2": "llama-1.llama", "n3": "llama-2.llama"}
    s = reported(running(hosts, pod_ips={"n1": "10.1.0.5", "n2": "10.1.0.6", "n3": "10.1.0.7"}), "n3", "10.1.0.6")
    plan = plan_of(decide(s, SETTLED, S))
    assert plan is not None and plan.nodes_after == ["n1", "n3"]


def test_a_node_that_reported_a_failure_of_its_own_is_alive_and_not_accused() -> None:
    # n1 left its broken world and closed its connections; n3 then saw its collective fail on n1.
    s = reported(reported(running(), "n1", "10.0.0.2"), "n3", "10.0.0.1", at=FAILED_AT + 0.05)
    plan = plan_of(decide(s, SETTLED + 0.05, S))
    assert plan is not None and plan.nodes_after == ["n1", "n3"], "n2 only: n1 reported, so it lives"


def test_an_ambiguous_or_missing_name_accuses_nobody() -> None:
    shared = {"n1": "127.0.0.1", "n2": "127.0.0.1", "n3": "127.0.0.1"}  # one machine: loopback
    for s in (
        reported(running(shared), "n1", "127.0.0.1"),
        reported(running(), "n1", ""),  # the backend named no peer
        reported(running(), "n1", "10.9.9.9"),  # nobody of the round there
        reported(running(), "n1", "10.0.0.1"),  # itself
    ):
        assert plan_of(decide(s, SETTLED + 5, S)) is None


def test_a_report_from_an_earlier_round_is_stale() -> None:
    s = reported(running(), "n1", "10.0.0.2", round_=0)
    assert plan_of(decide(s, SETTLED + 5, S)) is None


def test_a_member_whose_lease_went_unrenewed_is_lost_from_the_failure_where_no_address_names_it() -> None:
    shared = {"n1": "127.0.0.1", "n2": "127.0.0.1", "n3": "127.0.0.1"}  # one machine: no name by address
    s = reported(running(shared), "n1", "127.0.0.1", silent=("n2",), seen=FAILED_AT + 1.2)
    plan = plan_of(decide(s, FAILED_AT + 1.2, S))
    assert plan is not None and plan.cause == "node-lost" and plan.nodes_after == ["n1", "n3"]
    assert plan.reason == "lost n2 (its lease went unrenewed after a collective of round 1 failed (seen by n1))"
    assert plan.detected_at == FAILED_AT
    # gloo may name no peer at all: the probe alone is enough.
    plan = plan_of(decide(reported(running(), "n3", "", silent=("n2",)), SETTLED, S))
    assert plan is not None and plan.nodes_after == ["n1", "n3"]


def test_a_silent_name_never_accuses_the_reporter_a_reporter_or_a_node_outside_the_round() -> None:
    for s in (
        reported(running(), "n1", "", silent=("n1",)),  # itself
        reported(reported(running(), "n3", ""), "n1", "", silent=("n3",)),  # n3 reported: alive
        reported(running(), "n1", "", silent=("n9",)),  # not of the round
        reported(running(), "n1", "", silent=("n2",), round_=0),  # an earlier round's
    ):
        assert plan_of(decide(s, SETTLED + 5, S)) is None


def n2_named_dead() -> Scene:
    """n1's probe named n2 silent after round 1's collective failed; round 2 formed without
    n2. The survivors' records keep their report of round 1, and n2's record stands (round 1)."""
    shared = {"n1": "127.0.0.1", "n2": "127.0.0.1", "n3": "127.0.0.1"}
    s = reported(running(shared), "n1", "127.0.0.1", silent=("n2",))
    s = s.round_formed(2, ["n1", "n3"], at=T0 + 3)
    for n in ("n1", "n3"):
        s = s.with_member(dataclasses.replace(s.members[n], round=2), at=T0 + 3)
    return s


def test_the_record_of_an_agent_named_dead_is_no_joiner_a_new_agent_of_its_node_is() -> None:
    s = n2_named_dead()  # its record stands until its lease runs out
    assert s.members["n2"].round == 1
    d = decide(s, T0 + 60, S)  # any join window long closed
    assert plan_of(d) is None and "join" not in d.reason, d.reason
    # Its node's new agent registers afresh: a joiner, and the job grows back.
    s = s.with_member(dataclasses.replace(s.members["n2"], round=0, joined_at=T0 + 61), at=T0 + 61)
    plan = plan_of(decide(s, T0 + 120, S))
    assert plan is not None and plan.cause == "grow" and sorted(plan.nodes_after) == ["n1", "n2", "n3"]


def test_an_agent_named_dead_that_then_writes_its_record_is_alive_and_a_joiner_after_its_probation() -> None:
    # A survivor's probe read n2's lease between two renewals and named it; n2's agent was
    # alive (its own rank had crashed): it writes its record again, on probation, in the same
    # round. Once the probation is over it is a joiner, not a dead agent's record.
    s = n2_named_dead()
    probation_ends = FAILED_AT + 6
    s = s.with_member(dataclasses.replace(s.members["n2"], restart_count=1, not_before=probation_ends), at=FAILED_AT + 1)
    waiting = decide(s, probation_ends - 1, S)
    assert plan_of(waiting) is None and waiting.requeue_after is not None
    assert waiting.requeue_after.total_seconds() <= 1 + 1e-6, "woken when its probation ends"
    assert "gathering 1 joining" in decide(s, probation_ends + 0.1, S).reason
    plan = plan_of(decide(s, probation_ends + 60, S))  # its join window closed
    assert plan is not None and plan.cause == "grow" and sorted(plan.nodes_after) == ["n1", "n2", "n3"]
