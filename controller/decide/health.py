"""The job's nodes at this moment: lost, leaving (reclaim notices), storming, or joining.

A node is leaving under its own notice (a reclaim taint, a cordon), its pod's (a
disruption condition, a deletion with time left) or its agent's (``leaving_by``); the one
that ends first counts. A pod deletion or an agent's leave with too little time left
(``ReformSettings.min_planned_grace``) is a loss instead, as is an agent whose container
exited after it registered (``disruption.agent_exit``), whatever its lease still says.

A loss counts from its first evidence (``Health.lost_since``, a re-form's ``detected_at``):
the container's termination as the kubelet timed it, the pod's deletion as the API server
timed it, or when the controller first saw the member or the pod gone, whichever is earliest.

Also the writes that follow from that alone, whatever the re-form: cordons for restart
storms and ``control/excluded`` for the leaving nodes.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet

from regroup.controller.cluster import ObjectRef, PodInfo
from regroup.controller.decide.out import Out
from regroup.controller.disruption import AgentNotice, PodNotice, agent_exit, agent_notice, pod_gone_key
from regroup.controller.exclusions import LeavingNodes, exclusions_update
from regroup.controller.jobconfig import JobConfig
from regroup.controller.settings import ControllerSettings
from regroup.controller.signals import (
    ReclaimNotice,
    ends_earlier,
    member_seen_key,
    node_verdict,
    signal_key,
)
from regroup.controller.snapshot import Cordon, DeletePod, JobSnapshot, PostEvent
from regroup.records import MemberRecord, ReformOutcome, ReformPhase, ReformPlan


class Health:
    """Per-node classification of the job's nodes at this moment.

    A plain class with slots: made once per decision, where a dataclass's ``__init__``
    tested each of its six default factories in turn."""

    __slots__ = ("lost", "lost_since", "storm", "notices", "seen", "pods", "agents", "turns_lost_at")

    def __init__(self, pods: dict[str, PodNotice] | None = None) -> None:
        self.lost: dict[str, str] = {}
        """node -> why it is gone for training."""
        self.lost_since: dict[str, float] = {}
        self.storm: set[str] = set()
        self.notices: dict[str, ReclaimNotice] = {}
        self.seen: dict[str, float] = {}
        """node -> when the controller first saw its notice (the detect phase starts there)."""
        self.pods: dict[str, PodNotice] = pods if pods is not None else {}
        """node -> the notice of the job's going pod there (``DisruptionTarget``, deletion),
        even once it is a loss (it keeps the node excluded)."""
        self.agents: dict[str, AgentNotice] = {}
        """node -> the leave its agent announced, even once it is a loss (it keeps the node excluded)."""
        self.turns_lost_at: float | None = None
        """The earliest moment a pod's deletion or an agent's leave found here turns from a
        notice into a loss (the decision looks again then)."""


def plan_of_round(s: JobSnapshot) -> ReformPlan | None:
    """The completed plan that made the job's current round (its nodes, in the order the
    rendezvous formed them), if the last plan did."""
    plan = s.plan
    if (
        plan is not None
        and plan.phase == ReformPhase.DONE
        and plan.outcome == ReformOutcome.COMPLETED
        and plan.round_after == s.world_round
    ):
        return plan
    return None


def world_of(s: JobSnapshot) -> AbstractSet[str]:
    """Nodes of the job's current round, including members that vanished from it."""
    world = s.world_seen  # the model adds every member of world_round to it
    plan = plan_of_round(s)
    if plan is not None:
        world = world.union(plan.nodes_after)
    return world


PEER_FAILURE_SETTLE_S = 0.5
"""How long after a survivor's report of a peer failure the node it names counts as lost
(``_peer_failures``): the other live nodes of the round report theirs meanwhile."""


