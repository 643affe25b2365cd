"""Hand-built snapshots for the pure decision tests: any moment, no I/O."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from controller.cluster import NodeInfo, PodDisruption, PodInfo, Taint
from controller.disruption import disruption_key
from controller.signals import signal_key
from controller.snapshot import Action, JobSnapshot
from regroup.records import CheckpointAck, MemberRecord, Progress

NS, JOB = "team", "llama"
T0 = 1_700_000_000.0


def annotations(min_nodes: int = 2, max_nodes: int = 4, **extra: str) -> dict[str, str]:
    notes = {"regroup.dev/min-nodes": str(min_nodes), "regroup.dev/max-nodes": str(max_nodes)}
    notes.update({f"regroup.dev/{k.replace('_', '-')}": v for k, v in extra.items()})
    return notes


def pod(node: str, notes: Mapping[str, str] | None = None, created: float = 0.0, **kw: Any) -> PodInfo:
    return PodInfo(
        namespace=NS,
        name=f"{JOB}-{node}",
        uid=f"uid-{node}",
        job=JOB,
        node=node,
        annotations=dict(notes if notes is not None else annotations()),
        created_at=created,
        **kw,
    )


def member(node: str, round_: int = 1, restarts: int = 0, lws: int = 2) -> MemberRecord:
    return MemberRecord(
        node=node, pod=f"{JOB}-{node}", namespace=NS, round=round_, local_world_size=lws, restart_count=restarts
    )


def job(
    nodes: Iterable[str] = ("n1", "n2", "n3"),
    notes: Mapping[str, str] | None = None,
    round_: int = 1,
    step: int | None = 100,
    **kw: Any,
) -> JobSnapshot:
    """A steady job: one pod and one member per node, all in ``round_``, trainer at ``step``."""
    names = list(nodes)
    progress = Progress(step=step, loss=1.0, samples_seen=step * 8, world_size=2 * len(names), time=T0) if step is not None else None
    base = JobSnapshot(
        namespace=NS,
        job=JOB,
        pods=tuple(pod(n, notes) for n in names),
        nodes={n: NodeInfo(n) for n in names},
        members={n: member(n, round_) for n in names},
        world_round=round_,
        world_seen=frozenset(names),
        progress=progress,
        progress_revision=10 if progress else 0,
    )
    return dataclasses.replace(base, **kw)


def with_taint(s: JobSnapshot, node: str, key: str, value: str = "", seen: float = T0, time_added: float | None = None) -> JobSnapshot:
    info = s.nodes[node]
    nodes = dict(s.nodes)
    nodes[node] = dataclasses.replace(info, taints=info.taints + (Taint(key, value, "NoSchedule", time_added),))
    first_seen = dict(s.first_seen)
    first_seen[signal_key(node, "taint:" + key)] = seen
    return dataclasses.replace(s, nodes=nodes, first_seen=first_seen)


def with_disruption(
    s: JobSnapshot,
    node: str,
    reason: str = "PreemptionByScheduler",
    since: float | None = T0,
    grace: float = 30.0,
    seen: float = T0,
    **pod_fields: Any,
) -> JobSnapshot:
    """``node``'s pod carries ``DisruptionTarget=True`` (first seen at ``seen``)."""
    pods = tuple(
        dataclasses.replace(p, disruption=PodDisruption(reason, since, grace), **pod_fields) if p.node == node else p
        for p in s.pods
    )
    first_seen = dict(s.first_seen)
    for p in pods:
        if p.node == node:
            first_seen[disruption_key(p)] = seen
    return dataclasses.replace(s, pods=pods, first_seen=first_seen)


def acked(s: JobSnapshot, generation: int, step: int) -> JobSnapshot:
    acks = dict(s.acks)
    acks[generation] = CheckpointAck(generation=generation, step=step, checkpoint_id=f"step-{step}", duration_s=1.0, world_size=6)
    return dataclasses.replace(s, acks=acks)


def of(actions: Iterable[Action], kind: type) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def applied(s: JobSnapshot, actions: Iterable[Action]) -> JobSnapshot:
    """The snapshot after the controller's etcd writes landed (what the watch would show)."""
    from controller.snapshot import (
        WriteCheckpointRequest,
        WriteExclusions,
        WriteExpected,
        WritePlan,
        WritePresence,
        WriteReform,
        WriteStatus,
    )
    from regroup.records import ControllerPresence

    for a in actions:
        if isinstance(a, WritePlan):
            s = dataclasses.replace(s, plan=a.plan, plan_revision=s.plan_revision + 1)
        elif isinstance(a, WriteCheckpointRequest):
            s = dataclasses.replace(s, checkpoint=a.request)
        elif isinstance(a, WriteExpected):
            s = dataclasses.replace(s, expected=a.expected)
        elif isinstance(a, WriteReform):
            s = dataclasses.replace(s, reform=a.request)
        elif isinstance(a, WriteStatus):
            s = dataclasses.replace(s, status=a.status)
        elif isinstance(a, WriteExclusions):
            s = dataclasses.replace(s, exclusions=a.exclusions)
        elif isinstance(a, WritePresence):
            s = dataclasses.replace(s, presence=ControllerPresence(identity=a.presence.identity, since=a.presence.since))
    return s
