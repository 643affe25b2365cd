"""The rendezvous' own records under ``rdzv/`` (versioned JSON, like ``regroup.records``).

    rdzv/state          RoundState: the last formed round; compare-and-set on mod_revision
    rdzv/joins/<node>   JoinRecord: this agent wants into round N (bound to its lease)
    rdzv/rounds/<n>/... the agents' c10d store of round n (``rendezvous.store``)

An agent is named by ``agent_id(member)``: node plus the time its agent registered, so a
restarted agent on the same node is a different agent from the one a round remembers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from regroup.records import MemberRecord, Record


def agent_id(member: MemberRecord) -> str:
    """Identity of one agent process: its node and registration time."""
    return f"{member.node}@{member.joined_at!r}"


@dataclass(frozen=True)
class RoundState(Record):
    """The last round formed for the job (``rdzv/state``)."""

    kind: ClassVar[str] = "rdzv-state"
    min_nodes: int
    max_nodes: int
    round: int = 0
    """Number of the last formed round (0: none yet)."""
    nodes: list[str] = field(default_factory=list)
    """Nodes of the round, in rank order."""
    agents: list[str] = field(default_factory=list)
    """Agent ids of the round, parallel to ``nodes``."""
    hosts: list[str] = field(default_factory=list)
    """Addresses of the round's agents, parallel to ``nodes``."""
    reform_generation: int = 0
    """The ``control/reform`` generation already seen when this round formed."""
    expected_generation: int = 0
    """The last ``control/expected`` generation a round consumed."""
    excluded: list[str] = field(default_factory=list)
    """Agents left out by the consumed expected membership: they exit cleanly."""
    closed: bool = False
    """The job is finished: no more rounds (``set_closed``)."""
    formed_at: float = 0.0
    reason: str = ""
    """Why the round closed when it did."""

    def rank_of(self, agent: str) -> int | None:
        try:
            return self.agents.index(agent)
        except ValueError:
            return None


@dataclass(frozen=True)
class JoinRecord(Record):
    """An agent asking to be part of round ``round`` (``rdzv/joins/<node>``)."""

    kind: ClassVar[str] = "rdzv-join"
    node: str
    agent: str
    round: int
    host: str
    joined_at: float
    not_before: float = 0.0
    """Unix time before which the round does not wait for or count this agent: it is on
    probation after its own workers failed (in-place jobs train on without it meanwhile)."""
