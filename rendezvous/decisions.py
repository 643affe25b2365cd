"""Rendezvous decisions as pure functions of the job's etcd view and ``now``.

``plan_join`` says what a joining agent does next (write its join record, close the
round, wait, or finish); ``count_waiting`` is what ``num_nodes_waiting()`` reports to
torchrun's monitor loop; ``count_spares`` how many agents wait outside a formed round.
None does I/O: the handler applies their answers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from regroup.records import (
    ExpectedMembership,
    FinishedJob,
    JoinRecord,
    MemberRecord,
    ReformRequest,
    RoundState,
    agent_id,
)
from regroup.rendezvous.join_steps import Closed, CloseRound, Conflict, Done, Excluded, JoinStep, PutJoin, Wait

CLOSE_GRACE_S = 5.0
"""How long the other agents give the new round's live rank 0 to close it before trying themselves."""


@dataclass(frozen=True)
class JobView:
    """What the agent knows of the job's keys at one etcd revision."""

    revision: int = 0
    state: RoundState | None = None
    state_revision: int = 0
    """mod_revision of ``rdzv/state`` (0: absent): the compare-and-set token."""
    members: Mapping[str, MemberRecord] = field(default_factory=dict)
    """Live agents by node (their keys vanish with their lease)."""
    joins: Mapping[str, JoinRecord] = field(default_factory=dict)
    expected: ExpectedMembership | None = None
    reform: ReformRequest | None = None
    controller: bool = False
    """A controller is present (``control/controller`` exists)."""
    excluded: Mapping[str, str] = field(default_factory=dict)
    """``control/excluded``: node -> why it may not join the job (reclaim notice, cordon)."""
    finished: FinishedJob | None = None
    """The job's tombstone: it finished and the controller removed its keys. The job is as
    closed as with a closed ``state``, which went with them."""

    @property
    def closed(self) -> bool:
        """The run is over: its round state says closed, or its tombstone is there."""
        return self.finished is not None or (self.state is not None and self.state.closed)

    @cached_property
    def _alive(self) -> dict[str, str]:
        return {agent_id(m): node for node, m in self.members.items()}

    def alive(self) -> dict[str, str]:
        """Live agent id -> node."""
        return self._alive

    @cached_property
    def memo(self) -> dict[object, object]:
        """Decisions derived from this view alone, computed once for all agents reading it."""
        return {}

    @cached_property
    def _ranks(self) -> dict[str, int]:
        ranks: dict[str, int] = {}
        for rank, agent in enumerate(self.state.agents if self.state else ()):
            ranks.setdefault(agent, rank)
        return ranks

    def rank_of(self, agent: str) -> int | None:
        """``agent``'s rank in the last formed round (None: not in it), found in a map
        built once per view rather than a search of the round's agents per caller."""
        return self._ranks.get(agent)

    @cached_property
    def on_probation(self) -> list[tuple[float, str]]:
        """(not_before, agent) of the join records that ask not to be counted before a time."""
        return [(j.not_before, j.agent) for j in self.joins.values() if j.not_before > 0]

    @cached_property
    def next_joiners(self) -> list[JoinRecord]:
        """Live agents asking for the next round, in rank order (computed once per view:
        every agent sharing this view decides from it), those on probation included."""
        return _joiners(self, (self.state.round if self.state else 0) + 1)

    @cached_property
    def last_joined_at(self) -> float:
        """When the latest of ``next_joiners`` joined."""
        return max((j.joined_at for j in self.next_joiners), default=0.0)

    @cached_property
    def next_joined(self) -> frozenset[str]:
        return frozenset(j.node for j in self.next_joiners)


@dataclass(frozen=True)
class Me:
    """The agent asking."""

    node: str
    agent: str
    host: str


@dataclass(frozen=True)
class Bounds:
    min_nodes: int
    max_nodes: int
    last_call_s: float


def round_abandoned(view: JobView, round: int) -> str:
    """Why round ``round`` can no longer start ("" while it still can): a newer round
    formed, or an agent of the round is gone (its member key vanished with its lease),
    e.g. the node was deleted right after the round closed. Its peers must not wait for
    that agent's ``MASTER_PORT`` until the store timeout. Computed once per view: every
    agent waiting on the round's store asks at every change of the job's keys."""
    key = ("abandoned", round)
    why = view.memo.get(key)
    if why is None:
        why = view.memo[key] = _abandoned(view, round)
    return why  # type: ignore[return-value]


