"""``decide(snapshot, now, settings) -> Decision``: the controller's whole policy, pure.

Level-triggered: the same snapshot gives the same actions, and every write it asks for
is checked against what etcd already holds, so repeating a decision is harmless. One
re-form at a time per job: while ``control/plan`` is in flight, new signals only steer
that plan (a node lost mid-checkpoint forces the unplanned path) or wait for the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta

from controller.cluster import ObjectRef, PodInfo
from controller.disruption import PodNotice, pod_notices
from controller.exclusions import LeavingNodes, exclusions_update
from controller.jobconfig import JobConfig, resolve_job_config
from controller.reform_summary import resize_message
from controller.settings import ControllerSettings
from controller.signals import ReclaimNotice, ends_earlier, member_seen_key, node_verdict, signal_key
from controller.snapshot import (
    Action,
    Alerts,
    Cordon,
    Decision,
    DeletePod,
    JobSnapshot,
    PostEvent,
    WriteCheckpointRequest,
    WriteExpected,
    WritePlan,
    WritePresence,
    WriteReform,
    WriteStatus,
)
from controller.trace_ids import new_trace_id, traceparent
from regroup.records import (
    CheckpointRequest,
    ControllerPresence,
    ExpectedMembership,
    JobStatus,
    ReformCause,
    ReformOutcome,
    ReformPhase,
    ReformPlan,
    ReformRequest,
)


@dataclass
class _Health:
    """Per-node classification of the job's nodes at this moment."""

    lost: dict[str, str] = field(default_factory=dict)
    """node -> why it is gone for training."""
    lost_since: dict[str, float] = field(default_factory=dict)
    storm: set[str] = field(default_factory=set)
    notices: dict[str, ReclaimNotice] = field(default_factory=dict)
    seen: dict[str, float] = field(default_factory=dict)
    """node -> when the controller first saw its notice (the detect phase starts there)."""
    pods: dict[str, PodNotice] = field(default_factory=dict)
    """node -> the disruption notice of the job's pod there (``DisruptionTarget``), even
    when the pod is already terminating (it keeps the node excluded)."""


@dataclass
class _Out:
    actions: list[Action] = field(default_factory=list)
    requeue: list[float] = field(default_factory=list)
    """Seconds from now after which to look again."""

    def again_in(self, seconds: float) -> None:
        self.requeue.append(max(0.0, seconds))


def decide(s: JobSnapshot, now: float, settings: ControllerSettings) -> Decision:
    """Everything the controller wants done for job ``s`` at ``now``, with the reason."""
    out = _Out()
    resolved = s.resolved if s.resolved is not None else resolve_job_config(s.pods, settings.jobs)
    config, problems, newest = resolved.config, resolved.problems, resolved.newest
    for problem in problems:
        ref = ObjectRef("Pod", problem.pod.name, problem.pod.namespace, problem.pod.uid)
        out.actions.append(PostEvent(ref, "Warning", problem.kind, problem.message))
    if s.presence is None or s.presence.identity != s.identity:
        out.actions.append(WritePresence(ControllerPresence(identity=s.identity, since=now)))
    gpu_alert = _rendezvous_on_gpu(s, resolved.rendezvous_pods, out)
    flapping = _flapping(s, now, settings, newest, out)
    world = _world(s)
    if config is None:
        bad = any(p.kind == "BadConfig" for p in problems)
        reason = "bad configuration: " + "; ".join(p.message for p in problems) if bad else "no worker pods"
        _status(s, out, "bad-config" if bad else "waiting", reason, world, None, now)
        return _decision(out, reason, len(world), None, Alerts(bad_config=bad, flapping=flapping, rendezvous_on_gpu=gpu_alert))

    if s.finished:
        # The agents closed the rendezvous: training is over. Nothing to re-form, ever.
        if s.plan is not None and s.plan.phase != ReformPhase.DONE:
            _finish(s, s.plan, now, ReformOutcome.SUPERSEDED, out, "the job finished (its rendezvous is closed)")
        reason = "finished: the job's rendezvous is closed"
        _status(s, out, "finished", reason, world, config, now)
        return _decision(out, reason, len(world), config, Alerts(flapping=flapping, rendezvous_on_gpu=gpu_alert))

    disrupted = s.disrupted.values() if s.disrupted is not None else [p for p in s.pods if p.disruption is not None]
    health = _health(s, world, config, now, pod_notices(disrupted, resolved.workers_by_node, s.first_seen, now))
    _restart_storms(s, config, resolved.workers_by_node, health, now, settings, out)
    _exclusions(s, config, health, now, out)
    joiners = _joiners(s, world, health, now, out)
    plan = s.plan
    if plan is not None and plan.phase != ReformPhase.DONE:
        reason = _advance(s, plan, config, health, now, settings, out)
        state = "reforming"
        stalled = False
    else:
        reason, stalled = _start(s, world, joiners, config, health, now, settings, newest, out)
        state = "stalled" if stalled else ("reforming" if out.actions and _started(out) else "healthy")
    live = sorted([n for n in world if n not in health.lost] if health.lost else world)
    _status(s, out, state, reason, live, config, now, flapping=flapping, gpu=gpu_alert)
    alerts = Alerts(stalled=stalled, flapping=flapping, rendezvous_on_gpu=gpu_alert)
    return _decision(out, reason, len(live), config, alerts)


