"""A local node's agent process: how it is started, and its process tree, found and ended.

Only processes this package started, and their descendants, are ever signalled."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path


@dataclass(frozen=True)
class AgentCommand:
    """How to start one node's agent."""

    argv: list[str]
    env: dict[str, str]
    log_path: Path
    """stdout and stderr of the agent and its workers, appended."""
    cwd: Path | None = None
    """Working directory of the agent and its workers (None: the demo's own)."""


AgentLauncher = Callable[[str, str, int], AgentCommand]
"""``(node, pod, attempt) -> AgentCommand``; attempt counts restarts of the pod's agent."""


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of ``pid``, or None if it is gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None  # dead already, waiting for its parent to reap it
    return int(fields[1]), int(fields[19])


def process_tree(root: int) -> dict[int, int]:
    """``root`` and all its descendants, as ``{pid: start_time}``."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _proc_stat(int(entry))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(entry))
            starts[int(entry)] = stat[1]
    if root not in starts:
        return {}
    tree, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in starts and pid not in tree:
            tree[pid] = starts[pid]
            todo.extend(children.get(pid, []))
    return tree


def signal_known(pids: dict[int, int], sig: int) -> None:
    """Signal each pid that is still the same process (same start time): no pid-reuse victims."""
    for pid, started in pids.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[1] == started:
            with contextlib.suppress(ProcessLookupError):  # it exited since the check
                os.kill(pid, sig)


def kill_tree(root: int) -> dict[int, int]:
    """SIGKILL ``root`` and every descendant, freezing them first so none can fork or
    be orphaned between the listing and the kill. Returns what was killed."""
    frozen: dict[int, int] = {}
    while True:
        tree = process_tree(root)
        new = {pid: start for pid, start in tree.items() if pid not in frozen}
        if not new:
            break
        signal_known(new, signal.SIGSTOP)
        frozen.update(new)
    signal_known(frozen, signal.SIGKILL)
    return frozen


def kill_workers(agent: int) -> int:
    """SIGKILL the agent's descendants (not the agent). Returns how many were killed."""
    tree = process_tree(agent)
    tree.pop(agent, None)
    signal_known(tree, signal.SIGKILL)
    return len(tree)


async def end_agent(process: asyncio.subprocess.Process, grace: timedelta, sig: int = signal.SIGTERM) -> None:
    """Signal the agent (SIGTERM: a pod's deletion, which ``regroup-run`` takes as a notice to
    hand its node over; SIGINT: stop now), give it ``grace``, then SIGKILL whatever of its
    process tree survived (the agent or orphaned workers)."""
    if process.returncode is not None:
        return
    # Snapshot the tree first: once the agent exits, its workers are no longer its children.
    tree = process_tree(process.pid)
    signal_known({process.pid: tree.get(process.pid, 0)} if process.pid in tree else {}, sig)
    # asyncio.timeout, not wait_for: 3.11's wait_for can drop a cancellation (gh-86296).
    with contextlib.suppress(TimeoutError):  # past the grace, what is left is killed below
        async with asyncio.timeout(grace.total_seconds()):
            await process.wait()
    tree.update(process_tree(process.pid))
    signal_known(tree, signal.SIGKILL)
    await process.wait()