def _abandoned(view: JobView, round: int) -> str:
    state = view.state
    if state is None or state.round != round:
        return f"round {round} superseded by round {state.round if state else 0}"
    alive = view.alive()
    gone = [node for node, agent in zip(state.nodes, state.agents) if agent not in alive]
    if gone:
        return f"agents of round {round} gone: {_names(gone)}"
    # An agent that asks for a later round will not take part in this one: it stepped out
    # (its workers are being restarted) after the round closed with it.
    moved_on = [
        node for node, agent in zip(state.nodes, state.agents)
        if (j := view.joins.get(node)) is not None and j.agent == agent and j.round > round
    ]
    if moved_on:
        return f"agents of round {round} moved on to a later round: {_names(moved_on)}"
    # The controller re-formed the job after the round closed and left a node of it out (it
    # found the node lost): that node's agent will not come, whatever its lease still says.
    # Only a membership the next round can take (within the bounds), or rounds would be
    # given up one after the other without ever consuming it.
    expected = usable_expected(view, Bounds(state.min_nodes, state.max_nodes, 0.0))
    if expected is not None and view.reform is not None and view.reform.generation >= expected.generation:
        dropped = [node for node in state.nodes if node not in expected.nodes]
        if dropped:
            return f"the controller's re-form g{expected.generation} leaves out {_names(dropped)} of round {round}"
    return ""


def plan_join(
    view: JobView, me: Me, joined_for: int | None, now: float, bounds: Bounds, seat: int | None = None
) -> JoinStep:
    """Next step of an agent inside ``next_rendezvous``.

    ``joined_for`` is the round this agent's join record asks for (None before it wrote one).
    ``seat``: the round the join record it left when stepping out asked for; if that round
    closed with this agent in it, the agent takes its place (its peers wait for it there).
    """
    if view.finished is not None:
        return Closed()  # before anything is written: the job's keys were removed for good
    state = view.state
    current = state.round if state else 0
    if state is not None:
        if state.closed:
            return Closed()
        if (state.min_nodes, state.max_nodes) != (bounds.min_nodes, bounds.max_nodes):
            others = [node for node in view.members if node != me.node]
            if others:
                return Conflict(
                    f"the job runs with --nnodes={state.min_nodes}:{state.max_nodes} "
                    f"(members {_names(sorted(others))}) but this agent has "
                    f"--nnodes={bounds.min_nodes}:{bounds.max_nodes}"
                )
        if me.agent in state.excluded:
            return Excluded(f"left out of round {current}: {state.reason}")
        if seat is not None and current == seat and me.node not in view.excluded:
            rank = view.rank_of(me.agent)
            if rank is not None:
                return Done(current, rank, len(state.agents))
        if joined_for is not None and current >= joined_for:
            rank = view.rank_of(me.agent)
            if rank is not None and current == joined_for:
                return Done(current, rank, len(state.agents))
            joined_for = None  # a round formed without this agent: ask for the next one
    why = view.excluded.get(me.node)
    if why is not None:
        # Checked before joining: a node that is leaving must not be let back in, whoever
        # (if anyone) leads; its join record, if it wrote one before, no longer counts.
        return Wait(f"node {me.node} is excluded from the job: {why}", excluded=True)
    mine = view.joins.get(me.node)
    if joined_for is None or mine is None or mine.agent != me.agent or mine.round != current + 1:
        return PutJoin(current + 1, "join" if joined_for is None else "refresh join record")
    ready = _readiness(view, bounds, benched(view, now))
    closing = (
        ready.members
        if ready.members is not None
        else (ready.joiners if ready.until is not None and now >= ready.until else None)
    )
    if closing and closing[0].agent != me.agent and closing[0].agent in view.alive():
        # The new round's rank 0 closes it (a newcomer, when it fills a lost rank 0's
        # position: it is live and joined, so it is in its own join loop); the others step
        # in only if it is gone or stuck.
        backup = view.last_joined_at + CLOSE_GRACE_S
        if now < backup:
            return Wait(f"round {current + 1} ready; {closing[0].node} closes it", until=backup)
    return plan_close(view, now, bounds)