# --- observation helpers -------------------------------------------------------------


def _world(s: JobSnapshot) -> frozenset[str]:
    """Nodes of the job's current round, including members that vanished from it."""
    world = s.world_seen  # the model adds every member of world_round to it
    plan = s.plan
    if plan is not None and plan.phase == ReformPhase.DONE and plan.outcome == ReformOutcome.COMPLETED and plan.round_after == s.world_round:
        world = world.union(plan.nodes_after)
    return world


def _pod_by_name(s: JobSnapshot) -> Mapping[str, PodInfo]:
    return s.pods_by_name if s.pods_by_name is not None else {p.name: p for p in s.pods}


def _health(
    s: JobSnapshot, world: frozenset[str], config: JobConfig, now: float, disruptions: dict[str, PodNotice]
) -> _Health:
    health = _Health(pods=disruptions)
    pods = _pod_by_name(s)
    members, nodes, world_round = s.members, s.nodes, s.world_round
    if s.suspects is not None:
        # Suspects are few: filter them rather than building the round's whole node set.
        candidates: Iterable[str] = [n for n in s.suspects if n in world or n in members]
        if disruptions:
            extra = [n for n in disruptions if n not in s.suspects and (n in world or n in members)]
            candidates = [*candidates, *extra]
    else:
        candidates = world | members.keys()
    cached = s.verdicts if not config.reclaim_taints else None
    for node in candidates:
        member = members.get(node)
        lost: str | None = None
        since = now
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
            ):
                continue
        if member is None:
            lost, since = "member lease expired", s.first_seen.get(signal_key(node, "member-gone"), now)
        elif node in world and node in s.world_agents and member.joined_at != s.world_agents[node]:
            # A new agent registered on the node: the one in the round (and its workers) died.
            lost = f"agent on {node} restarted"
        elif member.pod:
            pod = pods.get(member.pod)
            if pod is None and s.pods_synced:
                lost, since = f"pod {member.pod} deleted", s.first_seen.get(signal_key(node, "pod-gone"), now)
            elif pod is not None and pod.deleting:
                lost, since = f"pod {member.pod} deleted or evicted", s.first_seen.get(signal_key(node, "pod-gone"), now)
            elif pod is not None and pod.phase in ("Failed", "Succeeded"):
                lost = f"pod {member.pod} {pod.phase}"
        if lost is None:
            lost, since = _node_notice(s, node, config, cached, health, now)
        if lost is not None:
            health.lost[node] = lost
            health.lost_since[node] = min(since, now)
    return health