def assess(
    s: JobSnapshot,
    world: AbstractSet[str],
    config: JobConfig,
    now: float,
    disruptions: dict[str, PodNotice],
    min_grace: float,
) -> Health:
    """Classify the round's nodes and the members outside it; ``disruptions`` are the pods'
    notices, ``min_grace`` the seconds of a deletion or leave below which it is a loss."""
    health = Health(pods=disruptions)
    pods = s.pods_by_name
    members, nodes, world_round = s.members, s.nodes, s.world_round
    cached = s.verdicts if not config.reclaim_taints else None
    for node in _candidates(s, world, disruptions):
        member = members.get(node)
        if member is not None and member.round == world_round:
            # The common case, checked inline: a healthy member of the round on a clean node.
            pod = pods.get(member.pod) if member.pod else None
            info = nodes.get(node)
            if (
                (pod is not None or not member.pod)
                and (pod is None or (not pod.deleting and pod.phase not in ("Failed", "Succeeded")))
                and info is not None
                and info.ready is True
                and not info.taints
                and not info.unschedulable
                and node not in disruptions
                and not member.leaving_by
                and member.peer_failure_round != world_round
                and (pod is None or agent_exit(pod, member.joined_at) is None)
            ):
                continue
        agent = agent_notice(node, member, s.first_seen, now, min_grace) if member is not None else None
        if agent is not None:
            health.agents[node] = agent
        lost, since = _member_loss(s, node, member, world, pods, disruptions, agent, now)
        if lost is None:
            lost, since = _node_notice(s, node, config, cached, health, agent, now)
        if lost is not None:
            health.lost[node] = lost
            health.lost_since[node] = min(since, now)
    _peer_failures(s, world, health, now)
    return health


def _peer_failures(s: JobSnapshot, world: AbstractSet[str], health: Health, now: float) -> None:
    """A survivor's collective of the round failed on a peer and named its host (gloo does):
    the node of the round at that address is lost, since the failure, without waiting for
    its lease or its pod's status. Only an unambiguous name counts: one node of the round at
    that host (its agent's address or its pod's IP), not the reporter, and not a node that
    reported a failure of its own in the round (it is alive). Agents sharing a host (one
    machine, loopback) name nobody by address. The survivor's agent also names the members
    of the round whose lease then went a second without renewal (``silent_peers``,
    ``regroup.rendezvous.silent``): those are lost too, under the same rules.

    A survivor that leaves its broken world closes its connections, and a third rank may
    then see its collective fail on that live survivor: a name counts only once
    ``PEER_FAILURE_SETTLE_S`` have passed since the report, time for every live node of
    the round to report its own failure."""
    members, world_round = s.members, s.world_round
    reporters = [
        m for n in s.suspects
        if (m := members.get(n)) is not None and m.round == world_round
        and m.peer_failure_round == world_round and (m.failed_peer or m.silent_peers)
    ]  # fmt: skip
    if not reporters:
        return
    pods = s.pods_by_name
    for reporter in sorted(reporters, key=lambda m: m.peer_failure_at):
        named = [
            n for n in world
            if n != reporter.node and (m := members.get(n)) is not None
            and reporter.failed_peer in (m.host, pod.ip if (pod := pods.get(m.pod)) is not None else "")
        ] if reporter.failed_peer else []  # fmt: skip
        accused = {named[0]: f"a collective of round {world_round} failed on it"} if len(named) == 1 else {}
        for node in reporter.silent_peers:
            if node in world and node != reporter.node and node in members:
                accused.setdefault(node, f"its lease went unrenewed after a collective of round {world_round} failed")
        for node, why in sorted(accused.items()):
            if node in health.lost or members[node].peer_failure_round == world_round:
                continue
            settled_at = min(reporter.peer_failure_at, now) + PEER_FAILURE_SETTLE_S
            if settled_at > now:
                later = health.turns_lost_at
                health.turns_lost_at = settled_at if later is None else min(later, settled_at)
                continue
            health.lost[node] = f"{why} (seen by {reporter.node})"
            health.lost_since[node] = min(reporter.peer_failure_at, now)


