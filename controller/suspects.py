"""The nodes of a job that a decision must look at closely.

A node of the job (of its round, or with a member) is a suspect unless it is plainly
healthy: its member is in the current round with the agent the round names, is not
leaving and saw no collective of the round fail on a peer, its pod is there and running,
the agent's container has not ended since the agent registered, and the node is known and
carries no taint, cordon or NotReady.
``decide`` examines only suspects; every other node of the round is known healthy.
Over-flagging is harmless (a closer look), missing one is not, so anything in doubt is
a suspect. The model keeps each job's set up to date node by node (``refresh``) and
recomputes it whole only when the round changes (``job_suspects``).
"""

from __future__ import annotations

from collections.abc import Iterable

from regroup.controller.disruption import agent_exit
from regroup.controller.fleet import Fleet
from regroup.controller.job_state import JobState


def is_suspect(state: JobState, fleet: Fleet, node: str) -> bool:
    """Whether ``node``, a node of the job's round or members, is not plainly healthy."""
    member = state.members.get(node)
    if member is None or member.round != state.round.world_round or node in fleet.flagged or node not in fleet.nodes:
        return True
    if member.leaving_by > 0 or member.peer_failure_round == state.round.world_round:
        return True
    agents = state.round.agents
    if node in agents and member.joined_at != agents[node]:
        return True
    if member.pod:
        pod = state.pods.get(member.pod)
        if pod is None or pod.deleting or pod.phase in ("Failed", "Succeeded"):
            return True
        return agent_exit(pod, member.joined_at) is not None
    return False


def job_suspects(state: JobState, fleet: Fleet) -> set[str]:
    """The job's suspects computed afresh."""
    nodes = state.round.seen | state.members.keys()
    return {node for node in nodes if is_suspect(state, fleet, node)}


def refresh(state: JobState, fleet: Fleet, nodes: Iterable[str]) -> None:
    """Bring the job's suspects up to date after a change that concerns only ``nodes``."""
    suspects = state.suspects
    if suspects is None:
        return
    for node in nodes:
        if (node in state.members or node in state.round.seen) and is_suspect(state, fleet, node):
            suspects.add(node)
        else:
            suspects.discard(node)