def _node_notice(
    s: JobSnapshot, node: str, config: JobConfig, cached: Mapping | None, health: _Health, now: float
) -> tuple[str | None, float]:
    """The node's own verdict (lost, or a reclaim notice), and its pod's disruption notice:
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
    if pod is not None and not pod.terminating and (notice is None or ends_earlier(pod.notice, notice)):
        notice, seen = pod.notice, pod.seen
    if notice is not None:
        health.notices[node] = notice
        health.seen[node] = seen
    return None, now


def _joiners(s: JobSnapshot, world: frozenset[str], health: _Health, now: float, out: _Out) -> list[str]:
    """Healthy members waiting outside the current round, oldest first. A member on
    probation (its own workers just failed, or are still starting up) is not one yet."""
    world_round = s.world_round
    waiting = []
    for n, m in s.members.items():
        if m.round == world_round or n in world or n in health.lost or n in health.notices or n in health.storm:
            continue
        if m.not_before > now:
            out.again_in(m.not_before - now)
            continue
        waiting.append(n)
    return sorted(waiting, key=lambda n: (_joiner_seen(s, n), n))


def _joiner_seen(s: JobSnapshot, node: str) -> float:
    member = s.members[node]
    return s.first_seen.get(member_seen_key(node, member.joined_at, member.round), member.joined_at)


def _exclusions(s: JobSnapshot, config: JobConfig, health: _Health, now: float, out: _Out) -> None:
    """Keep ``control/excluded`` equal to the job's leaving nodes (``controller.exclusions``)."""
    leaving = LeavingNodes(health.notices, health.storm, health.pods)
    write = exclusions_update(s, config.reclaim_taints, leaving, now)
    if write is not None:
        out.actions.append(write)


def _rendezvous_on_gpu(s: JobSnapshot, pods: Iterable[PodInfo], out: _Out) -> bool:
    alert = False
    for pod in pods:
        if pod.node is None:
            continue
        node = s.nodes.get(pod.node)
        if node is not None and node.has_gpus:
            alert = True
            out.actions.append(
                PostEvent(
                    ObjectRef("Pod", pod.name, pod.namespace, pod.uid),
                    "Warning",
                    "RendezvousOnGPUNode",
                    f"rendezvous pod {pod.name} runs on GPU node {pod.node}: a reclaim of that node takes the "
                    "job's etcd with it; pin it to CPU nodes",
                )
            )
    return alert


def _flapping(s: JobSnapshot, now: float, settings: ControllerSettings, newest: PodInfo | None, out: _Out) -> bool:
    window = settings.reform.flapping_window.total_seconds()
    recent = [t for t in s.round_times if now - window <= t <= now]
    if len(recent) < settings.reform.flapping_rounds:
        return False
    if newest is not None:
        out.actions.append(
            PostEvent(
                ObjectRef("Pod", newest.name, newest.namespace, newest.uid),
                "Warning",
                "RendezvousFlapping",
                f"job {s.job}: {len(recent)} rendezvous rounds within {settings.reform.flapping_window}",
            )
        )
    # Requeue so the alert clears once the window has passed.
    out.again_in(min(recent) + window - now)
    return True


def _restart_storms(
    s: JobSnapshot,
    config: JobConfig,
    pods_on: Mapping[str, tuple[PodInfo, ...]],
    health: _Health,
    now: float,
    settings: ControllerSettings,
    out: _Out,
) -> None:
    window = config.storm_window.total_seconds()
    budget = settings.cordon.budget(s.fleet.hosting_nodes)
    cordoned, added = s.fleet.cordoned, set()  # added: cordons this decision asks for
    k, horizon = config.storm_restarts, now - window
    # Times are in order: the K-th newest restart decides whether K fall in the window.
    hot = [node for node, times in s.restarts.items() if len(times) >= k and times[-k] >= horizon]
    for node in sorted(hot):
        times = s.restarts[node]
        recent = [t for t in times if now - window <= t <= now]
        if len(recent) < config.storm_restarts:
            continue
        health.storm.add(node)
        out.again_in(min(recent) + window - now)
        why = f"{len(recent)} rank restarts within {config.storm_window} (limit {config.storm_restarts}) on node {node}"
        if node not in cordoned and node not in added:
            if len(cordoned) + len(added) >= budget:
                out.actions.append(
                    PostEvent(
                        ObjectRef("Node", node),
                        "Warning",
                        "CordonBudgetExhausted",
                        f"{why}; not cordoned: {len(cordoned) + len(added)} nodes already cordoned, budget {budget}",
                    )
                )
                health.storm.discard(node)
                continue
            added.add(node)
            out.actions.append(Cordon(node, why))
            out.actions.append(PostEvent(ObjectRef("Node", node), "Warning", "RestartStorm", f"cordoned: {why}"))
        for pod in pods_on.get(node, ()):
            if not pod.deleting:
                out.actions.append(DeletePod(pod.namespace, pod.name, f"restart storm: {why}"))
        if node in s.members or node in health.lost:
            health.lost.setdefault(node, f"restart storm: {why}")
            health.lost_since.setdefault(node, min(recent[config.storm_restarts - 1], now))


# --- starting a re-form --------------------------------------------------------------


