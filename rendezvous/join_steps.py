"""What ``regroup.rendezvous.decisions.plan_join`` answers: the next step of an agent on its way
into a round. The join loop (``regroup.rendezvous.joining``) applies them."""

from __future__ import annotations

from dataclasses import dataclass

from regroup.records import RoundState


@dataclass(frozen=True)
class Done:
    """This agent is rank ``rank`` of round ``round``."""

    round: int
    rank: int
    node_count: int
    """Nodes in the round (torch's ``RendezvousInfo.world_size``)."""


@dataclass(frozen=True)
class PutJoin:
    """Write (or refresh) this agent's join record for ``round``."""

    round: int
    reason: str


@dataclass(frozen=True)
class CloseRound:
    """Compare-and-set ``rdzv/state`` from ``expected_revision`` to ``state``."""

    state: RoundState
    expected_revision: int


@dataclass(frozen=True)
class Wait:
    """Nothing to do until the view changes or ``until`` (unix time) passes."""

    reason: str
    until: float | None = None
    excluded: bool = False
    """This agent's node is in ``control/excluded``: it waits for that to lift, not for peers."""


@dataclass(frozen=True)
class Excluded:
    """The controller's expected membership left this agent out: leave cleanly."""

    reason: str


@dataclass(frozen=True)
class Closed:
    """The rendezvous is closed: the job is over."""


@dataclass(frozen=True)
class Conflict:
    """The job runs with other bounds than this agent's ``--nnodes``."""

    reason: str


JoinStep = Done | PutJoin | CloseRound | Wait | Excluded | Closed | Conflict
