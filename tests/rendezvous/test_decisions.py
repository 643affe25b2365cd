"""The rendezvous decisions as pure functions: any moment built by hand, no etcd, no clock."""

from __future__ import annotations

import dataclasses
import os

from datetime import timedelta

import pytest

from regroup.records import ExpectedMembership, JoinRecord, MemberRecord, ReformRequest, RoundState, agent_id
from regroup.rendezvous.decisions import Bounds, JobView, Me, count_waiting, plan_close, plan_join, round_abandoned
from regroup.rendezvous.join_steps import Closed, CloseRound, Conflict, Done, Excluded, PutJoin, Wait
from regroup.rendezvous.settings import SettingsError, parse_settings

BOUNDS = Bounds(min_nodes=2, max_nodes=4, last_call_s=1.0)


def member(node: str, registered: float = 1.0) -> MemberRecord:
    return MemberRecord(node=node, pod=node, namespace="default", round=0, local_world_size=1, joined_at=registered)


def aid(node: str) -> str:
    return agent_id(member(node))


def join(node: str, round: int, at: float = 10.0) -> JoinRecord:
    return JoinRecord(node=node, agent=aid(node), round=round, host="h", joined_at=at)


def formed(nodes: list[str], round: int = 1, **extra: object) -> RoundState:
    return RoundState(
        min_nodes=2,
        max_nodes=4,
        round=round,
        nodes=nodes,
        agents=[aid(n) for n in nodes],
        hosts=["h"] * len(nodes),
        **extra,
    )  # type: ignore[arg-type]


def view(alive: list[str], joins: list[JoinRecord] = (), state: RoundState | None = None, **extra: object) -> JobView:  # type: ignore[assignment]
    return JobView(
        state=state,
        state_revision=7 if state else 0,
        members={n: member(n) for n in alive},
        joins={j.node: j for j in joins},
        **extra,  # type: ignore[arg-type]
    )


def me(node: str) -> Me:
    return Me(node=node, agent=aid(node), host="h")


def test_first_round_waits_a_last_call_after_min_then_closes() -> None:
    v = view(["a", "b"], [join("a", 1, at=10.0), join("b", 1, at=10.5)])
    wait = plan_close(v, now=11.0, bounds=BOUNDS)
    assert isinstance(wait, Wait) and wait.until == pytest.approx(11.5)
    closed = plan_close(v, now=11.5, bounds=BOUNDS)
    assert isinstance(closed, CloseRound)
    assert closed.state.nodes == ["a", "b"] and closed.state.round == 1 and closed.expected_revision == 0