def _started(out: _Out) -> bool:
    return any(isinstance(a, WritePlan) for a in out.actions)


def _next_generation(s: JobSnapshot) -> int:
    gens = [0]
    for record in (s.plan, s.checkpoint, s.expected, s.reform):
        if record is not None:
            gens.append(record.generation)
    gens.extend(s.acks)
    return max(gens) + 1


def _clamp(survivors: Iterable[str], joiners: list[str], max_nodes: int) -> list[str]:
    keep = sorted(survivors)[:max_nodes]
    return keep + joiners[: max(0, max_nodes - len(keep))]


def _start(
    s: JobSnapshot,
    world: frozenset[str],
    joiners: list[str],
    config: JobConfig,
    health: _Health,
    now: float,
    settings: ControllerSettings,
    newest: PodInfo | None,
    out: _Out,
) -> tuple[str, bool]:
    """Begin a re-form if the job needs one. Returns (reason, stalled)."""
    lost = {n: r for n, r in health.lost.items() if n in world}
    leaving = {n: notice for n, notice in health.notices.items() if n in world}
    survivors = world - set(lost) - set(leaving)
    if lost:
        target = _clamp(survivors, joiners, config.max_nodes)
        storm_only = all(n in health.storm for n in lost)
        cause = ReformCause.RESTART_STORM if storm_only else ReformCause.NODE_LOST
        what = ", ".join(f"{n} ({r})" for n, r in sorted(lost.items()))
        if len(target) < config.min_nodes:
            return _stall(s, out, newest, f"lost {what}: {len(target)} nodes left, below min {config.min_nodes}")
        detected = min(health.lost_since[n] for n in lost)
        _begin(s, out, now, cause, False, f"lost {what}", world, target, detected, settings, config)
        return f"unplanned re-form ({cause.value}): lost {what}", False
    if leaving:
        target = _clamp(survivors, joiners, config.max_nodes)
        what = ", ".join(f"{n} ({notice.signal}, {notice.source})" for n, notice in sorted(leaving.items()))
        if len(target) < config.min_nodes:
            return _stall(s, out, newest, f"reclaim of {what} leaves {len(target)} nodes, below min {config.min_nodes}")
        detected = min(health.seen[n] for n in leaving)
        deadline = now + config.checkpoint_timeout.total_seconds()
        for notice in leaving.values():
            if notice.ends_at is not None:
                deadline = min(deadline, notice.ends_at - settings.reform.notice_margin.total_seconds())
        planned = deadline > now and s.progress is not None
        _begin(s, out, now, ReformCause.RECLAIM, planned, f"reclaim notice on {what}", world, target, detected, settings, config, deadline)
        return f"{'planned' if planned else 'unplanned'} shrink (reclaim): {what}", False
    if len(world) > config.max_nodes:
        target = sorted(world)[: config.max_nodes]
        deadline = now + config.checkpoint_timeout.total_seconds()
        why = f"{len(world)} nodes exceed max {config.max_nodes}"
        _begin(s, out, now, ReformCause.MANUAL, s.progress is not None, why, world, target, now, settings, config, deadline)
        return f"shrink to max: {why}", False
    live = len(world)
    if joiners and live < config.max_nodes:
        capacity = config.max_nodes - live
        # A joiner can only be added once the current round exists: the wait starts then.
        opened = max(_joiner_seen(s, joiners[0]), s.round_times[-1] if s.round_times else 0.0)
        closes = opened + config.join_window.total_seconds()
        if now < closes and len(joiners) < capacity:
            out.again_in(closes - now)
            return f"gathering {len(joiners)} joining nodes until the join window closes", live < config.min_nodes
        target = _clamp(world, joiners, config.max_nodes)
        if len(target) < config.min_nodes:
            return _stall(s, out, newest, f"{len(target)} nodes available, below min {config.min_nodes}")
        added = ", ".join(target[live:])
        planned = live >= config.min_nodes and s.progress is not None
        deadline = now + config.checkpoint_timeout.total_seconds()
        _begin(s, out, now, ReformCause.GROW, planned, f"nodes joining: {added}", world, target, min(opened, now), settings, config, deadline)
        return f"grow to {len(target)} nodes: {added} joining", False
    if world and live < config.min_nodes:
        return _stall(s, out, newest, f"{live} nodes, below min {config.min_nodes}")
    if joiners:
        return f"{len(joiners)} nodes waiting, job at max {config.max_nodes}", False
    return f"steady at {live} nodes", False