def _candidates(s: JobSnapshot, world: AbstractSet[str], disruptions: Mapping[str, PodNotice]) -> Iterable[str]:
    """The nodes worth examining: the model's suspects of the round and members, and the
    nodes whose pod has a disruption notice."""
    members, suspects = s.members, s.suspects
    # Suspects are few: filter them rather than building the round's whole node set.
    candidates: Iterable[str] = [n for n in suspects if n in world or n in members]
    if disruptions:
        extra = [n for n in disruptions if n not in suspects and (n in world or n in members)]
        candidates = [*candidates, *extra]
    return candidates


def _member_loss(
    s: JobSnapshot,
    node: str,
    member: MemberRecord | None,
    world: AbstractSet[str],
    pods: Mapping[str, PodInfo],
    disruptions: Mapping[str, PodNotice],
    agent: AgentNotice | None,
    now: float,
) -> tuple[str | None, float]:
    """Why the node's member (its agent or pod) is gone, and since when (its first evidence,
    module docstring); (None, now) if it is not. A pod being deleted, or an agent leaving,
    with time left to hand over is not gone: it is a notice (``_node_notice``); nor is the
    exit of an agent that announced its leave, with a code that is no failure (its leave's end)."""
    if member is None:
        return "member lease expired", _earliest(s.first_seen.get(signal_key(node, "member-gone"), now),
                                                 _round_agent_exit(s, node))
    if node in world and node in s.world_agents and member.joined_at != s.world_agents[node]:
        # A new agent registered on the node: the one in the round (and its workers) died.
        return f"agent on {node} restarted", _earliest(now, _round_agent_exit(s, node))
    if member.pod:
        pod = pods.get(member.pod)
        gone_seen = s.first_seen.get(pod_gone_key(node, member.pod), now)
        if pod is None:
            if s.pods_synced:
                return f"pod {member.pod} deleted", gone_seen
        else:
            deleted = _deleted_at(pod)
            ended = agent_exit(pod, member.joined_at)
            if ended is not None and not (ended.voluntary and member.leaving_by > 0):
                return ended.why, _earliest(ended.at, deleted)
            if pod.deleting:
                since = _earliest(gone_seen, deleted, ended.at if ended is not None else None)
                notice = disruptions.get(node)
                if notice is None or notice.pod.name != pod.name:
                    return f"pod {member.pod} deleted or evicted", since
                if notice.lost is not None:
                    return notice.lost, since
            if pod.phase in ("Failed", "Succeeded"):
                return f"pod {member.pod} {pod.phase}", ended.at if ended is not None else now
    if agent is not None and agent.lost is not None:
        return agent.lost, now
    return None, now


def _earliest(first: float, *others: float | None) -> float:
    return min([first, *(t for t in others if t is not None)])


def _deleted_at(pod: PodInfo) -> float | None:
    """When the pod's deletion was asked for, by the API server (``deletionTimestamp`` less
    its grace); None when not being deleted or not known."""
    if not pod.deleting or pod.deletion_deadline is None or pod.deletion_grace_seconds is None:
        return None
    return pod.deletion_deadline - pod.deletion_grace_seconds


def _round_agent_exit(s: JobSnapshot, node: str) -> float | None:
    """When the container of the agent the round names on ``node`` ended, by its pod there
    (the node's newest worker pod), if it did: evidence of a loss seen otherwise first."""
    joined = s.world_agents.get(node)
    workers = s.resolved.workers_by_node.get(node)
    if not joined or not workers:
        return None
    # The grouping may hold an older copy of the pod (a restart alone keeps it): read it fresh.
    pod = s.pods_by_name.get(max(workers, key=lambda p: (p.created_at, p.name)).name)
    ended = agent_exit(pod, joined) if pod is not None else None
    return ended.at if ended is not None else None


