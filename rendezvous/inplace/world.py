"""``ElasticWorld``: what a training script calls to survive re-forms in place.

Under ``regroup-run`` the agent does not restart its workers when the job's membership
changes. It announces the re-form in the node's channel (``regroup.rendezvous.inplace.channel``),
joins the next round itself, and hands each worker its new rank. A worker that opted in
leaves its process group at a step boundary, forms the new one, and carries on in the
same process: no re-import, no new CUDA context, its model still in memory::

    world = ElasticWorld.join(backend="gloo")          # instead of init_process_group()
    model, optimizer = build(world)
    while step < max_steps:
        try:
            train_step(model, optimizer)
            if world.reform_due():                      # cheap: a stat() of the channel
                raise Interrupted("re-form announced")  # (or fold it into your own agreement)
        except Exception as exc:
            if not world.interrupted(exc):
                raise                                   # a bug of ours: fail as usual
            world.rejoin()                              # new rank, world size, process group
            model, optimizer = rebuild_and_restore(world)

When this node is left out of the next world (the controller's expected membership
excludes it), ``rejoin`` raises ``LeavingJob``, a ``SystemExit`` with code 0: the script
ends (its agent, which leaves the job at once, would stop it anyway). Catch it to clean up:
the agent gives a worker that reported "leaving" ``LEAVING_EXIT_S`` (10 s) to end on its own
before it stops it.

A collective blocked on a dead or hung peer does not hang the survivor: once the re-form
is announced and the worker has not left within ``abort_grace``, a watcher thread severs
the process group's connections (gloo) or aborts its communicators (NCCL), so the call
raises and the loop above takes over. Under plain ``torchrun`` (no channel) ``join`` is
``init_process_group`` from the environment, ``in_place`` is False and ``interrupted``
always False: the worker fails and torchrun restarts it, as before.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from pathlib import Path

import structlog

from regroup.failures import PEER, failed_peer, failure_kind
from regroup.rendezvous.inplace.abort import abort_groups, forget_failed_formation, sever_connections, socket_inodes
from regroup.rendezvous.inplace.channel import (
    CHANNEL_ENV,
    MEMBER_ENV,
    REFORMING,
    RESTART_ONLY_ENV,
    STANDBY_ENV,
    WAIT_EXPIRED,
    NodeWorld,
    WorkerReport,
    WorldFile,
    describe_world,
    report_name,
    write_atomically,
)
from regroup.rendezvous.inplace.formation import connect_store, init_default_group
from regroup.rendezvous.inplace.membership import (
    Interrupted,
    LeavingJob,
    Membership,
    Reform,
    ReformFailed,
    Superseded,
)

log = structlog.get_logger("regroup.inplace.world")

_POLL_S = 0.02


class ElasticWorld:
    """One worker's membership of the job, kept across in-place re-forms."""

    def __init__(
        self,
        env: Mapping[str, str],
        backend: str,
        timeout: timedelta,
        abort_grace: timedelta,
        keep_ports: Iterable[int],
        form_timeout: timedelta = timedelta(minutes=2),
    ) -> None:
        self.backend = backend
        self.timeout = timeout
        self.abort_grace = abort_grace
        self.form_timeout = form_timeout
        self.local_rank = int(env.get("LOCAL_RANK", "0"))
        channel = env.get(CHANNEL_ENV)
        self.channel = Path(channel) if channel else None
        self.standby = env.get(STANDBY_ENV) == "1"
        self.member = env.get(MEMBER_ENV, "")
        """This node's member key, as the controller's requests name it ("" outside an agent)."""
        self.warm = False
        """This worker was up and waiting when its first world was handed out (a standby or
        spare worker): no process was started for that world."""
        self._restart_only = env.get(RESTART_ONLY_ENV) == "1"
        self._env = dict(env)
        self._keep_ports = set(keep_ports)
        self._file = WorldFile(self.channel) if self.channel else None
        self._lock = threading.Lock()
        self._baseline: set[str] = set()
        self._forming: Membership | None = None
        self._forming_since = 0.0
        self._overdue: Membership | None = None
        self._severed: Membership | None = None
        self._left = True
        self._due_since: float | None = None
        self._aborted = False
        self._stop_watch = threading.Event()
        self._watcher: threading.Thread | None = None
        self._peer_failure: tuple[int, float, str] = (0, 0.0, "")
        """(round, unix time, host named) of the first collective of a world that failed on
        a peer, kept in every report of this worker from then on (``WorkerReport``)."""
        self.membership: Membership | None = None
        self.formed: int = 0
        """How many worlds this process has formed (1 after ``join``)."""
        self.last_process_group_s = 0.0
        """Seconds the last ``join``/``rejoin`` spent creating the process group."""

    # -- the API ---------------------------------------------------------------------------

    @classmethod
    def join(
        cls,
        backend: str = "gloo",
        *,
        timeout: timedelta = timedelta(minutes=10),
        abort_grace: timedelta = timedelta(seconds=1),
        keep_ports: Iterable[int] = (),
        env: Mapping[str, str] | None = None,
        stop: Callable[[], bool] = lambda: False,
        form_timeout: timedelta = timedelta(minutes=2),
    ) -> ElasticWorld:
        """Form this worker's first world (the default process group).

        ``timeout``: of the process group's collectives, and of the wait for a world when
        started ahead of the rendezvous. ``abort_grace``: how long a worker may take to reach
        a step boundary after a re-form is announced before its blocked collectives are made
        to fail. ``keep_ports``: remote ports of connections never severed (your etcd).
        ``form_timeout``: how long forming one world may take before it is given up (the
        worker then exits and its agent restarts it) instead of waiting out ``timeout``.
        Raises ``LeavingJob`` when this node is left out before its first world formed."""
        world = cls(dict(os.environ) if env is None else env, backend, timeout, abort_grace, keep_ports, form_timeout)
        world._report("waiting", 0)
        if world.in_place:
            world._watcher = threading.Thread(target=world._watch, name="inplace-watch", daemon=True)
            world._watcher.start()
        world._form_newest(world._first_membership(stop), stop, world.timeout)
        return world

    @property
    def in_place(self) -> bool:
        """Whether this worker runs under an in-place agent (``regroup-run``)."""
        return self.channel is not None

    @property
    def outlives_reforms(self) -> bool:
        """Whether this process is kept across re-forms: under ``regroup-run`` without
        ``--in-place=off`` (whose agent restarts its workers on every re-form)."""
        return self.channel is not None and not self._restart_only

    @property
    def rank(self) -> int:
        assert self.membership is not None
        return self.membership.rank

    @property
    def world_size(self) -> int:
        assert self.membership is not None
        return self.membership.world_size

    @property
    def round(self) -> int:
        return self.membership.round if self.membership else 0

    def reform_due(self) -> bool:
        """A re-form of this worker's world is announced (no communication: a ``stat``)."""
        latest = self._file.poll() if self._file else None
        return latest is not None and self._supersedes(latest)

    def announcement(self, timeout: timedelta) -> NodeWorld | None:
        """This node's announcement of the re-form that ends the current world (``pending``,
        with ``leaving`` set when this node is left out), waited for up to ``timeout``: the
        agreed boundary may come from another node's agent first. None if none came."""
        if self._file is None or self.membership is None:
            return None
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            latest = self._file.poll()
            if latest is not None and self._supersedes(latest):
                return latest  # the announcement, or already the next world (not leaving, then)
            if time.monotonic() >= deadline:
                self._expired(f"this node's announcement of the re-form that ends round {self.round}", timeout, latest)
                return None
            time.sleep(_POLL_S)

    def interrupted(self, exc: BaseException) -> bool:
        """Whether ``exc`` (raised by a collective, ``Interrupted`` or ``Reform``) means:
        leave and rejoin. True for ``Interrupted`` and ``Reform``, and for a failed
        collective while a re-form is due, after this watcher aborted the groups, or when a
        peer went away."""
        if not self.in_place:
            return False
        if isinstance(exc, Interrupted | Reform):
            return True
        if self.ending():
            return True
        if failure_kind(exc) != PEER:
            return False
        self._note_peer_failure(exc)
        return True

    def ending(self) -> bool:
        """Whether this worker's world is over, whatever the script made of it: a re-form
        of it is due, or its groups were aborted for one (a collective that waited in it
        failed)."""
        return self.in_place and (self._aborted or self.reform_due())

    @property
    def aborted(self) -> bool:
        """The current world's groups were aborted for a re-form: no collective in it can
        succeed any more."""
        return self._aborted

    def reform_begins(self, why: str) -> None:
        """This worker leaves its world for a re-form (``why``): say so to the agent before
        anything else happens, so that an exit of this process before the next world reads
        as one during the re-form (``regroup.rendezvous.inplace.exits``)."""
        if self.membership is None or self._left:
            return
        log.info("the world ends for a re-form", round=self.membership.round, why=why[:200])
        self._report(REFORMING, self.membership.round)

    def _note_peer_failure(self, exc: BaseException) -> None:
        """A collective failed on a peer while no re-form was announced: the first sign of a
        loss. Report it to the agent (once per world), which tells the controller."""
        if self.membership is None or self._peer_failure[0] == self.membership.round:
            return
        self._peer_failure = (self.membership.round, time.time(), failed_peer(exc))
        log.warning("a collective failed on a peer; leaving the world", round=self.membership.round,
                    peer=self._peer_failure[2] or "not named", error=str(exc)[:200])
        self._report("running", self.membership.round)

    def leave(self) -> None:
        """Drop the current process groups (aborting what may still wait on a peer)."""
        with self._lock:
            if self._left:
                return
            self._left = True
            if not self._aborted:
                sever_connections(self._baseline, self._keep_ports)
            abort_groups()
            self._aborted = False
            self._due_since = None
        self._report("leaving", self.round)

    def rejoin(self, stop: Callable[[], bool] = lambda: False, timeout: timedelta | None = None) -> Membership:
        """Leave the current world (``leave``), wait for the agent to hand out the next one
        and form it; the new membership.

        A world superseded while it forms (a member vanished, or a restarted node came
        back) is dropped and the newer one formed, in the same process. Raises
        ``LeavingJob`` (a ``SystemExit`` with code 0) when this node's announcement says it
        is left out of the next world, before or while waiting: the worker has reported
        "leaving" and should exit; its agent leaves the job at once and stops it. Raises
        ``ReformFailed`` when no world comes within ``timeout`` (default: the world's
        timeout) or when ``stop()`` turns true while waiting: the worker then exits
        non-zero and its agent restarts it."""
        if not self.in_place:
            raise ReformFailed("not started by an in-place agent (regroup-run)")
        self.leave()
        old = self.round
        self._leave_job_if_left_out(self._file.poll() if self._file else None)
        self._report("waiting", old)
        limit = timeout or self.timeout
        membership = self._await_world(
            lambda w: not w.pending and w.round > old, stop, limit, f"the world after round {old}", leaving_ends=True
        )
        return self._form_newest(membership, stop, limit)

    def close(self) -> None:
        self._stop_watch.set()
        if self.channel is not None:
            (self.channel / report_name(self.local_rank)).unlink(missing_ok=True)

    # -- forming a world ---------------------------------------------------------------------

    def _first_membership(self, stop: Callable[[], bool]) -> Membership:
        if self.channel is None:
            return Membership.from_env(self._env, self.local_rank)
        if self.standby:
            # Started ahead of the rendezvous: the agent writes our world once the round forms.
            first = self._file.poll() if self._file else None
            self.warm = first is None or first.pending
            return self._await_world(lambda w: not w.pending, stop, self.timeout, "the first world", leaving_ends=True)
        current = self._file.poll() if self._file else None
        if current is None:
            return Membership.from_env(self._env, self.local_rank)
        # The agent may have re-formed while this process started: its file is the newest word.
        return self._await_world(lambda w: not w.pending, stop, self.timeout, "the first world", leaving_ends=True)

    def _await_world(
        self,
        ready: Callable[[NodeWorld], bool],
        stop: Callable[[], bool],
        timeout: timedelta,
        what: str,
        leaving_ends: bool = False,
    ) -> Membership:
        """The first world from the agent that is ``ready`` (``what``: which, for the log).
        ``leaving_ends``: an announcement that this node leaves the job ends the wait with
        ``LeavingJob`` (no world will come for it; its agent ends it)."""
        assert self._file is not None
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            world = self._file.poll()
            if leaving_ends:
                self._leave_job_if_left_out(world)
            if world is not None and ready(world):
                return Membership.from_world(world, self.local_rank)
            if stop():
                raise ReformFailed("stopped while waiting for the next world")
            if time.monotonic() >= deadline:
                self._expired(what, timeout, world)
                raise ReformFailed(f"no world handed out within {timeout}: waited for {what}")
            time.sleep(_POLL_S)

    def _leave_job_if_left_out(self, world: NodeWorld | None) -> None:
        """If ``world`` (the agent's newest word) announces that this node leaves the job:
        report "leaving" (the agent waits for that, then leaves) and raise ``LeavingJob``."""
        if world is None or not (world.pending and world.leaving):
            return
        if self.membership is not None and world.seq <= self.membership.seq:
            return  # not newer than the world this worker runs in (cannot happen: the agent leaves)
        log.info("this node leaves the job; leaving the script", round=self.round, local_rank=self.local_rank,
                 reason=world.reason)
        self._report("leaving", self.round)
        raise LeavingJob(f"this node leaves the job ({world.reason or 'left out of the next round'}); exit")

    def _expired(self, what: str, timeout: timedelta, world: NodeWorld | None) -> None:
        """One warning for a wait on the agent that ran out: what for, and what the agent last wrote."""
        membership = self.membership
        log.warning(WAIT_EXPIRED, waited_for=what, timeout_s=timeout.total_seconds(), local_rank=self.local_rank,
                    rank=membership.rank if membership else None, round=self.round,
                    not_answered=[{"who": "this node's agent (world.json)", **describe_world(world)}])  # fmt: skip

    def _form_newest(self, membership: Membership, stop: Callable[[], bool], timeout: timedelta) -> Membership:
        """Form ``membership``; while a newer world supersedes the one forming, form that one
        instead. Every superseded attempt costs at most the time to notice it."""
        while True:
            try:
                self._form(membership, stop)
                return membership
            except Superseded as exc:
                forget_failed_formation()
                if stop():
                    raise ReformFailed(str(exc)) from exc
                log.info("world superseded while forming; forming the newer one", round=membership.round,
                         why=str(exc)[:200])
                superseded = membership
                membership = self._await_world(
                    lambda w: not w.pending and w.seq > superseded.seq and w.round > superseded.round,
                    stop,
                    timeout,
                    f"a world newer than round {superseded.round} (superseded while forming)",
                    leaving_ends=True,
                )

    def _form(self, membership: Membership, stop: Callable[[], bool]) -> None:
        """Create the default process group of ``membership``. While it forms, a newer world
        from the agent (a member of this one vanished before it started) makes it fail:
        ``Superseded``, and the caller forms the newer one instead of waiting out the timeout."""
        started = time.perf_counter()
        with self._lock:
            self._baseline = socket_inodes()
            self._forming = membership
            self._forming_since = time.monotonic()
        try:
            store = None
            if membership.master_addr:
                store = connect_store(
                    membership, self.timeout, self.form_timeout, lambda: self._newer_than(membership) or stop()
                )
            init_default_group(self.backend, membership, store, self.timeout)
        except Exception as exc:
            if self._newer_than(membership):
                abort_groups()
                raise Superseded(f"world of round {membership.round} superseded while forming") from exc
            if self.in_place and failure_kind(exc) == PEER and self._overdue is not membership:
                # A member went away while it formed: wait here for the newer world its agent
                # hands out, rather than fail (a restarted worker loses what it holds in memory).
                abort_groups()
                log.warning("a peer went away while the world formed; waiting for the next one",
                            round=membership.round, error=str(exc)[:200])  # fmt: skip
                self._report("waiting", membership.round)
                raise Superseded(f"world of round {membership.round} lost a member while forming") from exc
            if self._overdue is membership:
                forget_failed_formation()
                raise ReformFailed(
                    f"world of round {membership.round} did not form within {self.form_timeout}"
                ) from exc
            raise
        finally:
            with self._lock:
                self._forming = None
        self.last_process_group_s = time.perf_counter() - started
        with self._lock:
            self.membership = membership
            self._left = False
            self._aborted = False
            self._due_since = None
        self.formed += 1
        self._report("running", membership.round)
        log.info(
            "world formed",
            round=membership.round,
            rank=membership.rank,
            world_size=membership.world_size,
            process_group_s=round(self.last_process_group_s, 3),
        )

    def _newer_than(self, membership: Membership) -> bool:
        latest = self._file.poll() if self._file else None
        return latest is not None and latest.seq > membership.seq

    def _supersedes(self, world: NodeWorld) -> bool:
        membership = self.membership
        if membership is None:
            return False
        return world.seq > membership.seq and (world.pending or world.round > membership.round)

    # -- the watcher -------------------------------------------------------------------------

    def _watch(self) -> None:
        """Abort the groups of a world whose re-form is announced, once ``abort_grace`` has
        passed without the main thread leaving it (it is blocked in a collective)."""
        while not self._stop_watch.wait(_POLL_S):
            due = self.reform_due()
            with self._lock:
                forming = self._forming
                if forming is not None and forming is not self._severed:
                    overdue = time.monotonic() - self._forming_since > self.form_timeout.total_seconds()
                    if self._newer_than(forming) or overdue:
                        # A member of the world being formed is gone, or it cannot form (a peer
                        # never came): fail the formation (once).
                        sever_connections(self._baseline, self._keep_ports)
                        self._severed = forming
                        self._overdue = forming if overdue else None
                        if overdue:
                            # gloo does not say which peers never connected; their agents' logs do.
                            log.warning(
                                WAIT_EXPIRED,
                                waited_for=f"the {forming.world_size} ranks of round {forming.round} to connect",
                                timeout_s=self.form_timeout.total_seconds(),
                                local_rank=self.local_rank,
                                rank=forming.rank,
                                round=forming.round,
                                not_answered=[{"who": "some of the world's other ranks (gloo does not say which)",
                                               "store": f"{forming.master_addr}:{forming.master_port}"}],
                            )
                        else:
                            log.warning("failing the formation of a world", round=forming.round, overdue=overdue)
                        continue
                if self._left or self._aborted:
                    continue
                if not due:
                    self._due_since = None
                    continue
                now = time.monotonic()
                if self._due_since is None:
                    self._due_since = now
                if now - self._due_since < self.abort_grace.total_seconds():
                    continue
                severed = sever_connections(self._baseline, self._keep_ports)
                if "nccl" in self.backend:
                    abort_groups()  # ncclCommAbort wakes the blocked call from this thread
                self._aborted = True
            log.warning("re-form announced and this worker is still inside a collective; aborting it",
                        round=self.round, severed=severed)

    def _report(self, state: str, round: int) -> None:
        if self.channel is None:
            return
        failed_round, failed_at, peer = self._peer_failure
        report = WorkerReport(local_rank=self.local_rank, pid=os.getpid(), round=round, state=state,
                              written_at=time.time(), peer_failure_round=failed_round, peer_failure_at=failed_at,
                              failed_peer=peer)  # fmt: skip
        try:
            write_atomically(self.channel / report_name(self.local_rank), report.to_json())
        except OSError as exc:
            log.warning("could not write the worker report", error=str(exc))