def _stall(s: JobSnapshot, out: _Out, newest: PodInfo | None, why: str) -> tuple[str, bool]:
    if newest is not None:
        ref = ObjectRef("Pod", newest.name, newest.namespace, newest.uid)
        out.actions.append(PostEvent(ref, "Warning", "JobStalled", f"job {s.job} stalled: {why}"))
    return f"stalled: {why}", True


def _begin(
    s: JobSnapshot,
    out: _Out,
    now: float,
    cause: ReformCause,
    planned: bool,
    reason: str,
    world: frozenset[str],
    target: list[str],
    detected: float,
    settings: ControllerSettings,
    config: JobConfig,
    deadline: float = 0.0,
) -> None:
    generation = _next_generation(s)
    plan = ReformPlan(
        generation=generation,
        cause=cause,
        planned=planned,
        phase=ReformPhase.CHECKPOINT if planned else ReformPhase.RENDEZVOUS,
        reason=reason,
        nodes_before=sorted(world),
        nodes_after=list(target),
        trace_id=new_trace_id(s.namespace, s.job, generation, now),
        detected_at=min(detected, now),
        decided_at=now,
        round_before=s.world_round,
    )
    if planned:
        plan = dataclasses.replace(plan, checkpoint_requested_at=now, checkpoint_deadline=deadline)
        out.actions.append(WritePlan(plan, s.plan_revision))
        out.actions.append(WriteCheckpointRequest(_checkpoint_request(plan)))
        out.again_in(deadline - now)
    else:
        plan = _request_reform(s, plan, now)
        out.actions.append(WritePlan(plan, s.plan_revision))
        _reform_writes(plan, out)
        out.again_in(settings.reform.rendezvous_timeout.total_seconds())


def _checkpoint_request(plan: ReformPlan) -> CheckpointRequest:
    return CheckpointRequest(
        generation=plan.generation,
        deadline=plan.checkpoint_deadline,
        hold=True,
        reason=plan.reason,
        traceparent=traceparent(plan.trace_id, ReformPhase.CHECKPOINT.value),
        requested_at=plan.checkpoint_requested_at,
    )


def _request_reform(s: JobSnapshot, plan: ReformPlan, now: float) -> ReformPlan:
    """The plan as it stands when ``control/expected`` and ``control/reform`` go out."""
    step = s.progress.step if s.progress is not None else -1
    ack = s.acks.get(plan.generation)
    if ack is not None:
        step = max(step, ack.step)
    ranks = 0
    for node in plan.nodes_after:
        member = s.members.get(node)
        ranks += member.local_world_size if member is not None else 0
    return dataclasses.replace(
        plan,
        phase=ReformPhase.RENDEZVOUS,
        reform_requested_at=now,
        step_before=step,
        progress_revision=s.progress_revision,
        world_size_target=ranks,
    )


def _reform_writes(plan: ReformPlan, out: _Out, s: JobSnapshot | None = None) -> None:
    rdzv = traceparent(plan.trace_id, ReformPhase.RENDEZVOUS.value)
    if s is None or s.expected is None or s.expected.generation != plan.generation:
        out.actions.append(
            WriteExpected(ExpectedMembership(plan.generation, list(plan.nodes_after), plan.reason, rdzv))
        )
    if s is None or s.reform is None or s.reform.generation != plan.generation:
        out.actions.append(
            WriteReform(ReformRequest(plan.generation, plan.cause.value, plan.reason, rdzv, plan.reform_requested_at))
        )


# --- driving a re-form in flight -----------------------------------------------------