def test_below_min_waits_without_deadline_and_max_closes_at_once() -> None:
    assert plan_close(view(["a"], [join("a", 1)]), now=99, bounds=BOUNDS) == Wait("1/2 nodes joined")
    full = view(list("abcde"), [join(n, 1, at=i) for i, n in enumerate("abcde")])
    closed = plan_close(full, now=0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == list("abcd")


def test_a_re_form_closes_as_soon_as_every_live_member_rejoined() -> None:
    state = formed(["b", "a", "c"])
    v = view(["a", "b"], [join("a", 2), join("b", 2)], state=state)  # c is gone
    closed = plan_close(v, now=10.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound)
    assert closed.state.nodes == ["b", "a"], "previous members keep their relative rank"
    assert closed.expected_revision == 7


def test_a_re_form_waits_for_running_members_however_long() -> None:
    v = view(["a", "b", "c"], [join("a", 2), join("b", 2)], state=formed(["a", "b", "c"]))
    step = plan_close(v, now=1e9, bounds=BOUNDS)
    assert isinstance(step, Wait) and "c" in step.reason


def test_joiners_of_dead_agents_do_not_count() -> None:
    v = view(["a"], [join("a", 1), join("b", 1)])
    assert plan_close(v, now=99, bounds=BOUNDS) == Wait("1/2 nodes joined")


def test_expected_membership_closes_exactly_those_nodes_and_excludes_the_rest() -> None:
    expected = ExpectedMembership(generation=3, nodes=["c", "a"], reason="reclaim b")
    state = formed(["a", "b"])
    v = view(["a", "b", "c"], [join("a", 2), join("c", 2)], state=state, expected=expected)
    closed = plan_close(v, now=10.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound)
    assert closed.state.nodes == ["c", "a"]
    assert closed.state.expected_generation == 3
    assert closed.state.excluded == [aid("b")]
    missing = plan_close(view(["a", "c"], [join("a", 2)], state=state, expected=expected), now=10, bounds=BOUNDS)
    assert isinstance(missing, Wait) and "c" in missing.reason


def test_a_consumed_or_out_of_bounds_expected_membership_is_ignored() -> None:
    spent = ExpectedMembership(generation=3, nodes=["a", "b"])
    state = formed(["a", "b"], expected_generation=3)
    v = view(["a", "b", "c"], [join("a", 2), join("b", 2), join("c", 2)], state=state, expected=spent)
    step = plan_close(v, now=0, bounds=BOUNDS)
    assert isinstance(step, CloseRound) and step.state.nodes == ["a", "b", "c"]
    too_small = ExpectedMembership(generation=9, nodes=["a"])
    step = plan_close(view(["a"], [join("a", 1)], expected=too_small), now=0, bounds=BOUNDS)
    assert step == Wait("1/2 nodes joined")


def test_plan_join_steps_an_agent_through_join_close_and_done() -> None:
    assert plan_join(view(["a"]), me("a"), None, 0, BOUNDS) == PutJoin(1, "join")
    state = formed(["a", "b"])
    assert plan_join(view(["a", "b"], state=state), me("b"), 1, 0, BOUNDS) == Done(1, 1, 2)
    # A round formed without this agent: it asks for the next one.
    assert isinstance(plan_join(view(["a", "b", "c"], state=state), me("c"), 1, 0, BOUNDS), PutJoin)
    assert isinstance(plan_join(view(["b"], state=formed(["a"], excluded=[aid("b")])), me("b"), 2, 0, BOUNDS), Excluded)
    assert plan_join(view(["a"], state=formed(["a"], closed=True)), me("a"), None, 0, BOUNDS) == Closed()


def test_other_bounds_conflict_only_while_the_job_has_live_members() -> None:
    other = RoundState(min_nodes=1, max_nodes=8, round=4, nodes=["x"], agents=[aid("x")])
    step = plan_join(view(["x", "a"], state=other), me("a"), None, 0, BOUNDS)
    assert isinstance(step, Conflict) and "--nnodes=1:8" in step.reason and "--nnodes=2:4" in step.reason
    assert plan_join(view(["a"], state=other), me("a"), None, 0, BOUNDS) == PutJoin(5, "join")


def test_count_waiting_reports_joiners_only_without_a_controller() -> None:
    state = formed(["a", "b"])
    v = view(["a", "b", "c"], [join("c", 2)], state=state)
    assert count_waiting(v, 1, 4)[0] == 1
    assert count_waiting(view(["a", "b", "c"], [join("c", 2)], state=state, controller=True), 1, 4) == (0, "")
    assert count_waiting(v, 1, max_nodes=2) == (0, ""), "a full job does not re-form for joiners"


def test_count_waiting_reports_lost_members_reform_requests_and_newer_rounds() -> None:
    state = formed(["a", "b"], reform_generation=4)
    assert count_waiting(view(["a"], state=state, controller=True), 1, 4)[0] == 1
    old = ReformRequest(generation=4, cause="manual")
    assert count_waiting(view(["a", "b"], state=state, reform=old), 1, 4) == (0, "")
    new = ReformRequest(generation=5, cause="grow")
    assert count_waiting(view(["a", "b"], state=state, reform=new), 1, 4)[0] == 1
    assert count_waiting(view(["a", "b"], state=formed(["a", "b"], round=2)), 1, 4)[0] == 1


def test_settings_refuse_bad_options_naming_them() -> None:
    base = {"endpoint": "127.0.0.1:2379", "run_id": "job", "min_nodes": 1, "max_nodes": 2, "env": {}}
    with pytest.raises(SettingsError, match="lease-ttl"):
        parse_settings(conf={"lease-ttl": "3"}, **base)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="lease_ttl"):
        parse_settings(conf={"lease_ttl": "1"}, **base)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="join_timeout"):
        parse_settings(conf={"join_timeout": "soon"}, **base)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="cacert"):
        parse_settings(conf={"cacert": "/no/such/ca.pem"}, **base)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="password"):
        parse_settings(conf={"user": "u"}, **base)  # type: ignore[arg-type]
    settings = parse_settings(
        conf={"timeout": "90", "last_call_timeout": "0", "key_prefix": "/x"},
        **{**base, "env": {"POD_NAMESPACE": "team", "NODE_NAME": "n7"}},  # type: ignore[arg-type]
    )
    assert settings.timeouts.join == timedelta(seconds=90)
    assert settings.timeouts.last_call == timedelta(0)
    assert settings.job.member("n7") == "/x/team/job/members/n7"


# Every key torch 2.13's c10d, etcd and etcd-v2 backends read from --rdzv-conf, with a value.
TORCH_LAUNCH_KEYS = {
    "join_timeout": "30", "last_call_timeout": "2", "close_timeout": "9", "heartbeat": "4",
    "keep_alive_interval": "2", "keep_alive_max_attempt": "4", "read_timeout": "7", "is_host": "false",
    "store_type": "tcp", "use_libuv": "1", "protocol": "http", "etcd_prefix": "/torchelastic/p2p",
    "timeout": "900", "rank": "0",
}  # fmt: skip


