"""A pod's container as the kubelet stand-in runs it: a process of its own session, its
output appended to a log, and, once its main process exits, the end of what it left behind.

Only processes the kubelet started, and their descendants, are ever signalled.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regroup.demo.processes import AgentCommand, signal_known

ContainerCommand = AgentCommand
"""How to run a pod's container: the demo's ``AgentCommand`` (argv, the process's whole
environment, the log its output is appended to, the working directory)."""


ContainerLauncher = Callable[[dict[str, Any]], ContainerCommand]
"""``pod -> ContainerCommand``, called at each start of the pod's container (restarts too)."""


@dataclass(eq=False)
class Container:
    """One started instance of a pod's container."""

    process: asyncio.subprocess.Process
    start_ticks: int
    """The process's start time (/proc), so a reused pid is never taken for it."""
    started_at: str
    exited: asyncio.Task[int]
    known: dict[int, int] = field(default_factory=dict)
    """Its process tree as last seen (pid -> start ticks), for ending what outlives the main process."""
    finished_at: str | None = None
    termination: dict[str, Any] | None = None
    """Its terminated state, once the kubelet has noted its exit."""

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        return not self.exited.done()

    @property
    def exit_code(self) -> int:
        """As container runtimes report it: the status, or 128 + the signal that ended it."""
        code = self.exited.result()
        return 128 - code if code < 0 else code


async def start_process(command: ContainerCommand) -> asyncio.subprocess.Process:
    """The container's main process: a new session, stdin from /dev/null, stdout and stderr
    appended to the command's log. Raises what the runtime cannot start (OSError, ValueError)."""
    command.log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(command.log_path, "ab") as log:  # noqa: ASYNC230 - a local append-only log file
        return await asyncio.create_subprocess_exec(
            *command.argv,
            env=command.env,
            cwd=command.cwd,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """{pid: (ppid, session id, start ticks)} of every live process (zombies left out)."""
    table: dict[int, tuple[int, int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        fields = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces and ')'
        if fields[0] != "Z":
            table[int(entry)] = (int(fields[1]), int(fields[3]), int(fields[19]))
    return table


def _leftovers(container: Container) -> dict[int, int]:
    """What is left of a container whose main process exited: the processes of its session
    (the main process was its leader) and those last seen in its tree, with their
    descendants. Everything here descends from a process the kubelet started."""
    table = _proc_table()
    roots = {pid: start for pid, start in container.known.items() if pid in table and table[pid][2] == start}
    leader, leader_start = container.pid, container.start_ticks
    # A session id is its leader's pid: trust it only while that pid is not someone else's now.
    if leader not in table or table[leader][2] == leader_start:
        roots.update({pid: t[2] for pid, t in table.items() if t[1] == leader and t[2] >= leader_start})
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        pid = todo.pop()
        if pid in table and pid not in found:
            found[pid] = table[pid][2]
            todo.extend(children.get(pid, []))
    return found


def end_leftovers(container: Container) -> None:
    """SIGKILLs what outlived the container's main process, as a runtime does when a
    container's init exits; frozen first so that none forks in between."""
    frozen: dict[int, int] = {}
    while new := {pid: start for pid, start in _leftovers(container).items() if pid not in frozen}:
        signal_known(new, signal.SIGSTOP)
        frozen.update(new)
    signal_known(frozen, signal.SIGKILL)