def _advance(
    s: JobSnapshot,
    plan: ReformPlan,
    config: JobConfig,
    health: _Health,
    now: float,
    settings: ControllerSettings,
    out: _Out,
) -> str:
    lost_targets = sorted(n for n in plan.nodes_after if n in health.lost)
    if plan.phase == ReformPhase.CHECKPOINT:
        if s.checkpoint is None or s.checkpoint.generation != plan.generation:
            out.actions.append(WriteCheckpointRequest(_checkpoint_request(plan)))
        ack = s.acks.get(plan.generation)
        leaving = set(plan.nodes_before) - set(plan.nodes_after)
        vanished = sorted(n for n in leaving if n in health.lost)
        fallback = ""
        if ack is None:
            if lost_targets:
                fallback = f"{', '.join(lost_targets)} lost before the checkpoint ack"
            elif vanished:
                fallback = f"{', '.join(vanished)} vanished before the checkpoint ack"
            elif now >= plan.checkpoint_deadline:
                fallback = "no checkpoint ack by the deadline"
            else:
                out.again_in(plan.checkpoint_deadline - now)
                return f"re-form {plan.generation}: waiting for the checkpoint ack"
        acked_at = min(now, s.first_seen.get(signal_key("", f"ack:{plan.generation}"), now)) if ack else now
        nodes = [n for n in plan.nodes_after if n not in health.lost]
        if len(nodes) < config.min_nodes:
            return _finish(s, plan, now, ReformOutcome.SUPERSEDED, out, f"only {len(nodes)} target nodes left, below min {config.min_nodes}")
        updated = dataclasses.replace(
            plan,
            acked_at=acked_at,
            ack_step=ack.step if ack is not None else -1,
            planned=ack is not None,
            fallback=fallback,
            nodes_after=nodes,
        )
        updated = _request_reform(s, updated, now)
        out.actions.append(WritePlan(updated, s.plan_revision))
        _reform_writes(updated, out)
        out.again_in(settings.reform.rendezvous_timeout.total_seconds())
        if fallback:
            return f"re-form {plan.generation}: unplanned fallback: {fallback}"
        return f"re-form {plan.generation}: checkpoint acked at step {ack.step if ack else -1}, re-forming"
    if plan.phase == ReformPhase.RENDEZVOUS:
        _reform_writes(plan, out, s)
        rounds = [s.members[n].round for n in plan.nodes_after if n in s.members]
        # Formed: the rendezvous' round record shows a newer round of exactly the planned
        # nodes, or (without that record) every planned member reports a newer round. A
        # newer round of other nodes (one formed while no controller led, say) is not this
        # plan's: waiting on it would wait for a state that cannot come.
        newer = s.world_round > plan.round_before and bool(s.world_agents)
        if newer and set(s.world_agents) != set(plan.nodes_after):
            return _finish(s, plan, now, ReformOutcome.SUPERSEDED, out, _other_round(s, plan))
        formed = newer and set(plan.nodes_after) <= s.world_seen
        if formed or (len(rounds) == len(plan.nodes_after) and all(r > plan.round_before for r in rounds)):
            round_after = s.world_round if formed else max(rounds)
            updated = dataclasses.replace(plan, phase=ReformPhase.RESUME, round_after=round_after, rendezvous_done_at=now)
            out.actions.append(WritePlan(updated, s.plan_revision))
            out.again_in(settings.reform.resume_timeout.total_seconds())
            return f"re-form {plan.generation}: round {round_after} formed with {len(plan.nodes_after)} nodes"
        if lost_targets:
            return _finish(s, plan, now, ReformOutcome.SUPERSEDED, out, f"{', '.join(lost_targets)} lost during the rendezvous")
        elapsed = now - plan.reform_requested_at
        limit = settings.reform.rendezvous_timeout.total_seconds()
        if elapsed >= limit:
            return _finish(s, plan, now, ReformOutcome.TIMEOUT, out, "expected members did not all join the new round")
        out.again_in(limit - elapsed)
        pending = [n for n in plan.nodes_after if n not in s.members or s.members[n].round <= plan.round_before]
        return f"re-form {plan.generation}: waiting for {', '.join(pending)} to join the new round"
    if plan.phase == ReformPhase.RESUME:
        _reform_writes(plan, out, s)
        progress = s.progress
        if (
            progress is not None
            and s.progress_revision > plan.progress_revision
            and (plan.world_size_target == 0 or progress.world_size == plan.world_size_target)
        ):
            seen = min(now, s.first_seen.get(signal_key("", "progress"), now))
            lost_steps = max(0, plan.step_before - progress.resumed_from_step) if plan.step_before >= 0 else -1
            # Only the trainer's rank 0 knows how its world came to be and where the resume time
            # went; the plan carries that to the re-form's trace.
            resumed = dataclasses.replace(
                plan, resumed_at=max(seen, plan.rendezvous_done_at), resumed_from_step=progress.resumed_from_step,
                lost_steps=lost_steps, mode=progress.reform_mode, resume_phases=dict(progress.resume_phases),
            )
            return _finish(s, resumed, now, ReformOutcome.COMPLETED, out, f"resumed from step {progress.resumed_from_step}")
        if lost_targets:
            return _finish(s, plan, now, ReformOutcome.SUPERSEDED, out, f"{', '.join(lost_targets)} lost before the trainer resumed")
        if s.world_round > plan.round_after and s.world_agents and set(s.world_agents) != set(plan.nodes_after):
            return _finish(s, plan, now, ReformOutcome.SUPERSEDED, out, _other_round(s, plan) + " before the trainer resumed")
        elapsed = now - plan.rendezvous_done_at
        limit = settings.reform.resume_timeout.total_seconds()
        if elapsed >= limit:
            return _finish(s, plan, now, ReformOutcome.TIMEOUT, out, "the trainer reported no progress at the new size")
        out.again_in(limit - elapsed)
        return f"re-form {plan.generation}: waiting for the trainer to resume at the new size"
    return _finish(s, plan, now, ReformOutcome.SUPERSEDED, out, f"unknown phase {plan.phase.value!r}")


