"""Prompt, clean stops on SIGTERM/SIGINT (the torchrun agent stopping workers to re-form).

The signal sets a flag that the loop turns into an agreed stop at the next step
boundary. Python runs signal handlers only when the main thread returns to bytecode,
and a rank blocked in a collective may not for a long time, so the C-level wakeup fd
also wakes a watchdog thread: if the loop has not exited within ``grace``, the watchdog
calls ``on_force`` (rank 0 publishes its last progress) and ends the process. Neither
path ever writes a commit marker, so a save cut short stays uncommitted.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import threading
from collections.abc import Callable
from datetime import timedelta
from types import FrameType

import structlog

from regroup.exit_codes import hard_exit

log = structlog.get_logger("regroup.trainer.stopping")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def exit_code(signum: int) -> int:
    """Exit status of a process ended by ``signum`` (shell convention 128 + n)."""
    return 128 + signum


class StopSignal:
    """A stop request: set by a signal, or by hand in tests."""

    def __init__(self, grace: timedelta = timedelta(seconds=1.5)) -> None:
        self.grace = grace
        self.signum = 0
        self._event = threading.Event()
        self._on_force: Callable[[], None] = lambda: None
        self._read_fd = -1

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, waking early on a stop; True if a stop was requested."""
        return self._event.wait(max(0.0, seconds))

    def request(self, signum: int = signal.SIGTERM) -> None:
        if not self._event.is_set():
            self.signum = signum
            self._event.set()

    def on_force(self, callback: Callable[[], None]) -> None:
        """What to do just before a forced exit (best effort, must be quick)."""
        self._on_force = callback

    def install(self, orphan_check: timedelta | None = None) -> None:
        """Install handlers and the watchdog; call from the main thread before training.

        With ``orphan_check``, a thread also requests a stop (as SIGTERM would) once the
        parent process is gone: a torchrun worker whose agent died has nobody left to stop
        or re-form it, and torchrun starts workers in their own session, so nothing else
        would end it.
        """
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        self._read_fd = read_fd
        signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        threading.Thread(target=self._watch, name="stop-watchdog", daemon=True).start()
        if orphan_check is not None:
            parent = os.getppid()
            threading.Thread(
                target=self._watch_parent, args=(parent, orphan_check), name="orphan-watch", daemon=True
            ).start()

    def _watch_parent(self, parent: int, period: timedelta) -> None:
        while not self._event.wait(period.total_seconds()):
            if os.getppid() != parent:
                _quiet_log("warning", "agent process gone; stopping", agent_pid=parent)
                # Through the wakeup path, so the watchdog's grace and forced exit apply too.
                os.kill(os.getpid(), signal.SIGTERM)
                return

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(signum)

    def _watch(self) -> None:
        while True:
            data = os.read(self._read_fd, 1)
            if not data:
                return
            signum = data[0]
            if signum not in {int(s) for s in STOP_SIGNALS}:
                continue
            self.request(signum)
            try:
                # The main thread exits itself at the next boundary; past the grace, force it.
                _quiet_log("info", "stop requested", signal=signal.Signals(signum).name)
                threading.Event().wait(self.grace.total_seconds())
                _quiet_log("warning", "training loop did not stop in time; exiting", grace_s=self.grace.total_seconds())
                _dump_stacks()
                self._on_force()
            finally:
                hard_exit(exit_code(signum))


def _dump_stacks() -> None:
    """Where every thread is, on stderr: what the loop was blocked in when it missed its stop."""
    with contextlib.suppress(OSError, ValueError, RuntimeError):  # stderr gone: the exit goes on
        faulthandler.dump_traceback(all_threads=True)


def _quiet_log(level: str, event: str, **fields: object) -> None:
    """Log, ignoring a closed stderr (the agent that read it may be gone): the watchdog
    must reach its exit whatever happens to the log pipe."""
    try:
        getattr(log, level)(event, **fields)
    except (OSError, ValueError):
        pass
