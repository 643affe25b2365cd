"""``InPlaceAgent``: torchrun's ``LocalElasticAgent``, re-forming its running workers in place.

torch's agent answers every membership change by stopping its workers, joining the next
round and starting new ones. This agent, when its workers opted in (``ElasticWorld``),
instead announces the re-form in the node's channel, joins the next round while the
workers live on, assigns their ranks with torch's own protocol (so nodes that start
workers the usual way can share the round), and hands the workers their new world.
Everything else is torch's: worker failures, ``--max-restarts``, the exit barrier, logs.

A worker that cannot re-form in place exits non-zero; this agent then restarts it the
usual way, and the others re-form around it. On a node left out of the next round, the
workers hand their shards over and report "leaving" (``ElasticWorld.rejoin`` raises
``LeavingJob`` there). The agent then stays, with fresh workers, and asks to be let back in
(``excluded_timeout`` at most, then it exits ``LEFT_JOB``), unless it was told to stop. With
``standby``, workers are started before the rendezvous, so a node joining a running job (or
restarting its workers) pays for interpreter start-up and ``import torch`` while the round
forms, not after.

SIGTERM is a notice to leave, not a kill (``regroup.rendezvous.inplace.notice``): while a
controller leads the job the workers train on until it leaves this node out (their shards
are handed over on the way), within ``term_grace``; otherwise they are stopped at once.
Either way the agent exits ``LEFT_JOB`` (75): a node never reports success for a job that
goes on. A second SIGTERM, or SIGINT, stops at once (torch's way; ``regroup-run`` then
ends with one line instead of torch's traceback, see ``regroup.rendezvous.inplace.launcher``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, Worker, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.metrics import put_metric
from torch.distributed.elastic.rendezvous import RendezvousClosedError

from regroup.exit_codes import FINISHED
from regroup.failures import FAILURE_DIR_ENV
from regroup.rendezvous.joining import ExcludedFromRound, ExcludedTooLong, JoinStopped
from regroup.rendezvous.store import RoundAbandoned
from regroup.rendezvous.inplace.channel import (
    CHANNEL_ENV,
    MEMBER_ENV,
    RESTART_ONLY_ENV,
    STANDBY_ENV,
    WAIT_EXPIRED,
    WORLD_FILE,
    NodeWorld,
    RankSlot,
    StampedFile,
    WorkerReport,
    describe_report,
    report_file,
    write_atomically,
)
from regroup.rendezvous.inplace.exits import REFORM_EXIT, read_reform_exit
from regroup.rendezvous.inplace.agent_notice import SigtermNotice
from regroup.rendezvous.inplace.notice import DEFAULT_TERM_GRACE, StopNotice

log = structlog.get_logger("regroup.inplace.agent")

LEFT_OUT = "left out of the round; staying to be let back in"
"""Logged when a round left this node out and the agent, not told to stop, stays."""
_SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
_TORCH_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""The signals torch's ``start_processes`` answers by stopping the workers, when unset."""

WARM_TIMEOUT_S = 300.0
"""How long a standby agent waits for its workers to start up before joining anyway."""
HANDOFF_TIMEOUT_S = 60.0
"""How long the agent of a leaving node waits for its workers to hand their shards over
(a worker is done once it reported anything but "running", or exited)."""


def _started(report: WorkerReport | None) -> bool:
    """The worker has started up: it reached ``ElasticWorld.join`` (any report of its own)."""
    return report is not None


def _left_since(announced_at: float) -> Callable[[WorkerReport | None], bool]:
    """Whether a worker of a leaving node is done with its world, given the announcement's
    time: it reported "leaving" (at any time: after any hand-off of its shards, which it
    does while still "running"), or "waiting" since the announcement (it left its world
    and has nothing to hand over; ``rejoin`` then raises ``LeavingJob``), or never reported
    (it never joined a world). An older "waiting" may be a world still forming, which
    can still go on to train and hand its shards over: that one is waited for."""

    def left(report: WorkerReport | None) -> bool:
        if report is None or report.state == "leaving":
            return True
        return report.state == "waiting" and report.written_at >= announced_at

    return left


class _LeftOut(Exception):
    """This node's workers were in a world when the round left the node out: restart them."""


