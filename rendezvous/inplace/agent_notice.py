"""The agent's side of a SIGTERM: a notice to leave, not a kill (a part of ``InPlaceAgent``).

The first SIGTERM is recorded (the member record, a bound on every wait for a round) and
acted on by the main thread: the workers train on until the controller leaves this node out
(their shards handed over on the way), within the grace; then the agent leaves the job with
``LEFT_JOB``. A second SIGTERM stops at once. The decisions are ``notice``'s (pure).

Workers that reported "leaving" (``LeavingJob`` was raised in them: a script may catch it to
clean up) are given ``LEAVING_EXIT_S`` to end on their own before the agent stops them.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import structlog
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.multiprocessing import SignalException

from regroup.exit_codes import LEFT_JOB
from regroup.rendezvous.joining import LeftJob
from regroup.rendezvous.inplace.channel import WorkerReport
from regroup.rendezvous.inplace.notice import StopNotice, overdue, take_notice

log = structlog.get_logger("regroup.inplace.agent")

TERM_NOTICE = "SIGTERM: a notice to leave the job"
"""Logged once per notice, with whether the agent waits for a hand-off and until when."""
LEAVING = "leaving a job that goes on"
"""Logged when the agent leaves the job with ``LEFT_JOB``, with the reason."""
LEAVING_EXIT_S = 10.0
"""How long the agent of a node that leaves waits for workers that all reported "leaving" to
end on their own (a script that catches ``LeavingJob`` cleans up) before it stops them; never
past a notice's deadline."""


class SigtermNotice:
    """Taking SIGTERM as a notice, and leaving the job when it is due."""

    _worker_group: WorkerGroup
    _term_grace: timedelta
    _notice: StopNotice | None
    _notice_logged: bool
    _shutdown_timeout: int
    _pcontext: Any
    _channel: Path

    def _take_sigterm(self) -> None:
        """Answer SIGTERM with ``_on_sigterm`` (only the main thread may install a handler)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The first SIGTERM is a notice: record it (member record, a bound on every wait for
        a round) and return; the main thread acts on it (``_check_notice``). No logging here:
        the main thread may be inside a write to the same stream."""
        if self._notice is not None:
            # Asked twice: stop at once, as torch's own handler does (and does for SIGINT).
            raise SignalException(f"Process {os.getpid()} got signal: {signal.SIGTERM!r} again", signal.SIGTERM)
        handler = self._worker_group.spec.rdzv_handler
        in_round = getattr(handler, "in_round", None)
        notice = take_notice(
            time.time(),
            self._term_grace,
            controller=bool(getattr(getattr(handler, "view", None), "controller", False)),
            in_round=bool(in_round()) if in_round is not None else False,
        )
        self._notice = notice
        notify = getattr(handler, "notice_leaving", None)
        if notify is not None:
            notify(notice.since, notice.by, notice.stop_at, notice.reason)

    def _check_notice(self) -> None:
        """When told to stop: log it (once), and leave the job once that is due."""
        notice = self._notice
        if notice is None:
            return
        if not self._notice_logged:
            self._notice_logged = True
            log.warning(
                TERM_NOTICE, hands_over=notice.hands_over, reason=notice.reason, term_grace_s=notice.by - notice.since,
                leaving_by=notice.by, stop_at=notice.stop_at,
            )  # fmt: skip
        why = overdue(notice, time.time())
        if why:
            raise self._leave(why)

    def _leave(self, reason: str) -> LeftJob:
        """This node leaves a job that goes on: torch's shutdown stops the workers next (within
        the grace when on notice), and the agent exits ``LEFT_JOB``."""
        self._let_leaving_workers_end()
        notice = self._notice
        if notice is not None:
            # torch waits this long for the workers to go after their SIGTERM, then SIGKILLs them.
            self._shutdown_timeout = max(1, min(self._shutdown_timeout, int(notice.by - time.time() - 1)))
        handler = self._worker_group.spec.rdzv_handler
        log.warning(
            LEAVING, reason=reason, exit_code=LEFT_JOB, node=str(getattr(handler, "node", "")),
            on_notice=notice is not None,
        )  # fmt: skip
        return LeftJob(reason)

    def _let_leaving_workers_end(self) -> None:
        """When every live worker reported "leaving" (it left its world and is ending), wait
        for them to end on their own: at most ``LEAVING_EXIT_S``, never past a notice's
        deadline. Stopping them at once would cut a script's clean-up short."""
        pcontext = self._pcontext
        if pcontext is None:
            return
        reports = [WorkerReport.read(self._channel, local_rank) for local_rank in pcontext.pids()]
        if not reports or any(r is None or r.state != "leaving" for r in reports):
            return
        timeout = LEAVING_EXIT_S
        if self._notice is not None:
            timeout = min(timeout, self._notice.by - time.time() - 1)
        if timeout <= 0:
            return
        started = time.monotonic()
        ended = pcontext.wait(timeout=timeout, period=0.05) is not None
        log.info("leaving workers ended on their own" if ended else "leaving workers still running; stopping them",
                 seconds=round(time.monotonic() - started, 3), waited_at_most_s=round(timeout, 3))