def test_every_rdzv_conf_key_torchs_backends_accept_is_accepted_mapped_or_noted() -> None:
    base = {"endpoint": "127.0.0.1:2379", "run_id": "job", "min_nodes": 1, "max_nodes": 2, "env": {"NODE_NAME": "n1"}}
    settings = parse_settings(conf=TORCH_LAUNCH_KEYS, **base)  # type: ignore[arg-type]
    assert settings.timeouts.join == timedelta(seconds=30) and settings.timeouts.close == timedelta(seconds=9)
    assert settings.lease_ttl == timedelta(seconds=8), "keep_alive_interval x keep_alive_max_attempt"
    assert settings.etcd.request_timeout == timedelta(seconds=7) and not settings.etcd.tls
    assert settings.job.member("n1") == "/torchelastic/p2p/default/job/members/n1"
    noted = " ".join(settings.notes)
    assert all(f"{k}=" in noted for k in ("heartbeat", "is_host", "store_type", "use_libuv"))
    # etcd-v2's names, https without a CA bundle (the system's), quoted values as a launcher passes them.
    v2 = parse_settings(conf={"protocol": "https", "ttl": '"6"', "join_timeout": "'12'"}, **base)  # type: ignore[arg-type]
    assert v2.etcd.tls and v2.etcd.describe().startswith("https://") and v2.lease_ttl == timedelta(seconds=6)
    assert v2.timeouts.join == timedelta(seconds=12)
    # Bad values are named as torch names them; a key no backend knows is refused.
    with pytest.raises(SettingsError, match="is_host: expected a boolean"):
        parse_settings(conf={"is_host": "maybe"}, **base)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="protocol"):
        parse_settings(conf={"protocol": "grpc"}, **base)  # type: ignore[arg-type]
    with pytest.raises(SettingsError, match="unknown option.*lease-ttl"):
        parse_settings(conf={"lease-ttl": "3"}, **base)  # type: ignore[arg-type]
    # Agents sharing a host get distinct names when asked.
    named = parse_settings(conf={"node_name": "{hostname}-{pid}"}, **{**base, "env": {}})  # type: ignore[arg-type]
    assert named.identity.node.endswith(f"-{os.getpid()}")


def test_a_round_whose_agent_vanished_or_that_was_superseded_is_abandoned() -> None:
    state = formed(["a", "b", "c"], round=4)
    assert round_abandoned(view(["a", "b", "c"], state=state), 4) == ""
    # c's node was deleted right after the round closed: a and b must not wait for it.
    assert "gone: c" in round_abandoned(view(["a", "b"], state=state), 4)
    # A restarted agent on c is a different agent: the round's c is still gone.
    restarted = dataclasses.replace(view(["a", "b", "c"], state=state), members={
        "a": member("a"), "b": member("b"), "c": member("c", registered=99.0)})
    assert "gone: c" in round_abandoned(restarted, 4)
    assert "superseded by round 5" in round_abandoned(view(["a", "b"], state=formed(["a", "b"], round=5)), 4)


def test_an_excluded_node_waits_outside_and_its_join_does_not_count_with_or_without_a_controller() -> None:
    excluded = {"c": "taint aws-node-termination-handler/spot-itn (AWS node-termination-handler)"}
    state = formed(["a", "b"])
    # Its agent came back (the pod restarted on the still-tainted node): it writes no join.
    step = plan_join(view(["a", "b", "c"], state=state, excluded=excluded), me("c"), None, 0, BOUNDS)
    assert isinstance(step, Wait) and step.excluded and "spot-itn" in step.reason and step.until is None
    # A join it wrote before the exclusion arrived neither prompts a re-form (no controller
    # present) nor takes a place in the next round.
    v = view(["a", "b", "c"], [join("c", 2)], state=state, excluded=excluded)
    assert count_waiting(v, 1, 4) == (0, "")
    rejoin = view(["a", "b", "c"], [join("a", 2), join("b", 2), join("c", 2)], state=state, excluded=excluded)
    closed = plan_close(rejoin, now=20.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == ["a", "b"]
    # Lifted: the node joins again like any other.
    assert plan_join(view(["a", "b", "c"], state=state), me("c"), None, 0, BOUNDS) == PutJoin(2, "join")


def test_a_round_whose_agent_stepped_out_to_a_later_round_is_abandoned() -> None:
    # c closed round 4 with a and b, then its workers failed and it stepped out for round 5:
    # a and b, still assigning ranks in round 4, must not wait for c's ranks there.
    state = formed(["a", "b", "c"], round=4)
    assert round_abandoned(view(["a", "b", "c"], [join("c", 4)], state=state), 4) == ""
    assert "moved on to a later round: c" in round_abandoned(view(["a", "b", "c"], [join("c", 5)], state=state), 4)


def test_a_stepped_out_agent_takes_its_place_in_a_round_that_counted_it() -> None:
    # c stepped out with a join for round 2; the round closed with it (the controller's
    # expected membership counts every live member): c completes round 2, it does not ask for 3.
    state = formed(["a", "b", "c"], round=2)
    v = view(["a", "b", "c"], [join("c", 2)], state=state)
    assert plan_join(v, me("c"), None, 0, BOUNDS, seat=2) == Done(2, 2, 3)
    # Without the seat (a plain restart after the round it completed), it asks for the next.
    assert plan_join(v, me("c"), None, 0, BOUNDS) == PutJoin(3, "join")
    # A round that formed without it, or an older seat, gives no place.
    assert plan_join(view(["a", "b", "c"], state=formed(["a", "b"], round=2)), me("c"), None, 0, BOUNDS,
                     seat=2) == PutJoin(3, "join")
    assert plan_join(v, me("c"), None, 0, BOUNDS, seat=1) == PutJoin(3, "join")
