"""``control/excluded``: the job's nodes that are leaving, which no agent brings back.

A node is excluded while it is under a reclaim notice or cordoned (a restart storm's
cordon included), while the job's pod on it carries ``DisruptionTarget=True`` or is being
deleted, and while its agent is leaving (``leaving_by``). Agents read the record and do
not bring such a node back into the job, with or without a controller; an entry lifts
with its taint, cordon, pod condition or deletion (the pod gone or replaced), the leaving
agent's record, or the node's deletion. Pure: ``decide`` calls it and applies the write it returns.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import NamedTuple

from regroup.controller.disruption import AgentNotice, PodNotice
from regroup.controller.signals import ReclaimNotice, leaving_signal
from regroup.controller.snapshot import JobSnapshot, WriteExclusions
from regroup.records import Exclusions


class LeavingNodes(NamedTuple):
    """What this decision found leaving (a named tuple: made once per decision)."""

    notices: Mapping[str, ReclaimNotice]
    """node -> its reclaim notice (a taint, a cordon or its pod's disruption)."""
    storm: Collection[str]
    """Nodes under a restart storm."""
    pods: Mapping[str, PodNotice]
    """node -> the notice of the job's going pod there, a loss already or not."""
    agents: Mapping[str, AgentNotice]
    """node -> the leave its agent announced, a loss already or not."""


def exclusions_update(
    s: JobSnapshot, reclaim_taints: Collection[str], leaving: LeavingNodes, now: float
) -> WriteExclusions | None:
    """The write that makes ``control/excluded`` equal to the leaving nodes; None when it is."""
    wanted: dict[str, str] = {}
    for node, notice in leaving.notices.items():
        info = s.nodes.get(node)
        why = leaving_signal(info, reclaim_taints) if info is not None else None
        wanted[node] = why or notice.signal  # a pod's or an agent's notice names itself
    for node in leaving.storm:
        wanted.setdefault(node, "restart storm")
    for node, pod in leaving.pods.items():
        wanted.setdefault(node, pod.why)  # until the condition goes or the pod is gone or replaced
    for node, agent in leaving.agents.items():
        wanted.setdefault(node, agent.notice.signal)  # until the leaving agent's record goes
    old = s.exclusions.nodes if s.exclusions is not None else {}
    for node, why in old.items():
        if node in wanted:
            continue
        if not s.pods_synced:
            wanted[node] = why  # a pod's condition is not known gone yet
            continue
        info = s.nodes.get(node)
        if info is None:
            if not s.nodes_synced:
                wanted[node] = why  # not known gone yet
            continue  # deleted: nothing left to exclude
        if leaving_signal(info, reclaim_taints) is not None:
            wanted[node] = why  # still leaving (NotReady as well, say)
    # A node only picks up a new reason when it is newly excluded: no write per decision.
    wanted = {n: old.get(n, why) for n, why in wanted.items()}
    if wanted == old:
        return None
    return WriteExclusions(Exclusions(nodes=dict(sorted(wanted.items())), updated_at=now))
