"""``JoinLoop``: one agent's way into the next round, run on the handler's loop thread.

It applies the steps ``regroup.rendezvous.decisions.plan_join`` decides (write the join record,
close the round, wait for the view to change) until the agent has a rank, and turns the
steps that end its rendezvous (left out, closed, conflicting bounds, timeouts, a stop on
notice) into torch's rendezvous errors.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)

from regroup.etcd import TRANSIENT_ERRORS as ETCD_ERRORS
from regroup.exit_codes import LEFT_JOB
from regroup.rendezvous.agent import AgentKeys, DuplicateNode
from regroup.rendezvous.decisions import Bounds, JobView, plan_join
from regroup.rendezvous.join_steps import Closed, CloseRound, Conflict, Done, Excluded, PutJoin, Wait
from regroup.rendezvous.settings import RendezvousSettings
from regroup.rendezvous.watch import JobWatch

log = structlog.get_logger("rendezvous")


class ExcludedFromRound(RendezvousGracefulExitError):
    """The controller's expected membership left this node out of the next round. The
    in-place agent stays and asks to be let back in; torch's agent exits ``LEFT_JOB``."""


class ExcludedTooLong(RendezvousError):
    """This agent stayed out of the job's rounds (left out of one, or its node listed in
    ``control/excluded``) for ``excluded_timeout``: it leaves the job (``LEFT_JOB``)."""


class JoinStopped(RendezvousError):
    """The agent was told to stop (SIGTERM) and may not wait for a round any longer."""