def _other_round(s: JobSnapshot, plan: ReformPlan) -> str:
    formed = ", ".join(sorted(s.world_agents))
    return f"round {s.world_round} formed with {formed}, not the planned {', '.join(plan.nodes_after)}"


def _finish(s: JobSnapshot, plan: ReformPlan, now: float, outcome: ReformOutcome, out: _Out, why: str) -> str:
    """End the plan. A completed one is told on each of the job's pods (a Normal Event
    ``Resized``); one that did not complete is abandoned loudly (a Warning Event on each of
    the job's pods; the trace and the metric carry ``why``) and decided afresh at once."""
    done = dataclasses.replace(plan, phase=ReformPhase.DONE, outcome=outcome, finished_at=now, why=why)
    out.actions.append(WritePlan(done, s.plan_revision, finished=True))
    if outcome == ReformOutcome.COMPLETED:
        message = resize_message(done)
        for pod in s.pods:
            out.actions.append(PostEvent(ObjectRef("Pod", pod.name, pod.namespace, pod.uid), "Normal", "Resized", message))
    else:
        message = f"re-form {plan.generation} ({plan.cause.value}, phase {plan.phase.value}) abandoned, {outcome.value}: {why}"
        for pod in s.pods:
            ref = ObjectRef("Pod", pod.name, pod.namespace, pod.uid)
            out.actions.append(PostEvent(ref, "Warning", "ReformAbandoned", message))
        out.again_in(0)
    return f"re-form {plan.generation} {outcome.value}: {why}"


# --- status --------------------------------------------------------------------------


def _status(
    s: JobSnapshot,
    out: _Out,
    state: str,
    reason: str,
    nodes: Iterable[str],
    config: JobConfig | None,
    now: float,
    flapping: bool = False,
    gpu: bool = False,
) -> None:
    alerts = [name for name, on in (("rendezvous-flapping", flapping), ("rendezvous-on-gpu-node", gpu)) if on]
    nodes = sorted(nodes)
    min_nodes, max_nodes = (config.min_nodes, config.max_nodes) if config else (0, 0)
    old = s.status
    # The reason alone changing (counts, phases) is not worth a write per decision.
    if old is None or (old.state, old.world_size, old.min_nodes, old.max_nodes, old.nodes, old.alerts) != (
        state, len(nodes), min_nodes, max_nodes, nodes, alerts
    ):
        status = JobStatus(
            state=state,
            reason=reason,
            world_size=len(nodes),
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            nodes=nodes,
            alerts=alerts,
            updated_at=now,
        )
        out.actions.append(WriteStatus(status))


def _decision(out: _Out, reason: str, world_size: int, config: JobConfig | None, alerts: Alerts) -> Decision:
    requeue = timedelta(seconds=min(out.requeue)) if out.requeue else None
    return Decision(
        actions=tuple(out.actions),
        reason=reason,
        requeue_after=requeue,
        world_size=world_size,
        min_nodes=config.min_nodes if config else 0,
        max_nodes=config.max_nodes if config else 0,
        alerts=alerts,
    )


def summarize(actions: Iterable[Action]) -> Mapping[str, int]:
    """Count of actions by type, for logs."""
    counts: dict[str, int] = {}
    for action in actions:
        counts[type(action).__name__] = counts.get(type(action).__name__, 0) + 1
    return counts