def _node_notice(
    s: JobSnapshot,
    node: str,
    config: JobConfig,
    cached: Mapping | None,
    health: Health,
    agent: AgentNotice | None,
    now: float,
) -> tuple[str | None, float]:
    """The node's own verdict (lost, or a reclaim notice), its pod's notice and its agent's:
    a loss wins, else the notice that ends first. Returns (why lost, since)."""
    notice, seen = None, now
    info = s.nodes.get(node)
    if info is not None or s.nodes_synced:
        verdict = cached.get(node) if cached is not None else None
        if verdict is None:
            verdict = node_verdict(info, node, config.reclaim_taints, s.first_seen, now)
        if verdict.lost is not None:
            return verdict.lost, verdict.lost_since or now
        if verdict.notice is not None:
            notice = verdict.notice
            key = "unschedulable" if notice.signal == "spec.unschedulable" else "taint:" + notice.signal
            seen = min(now, s.first_seen.get(signal_key(node, key), now))
    pod = health.pods.get(node)
    if pod is not None and pod.lost is None:
        if notice is None or ends_earlier(pod.notice, notice):
            notice, seen = pod.notice, pod.seen
        _turns_lost(health, pod.lost_at)
    if agent is not None and agent.lost is None:
        if notice is None or ends_earlier(agent.notice, notice):
            notice, seen = agent.notice, agent.seen
        _turns_lost(health, agent.lost_at)
    if notice is not None:
        health.notices[node] = notice
        health.seen[node] = seen
    return None, now


def _turns_lost(health: Health, at: float | None) -> None:
    if at is not None and (health.turns_lost_at is None or at < health.turns_lost_at):
        health.turns_lost_at = at


def waiting_joiners(s: JobSnapshot, world: AbstractSet[str], health: Health, now: float, out: Out) -> list[str]:
    """Healthy members waiting outside the current round, oldest first. A member on
    probation (its own workers just failed, or are still starting up) is not one yet, nor
    is the record of an agent its round's survivors found dead (``named_dead``)."""
    members = s.members
    waiting = []
    # A member outside the round is a suspect (``regroup.controller.suspects``): look no further.
    for n in s.suspects:
        m = members.get(n)
        if m is None or not _outside_healthy(s, world, health, n, m) or named_dead(s, n, m):
            continue
        if m.not_before > now:
            out.again_in(m.not_before - now)
            continue
        waiting.append(n)
    return sorted(waiting, key=lambda n: (joiner_seen(s, n), n))


def _outside_healthy(s: JobSnapshot, world: AbstractSet[str], health: Health, node: str, m: MemberRecord) -> bool:
    """A member outside the current round, neither lost, leaving nor in a restart storm,
    nor the record of a pod that is gone (``older_than_its_pod``)."""
    return m.round != s.world_round and node not in world and not (
        node in health.lost or node in health.notices or node in health.storm or older_than_its_pod(s, m)
    )


CLOCK_SLACK_S = 5.0
"""How far an agent's clock (``joined_at``) may trail the API server's (``creationTimestamp``,
whole seconds) before its member record counts as older than its pod. An agent registers
seconds after its pod is created (the container starts, Python and torch load)."""


def older_than_its_pod(s: JobSnapshot, member: MemberRecord) -> bool:
    """Whether the record of a member that took part in a round was written before its pod
    was created: the pod was deleted and made again under the same name (a node lost and
    restored, a StatefulSet's pod), and the record is the old pod's agent's, standing until
    its lease runs out. That agent is gone: no joiner. The new pod's agent registers afresh
    (round 0, after its pod was created) and is one."""
    pod = s.pods_by_name.get(member.pod) if member.pod else None
    return pod is not None and member.round > 0 and 0 < member.joined_at < pod.created_at - CLOCK_SLACK_S


