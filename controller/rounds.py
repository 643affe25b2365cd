"""Which round a job is in and who is in it, followed from its members and ``rdzv/state``.

The rendezvous' own record of the last formed round (``rdzv/state``, owned by
rendezvous/) is the authority once it exists. Without it the members lead: the round
advances only when a node of the current round moves to a later one, so joiners
announcing a later round do not move it, nor do agents that restarted.

It also follows which rounds the trainers took a step in (``progress``, from the round
its record names): a round that gave way to the next before any training step in it did
not hold, and rounds that do not hold, again and again, are what flapping is. A re-form
the controller asked for, in place or not, with a spare or not, and the round the agents
form around a crashed rank all train at once; they are churn the job got through, however
many of them come.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from regroup.records import MemberRecord, Progress, ReformPlan, RoundState

HISTORY = 64
"""Restart and round timestamps kept per node/job: far more than any K of a storm rule."""


class JobRound:
    """A job's current round, the nodes seen in it, and when its rounds advanced."""

    def __init__(self) -> None:
        self.world_round: int | None = None
        self.seen: set[str] = set()
        """Nodes seen as members of ``world_round``, including ones whose member has vanished since."""
        self.formed_round: int | None = None
        """``rdzv/state``'s last formed round, when the rendezvous has written one."""
        self.agents: dict[str, float] = {}
        """Node -> ``joined_at`` of the agent in the formed round (from ``rdzv/state``)."""
        self.order: tuple[str, ...] = ()
        """The formed round's nodes in rank order (``rdzv/state``); empty without that record."""
        self.formed_at = 0.0
        """When the rendezvous says the formed round formed (``rdzv/state`` ``formed_at``); 0: not known."""
        self.closed = False
        """``rdzv/state`` says the run is closed: the job is over (``set_closed``/``shutdown``)."""
        self.times: deque[float] = deque(maxlen=HISTORY)
        """When the round advanced (rendezvous rounds), oldest first."""
        self.advanced = 0
        """Rounds the job's world advanced through while observed."""
        self.trained = 0
        """The newest round the trainers took a step in: the round their newest progress
        record names (with a trainer that names none, the round in place when it came)."""
        self.untrained: deque[float] = deque(maxlen=HISTORY)
        """When the round advanced past one the trainers took no step in (it formed, then
        gave way before any training), oldest first: what the flapping alert counts."""

    def progressed(self, progress: Progress) -> None:
        """A progress record of the trainers arrived: the round it comes from trained."""
        self.trained = max(self.trained, progress.round or self.world_round or 0)

    def formed(self, record: RoundState, members: Mapping[str, MemberRecord], now: float) -> tuple[bool, bool]:
        """Apply ``rdzv/state``. Returns (anything changed, the round changed)."""
        if record.closed != self.closed:
            self.closed = record.closed
            return True, False
        formed = record.round
        if formed < 1 or formed == self.formed_round:
            return False, False
        self.agents = record.joined_at()
        self.order = tuple(record.nodes)
        self.formed_at = record.formed_at
        if self.world_round is not None and formed > self.world_round:
            self._advance(now, self.world_round)
        self.formed_round = self.world_round = formed
        self.seen = set(record.nodes)
        self.seen.update(n for n, m in members.items() if m.round == formed)
        return True, True

    def member_put(self, node: str, member: MemberRecord, members: Mapping[str, MemberRecord],
                   plan: ReformPlan | None, now: float) -> bool:
        """``node``'s member was written (``members`` already holds it). Returns whether the round changed.

        Only this member changed: every other node of ``seen`` still reports the round it
        did, so the whole membership is read only when the round itself moves.
        """
        if self.world_round is None:
            self._first_round(members, plan)
            return True
        if member.round == self.world_round:
            self.seen.add(node)
            return False
        if self.formed_round is None and node in self.seen and member.round > self.world_round:
            self._advance(now, self.world_round)
            self.world_round = member.round
            self.seen = {n for n, m in members.items() if m.round == member.round}
            return True
        return False

    def _first_round(self, members: Mapping[str, MemberRecord], plan: ReformPlan | None) -> None:
        """Without ``rdzv/state``: the plan's round if its members are in it, else the most
        common round among the members (the lowest on a tie)."""
        rounds = [m.round for m in members.values()]
        if plan is not None and plan.round_after and plan.round_after in rounds:
            self.world_round = plan.round_after
        else:
            counts: dict[int, int] = {}
            for r in rounds:
                counts[r] = counts.get(r, 0) + 1
            self.world_round = max(counts, key=lambda r: (counts[r], -r))
        self.seen = {n for n, m in members.items() if m.round == self.world_round}

    def _advance(self, now: float, left: int) -> None:
        """The round advanced past round ``left`` (0: the agents had formed none yet)."""
        self.times.append(now)
        if left > self.trained:
            self.untrained.append(now)
        self.advanced += 1