def benched(view: JobView, now: float) -> frozenset[str]:
    """Agents asking for the next round that are still on probation at ``now``."""
    return frozenset(agent for not_before, agent in view.on_probation if not_before > now)


def _joiners(view: JobView, target: int, bench: frozenset[str] = frozenset()) -> list[JoinRecord]:
    """Live agents asking for round ``target``, not excluded and not in ``bench``, in rank
    order (``round_order``)."""
    alive, excluded = view.alive(), view.excluded
    joins = [
        j for j in view.joins.values()
        if j.round == target and alive.get(j.agent) == j.node and j.node not in excluded and j.agent not in bench
    ]
    return round_order(view.state.agents if view.state else (), joins, view.members)


def round_order(
    previous: Sequence[str], joins: list[JoinRecord], members: Mapping[str, MemberRecord] | None = None
) -> list[JoinRecord]:
    """The next round's members in rank order: each member of the previous round (agents
    ``previous``, in rank order) that joins keeps its position; the positions of those that
    do not (lost, left out, excluded, on probation) go to the newcomers in join order; the
    remaining newcomers follow, and positions still vacant are dropped (the members after
    them move up, keeping their relative order). Newcomers go by how long their agents have
    waited (their registration in ``members``): a spare renews its join record after every
    round that forms without it, so the record's own time says only when it last did.

    A node that takes a leaving node's position takes its ranks: an agent's rank in the
    round is its group rank, and torch's ``_assign_worker_ranks`` gives each agent the
    global ranks that follow those of the agents before it. So a replacement with the same
    ``--nproc-per-node`` gets exactly the leaving node's ranks (and mesh coordinates), and
    the survivors keep theirs. O(n log n): it runs on every change of a big job's view."""
    position: dict[str, int] = {}
    for index, agent in enumerate(previous):
        position.setdefault(agent, index)
    held_by: list[JoinRecord | None] = [None] * len(previous)
    newcomers: list[JoinRecord] = []
    for j in joins:
        index = position.get(j.agent)
        if index is None:
            newcomers.append(j)
        else:
            held_by[index] = j
    registered = members or {}

    def waited(j: JoinRecord) -> tuple[float, float, str]:
        member = registered.get(j.node)
        return (member.joined_at if member is not None else j.joined_at, j.joined_at, j.node)

    newcomers.sort(key=waited)
    arrivals = iter(newcomers)
    order: list[JoinRecord] = []
    for held in held_by:
        member = held if held is not None else next(arrivals, None)
        if member is not None:
            order.append(member)
    order.extend(arrivals)
    return order


def _round(
    view: JobView, members: list[JoinRecord], now: float, bounds: Bounds, reason: str, **extra: object
) -> CloseRound:
    state = view.state
    reform = view.reform.generation if view.reform else 0
    base: dict[str, object] = {
        "min_nodes": bounds.min_nodes,
        "max_nodes": bounds.max_nodes,
        "round": (state.round if state else 0) + 1,
        "nodes": [j.node for j in members],
        "agents": [j.agent for j in members],
        "hosts": [j.host for j in members],
        "reform_generation": max(reform, state.reform_generation if state else 0),
        "expected_generation": state.expected_generation if state else 0,
        "excluded": [],
        "formed_at": now,
        "reason": reason,
    }
    base.update(extra)
    # The controller writes a re-form's expected membership and its reform request under one
    # generation, the first before the second: a round that consumed the membership answers
    # the request too, even when it closed before the request arrived (else its agents would
    # take that request for a new re-form and form the same round again).
    base["reform_generation"] = max(base["reform_generation"], base["expected_generation"])  # type: ignore[call-overload]
    return CloseRound(RoundState(**base), view.state_revision)  # type: ignore[arg-type]


