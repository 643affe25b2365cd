"""The seeded series of faults: which kinds, in which order, with which parameters.

The plan is a pure function of the seed and the fault count, so a campaign that found a
violation is replayed by its seed (``--seed S --faults I+1``), and one fault of it on a
fresh job by ``--seed S --only I``. What the faults hit at run time (which node is a
member, when a save is in flight) depends on the job; the plan fixes the choices the
campaign makes about it (``pick`` of the candidates, ``delay`` after the moment).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

NODE_KILL = "node-kill"
"""SIGKILL of the node's whole process tree (agent and workers), and the node is gone."""
RANK_KILL = "rank-kill"
"""SIGKILL of the node's worker processes only: the agent lives and restarts its rank."""

MID_STEP = "mid-step"
"""Right after a training step, the survivors then blocked in the next step's collectives."""
DURING_SAVE = "save"
"""While a checkpoint step folder exists without its commit marker."""
DURING_RENDEZVOUS = "rendezvous"
"""When a member of the current round puts its join record for the next round."""
AFTER_ACK = "after-ack"
"""Right after a checkpoint ack, before the controller's re-form."""

KILL_POINTS: tuple[str, ...] = (MID_STEP, DURING_SAVE, DURING_RENDEZVOUS, AFTER_ACK)

ETCD_RESTART = "etcd-restart"
CONTROLLER_KILL = "controller-kill/mid-reform"
WATCH_DROP = "watch-drop"
SHORT_RECLAIM = "short-reclaim"

KINDS: tuple[str, ...] = (
    *(f"{target}/{point}" for point in KILL_POINTS for target in (NODE_KILL, RANK_KILL)),
    ETCD_RESTART,
    CONTROLLER_KILL,
    WATCH_DROP,
    SHORT_RECLAIM,
)
"""Every kind a campaign draws from; ``--quick`` plays each once."""


@dataclass(frozen=True)
class Fault:
    """One planned fault."""

    index: int
    kind: str
    pick: float
    """Which candidate node to hit: this fraction into the sorted candidates."""
    delay: float
    """Fraction of a step to wait after the moment is seen (mid-step: where in the step)."""
    gap_s: float
    """watch-drop: how long the cluster watch stays broken (a node is killed inside the gap)."""
    crash: bool
    """etcd-restart: SIGKILL (a crash) instead of SIGTERM (a clean restart)."""

    @property
    def target(self) -> str | None:
        """``node-kill`` or ``rank-kill`` for the timed kills, else None."""
        head, _, _ = self.kind.partition("/")
        return head if head in (NODE_KILL, RANK_KILL) else None

    @property
    def point(self) -> str | None:
        """The moment a timed kill waits for, else None."""
        return self.kind.partition("/")[2] if self.target else None

    def describe(self) -> str:
        if self.kind == ETCD_RESTART:
            return f"etcd {'killed (SIGKILL)' if self.crash else 'stopped (SIGTERM)'} and started again"
        if self.kind == WATCH_DROP:
            return f"cluster watch dropped for {self.gap_s:.1f}s, a node killed in the gap, then a relist"
        if self.kind == SHORT_RECLAIM:
            return "reclaim notice of 0.5s, shorter than a checkpoint"
        if self.kind == CONTROLLER_KILL:
            return "controller cancelled mid re-form, a new instance takes over"
        return self.kind

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def draw_plan(seed: int, count: int, kinds: Sequence[str] = KINDS) -> list[Fault]:
    """``count`` faults from ``random.Random(seed)``: the kinds in shuffled rounds (each
    kind once per round, so every kind is played in proportion), each with its parameters."""
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise ValueError(f"unknown fault kind {unknown[0] if unknown else '(none given)'}; known: {', '.join(KINDS)}")
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < count:
        batch = list(kinds)
        rng.shuffle(batch)
        order += batch
    return [
        Fault(
            index=i,
            kind=kind,
            pick=rng.random(),
            delay=rng.random(),
            gap_s=round(rng.uniform(1.0, 3.0), 2),
            crash=rng.random() < 0.5,
        )
        for i, kind in enumerate(order[:count])
    ]
