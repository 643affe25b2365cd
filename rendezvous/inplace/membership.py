"""The world a worker runs in (``Membership``), and why a worker leaves one.

A worker learns its world from the environment torchrun set (plain torchrun, or the first
world under ``regroup-run`` when the channel has none yet), or from its agent's
``world.json`` (``regroup.rendezvous.inplace.channel``) for every world after that.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from regroup.rendezvous.inplace.channel import NodeWorld


class Interrupted(Exception):
    """The current world is being re-formed (or a peer vanished): leave and rejoin. What a
    script written against ``ElasticWorld`` raises itself (``reform_due()``), and catches
    around its step with its collectives' errors (``ElasticWorld.interrupted``)."""


class Reform(BaseException):
    """The current world is being re-formed (or a peer vanished): leave and rejoin.

    What ends a call of the training function under ``@elastic.in_place`` for a re-form
    (``regroup.elastic.Reform``). A ``BaseException``, as ``SystemExit`` and
    ``KeyboardInterrupt`` are, so that an ``except Exception`` in the script, and a wrapper
    that catches ``Exception`` (``@hydra.main`` exits 1 on one), let it through to
    ``in_place``. ``clean``: every rank left at one agreed step boundary, so the live state
    is consistent (else only snapshots and committed checkpoints are)."""

    def __init__(self, why: str = "re-form", *, clean: bool = True) -> None:
        super().__init__(why)
        self.clean = clean


class Superseded(RuntimeError):
    """The world being formed was replaced by a newer one before it started."""


class LeavingJob(SystemExit):
    """This worker's node is left out of the next world (the controller's expected
    membership excludes it): the job goes on without it, and the script should exit.

    Raised by ``ElasticWorld.rejoin`` (and ``join``) once the agent's announcement says this
    node is leaving, after the worker reported "leaving" to its agent, which then leaves the
    job at once and stops the worker. It is a ``SystemExit`` with code 0: a script that does
    not catch it ends cleanly, and an ``except Exception`` around a training step does not
    swallow it. Catch it to clean up first (close files, ``world.close()``), then exit."""

    def __init__(self, reason: str = "this node leaves the job") -> None:
        super().__init__(0)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class ReformFailed(RuntimeError):
    """This worker could not take part in the re-form in place; it should exit non-zero so
    its agent restarts it (the restart path)."""


@dataclass(frozen=True)
class Membership:
    """The world this process runs in."""

    round: int
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    group_rank: int = 0
    group_world_size: int = 1
    restart_count: int = 0
    traceparent: str = ""
    seq: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str], local_rank: int) -> Membership:
        """The world torchrun started this worker in (round 0: not handed out by an agent)."""
        return cls(
            round=0,
            rank=int(env.get("RANK", "0")),
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=local_rank,
            master_addr=env.get("MASTER_ADDR", ""),
            master_port=int(env.get("MASTER_PORT", "0") or 0),
            group_rank=int(env.get("GROUP_RANK", "0")),
            group_world_size=int(env.get("GROUP_WORLD_SIZE", "1")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )

    @classmethod
    def from_world(cls, world: NodeWorld, local_rank: int) -> Membership:
        """Worker ``local_rank``'s place in the world its agent handed out."""
        slot = world.slot(local_rank)
        return cls(
            round=world.round,
            rank=slot.rank,
            world_size=slot.world_size,
            local_rank=local_rank,
            master_addr=world.master_addr,
            master_port=world.master_port,
            group_rank=world.group_rank,
            group_world_size=world.group_world_size,
            restart_count=world.restart_count,
            traceparent=world.traceparent,
            seq=world.seq,
        )