def usable_expected(view: JobView, bounds: Bounds) -> ExpectedMembership | None:
    """The controller's expected membership, if it is new and fits the bounds."""
    expected = view.expected
    if expected is None:
        return None
    if view.state is not None and expected.generation <= view.state.expected_generation:
        return None
    nodes = expected.nodes
    if len(set(nodes)) != len(nodes) or not bounds.min_nodes <= len(nodes) <= bounds.max_nodes:
        return None
    return expected


@dataclass(frozen=True)
class _Readiness:
    """Whether the next round can close, from the view alone (shared by all its readers)."""

    members: list[JoinRecord] | None
    """The round's members, in rank order, when it can close now; else None."""
    reason: str
    until: float | None = None
    """When waiting for a last call: the moment it ends (then the round is ``joiners``)."""
    extra: dict[str, object] = field(default_factory=dict)
    joiners: list[JoinRecord] = field(default_factory=list)
    """The agents counted for the round (those on probation left out), in rank order."""


def _readiness(view: JobView, bounds: Bounds, bench: frozenset[str] = frozenset()) -> _Readiness:
    key = (bounds, bench)
    memo = view.memo.get(key)
    if memo is None:
        memo = view.memo[key] = _assess(view, bounds, bench)
    return memo  # type: ignore[return-value]


def _assess(view: JobView, bounds: Bounds, bench: frozenset[str] = frozenset()) -> _Readiness:
    state = view.state
    joiners = view.next_joiners
    joined = view.next_joined
    expected = usable_expected(view, bounds)
    if expected is not None:
        # The controller's order is kept as given (it orders the nodes as ``round_order`` does).
        missing = [n for n in expected.nodes if n not in joined]
        # A member named that is warming up (its workers restarting since it was named) is
        # not waited for: the others form without it, and it joins a later round once warm.
        # So is one that stepped out after it was named (its workers failed; its join record
        # asks not to be counted): the round would otherwise close with it and wait there
        # for its new workers to start.
        warming = {n for n in expected.nodes if (m := view.members.get(n)) is not None and m.warming_since > 0}
        nodes = [n for n in expected.nodes if n not in warming]
        still = [n for n in missing if n not in warming]
        if still or len(nodes) < bounds.min_nodes:
            waiting = still or missing or sorted(warming)
            return _Readiness(None, f"expected membership g{expected.generation}: waiting for {_names(waiting)}")
        by_node = {j.node: j for j in joiners}
        wanted = set(expected.nodes)
        # Members of the last round that the controller leaves out are told to go. A waiting
        # node it does not take (a spare: the job is at its max) is not: it keeps waiting
        # for a later round, its workers warm, instead of being sent away and restarted.
        previous = frozenset(state.agents) if state is not None else frozenset()
        left_out = [j.agent for j in joiners if j.node not in wanted and j.agent in previous]
        if state is not None:
            left_out += [a for a, n in zip(state.agents, state.nodes) if n not in wanted and a in view.alive()]
        reason = f"expected membership g{expected.generation}" + (f" ({expected.reason})" if expected.reason else "")
        if warming:
            reason += f", without {_names(sorted(warming))} (warming up)"
        extra = {"expected_generation": expected.generation, "excluded": sorted(set(left_out))}
        return _Readiness([by_node[n] for n in nodes], reason, extra=extra)
    if bench:
        # Nodes on probation neither count as joined nor hold the round up, nor keep their
        # position: a newcomer may take it.
        benched_nodes = {j.node for j in joiners if j.agent in bench}
        joiners = _joiners(view, (state.round if state else 0) + 1, bench)
        joined = frozenset(j.node for j in joiners) | benched_nodes
    alive = view.alive()
    previous = set(state.agents) if state else set()
    running = sorted(alive[a] for a in previous if a in alive and alive[a] not in joined)
    if len(joiners) >= bounds.max_nodes and not [n for n in running if n not in view.excluded]:
        # At max at once, unless a member still running would lose its position to a
        # newcomer: waiting nodes fill the positions of those that left, never a survivor's.
        return _Readiness(joiners[: bounds.max_nodes], f"max {bounds.max_nodes} nodes joined", joiners=joiners)
    if len(joiners) < bounds.min_nodes:
        return _Readiness(None, f"{len(joiners)}/{bounds.min_nodes} nodes joined", joiners=joiners)
    if running:
        return _Readiness(None, f"waiting for running members to rejoin: {_names(running)}", joiners=joiners)
    # Members that may still join: not those kept out of the job (a reclaimed node, leaving)
    # nor those whose workers are starting up (warming: they ask to join once up, and a
    # last call would only hold the others for them).
    registering = [
        n for n, m in view.members.items() if n not in joined and n not in view.excluded and not m.warming_since
    ]
    if not registering and any(j.agent in previous for j in joiners):
        return _Readiness(joiners, "every live member rejoined", joiners=joiners)
    deadline = sorted(j.joined_at for j in joiners)[bounds.min_nodes - 1] + bounds.last_call_s
    return _Readiness(None, f"last call for more nodes ({len(joiners)} joined)", until=deadline, joiners=joiners)


