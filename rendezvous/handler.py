"""``EtcdV3RendezvousHandler``: torchrun's ``RendezvousHandler`` on the etcd v3 API.

torchrun calls it from its (synchronous) agent; the etcd work runs on an asyncio loop
in a thread. Decisions come from ``regroup.rendezvous.decisions`` (pure), the join loop that
applies them from ``regroup.rendezvous.joining``, the writes from ``regroup.rendezvous.agent``, the view
of the job from ``regroup.rendezvous.watch``.

Every round gets a fresh agent store in etcd (``regroup.rendezvous.store.RoundStore``), so no
stale worker address or ``MASTER_ADDR`` of an earlier round can leak into this one
(pytorch#135712), and no agent hosts a store the job depends on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import structlog
from opentelemetry import trace
from torch.distributed import Store
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from regroup.etcd import TRANSIENT_ERRORS as ETCD_ERRORS
from regroup.exit_codes import LEFT_JOB
from regroup.failures import FAILURE_DIR_ENV, charged, take_failures
from regroup.telemetry import context_from_traceparent
from regroup.rendezvous.agent import AgentKeys
from regroup.rendezvous.connection import Shared
from regroup.rendezvous.decisions import Bounds, JobView, count_spares, count_waiting, round_abandoned, usable_expected
from regroup.rendezvous.joining import ExcludedFromRound, ExcludedTooLong, JoinLoop
from regroup.rendezvous.ports import master_port
from regroup.rendezvous.settings import RendezvousSettings
from regroup.rendezvous.silent import to_probe
from regroup.rendezvous.store import RoundAbandoned, RoundStore, round_prefix

log = structlog.get_logger("rendezvous")

BACKEND_NAME = "etcd-v3"
# A stepped-out agent asks not to be counted until it joins for real (which resets this).
_STEPPED_OUT_S = 3600.0
# How long a read of the round's store waits for its key.
STORE_TIMEOUT = timedelta(seconds=60)


class EtcdV3RendezvousHandler(RendezvousHandler):
    """Elastic rendezvous on etcd v3: leased members, watch-driven, controller-aware."""

    def __init__(
        self,
        settings: RendezvousSettings,
        shared: Shared | None = None,
        exit_when_excluded: bool = False,
        tracer_provider: trace.TracerProvider | None = None,
    ) -> None:
        """``shared``: a connection several handlers of one process use (default: its own).
        ``exit_when_excluded``: see the attribute.
        ``tracer_provider``: where the ``regroup.rendezvous.join`` spans go (default: global)."""
        self._settings = settings
        self._tracer_provider = tracer_provider
        self._tracer = trace.get_tracer("regroup.rendezvous", tracer_provider=tracer_provider)
        self.exit_when_excluded = exit_when_excluded
        """Leave the process with ``SystemExit(LEFT_JOB)`` instead of raising ``ExcludedFromRound``
        or ``ExcludedTooLong``: what torch's agent needs, which cannot rejoin (see
        ``next_rendezvous``). The in-place agent turns it off: it stays and asks to be let back in."""
        self._leaving = ""
        self._leave_by: float | None = None
        self._peer_failure_round = 0
        self._owns_shared = shared is None
        self._shared = shared or Shared.open(settings)
        self._keys = AgentKeys(self._shared.connection, settings)
        self._bounds = Bounds(settings.min_nodes, settings.max_nodes, settings.timeouts.last_call.total_seconds())
        self._joining = JoinLoop(settings, self._keys, self._shared.connection.watch, self._bounds)
        self._round = 0
        self._restart_count = 0
        self._restart_requested = False
        self._store: Store | None = None
        # Workers (started after this, inheriting the environment) report why they failed here.
        self._failures = tempfile.mkdtemp(prefix=f"regroup-failures-{settings.identity.node}-")
        os.environ[FAILURE_DIR_ENV] = self._failures
        self._traceparent = ""
        self._probation: timedelta | None = None
        self._stepped_out: bool | None = None
        self._shutdown_result: bool | None = None
        self._shutdown_lock = threading.Lock()
        for note in settings.notes:
            log.info(note, job=settings.job.job, node=settings.identity.node)

    # -- RendezvousHandler --------------------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    @property
    def use_agent_store(self) -> bool:
        # Workers bootstrap their own store from MASTER_ADDR/PORT, chosen fresh each round.
        return False

    def get_run_id(self) -> str:
        return self._settings.job.job

    @property
    def settings(self) -> RendezvousSettings:
        return self._settings

    @property
    def node(self) -> str:
        return self._settings.identity.node

    @property
    def view(self) -> JobView:
        """This agent's current view of the job's etcd keys."""
        return self._shared.connection.watch.view

    @property
    def round(self) -> int:
        """The round this agent last joined (0: none yet)."""
        return self._round

    @property
    def restart_count(self) -> int:
        """Rounds this agent re-entered because its own workers failed (see ``next_rendezvous``)."""
        return self._restart_count

    @property
    def traceparent(self) -> str:
        """The ``traceparent`` of the controller request the last round answered ("" if none)."""
        return self._traceparent

    @property
    def waiting_for(self) -> str:
        """What this agent's rendezvous waits on right now, e.g. that its node is excluded
        ("" while it is not waiting)."""
        return self._joining.waiting

    def left_out(self) -> bool:
        """The controller's next expected membership leaves this node out (it is leaving)."""
        expected = usable_expected(self.view, self._bounds)
        return expected is not None and self.node not in expected.nodes

    def in_round(self) -> bool:
        """This agent's workers hold ranks of the job that a planned leave would hand over: it
        has a rank in the last formed round, or that round left it out and its workers are
        still in the one before (their hand-off is still to come)."""
        view = self.view
        state = view.state
        if state is None or state.closed or not self._round:
            return False
        agent = self._keys.me.agent
        return view.rank_of(agent) is not None or agent in state.excluded

    def note_peer_failure(self, round: int, at: float, peer: str) -> None:
        """A worker's collective of ``round`` failed on a peer (named ``peer``, a host, or
        ""): say so in this agent's member record, once per round. From any thread."""
        if round <= self._peer_failure_round:
            return
        self._peer_failure_round = round
        log.warning("a worker's collective failed on a peer", job=self._settings.job.job, node=self.node,
                    round=round, peer=peer or "not named")
        self._on_loop(self._keys.note_peer_failure_soon, round, at, peer, to_probe(self.view.members, round, self.node))

    def note_worker_exit(self, round: int, note: str) -> None:
        """A worker exited during the in-place re-form of ``round``'s world, likely for the
        reason ``note`` says (one line): put it in this agent's member record. From any thread."""
        self._on_loop(self._keys.note_worker_exit_soon, round, note)

    def notice_leaving(self, since: float, by: float, stop_at: float, reason: str) -> None:
        """This agent was told to stop (SIGTERM) at ``since`` and must be gone by ``by``: say so
        in its member record (``leaving_since``, ``leaving_by``: the controller's cue for a
        planned leave), and let no wait for a round go on past ``stop_at``. From then on a
        shutdown leaves the job alone. Unix times. Safe to call from a signal handler while
        this handler's rendezvous runs: it only hands the work to the loop thread."""
        self._leaving = f"told to stop: {reason}"
        self._leave_by = by
        self._on_loop(self._note_leaving, since, by, stop_at, reason)

    def _note_leaving(self, since: float, by: float, stop_at: float, reason: str) -> None:
        log.warning(
            "leaving the job on notice", job=self._settings.job.job, node=self.node, round=self._round,
            leaving_by=by, stop_at=stop_at, reason=reason,
        )  # fmt: skip
        self._keys.note_leaving_soon(since, by)
        self._joining.stop_by(stop_at, reason)

    def start_over(self, reason: str, warming: bool = False) -> None:
        """This agent was left out of the round (``ExcludedFromRound``) and was not told to
        stop: it stays, as a new agent of its node that asks to join the next round (the round
        never admits the agent it left out). The controller lets it back in, or keeps it out
        while its node is leaving (``control/excluded``); after ``excluded_timeout`` without a
        place the next join raises ``ExcludedTooLong``.

        ``warming``: its workers are being restarted ahead of that join (``--standby``). Until
        ``next_rendezvous`` it asks not to be counted (as a stepped-out agent does) and its
        member record says it is warming up, so a grow does not hold the others for it."""
        if warming:
            self._keys.not_before = time.time() + _STEPPED_OUT_S
            self._keys.warming_since = time.time()
        self._round = 0
        self._store = None
        self._stepped_out = None
        self._restart_requested = False
        self._joining.left_out(reason)
        self._shared.loop.run(self._keys.start_over(), self._settings.timeouts.close)

    def step_out(self) -> None:
        """This node's workers failed and are being restarted: say so at once, with a join
        record for the next round that asks not to be counted, so the others re-form without
        this node now instead of waiting on its ranks. ``next_rendezvous`` later joins for
        real (after the probation, when in place)."""
        self._stepped_out = self._charge_failure()
        self._keys.not_before = time.time() + _STEPPED_OUT_S
        self._keys.warming_since = time.time()
        self._update_member()
        state = self.view.state
        self._joining.seat = (state.round if state else 0) + 1
        try:
            self._shared.loop.run(self._keys.put_join(self._joining.seat), self._settings.timeouts.close)
        except (TimeoutError, RuntimeError, *ETCD_ERRORS) as exc:
            log.warning("could not step out of the round; the others notice through the workers", error=str(exc))

    def _charge_failure(self) -> bool:
        """Whether the round just left failed through this node's own workers (then counted
        in ``restart_count``, which the controller's restart-storm rule reads)."""
        own = bool(self._round) and not self._restart_requested and charged(take_failures(self._failures))
        if own:
            self._restart_count += 1
        return own

    def _on_loop(self, work: Callable[..., object], *args: object) -> None:
        """Hand ``work`` to the loop thread, from any thread (a signal handler too); nothing
        when the loop is closed: this agent has left already."""
        with contextlib.suppress(RuntimeError):
            self._shared.loop.loop.call_soon_threadsafe(work, *args)

    def _update_member(self) -> None:
        """Rewrite the member record (round, restart count, probation) from this thread."""
        self._shared.loop.loop.call_soon_threadsafe(self._keys.update_member_soon, self._round, self._restart_count)

    def abandon_round(self) -> None:
        """The round just joined cannot start (an agent of it vanished before the workers'
        ranks were assigned): the next ``next_rendezvous`` joins a newer one, and it is a
        membership change, not a restart of this node's workers."""
        self._restart_requested = True

    def enable_in_place(self, probation: timedelta = timedelta(seconds=5)) -> None:
        """Called by the in-place agent: after this node's own workers fail, its next join
        waits out ``probation`` while the others re-form without it and train on."""
        self._probation = probation

    def next_rendezvous(self) -> RendezvousInfo:
        """Join the next round and return this agent's rank, the world size and a fresh store.

        Raises ``ExcludedFromRound`` (a ``RendezvousGracefulExitError``) when the controller's
        expected membership leaves this node out, ``ExcludedTooLong`` when it stayed out of the
        job's rounds for ``excluded_timeout``, and ``JoinStopped`` once told to stop
        (``notice_leaving``). With ``exit_when_excluded`` the first two leave the process
        with ``SystemExit(LEFT_JOB)`` instead.

        ``restart_count`` counts the calls after the first that were not asked for by
        ``num_nodes_waiting()``: torchrun's agent re-enters the rendezvous either because
        this handler reported a membership change, or because its own workers failed
        (the only other path, and the one that spends one of ``--max-restarts``). Of the
        nodes whose workers failed in one round, a node is not charged when its ranks only
        failed because a peer went away (``regroup.failures``).
        """
        if self._stepped_out is not None:
            own_failure, self._stepped_out = self._stepped_out, None  # charged when stepping out
        else:
            own_failure = self._charge_failure()
        # Probation (in place): the others re-form without this node and train on meanwhile.
        probation = own_failure and self._probation is not None
        not_before = time.time() + self._probation.total_seconds() if probation and self._probation else 0.0
        if not_before or self._keys.not_before or self._keys.warming_since:
            self._keys.not_before = not_before
            self._keys.warming_since = 0.0  # its workers are up (standby), or start after the round
            self._update_member()
        if probation:
            log.info("own workers failed; on probation before rejoining", node=self.node, until=not_before)
        self._restart_requested = False
        self._traceparent = self._requested_by()
        attributes = {"regroup.job": self._settings.job.job, "regroup.node": self.node}
        with self._tracer.start_as_current_span(
            "regroup.rendezvous.join", context=context_from_traceparent(self._traceparent), attributes=attributes
        ) as span:
            info = self._next_rendezvous()
            span.set_attributes(
                {
                    "regroup.round": self._round,
                    "regroup.rank": info.rank,
                    "regroup.node_count": info.world_size,
                    "regroup.restart_count": self._restart_count,
                }
            )
            return info

    def _requested_by(self) -> str:
        """The ``traceparent`` of the controller request this rendezvous answers, if any: the
        agent's span then joins the re-form's trace."""
        view = self.view
        state = view.state
        if view.reform is not None and (state is None or view.reform.generation > state.reform_generation):
            return view.reform.traceparent
        if view.expected is not None and (state is None or view.expected.generation > state.expected_generation):
            return view.expected.traceparent
        return ""

    def _next_rendezvous(self) -> RendezvousInfo:
        timeout = self._settings.timeouts.join + timedelta(seconds=5)
        started = time.monotonic()
        while True:
            number, rank, node_count = self._join_round(timeout)
            prefix = round_prefix(self._settings.job.rdzv, number)
            store = RoundStore(
                self._shared.loop,
                self._shared.connection,
                prefix,
                STORE_TIMEOUT,
                abandoned=functools.partial(self._abandoned, number),
            )
            try:
                # Rank 0 publishes MASTER_ADDR/PORT in the round's store; the others wait for it.
                bootstrap = RendezvousStoreInfo.build(
                    rank, store, local_addr=self._settings.identity.host,
                    server_port=master_port() if rank == 0 else None,
                )
                break
            except RoundAbandoned as exc:
                log.warning("round abandoned before it started; joining the next", round=number, reason=str(exc))
            finally:
                # Once the round's address is known: a member record written at once would
                # reach every agent while all of them wait for that address.
                self._update_member()
        self._store = store
        spares, wanted = count_spares(self.view, time.time()), self._settings.spare_nodes
        log.info(
            "rendezvous complete",
            job=self._settings.job.job,
            node=self.node,
            round=number,
            rank=rank,
            node_count=node_count,
            restart_count=self._restart_count,
            spares=spares,
            spares_wanted=wanted,
            seconds=round_s(time.monotonic() - started),
        )
        if rank == 0 and spares < wanted:
            self._warn_spares(number, node_count, spares, wanted)
        return RendezvousInfo(store, rank, node_count, bootstrap)

    def _warn_spares(self, number: int, node_count: int, spares: int, wanted: int) -> None:
        """The job has fewer spares than ``spare_nodes`` asks for: the round's rank 0 says so,
        once per round for the whole job."""
        loss = "the next loss of a node" if not spares else f"a loss of a node beyond the {spares} spare(s)"
        if node_count > self._settings.min_nodes:
            note = f"{loss} shrinks the job to {node_count - 1} node(s)"
        else:
            note = f"{loss} stalls the job below --nnodes min {self._settings.min_nodes}"
        log.warning(
            "spares below wanted", job=self._settings.job.job, node=self.node, round=number, spares=spares,
            spares_wanted=wanted, note=note,
        )  # fmt: skip

    def _join_round(self, timeout: timedelta) -> tuple[int, int, int]:
        try:
            return self._shared.loop.run(self._rendezvous(), timeout)
        except (ExcludedFromRound, ExcludedTooLong) as exc:
            if not self.exit_when_excluded:
                raise
            # torch's agent cannot rejoin: it leaves a job that goes on, never with 0, which
            # would mark an Indexed Job's, JobSet's or PyTorchJob's pod succeeded for good.
            # (torch 2.13's launcher turns RendezvousGracefulExitError into an AttributeError
            # and exits 1; a SystemExit is what it lets through with its code.)
            log.warning(
                "left out of the next round; exiting", job=self._settings.job.job, node=self.node, reason=str(exc),
                exit_code=LEFT_JOB,
            )  # fmt: skip
            raise SystemExit(LEFT_JOB) from exc

    def _abandoned(self, number: int) -> str:
        """Why this agent waits no longer for round ``number``'s store ("" while it may): the
        round can no longer start, or this agent, told to stop, may not wait any longer."""
        return round_abandoned(self.view, number) or self._joining.stopped(time.time())

    def is_closed(self) -> bool:
        """The run is over: closed, or finished and its keys removed (its tombstone)."""
        return self.view.closed

    def set_closed(self) -> None:
        """Close the run: no more rounds; every agent's next rendezvous raises
        ``RendezvousClosedError``. Works before any round formed; idempotent."""
        try:
            self._shared.loop.run(self._joining.set_closed(), self._settings.timeouts.close)
        except TimeoutError:
            raise RendezvousTimeoutError(
                f"rendezvous {self._settings.job.job}: not closed within close_timeout "
                f"{self._settings.timeouts.close.total_seconds():g}s (etcd at {self._settings.etcd.describe()})"
            ) from None

    def num_nodes_waiting(self) -> int:
        waiting, reason = count_waiting(self.view, self._round, self._settings.max_nodes, time.time())
        if waiting:
            if not self._restart_requested:
                log.info("re-forming", job=self._settings.job.job, node=self.node, round=self._round, reason=reason)
            self._restart_requested = True
        return waiting

    def shutdown(self) -> bool:
        """Leave the rendezvous; close the run too when the job is over: this agent's
        workers succeeded (it entered torchrun's exit barrier), or no round ever formed.
        Otherwise it leaves alone (left out or excluded, refused at start, a joiner that gave
        up, or a failure) and the others re-form without it. Returns False when etcd could
        not record it (the lease still expires within ``lease_ttl``)."""
        with self._shutdown_lock:  # a second caller waits for the first one's answer
            if self._shutdown_result is None:
                self._shutdown_result = self._shutdown()
            return self._shutdown_result

    def _shutdown(self) -> bool:
        ok = True
        state = self.view.state
        finished = self._store is not None and getattr(self._store, "exit_barrier_entered", False)
        # Only a job that is over is closed: this agent's workers succeeded, or no round ever
        # formed. An agent that fails (its workers past --max-restarts, a store timeout) leaves
        # alone: closing would end an elastic job for every survivor and every later pod.
        # An agent told to stop leaves alone too, unless its workers finished first.
        alone = self._leaving or self._joining.alone
        close = finished or (not alone and (state is None or state.round == 0))
        try:
            if close and not self.is_closed():
                self._shared.loop.run(self._joining.set_closed(), self._settings.timeouts.close)
                log.info("rendezvous closed: the job is over", job=self._settings.job.job, node=self.node)
            elif not close:
                why = alone or "its workers did not finish"
                log.info("leaving the job alone; the run stays open", node=self.node, why=why)
        except (TimeoutError, *ETCD_ERRORS) as exc:
            ok = False
            log.warning("closing the rendezvous failed", node=self.node, error=str(exc))
        limit = self._settings.timeouts.close
        if self._leave_by is not None:
            # Told to stop: the lease, which expires anyway, is not worth the kubelet's SIGKILL.
            limit = min(limit, timedelta(seconds=max(0.5, self._leave_by - time.time() - 0.5)))
        try:
            ok = self._shared.loop.run(self._keys.leave(), limit) and ok
        except (TimeoutError, *ETCD_ERRORS) as exc:
            ok = False
            log.warning("leaving the rendezvous failed; the lease will expire", node=self.node, error=str(exc))
        finally:
            self._store = None
            shutil.rmtree(self._failures, ignore_errors=True)
            if self._owns_shared:
                self._shared.close()
            flush = getattr(self._tracer_provider or trace.get_tracer_provider(), "force_flush", None)
            if flush is not None:
                flush(2000)
        return ok

    async def _rendezvous(self) -> tuple[int, int, int]:
        done = await self._joining.join()
        self._round = done.round
        return done.round, done.rank, done.node_count


def round_s(seconds: float) -> float:
    return float(f"{seconds:.3f}")
