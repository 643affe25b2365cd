"""``JoinLoop``: one agent's way into the next round, run on the handler's loop thread.

It applies the steps ``regroup.rendezvous.decisions.plan_join`` decides (write the join record,
close the round, wait for the view to change) until the agent has a rank, and turns the
steps that end its rendezvous (left out, closed, conflicting bounds, timeouts) into
torch's rendezvous errors.
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
from regroup.rendezvous.agent import AgentKeys, DuplicateNode
from regroup.rendezvous.decisions import Bounds, plan_join
from regroup.rendezvous.join_steps import Closed, CloseRound, Conflict, Done, Excluded, PutJoin, Wait
from regroup.rendezvous.settings import RendezvousSettings
from regroup.rendezvous.watch import JobWatch

log = structlog.get_logger("rendezvous")


class ExcludedFromRound(RendezvousGracefulExitError):
    """The controller's expected membership left this node out; its agent exits cleanly."""


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
        backoff = 0.05
        while True:
            try:
                version = watch.version
                step = plan_join(watch.view, self._keys.me, joined_for, time.time(), self._bounds, seat=self.seat)
                self._note(step)
                if isinstance(step, Done):
                    self.seat = None
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
                    remaining = deadline - loop.time()
                    if step.excluded:
                        self.alone = step.reason
                        excluded_since = loop.time() if excluded_since is None else excluded_since
                        limit = self._settings.timeouts.excluded.total_seconds()
                        if loop.time() - excluded_since >= limit:
                            raise RendezvousError(
                                f"rendezvous {self._settings.job.job}: {step.reason}; still excluded after "
                                f"excluded_timeout {limit:.0f}s, exiting so the pod's restart policy applies"
                            )
                        remaining = min(remaining, excluded_since + limit - loop.time())
                    else:
                        excluded_since, self.alone = None, ""
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

    async def set_closed(self) -> None:
        """Compare-and-set the round state to closed, retrying until it is (by anyone)."""
        watch = self._watch
        while True:
            view = watch.view
            if view.state is not None and view.state.closed:
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
