"""The newest step this node's workers completed, kept on the node for the workers its
agent starts next.

On the restart path (``regroup-run --in-place=off``, plain ``torchrun``) every worker of a
broken world ends, and with it what it knew; the job's ``progress`` record is rank 0's,
published every ``etcd.progress_interval``, and says nothing of the steps completed since
(nor anything once rank 0's node is the one lost). So each worker also keeps the newest
step it completed in a small file on its node, scoped to its agent (the parent process:
its pid and start time), and the workers the agent starts for the next world read the
files of every local rank before they agree on where they stand (``Resuming``). A file
only ever grows, and is written when a step passes the newest it holds: a few bytes, no
fsync, nothing on the step's critical path but one ``pwrite``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import structlog

log = structlog.get_logger("regroup.trainer")

_WIDTH = 20
"""Digits of a record: every write covers the whole previous one."""


def _agent_key(parent: int) -> str | None:
    """``<pid>-<start ticks>`` of the parent process, unique while the machine runs (a pid
    alone is reused); None where /proc does not say."""
    try:
        with open(f"/proc/{parent}/stat") as stat:
            started = stat.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
    return f"{parent}-{started}"


class NodeSteps:
    """This worker's file of its newest completed step, beside those of its agent's other
    local ranks (and of the workers the agent ran before, which had the same ranks)."""

    def __init__(self, folder: Path, local_rank: int) -> None:
        self.folder = folder
        self.path = folder / str(local_rank)
        self._kept = self.read()
        """The newest step on this node's record (-1: none): a step past it is written."""
        self._fd: int | None = None
        self._broken = False

    @classmethod
    def for_agent(cls, env: Mapping[str, str], root: Path | None = None) -> NodeSteps | None:
        """The files of this worker's agent, or None outside one (no ``TORCHELASTIC_RUN_ID``:
        the process is the whole run) or where the parent cannot be told apart."""
        run_id = env.get("TORCHELASTIC_RUN_ID")
        key = _agent_key(os.getppid()) if run_id else None
        if run_id is None or key is None:
            return None
        base = root if root is not None else Path(tempfile.gettempdir()) / "regroup-steps"
        name = run_id.replace(os.sep, "_")
        return cls(base / f"{name}-{key}", int(env.get("LOCAL_RANK", "0")))

    def read(self) -> int:
        """The newest step any worker of this agent recorded (-1: none)."""
        newest = -1
        with contextlib.suppress(OSError):
            for path in self.folder.iterdir():
                with contextlib.suppress(OSError, ValueError):
                    newest = max(newest, int(path.read_text().strip() or -1))
        return newest

    def record(self, step: int) -> None:
        """This worker completed ``step``: kept when it is the agent's newest."""
        if step <= self._kept or self._broken:
            return
        self._kept = step
        try:
            if self._fd is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
            os.pwrite(self._fd, str(step).rjust(_WIDTH).encode(), 0)
        except OSError as exc:
            # The record is a help to the next world, never a reason to stop training.
            log.warning("cannot keep the step reached on this node", path=str(self.path), error=str(exc))
            self.close()
            self._broken = True

    def forget(self) -> None:
        """The run is over (its last step reached): no worker of this agent resumes it."""
        self.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # the last local rank to finish takes the folder

    def close(self) -> None:
        """Release the file (it stays for the workers the agent starts next)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