class LeftJob(SystemExit):
    """This agent leaves a job that goes on: it exits ``LEFT_JOB`` (75), never 0, which
    would mark the pod of an Indexed Job, a JobSet or a PyTorchJob succeeded for good."""

    def __init__(self, reason: str) -> None:
        super().__init__(LEFT_JOB)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class JoinLoop:
    """Joins one agent into rounds, one ``join`` per ``next_rendezvous``."""

    def __init__(self, settings: RendezvousSettings, keys: AgentKeys, watch: JobWatch, bounds: Bounds) -> None:
        self._settings = settings
        self._keys = keys
        self._watch = watch
        self._bounds = bounds
        self._last_reason = ""
        self.seat: int | None = None
        """The round this agent's step-out join asked for: its place if that round counts it."""
        self.alone = ""
        """Why this agent leaves the job on its own (left out, excluded, refused): then
        ``shutdown`` does not close the run for the others."""
        self.waiting = ""
        """What the join waits on right now ("" while it is not waiting)."""
        self.left_out_at: float | None = None
        """Unix time this agent was left out of a round against its will (not told to stop),
        until it has a place again: ``excluded_timeout`` counts from then."""
        self.stop_at: float | None = None
        """Unix time after which the agent, told to stop, may not wait for a round any longer."""
        self.stop_reason = ""

    def _spare(self, view: JobView) -> bool:
        """Whether this agent waits outside a round of the job that is running: the round is
        open, this agent is not in it, and every agent of it is alive."""
        state = view.state
        if state is None or state.closed or view.rank_of(self._keys.me.agent) is not None:
            return False
        alive = view.alive()
        return all(agent in alive for agent in state.agents)

    @property
    def node(self) -> str:
        return self._settings.identity.node

    async def join(self) -> Done:
        """Apply ``plan_join``'s steps until this agent has a rank in a round."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._settings.timeouts.join.total_seconds()
        watch = self._watch
        joined_for: int | None = None
        excluded_since: float | None = None
        was_spare = False
        backoff = 0.05
        while True:
            try:
                version = watch.version
                stopped = self.stopped(time.time())
                if stopped:
                    self.alone = stopped
                    raise JoinStopped(f"node {self.node}: {stopped}")
                step = plan_join(watch.view, self._keys.me, joined_for, time.time(), self._bounds, seat=self.seat)
                self._note(step)
                if isinstance(step, Done):
                    self.seat = self.left_out_at = None
                    self.alone = ""
                    return step
                if isinstance(step, PutJoin):
                    self.seat = None  # the new record replaces the one left when stepping out
                    if self._keys.registered:
                        revision = await self._keys.put_join(step.round)
                    else:
                        try:
                            await self._keys.claim_node(watch)
                        except DuplicateNode as exc:
                            self.alone = str(exc)
                            raise
                        revision = await self._keys.register(join_round=step.round)
                    await watch.caught_up(revision, 2.0)
                    joined_for = step.round
                elif isinstance(step, CloseRound):
                    won, revision = await self._keys.close_round(step)
                    if won:
                        log.info(
                            "round closed",
                            job=self._settings.job.job,
                            round=step.state.round,
                            reason=step.state.reason,
                            nodes=step.state.nodes,
                        )
                    await watch.caught_up(revision, 2.0)
                elif isinstance(step, Wait):
                    if step.excluded:
                        self.alone = step.reason
                        excluded_since = loop.time() if excluded_since is None else excluded_since
                    else:
                        excluded_since = None
                        if self.left_out_at is None:
                            self.alone = ""
                    spare = not step.excluded and self._spare(watch.view)
                    if spare or was_spare:
                        # A spare: the job trains without this agent and it waits for a place
                        # for as long as the job runs; join_timeout bounds forming a round, from
                        # the moment a place is free (the wake-up that sees the loss may come
                        # just at the deadline the last wait set).
                        deadline = max(deadline, loop.time() + self._settings.timeouts.join.total_seconds())
                    was_spare = spare
                    remaining = deadline - loop.time()
                    if step.excluded or self.left_out_at is not None:
                        # Out of the job, not late: excluded_timeout applies, join_timeout does not.
                        out_for = max(
                            loop.time() - excluded_since if excluded_since is not None else 0.0,
                            time.time() - self.left_out_at if self.left_out_at is not None else 0.0,
                        )
                        limit = self._settings.timeouts.excluded.total_seconds()
                        if out_for >= limit:
                            raise ExcludedTooLong(
                                f"rendezvous {self._settings.job.job}: {self.alone or step.reason}; out of the job "
                                f"for excluded_timeout {limit:g}s, leaving it (exit {LEFT_JOB}) so the pod's "
                                "restart policy applies"
                            )
                        deadline = max(deadline, loop.time() + self._settings.timeouts.join.total_seconds())
                        remaining = limit - out_for
                    if self.stop_at is not None:
                        remaining = min(remaining, max(0.0, self.stop_at - time.time()) + 0.01)
                    if remaining <= 0:
                        raise RendezvousTimeoutError(
                            f"rendezvous {self._settings.job.job}: no round formed within join_timeout "
                            f"{self._settings.timeouts.join.total_seconds():.0f}s ({step.reason})"
                        )
                    if step.until is not None:
                        remaining = min(remaining, max(0.0, step.until - time.time()) + 0.01)
                    await watch.changed(remaining, since=version)
                elif isinstance(step, Excluded):
                    self.alone = step.reason
                    raise ExcludedFromRound(f"node {self.node}: {step.reason}")
                elif isinstance(step, Closed):
                    raise RendezvousClosedError(f"rendezvous {self._settings.job.job} is closed")
                elif isinstance(step, Conflict):
                    self.alone = step.reason
                    raise RendezvousError(f"rdzv-id {self._settings.job.job}: {step.reason}")
                backoff = 0.05
            except ETCD_ERRORS as exc:
                if loop.time() + backoff > deadline:
                    raise RendezvousConnectionError(
                        f"etcd at {self._settings.etcd.describe()} failed during rendezvous: {exc}"
                    ) from exc
                log.warning("etcd request failed during rendezvous; retrying", node=self.node, error=str(exc))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def left_out(self, reason: str) -> None:
        """This agent was left out of a round and stays to be let back in: the join waits for
        that at most ``excluded_timeout`` from now, and a shutdown meanwhile leaves the job alone."""
        self.left_out_at = time.time()
        self.alone = reason

    def stop_by(self, at: float, reason: str) -> None:
        """Told to stop: no wait for a round goes on past ``at`` (unix time); a join then
        raises ``JoinStopped``. Runs on the loop: it wakes every wait of this agent at once
        and again at ``at``."""
        self.stop_at, self.stop_reason = at, reason
        self._watch.poke()
        asyncio.get_running_loop().call_later(max(0.0, at - time.time()) + 0.01, self._watch.poke)

    def stopped(self, now: float) -> str:
        """Why this agent may not wait for a round any longer ("" while it may)."""
        if self.stop_at is None or now < self.stop_at:
            return ""
        return self.stop_reason or "told to stop"

    async def set_closed(self) -> None:
        """Compare-and-set the round state to closed, retrying until it is (by anyone). A job
        whose keys were removed after it finished (its tombstone) is closed already: nothing
        is written under it again."""
        watch = self._watch
        while True:
            view = watch.view
            if view.closed:
                return
            revision = await self._keys.mark_closed(view.state, view.state_revision)
            if revision:
                await watch.caught_up(revision, 2.0)
                return
            await watch.changed(0.5)

    def _note(self, step: Any) -> None:
        reason = getattr(step, "reason", "")
        self.waiting = reason if isinstance(step, Wait) else ""
        if isinstance(step, Wait) and reason != self._last_reason:
            log.info("rendezvous waiting", job=self._settings.job.job, node=self.node, reason=reason)
        self._last_reason = reason
