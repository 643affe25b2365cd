"""The rendezvous decisions as pure functions: any moment built by hand, no etcd, no clock."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from datetime import timedelta

import pytest

from regroup.records import ExpectedMembership, JoinRecord, MemberRecord, ReformRequest, RoundState, agent_id
from regroup.rendezvous.decisions import (
    Bounds,
    JobView,
    Me,
    count_spares,
    count_waiting,
    plan_close,
    plan_join,
    round_abandoned,
    round_order,
)
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
    # The round closed before the controller's reform request of the same generation came:
    # that request is answered by this round, not a new re-form once it arrives.
    assert closed.state.reform_generation == 3
    after = view(["a", "c"], state=closed.state, reform=ReformRequest(3, "reclaim"))
    assert count_waiting(after, closed.state.round, 4) == (0, "")
    assert count_waiting(view(["a", "c"], state=closed.state, reform=ReformRequest(4, "grow")), closed.state.round, 4)[0]


def test_expected_membership_does_not_wait_for_a_member_warming_up() -> None:
    """The controller named c to join; c's workers then failed and restart (its record says
    it is warming up): the round forms with the others at once, without telling c to go, and
    c joins a later one once warm. A named member that is neither joined nor warming is
    waited for, and so is a warming one the round cannot do without (the minimum)."""
    expected = ExpectedMembership(generation=5, nodes=["a", "b", "c"], reason="grow")
    state = formed(["a", "b", "c"])
    warming = dataclasses.replace(member("c"), warming_since=9.0)
    v = dataclasses.replace(view(["a", "b"], [join("a", 2), join("b", 2)], state=state, expected=expected),
                            members={"a": member("a"), "b": member("b"), "c": warming})  # fmt: skip
    closed = plan_close(v, now=10.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound), closed
    assert closed.state.nodes == ["a", "b"] and closed.state.excluded == []
    assert closed.state.expected_generation == 5 and "without c (warming up)" in closed.state.reason
    not_warming = view(["a", "b", "c"], [join("a", 2), join("b", 2)], state=state, expected=expected)
    assert plan_close(not_warming, now=10.0, bounds=BOUNDS) == Wait("expected membership g5: waiting for c")
    two = ExpectedMembership(generation=5, nodes=["a", "c"], reason="grow")
    short = dataclasses.replace(v, expected=two, joins={"a": join("a", 2)})
    assert isinstance(plan_close(short, now=10.0, bounds=BOUNDS), Wait)
    # c stepped out after it was named: its join record (asking not to be counted) is there,
    # its workers restart. The round forms without it rather than with it, where the others
    # would wait for c's new workers to start before their ranks are assigned.
    stepped_out = dataclasses.replace(v, joins={"a": join("a", 2), "b": join("b", 2), "c": join("c", 2)})
    closed = plan_close(stepped_out, now=10.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == ["a", "b"], closed


def test_expected_membership_leaves_a_waiting_spare_waiting_rather_than_sending_it_away() -> None:
    """The controller's round [a, b] leaves out c, a member of the last round (told to go),
    and d, a node that never had a place (a spare of a job at its max): d is not excluded, and
    asks for the round after, its workers untouched."""
    expected = ExpectedMembership(generation=4, nodes=["a", "b"], reason="c leaves")
    state = formed(["a", "b", "c"])
    v = view(["a", "b", "c", "d"], [join("a", 2), join("b", 2), join("c", 2), join("d", 2)], state=state,
             expected=expected)
    closed = plan_close(v, now=10.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == ["a", "b"]
    assert closed.state.excluded == [aid("c")]
    after = view(["a", "b", "c", "d"], [join("d", 2)], state=closed.state, expected=expected)
    assert isinstance(plan_join(after, me("c"), 2, 11.0, BOUNDS), Excluded)
    assert plan_join(after, me("d"), 2, 11.0, BOUNDS) == PutJoin(3, "join")


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


def test_no_last_call_for_members_that_cannot_join_now() -> None:
    # Round 1 was a, b, c; d, left out of it, is reclaimed (excluded, its agent still
    # registered). c's workers failed and restart: it stepped out (warming, its join on
    # probation). a and b rejoin: nobody else can come soon, so the round closes now instead
    # of after a last call.
    state = formed(["a", "b", "c"])
    excluded = {"d": "taint aws-node-termination-handler/spot-itn (AWS node-termination-handler)"}
    members = {"a": member("a"), "b": member("b"), "c": dataclasses.replace(member("c"), warming_since=9.0),
               "d": member("d")}  # fmt: skip
    stepped_out = dataclasses.replace(join("c", 2, at=9.0), not_before=3600.0)
    v = dataclasses.replace(view(["a", "b"], [join("a", 2), join("b", 2), stepped_out], state=state,
                                 excluded=excluded), members=members)  # fmt: skip
    closed = plan_close(v, now=10.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == ["a", "b"], closed
    assert closed.state.reason == "every live member rejoined"
    # A member that is neither kept out nor warming may still come: the last call waits for it.
    waiting = plan_close(dataclasses.replace(v, excluded={}), now=10.0, bounds=BOUNDS)
    assert isinstance(waiting, Wait) and "last call" in waiting.reason, waiting


def test_a_round_the_controller_re_formed_without_one_of_its_nodes_is_abandoned() -> None:
    # Round 4 closed under expected membership g6 with a, b and c; c's node died while the
    # agents assigned ranks, and the controller, seeing c's pod deleted, re-formed without it
    # (g7). a and b stop waiting for c at once instead of until c's lease runs out.
    state = formed(["a", "b", "c"], round=4, expected_generation=6)
    alive = ["a", "b", "c"]  # c's lease still runs
    g7 = ExpectedMembership(7, ["a", "b"], "lost c")
    assert round_abandoned(view(alive, state=state, expected=g7), 4) == ""  # expected alone: no re-form yet
    reformed = view(alive, state=state, expected=g7, reform=ReformRequest(7, "node-lost"))
    assert "the controller's re-form g7 leaves out c of round 4" in round_abandoned(reformed, 4)
    # The membership the round itself consumed does not abandon it, nor one that keeps every node.
    same = view(alive, state=state, expected=ExpectedMembership(6, ["a", "b"]), reform=ReformRequest(6, "grow"))
    assert round_abandoned(same, 4) == ""
    grown = view(alive, state=state, expected=ExpectedMembership(7, ["a", "b", "c", "d"]), reform=ReformRequest(7, "grow"))
    assert round_abandoned(grown, 4) == ""
    # One the next round could not take either (below min) abandons nothing: rounds would be
    # given up one after the other, none consuming it.
    below = view(alive, state=state, expected=ExpectedMembership(7, ["a"]), reform=ReformRequest(7, "node-lost"))
    assert round_abandoned(below, 4) == ""


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


# -- positions and spares --------------------------------------------------------------------


def rejoin(state: RoundState, alive: list[str], waiting: Sequence[str] = (), **extra: object) -> JobView:
    """The view once every live member of ``state`` asked for the next round, with the agents
    ``waiting`` (spares, newcomers) in join order, ahead of the members."""
    nxt = state.round + 1
    joins = [join(n, nxt, at=1.0 + i) for i, n in enumerate(waiting)]
    joins += [join(n, nxt, at=50.0) for n in state.nodes if n in alive]
    return view([*alive, *waiting], joins, state=state, **extra)


@pytest.mark.parametrize(
    ("before", "lost", "waiting", "after"),
    [
        ("abcd", "c", "e", "abed"),  # the spare takes the lost node's position
        ("abcd", "a", "e", "ebcd"),  # rank 0's too
        ("abcd", "c", "", "abd"),  # none waiting: the position is dropped, the others move up
        ("abcd", "ac", "fe", "fbed"),  # vacant positions in rank order, spares in join order
        ("abc", "b", "ef", "aecf"),  # below max: vacancies first, then the rest appended
        ("abd", "", "e", "abde"),  # a grow appends
    ],
)
def test_a_new_round_keeps_every_survivors_position_and_fills_the_vacant_ones_in_join_order(
    before: str, lost: str, waiting: str, after: str
) -> None:
    state = formed(list(before))
    v = rejoin(state, [n for n in before if n not in lost], list(waiting))
    closed = plan_close(v, now=60.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound), closed
    assert "".join(closed.state.nodes) == after


def test_with_several_workers_per_node_a_replacement_gets_exactly_the_lost_nodes_ranks() -> None:
    """``--nproc-per-node=k`` is only a matter of positions: a round's position is its agent's
    group rank, and torch's ``_assign_worker_ranks`` gives each agent the k global ranks
    after those of the agents before it (its workers' mesh coordinates follow from those
    ranks). So keeping the survivors' positions keeps their ranks, and the node in a lost
    node's position gets exactly that node's ranks; nothing else is needed of the rendezvous."""
    k = 4

    def ranks(nodes: list[str]) -> dict[str, list[int]]:
        return {node: list(range(position * k, position * k + k)) for position, node in enumerate(nodes)}

    before = ranks(list("abcd"))
    closed = plan_close(rejoin(formed(list("abcd")), list("abd"), ["e"]), now=60.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound)
    after = ranks(closed.state.nodes)
    assert after["e"] == before["c"] == [8, 9, 10, 11]
    assert all(after[n] == before[n] for n in "abd")


def test_a_spare_is_not_a_reason_to_re_form_with_or_without_a_controller() -> None:
    state = formed(list("abcd"))
    for controller in (False, True):
        v = view(list("abcde"), [join("e", 2)], state=state, controller=controller)
        assert count_waiting(v, 1, max_nodes=4) == (0, ""), f"controller={controller}"


def test_a_loss_with_a_spare_waiting_closes_at_once_with_the_spare_in_the_lost_position() -> None:
    state = formed(list("abcd"))
    spare = join("e", 2, at=1.0)
    for controller in (False, True):
        lost = view(list("abde"), [spare], state=state, controller=controller)
        assert count_waiting(lost, 1, max_nodes=4) == (1, "member(s) lost: c")
    v = rejoin(state, list("abd"), ["e"])
    closed = plan_close(v, now=50.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.reason == "max 4 nodes joined"
    assert closed.state.nodes == list("abed")
    # The round is closed by its rank 0; the spare learns its rank, the lost node's.
    assert plan_join(v, me("b"), 2, 50.0, BOUNDS) == Wait("round 2 ready; a closes it", until=55.0)
    after = view(list("abde"), v.joins.values(), state=closed.state)  # type: ignore[arg-type]
    assert plan_join(after, me("e"), 2, 50.0, BOUNDS) == Done(2, 2, 4)


def test_a_spare_in_a_lost_rank_0s_position_closes_the_round_itself() -> None:
    v = rejoin(formed(list("abcd")), list("bcd"), ["e"])
    assert plan_join(v, me("b"), 2, 50.0, BOUNDS) == Wait("round 2 ready; e closes it", until=55.0)
    closed = plan_join(v, me("e"), 2, 50.0, BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == list("ebcd")
    # Should it not close (stuck), the others do, after the grace, in the same order.
    backup = plan_join(v, me("b"), 2, 55.0, BOUNDS)
    assert isinstance(backup, CloseRound) and backup.state.nodes == list("ebcd")


def test_spares_wait_for_every_running_member_rather_than_take_its_position() -> None:
    # c is lost; a and b rejoined first, d is still stopping its workers: two spares and the
    # two rejoined members make four, but d keeps its position.
    state = formed(list("abcd"))
    v = view(list("abdef"), [join("e", 2, at=1.0), join("f", 2, at=2.0), join("a", 2), join("b", 2)], state=state)
    assert plan_close(v, now=50.0, bounds=BOUNDS) == Wait("waiting for running members to rejoin: d")
    closed = plan_close(rejoin(state, list("abd"), ["e", "f"]), now=50.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == list("abed")


def test_an_excluded_or_benched_members_position_goes_to_a_spare() -> None:
    state = formed(list("abcd"))
    # c's node is leaving (control/excluded): its agent is alive but does not come back.
    excluded = rejoin(state, list("abcd"), ["e"], excluded={"c": "reclaim notice"})
    closed = plan_close(excluded, now=50.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == list("abed")
    # c's own workers failed: it is on probation, and the spare takes its position meanwhile.
    benched = rejoin(state, list("abd"), ["e"])
    benched = dataclasses.replace(benched, members={**benched.members, "c": member("c")},
                                  joins={**benched.joins, "c": dataclasses.replace(join("c", 2), not_before=100.0)})
    closed = plan_close(benched, now=50.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == list("abed")


def test_expected_membership_keeps_the_controllers_order() -> None:
    expected = ExpectedMembership(generation=2, nodes=["e", "a", "b", "d"], reason="replace c")
    v = rejoin(formed(list("abcd")), list("abd"), ["e"], expected=expected)
    closed = plan_close(v, now=50.0, bounds=BOUNDS)
    assert isinstance(closed, CloseRound) and closed.state.nodes == ["e", "a", "b", "d"]


def test_round_order_fills_a_big_jobs_vacant_positions_in_join_order() -> None:
    """Hundreds of agents: a round of 512 with every other member lost, 300 spares whose
    records come in no particular order."""
    previous = [f"n{i}" for i in range(512)]
    survivors = [join(n, 2) for n in previous[::2]]
    spares = [join(f"s{i}", 2, at=float(i)) for i in range(300)]
    order = round_order([aid(n) for n in previous], [*spares[::-1], *survivors])
    assert [j.node for j in order[:4]] == ["n0", "s0", "n2", "s1"]
    assert [j.node for j in order[510:514]] == ["n510", "s255", "s256", "s257"]
    assert len(order) == 556


def test_count_spares_counts_live_waiting_agents_outside_the_round_only() -> None:
    state = formed(list("abcd"), round=2, excluded=[aid("x")])
    joins = [
        join("e", 2),  # asked for the round that formed without it, not refreshed yet
        join("f", 3),  # asked again for the next
        join("a", 3),  # a member re-entering: not a spare
        join("g", 3),  # its agent is dead
        join("h", 3),  # its node is leaving
        dataclasses.replace(join("p", 3), not_before=100.0),  # on probation
        join("x", 3),  # left out of the round
        join("o", 1),  # a stale record of an older round
    ]
    v = view([*"abcdefhpxo"], joins, state=state, excluded={"h": "reclaim notice"})
    assert count_spares(v, now=50.0) == 2
    assert count_spares(v, now=100.0) == 3, "probation over"
    assert count_spares(view(["a"]), now=0.0) == 0, "no round formed"


def test_settings_read_spare_nodes_as_a_count() -> None:
    base = {"endpoint": "127.0.0.1:2379", "run_id": "job", "min_nodes": 1, "max_nodes": 2, "env": {}}
    assert parse_settings(conf={}, **base).spare_nodes == 0  # type: ignore[arg-type]
    assert parse_settings(conf={"spare_nodes": "2"}, **base).spare_nodes == 2  # type: ignore[arg-type]
    assert parse_settings(conf={"spare_nodes": "'1'"}, **base).spare_nodes == 1  # type: ignore[arg-type]
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(SettingsError, match="spare_nodes: expected a whole number >= 0"):
            parse_settings(conf={"spare_nodes": bad}, **base)  # type: ignore[arg-type]


def test_the_spare_that_waited_longest_takes_the_place_whenever_it_last_renewed_its_join() -> None:
    """Spares renew their join records after every round that forms without them, so the
    records' times say nothing of who came first: the agents' registrations do."""
    state = formed(["a", "b"], round=3)
    members = {"a": member("a"), "c": member("c", registered=5.0), "d": member("d", registered=9.0)}  # b is lost
    joins = [
        dataclasses.replace(join(node, 4, at=at), agent=agent_id(members[node]))
        for node, at in (("a", 50.0), ("c", 40.0), ("d", 30.0))
    ]
    v = JobView(state=state, state_revision=7, members=members, joins={j.node: j for j in joins})
    closed = plan_close(v, now=60.0, bounds=Bounds(1, 2, 1.0))
    assert isinstance(closed, CloseRound) and closed.state.nodes == ["a", "c"]