def plan_close(view: JobView, now: float, bounds: Bounds) -> CloseRound | Wait:
    """Close the next round now, or wait (and until when)."""
    bench = benched(view, now)
    ready = _readiness(view, bounds, bench)
    if ready.members is not None:
        return _round(view, ready.members, now, bounds, ready.reason, **ready.extra)
    if ready.until is not None and now >= ready.until:
        return _round(view, ready.joiners, now, bounds, f"last call after {bounds.last_call_s}s")
    until = ready.until
    if bench:
        ends = min(j.not_before for j in view.joins.values() if j.agent in bench)
        until = ends if until is None else min(until, ends)
    return Wait(ready.reason, until=until)


def count_waiting(view: JobView, my_round: int, max_nodes: int, now: float = 0.0) -> tuple[int, str]:
    """What ``num_nodes_waiting()`` reports for an agent running round ``my_round``, and why.

    Non-zero makes torchrun stop the workers and call ``next_rendezvous`` again.
    """
    state = view.state
    if state is None or state.closed or my_round == 0:
        return 0, ""
    if state.round != my_round:
        return 1, f"round {state.round} formed after this agent's round {my_round}"
    if view.reform is not None and view.reform.generation > state.reform_generation:
        return 1, f"re-form requested (g{view.reform.generation}, {view.reform.cause})"
    alive = view.alive()
    lost = [n for a, n in zip(state.agents, state.nodes) if a not in alive]
    if lost:
        return len(lost), f"member(s) lost: {_names(lost)}"
    # A member that re-entered the rendezvous (its workers failed and its agent restarts
    # them) no longer runs this round's ranks: re-form now rather than wait for the
    # survivors' collectives to fail.
    rejoining = [
        n for a, n in zip(state.agents, state.nodes)
        if (j := view.joins.get(n)) is not None and j.agent == a and j.round == my_round + 1
    ]
    if rejoining:
        return len(rejoining), f"member(s) re-entering the rendezvous: {_names(rejoining)}"
    if not view.controller and len(state.agents) < max_nodes:
        current = set(state.agents)
        waiting = [
            j.node
            for j in view.joins.values()
            if j.round == my_round + 1 and j.agent not in current and alive.get(j.agent) == j.node
            and j.not_before <= now and j.node not in view.excluded
        ]
        if waiting:
            return len(waiting), f"node(s) waiting to join: {_names(sorted(waiting))}"
    return 0, ""


def count_spares(view: JobView, now: float) -> int:
    """The job's spares around its last formed round: live agents whose join record asks for
    that round or a later one, that are not in it, not excluded (their node in
    ``control/excluded``, or left out of the round) and not on probation at ``now``. They
    are what answers the next loss without shrinking the job: a waiting agent takes the lost
    node's position. One pass over the view's join records."""
    state = view.state
    if state is None or state.closed:
        return 0
    alive, excluded, left_out = view.alive(), view.excluded, frozenset(state.excluded)
    return sum(
        1
        for j in view.joins.values()
        if j.round >= state.round and alive.get(j.agent) == j.node and view.rank_of(j.agent) is None
        and j.node not in excluded and j.agent not in left_out and j.not_before <= now
    )


def _names(nodes: list[str], shown: int = 5) -> str:
    """A list of node names for a reason string, cut short for large jobs."""
    if len(nodes) <= shown:
        return ", ".join(nodes)
    return f"{', '.join(nodes[:shown])} and {len(nodes) - shown} more"