class InPlaceAgent(SigtermNotice, LocalElasticAgent):
    """A ``LocalElasticAgent`` whose membership changes keep opted-in workers alive."""

    def __init__(
        self,
        *args: Any,
        in_place: bool = True,
        standby: bool = False,
        probation: timedelta = timedelta(seconds=5),
        term_grace: timedelta = DEFAULT_TERM_GRACE,
        **kwargs: Any,
    ) -> None:
        """``in_place``: re-form opted-in workers in place (False: torch's restart path only).
        ``standby``: start workers before each rendezvous (the script must use ElasticWorld).
        ``probation``: after this node's own workers failed, how long it stays out of the
        next round (the others re-form without it and train on).
        ``term_grace``: the pod's ``terminationGracePeriodSeconds``: how long after SIGTERM
        the agent has before it is killed (it cannot read the pod's spec)."""
        super().__init__(*args, **kwargs)
        self._term_grace = term_grace
        self._notice: StopNotice | None = None
        self._notice_logged = False
        self._in_place = in_place
        self._standby = standby and in_place
        self._channel = Path(tempfile.mkdtemp(prefix="regroup-inplace-"))
        # Workers inherit the agent's environment (as REGROUP_FAILURE_DIR reaches them). With
        # in-place re-forms off they are told so: nothing they do may count on outliving a world.
        os.environ[CHANNEL_ENV] = str(self._channel)
        member = str(getattr(self._worker_group.spec.rdzv_handler, "node", "") or "")
        if member:
            os.environ[MEMBER_ENV] = member
        if in_place:
            os.environ.pop(RESTART_ONLY_ENV, None)
        else:
            os.environ[RESTART_ONLY_ENV] = "1"
        self._reports: dict[int, StampedFile[WorkerReport]] = {}
        """Each local worker's report, read on change (``_check_peer_failures``)."""
        self._seq = 0
        self._rounds = 0
        self._join_first = False
        self.in_place_reforms = 0
        handler = self._worker_group.spec.rdzv_handler
        if in_place and hasattr(handler, "enable_in_place"):
            handler.enable_in_place(probation)
        if hasattr(handler, "exit_when_excluded"):
            handler.exit_when_excluded = False  # left out, this agent stays (see _rendezvous)

    # -- torch's monitor loop, with the membership branch changed ----------------------------

    def _invoke_run(self, role: str = "default") -> RunResult:
        spec = self._worker_group.spec
        role = spec.role
        rdzv_handler = spec.rdzv_handler
        self._take_sigterm()
        try:
            self._initialize_workers(self._worker_group)
            while True:
                time.sleep(spec.monitor_interval)
                self._check_notice()
                self._check_peer_failures()
                run_result = self._monitor_workers(self._worker_group)
                state = run_result.state
                self._worker_group.state = state
                put_metric(f"workers.{role}.remaining_restarts", self._remaining_restarts)
                put_metric(f"workers.{role}.{state.name.lower()}", 1)
                if state == WorkerState.SUCCEEDED:
                    self._exit_barrier()
                    return run_result
                if state in {WorkerState.UNHEALTHY, WorkerState.FAILED}:
                    self._note_reform_exits(run_result)
                    if self._notice is not None:
                        raise self._leave(f"its workers failed ({state.name}) while it was leaving the job")
                    if self._remaining_restarts > 0:
                        log.info("worker group failed; restarting it", state=state.name,
                                 restarts_left=self._remaining_restarts)
                        self._remaining_restarts -= 1
                        self._join_first = self._standby
                        self._restart_workers(self._worker_group)
                        continue
                    self._stop_workers(self._worker_group)
                    self._worker_group.state = WorkerState.FAILED
                    return run_result
                if state != WorkerState.HEALTHY:
                    raise RuntimeError(f"[{role}] worker group in {state.name} state")
                # Membership changes do not count as restarts.
                if rdzv_handler.num_nodes_waiting() > 0:
                    if self._workers_opted_in():
                        self._reform_in_place(self._worker_group)
                    else:
                        self._restart_workers(self._worker_group)
        finally:
            shutil.rmtree(self._channel, ignore_errors=True)

    def _check_peer_failures(self) -> None:
        """Pass a worker's report of a collective that failed on a peer (in place, with no
        re-form announced: the first evidence of a lost node) on to the member record."""
        if not self._in_place or self._pcontext is None:
            return
        note = getattr(self._worker_group.spec.rdzv_handler, "note_peer_failure", None)
        if note is None:
            return
        for local_rank in self._pcontext.pids():
            file = self._reports.get(local_rank)
            if file is None:
                file = self._reports[local_rank] = report_file(self._channel, local_rank)
            report = file.poll()  # a stat per tick; parsed only when the worker rewrote it
            if report is not None and report.peer_failure_round:
                note(report.peer_failure_round, report.peer_failure_at, report.failed_peer)

    def _note_reform_exits(self, result: RunResult) -> None:
        """Say why a worker that exited during an in-place re-form likely did
        (``regroup.rendezvous.inplace.exits``): one warning, and the member record, whose
        line the controller puts in the re-form's Event and trace."""
        if not self._in_place:
            return
        handler = self._worker_group.spec.rdzv_handler
        failures = os.environ.get(FAILURE_DIR_ENV, "")
        for failure in result.failures.values():
            found = read_reform_exit(self._channel, failures, failure.local_rank, failure.pid, failure.exitcode)
            if found is None:
                continue
            log.warning(
                REFORM_EXIT, node=str(getattr(handler, "node", "")), local_rank=failure.local_rank, pid=failure.pid,
                exit_code=failure.exitcode, round=found.round, last_state=found.last_state,
                announced=found.announced, note=found.note,
            )  # fmt: skip
            getattr(handler, "note_worker_exit", lambda round, note: None)(found.round, found.note)
            return  # one line per failure of the group: the first worker's

    # -- starting workers ----------------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        # torch's start_processes installs, on every start, a SIGTERM handler that stops the
        # workers at once: leave SIGTERM out of its list while it starts them, and take it back.
        saved = os.environ.get(_SIGNALS_ENV)
        names = (saved if saved is not None else _TORCH_SIGNALS).split(",")
        os.environ[_SIGNALS_ENV] = ",".join(n for n in names if n.strip() != "SIGTERM")
        try:
            return super()._start_workers(worker_group)
        finally:
            if saved is None:
                os.environ.pop(_SIGNALS_ENV, None)
            else:
                os.environ[_SIGNALS_ENV] = saved
            self._take_sigterm()

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        if not self._standby:
            super()._initialize_workers(worker_group)
            return
        # Workers first, rendezvous second: they import torch while the round forms, then
        # read their ranks from the channel. Nothing of an earlier world may be read as theirs.
        self._announce("starting workers ahead of the rendezvous")
        spec = worker_group.spec
        worker_group.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        worker_group.store = dist.HashStore()  # not used by standby workers; torch requires one
        worker_group.master_addr, worker_group.master_port = "", 0
        worker_group.group_rank, worker_group.group_world_size = -1, -1
        os.environ[STANDBY_ENV] = "1"
        try:
            ids = self._start_workers(worker_group)
        finally:
            os.environ.pop(STANDBY_ENV, None)
        worker_group.state = WorkerState.HEALTHY
        if self._join_first:
            # The others wait on this node's dead ranks: tell them now (they re-form without
            # it), then join for real once the new workers have started up.
            getattr(worker_group.spec.rdzv_handler, "step_out", lambda: None)()
        self._join_first = False
        # Join only once every worker has started up (imported torch, reached
        # ElasticWorld.join): the round never waits on a cold interpreter.
        self._await_workers("the workers to start up before joining the round (WARM_TIMEOUT_S)", _started,
                            WARM_TIMEOUT_S)
        self._rendezvous(worker_group)
        for local_rank, worker_id in ids.items():
            worker_group.workers[local_rank].id = worker_id

    def _rendezvous(self, worker_group: WorkerGroup, publish: bool = True, in_world: bool = False) -> None:
        """Join the next round. Left out of it (not told to stop), the agent stays as a new
        joiner of its node and joins again; with ``in_world`` (its workers were in a world)
        it raises ``_LeftOut`` instead, so that they are restarted first. Told to stop, or out
        of the job for ``excluded_timeout``, it leaves (``LeftJob``)."""
        handler = worker_group.spec.rdzv_handler
        while True:
            try:
                super()._rendezvous(worker_group)
                break
            except RoundAbandoned as exc:
                # An agent of the round vanished while ranks were being assigned (a node
                # cordoned and deleted right after it joined): join the next round instead.
                log.warning("round abandoned while assigning ranks; joining the next", reason=str(exc))
                getattr(handler, "abandon_round", lambda: None)()
            except ExcludedFromRound as exc:
                if self._notice is not None:
                    raise self._leave(f"left out of the job's round on notice ({exc})") from exc
                # Exiting 0 would mark the pod of an Indexed Job, JobSet or PyTorchJob succeeded,
                # its index gone for good: stay, and let the controller take the node back.
                settings = getattr(handler, "settings", None)  # only the etcd-v3 handler leaves a node out
                log.warning(LEFT_OUT, reason=str(exc),
                            excluded_timeout_s=settings.timeouts.excluded.total_seconds() if settings else None)
                # Its workers restart ahead of the next join (standby): warming up, no joiner yet.
                getattr(handler, "start_over", lambda reason, **_: None)(str(exc), warming=in_world and self._standby)
                if in_world:
                    raise _LeftOut(str(exc)) from exc
            except (ExcludedTooLong, JoinStopped) as exc:
                raise self._leave(str(exc)) from exc
            except RendezvousClosedError as exc:
                # The job is over (e.g. while this node waited to be let back in): that is
                # success for every node, not a failure of this one (torch's agent exits 1).
                log.info("the job is over (its rendezvous is closed); exiting", exit_code=FINISHED)
                raise SystemExit(FINISHED) from exc
        self._rounds += 1
        if publish:
            self._publish(worker_group, pending=False, reason="round formed")

    def _await_workers(
        self, waited_for: str, answered: Callable[[WorkerReport | None], bool], timeout_s: float
    ) -> bool:
        """Wait until every local worker process has ``answered`` (given its own last report,
        None if it has none), at most ``timeout_s``; False if the wait ran out (then one
        ``WAIT_EXPIRED`` warning names who had not answered and what each last reported). A
        worker that exits meanwhile is left to the monitor loop: nothing more will come from it."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_notice()
            pids = self._pcontext.pids() if self._pcontext is not None else {}
            reports = {local_rank: WorkerReport.read(self._channel, local_rank) for local_rank in pids}
            pending = {
                local_rank: pid
                for local_rank, pid in pids.items()
                if not self._exited(local_rank) and not answered(_own(reports[local_rank], pid))
            }
            if not pending:
                return True
            if self._pcontext is not None and self._pcontext.wait(0) is not None:
                return True  # all exited, or one failed (torch then stops the others)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        handler = self._worker_group.spec.rdzv_handler
        now = time.time()
        log.warning(
            WAIT_EXPIRED,
            waited_for=waited_for,
            timeout_s=timeout_s,
            node=str(getattr(handler, "node", "")),
            round=int(getattr(handler, "round", self._rounds)),
            not_answered=[
                {"local_rank": local_rank, **describe_report(reports[local_rank], pid, now)}
                for local_rank, pid in sorted(pending.items())
            ],
        )
        return False

    def _exited(self, local_rank: int) -> bool:
        """Whether worker ``local_rank``'s process has exited (torch's context keeps its exit code)."""
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        handler = handlers.get(local_rank)
        return handler is not None and handler.proc.poll() is not None

    # -- the in-place path ------------------------------------------------------------------------

    def _workers_opted_in(self) -> bool:
        """Every local worker takes part in in-place re-forms (standby workers always do)."""
        if not self._in_place or self._pcontext is None:
            return False
        if self._standby:
            return True
        for local_rank, pid in self._pcontext.pids().items():
            report = WorkerReport.read(self._channel, local_rank)
            if report is None or report.pid != pid:
                return False
        return True

    def _reform_in_place(self, worker_group: WorkerGroup) -> None:
        """Announce, join the next round with the workers alive, hand them their new world."""
        started = time.monotonic()
        handler = worker_group.spec.rdzv_handler
        leaving = _left_out(handler)
        announced = self._announce("leaving the job" if leaving else "membership changed", leaving=leaving)
        if leaving:
            # Its workers hand their shards to survivors first (still "running"); the round
            # (which excludes this node and ends this agent) is joined once they have left
            # their world ("leaving", or "waiting": ElasticWorld.rejoin raises LeavingJob on
            # this announcement), or exited.
            started_handoff = time.monotonic()
            if self._await_workers("the workers of this leaving node to leave their world (HANDOFF_TIMEOUT_S)",
                                   _left_since(announced.written_at), HANDOFF_TIMEOUT_S):
                log.info("workers left their world; leaving the job",
                         seconds=round(time.monotonic() - started_handoff, 3))
        pids = self._pcontext.pids() if self._pcontext is not None else {}
        try:
            self._rendezvous(worker_group, publish=not leaving, in_world=True)
        except _LeftOut:
            # Left out and not told to stop: its workers left their world (some exited 0 through
            # LeavingJob, which is not the job's success). Fresh ones wait with the agent, which
            # asks to be let back in.
            self._let_leaving_workers_end()
            self._restart_workers(worker_group)
            return
        if leaving:
            # Not left out after all: the controller took this node back between the
            # announcement and the round. Its workers were told to go (they left their world,
            # some may have exited 0, which must not read as the job's success): start new
            # ones. A membership change, not a failure of this node's.
            log.warning("taken into the round after its workers were told this node leaves; restarting them",
                        round=int(getattr(handler, "round", self._rounds)))
            getattr(handler, "abandon_round", lambda: None)()
            self._restart_workers(worker_group)
            return
        # The rank assignment made new Worker records: they are still the same processes.
        for worker in worker_group.workers:
            worker.id = pids.get(worker.local_rank)
        self.in_place_reforms += 1
        log.info(
            "re-formed in place",
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            ranks=[w.global_rank for w in worker_group.workers],
            seconds=round(time.monotonic() - started, 3),
        )

    # -- the channel --------------------------------------------------------------------------------

    def _announce(self, reason: str, leaving: bool = False) -> NodeWorld:
        """Tell the workers to leave their process group at the next step boundary."""
        current = NodeWorld.read(self._channel)
        return self._write(
            NodeWorld(
                seq=0,
                round=current.round if current else 0,
                pending=True,
                master_addr="",
                master_port=0,
                group_rank=-1,
                group_world_size=-1,
                reason=reason,
                leaving=leaving,
            )
        )

    def _publish(self, worker_group: WorkerGroup, *, pending: bool, reason: str) -> None:
        spec = worker_group.spec
        handler = spec.rdzv_handler
        slots = {
            str(w.local_rank): RankSlot(w.global_rank, w.world_size, w.role_rank, w.role_world_size)
            for w in worker_group.workers
        }
        self._write(
            NodeWorld(
                seq=0,
                round=int(getattr(handler, "round", self._rounds)),
                pending=pending,
                master_addr=str(worker_group.master_addr),
                master_port=int(worker_group.master_port or 0),
                group_rank=int(worker_group.group_rank or 0),
                group_world_size=int(worker_group.group_world_size or 0),
                slots=slots,
                restart_count=spec.max_restarts - self._remaining_restarts,
                reason=reason,
                traceparent=str(getattr(handler, "traceparent", "")),
            )
        )

    def _write(self, world: NodeWorld) -> NodeWorld:
        self._seq += 1
        stamped = NodeWorld(**{**world.__dict__, "seq": self._seq, "written_at": time.time()})
        write_atomically(self._channel / WORLD_FILE, stamped.to_json())
        return stamped


def _left_out(handler: Any) -> bool:
    """This node is left out of the next round: the controller's next expected membership
    leaves it out, or the round that answered it formed already and excluded this node's
    agent (one that noticed the re-form late: the expected membership is consumed then,
    and its join will be refused)."""
    if getattr(handler, "left_out", lambda: False)():
        return True
    state = getattr(getattr(handler, "view", None), "state", None)
    node = getattr(handler, "node", None)
    if state is None or node is None or state.round <= int(getattr(handler, "round", 0)):
        return False
    # Agent ids are "<node>@<registration time>"; a node has one live agent at a time.
    return any(agent.rpartition("@")[0] == node for agent in state.excluded)


def _own(report: WorkerReport | None, pid: int) -> WorkerReport | None:
    """``report`` if process ``pid`` wrote it (not an earlier worker of this local rank)."""
    return report if report is not None and report.pid == pid else None
