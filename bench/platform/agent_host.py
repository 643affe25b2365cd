"""A process that hosts the agents of many jobs as threads (``JobAgents``), driven over a pipe.

Hundreds of agents fit two cores this way: one interpreter and one ``import torch`` per host,
not per agent (see ``bench.rendezvous``). The host answers commands in order and sends the
agents' news back on the same pipe; ``AgentHost`` is the benchmark's handle on it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from bench.platform.agent_specs import JobPlacement, Timing

HOST_START_TIMEOUT = 120.0
"""A host imports torch before it answers: seconds on a busy machine."""


class AgentHost:
    """``await host.start()``; ``host.send(command)``; news goes to ``on_news`` in the loop."""

    def __init__(self, name: str, endpoint: str, timing: Timing, on_news: Callable[[tuple[Any, ...]], None]) -> None:
        self.name = name
        self._on_news = on_news
        context = multiprocessing.get_context("spawn")
        self._conn, self._child = context.Pipe()
        self._process = context.Process(target=_serve, args=(self._child, endpoint, timing), name=name, daemon=True)
        self._reader: threading.Thread | None = None
        self._ready = asyncio.Event()

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    async def start(self) -> None:
        self._process.start()
        self._child.close()  # the child's end lives in the child now: its exit is this end's EOF
        # A thread of its own, not the loop's executor: it blocks for the host's whole life.
        self._reader = threading.Thread(target=self._read, args=(asyncio.get_running_loop(),), daemon=True)
        self._reader.start()
        await asyncio.wait_for(self._ready.wait(), HOST_START_TIMEOUT)
        if not self._process.is_alive():
            raise RuntimeError(f"agent host {self.name} exited with {self._process.exitcode} before it was ready")

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                news = self._conn.recv()
            except (EOFError, OSError):
                loop.call_soon_threadsafe(self._ready.set)  # gone: whoever waits for it learns so now
                return
            if news[0] == "ready":
                loop.call_soon_threadsafe(self._ready.set)
            else:
                loop.call_soon_threadsafe(self._on_news, news)

    def send(self, *command: Any) -> None:
        self._conn.send(command)

    async def stop(self) -> None:
        """Every job still hosted finishes, then the process exits."""
        if self._process.is_alive():
            self.send("stop")
            await asyncio.to_thread(self._process.join, 60)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 10)
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 10)  # the child is gone: its end of the pipe is closed
        self._conn.close()


def _serve(conn: Connection, endpoint: str, timing: Timing) -> None:
    import structlog

    from bench.platform.job_agents import JobAgents

    # The agents log every round; the benchmark keeps their errors only.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lock = threading.Lock()

    def report(news: tuple[Any, ...]) -> None:
        with lock:
            conn.send(news)

    jobs: dict[str, JobAgents] = {}
    report(("ready",))
    while True:
        command = conn.recv()
        kind = command[0]
        try:
            if kind == "start":
                placement: JobPlacement = command[1]
                jobs[placement.job] = agents = JobAgents(placement, endpoint, timing, report)
                agents.start()
            elif kind == "join":
                jobs[command[1]].join(command[2], command[3])
            elif kind == "kill":
                jobs[command[1]].kill(command[2])
            elif kind == "finish":
                try:
                    jobs.pop(command[1]).finish()
                finally:
                    report(("finished", command[1]))  # whoever waits for it goes on; an error is reported too
            elif kind == "stop":
                for agents in jobs.values():
                    agents.finish()
                return
        except Exception as exc:  # noqa: BLE001 - reported to the benchmark, which decides
            job = command[1].job if kind == "start" else command[1] if len(command) > 1 else ""
            report(("error", job, "", f"{kind}: {type(exc).__name__}: {exc}"))