def named_dead(s: JobSnapshot, node: str, member: MemberRecord) -> bool:
    """Whether the member record is that of an agent the survivors of its round named dead
    (``silent_peers``), standing until its lease runs out: not a joiner. A new agent of the
    node registers afresh (round 0) and is one; so is an agent that wrote its record after
    the failure it was named in (a probation, a warm-up or a new registration after it): it
    was not dead, whatever its lease read in the probe."""
    if member.round <= 0:
        return False
    written = max(member.not_before, member.warming_since, member.joined_at)
    return any(
        m.peer_failure_round == member.round and node in m.silent_peers and written < m.peer_failure_at
        for n, m in s.members.items() if n != node
    )  # fmt: skip


def warming_joiners(s: JobSnapshot, world: AbstractSet[str], health: Health) -> list[str]:
    """Members outside the round whose standby workers are still starting up
    (``MemberRecord.warming_since``), sorted: joiners once warm, reported until then, and
    never waited for at a hold."""
    members = s.members
    return sorted(
        n for n in s.suspects
        if (m := members.get(n)) is not None and m.warming_since > 0 and _outside_healthy(s, world, health, n, m)
    )


def joiner_seen(s: JobSnapshot, node: str) -> float:
    """When the controller first saw the member on ``node`` waiting to join."""
    member = s.members[node]
    return s.first_seen.get(member_seen_key(node, member.joined_at, member.round), member.joined_at)


def keep_exclusions(s: JobSnapshot, config: JobConfig, health: Health, now: float, out: Out) -> None:
    """Keep ``control/excluded`` equal to the job's leaving nodes (``regroup.controller.exclusions``)."""
    leaving = LeavingNodes(health.notices, health.storm, health.pods, health.agents)
    write = exclusions_update(s, config.reclaim_taints, leaving, now)
    if write is not None:
        out.actions.append(write)


def restart_storms(
    s: JobSnapshot,
    config: JobConfig,
    pods_on: Mapping[str, tuple[PodInfo, ...]],
    health: Health,
    now: float,
    settings: ControllerSettings,
    out: Out,
) -> None:
    """Cordon (within the budget) each node with K restarts in W, delete its pods, and
    count its member lost."""
    window = config.storm_window.total_seconds()
    k, horizon = config.storm_restarts, now - window
    # Times are in order: the K-th newest restart (its mark) decides whether K fall in the window.
    hot = [node for node, mark in s.storm_marks.items() if mark >= horizon]
    if not hot:
        return
    budget = settings.cordon.budget(s.fleet.hosting_nodes)
    cordoned, added = s.fleet.cordoned, set()  # added: cordons this decision asks for
    for node in sorted(hot):
        times = s.restarts[node]
        # The window's restarts, found by bisection: times are in order.
        first, end = bisect_left(times, horizon), bisect_right(times, now)
        if end - first < k:
            continue
        health.storm.add(node)
        out.again_in(times[first] + window - now)
        # A pod-named member's node is the one its pod runs on: that one is cordoned.
        host = s.fleet.hosts.get(node, node)
        why = f"{end - first} rank restarts within {config.storm_window} (limit {k}) on node {host}"
        if host not in cordoned and host not in added:
            if len(cordoned) + len(added) >= budget:
                out.actions.append(
                    PostEvent(
                        ObjectRef("Node", host),
                        "Warning",
                        "CordonBudgetExhausted",
                        f"{why}; not cordoned: {len(cordoned) + len(added)} nodes already cordoned, budget {budget}",
                    )
                )
                health.storm.discard(node)
                continue
            added.add(host)
            out.actions.append(Cordon(host, why))
            out.actions.append(PostEvent(ObjectRef("Node", host), "Warning", "RestartStorm", f"cordoned: {why}"))
        for pod in pods_on.get(node, ()):
            if not pod.deleting:
                out.actions.append(DeletePod(pod.namespace, pod.name, f"restart storm: {why}"))
        if node in s.members or node in health.lost:
            health.lost.setdefault(node, f"restart storm: {why}")
            health.lost_since.setdefault(node, min(times[first + k - 1], now))
