"""What a scenario gets on one backend: a ``Run``.

One backend, one fresh ``--rdzv-id``, its own folder. A ``Run`` makes rendezvous handlers
(through torch's registry, as torchrun does) and starts torchrun agents as forks of the
``zygote`` launcher, and cleans up after itself: handlers shut down, agents' process groups
and workers killed, private servers stopped.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from regroup.ports import free_port
from tests.rendezvous.agents import wait_until
from tests.rendezvous.conformance.backends import Backend, Server
from tests.rendezvous.conformance.processes import HERE, Agent, Launcher, kill_ours


WORKER = HERE / "worker.py"
TORCH_WORKER = HERE / "torch_worker.py"


@dataclass
class Run:
    """What a scenario gets for one backend; ``close()`` undoes all of it."""

    backend: Backend
    run_id: str
    out: Path
    launcher: Launcher | None
    """None in a child that runs a scenario apart (it starts nothing)."""
    env: dict[str, str]
    port: int = field(default_factory=free_port)
    handlers: list[RendezvousHandler] = field(default_factory=list)
    agents: dict[str, Agent] = field(default_factory=dict)
    servers: list[Server] = field(default_factory=list)
    pool: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(max_workers=4))

    def __post_init__(self) -> None:
        # What agents and workers leave in their temp dir (a killed agent cannot clean up) stays here.
        (self.out / "tmp").mkdir(parents=True, exist_ok=True)
        self.env = {**self.env, "TMPDIR": str(self.out / "tmp")}

    @property
    def children(self) -> Launcher:
        """The launcher, which forks this run's agents and helpers."""
        if self.launcher is None:
            raise RuntimeError("a scenario run apart starts no process")
        return self.launcher

    # -- handlers in this process

    def handler(
        self,
        nnodes: tuple[int, int] = (1, 2),
        *,
        endpoint: str | None = None,
        host: bool | None = None,
        local_addr: str = "127.0.0.1",
        **conf: str,
    ) -> Any:
        """A handler from torch's registry, as torchrun makes it (the first one hosts c10d's store)."""
        index = len(self.handlers)
        host = index == 0 and endpoint is None if host is None else host
        params = RendezvousParameters(
            backend=self.backend.name,
            endpoint=endpoint or self.backend.endpoint(self),
            run_id=self.run_id,
            min_nodes=nnodes[0],
            max_nodes=nnodes[1],
            local_addr=local_addr,
            **{**self.backend.conf(self, index, host), **conf},
        )
        handler = get_rendezvous_handler(params)
        self.handlers.append(handler)
        return handler

    def call(self, fn: Callable[[], Any], timeout: float, what: str) -> Any:
        """``fn()`` on the run's pool, failing the scenario if it takes longer than ``timeout``."""
        future = self.pool.submit(fn)
        done, _ = wait([future], timeout)
        if not done:
            raise AssertionError(f"{what} did not return within {timeout:g}s")
        return future.result()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        return self.pool.submit(fn)

    def join(self, *handlers: Any, timeout: float = 20.0) -> list[RendezvousInfo]:
        """Every handler's ``next_rendezvous()``, concurrently."""
        futures = [self.pool.submit(h.next_rendezvous) for h in handlers]
        done, pending = wait(futures, timeout)
        if pending:
            still = f"{len(pending)} of {len(handlers)}"
            raise AssertionError(f"{still} next_rendezvous() calls still waiting after {timeout:g}s")
        return [f.result() for f in futures]

    def server(self) -> Server:
        server = self.backend.server(self)
        self.servers.append(server)
        return server

    # -- torchrun agents

    def start(
        self,
        label: str,
        nnodes: str,
        *,
        nproc: int = 1,
        max_restarts: int = 0,
        script: Path = WORKER,
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        conf: dict[str, str] | None = None,
        patch: dict[str, Any] | None = None,
        host: bool | None = None,
    ) -> Agent:
        """Start a torchrun agent (``torch.distributed.run.main``) labelled ``label``."""
        host = not self.agents if host is None else host
        rdzv_conf = conf if conf is not None else self.backend.cli_conf(self, host)
        argv = [
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", "--local-addr=127.0.0.1", f"--log-dir={self.out / 'logs' / label}",
            f"--rdzv-backend={self.backend.name}", f"--rdzv-endpoint={self.backend.endpoint(self)}",
            f"--rdzv-id={self.run_id}", "--rdzv-conf=" + ",".join(f"{k}={v}" for k, v in rdzv_conf.items()),
            str(script), str(self.out), *args,
        ]  # fmt: skip
        log = self.out / f"agent-{label}.log"
        request = {
            "kind": "torchrun",
            "argv": argv,
            "env": {**self.env, "CONFORMANCE_AGENT": label, **(env or {})},
            "log": str(log),
            "patch": patch or {},
        }
        agent = Agent(label, self.children.spawn(request), log, self.children)
        self.agents[label] = agent
        return agent

    def rows(self, label: str | None = None) -> list[dict[str, Any]]:
        """What each worker of agent ``label`` (or of every agent) was started with, oldest first."""
        rows = []
        for path in (self.out / "workers").glob("*.json"):
            row = json.loads(path.read_text())
            if label is None or row["agent"] == label:
                rows.append(row)
        return sorted(rows, key=lambda r: r["t"])

    def meshed(self) -> list[dict[str, Any]]:
        """The workers that joined their round's mesh (``worker.py --mesh``)."""
        folder = self.out / "meshed"
        return [json.loads(p.read_text()) for p in folder.glob("*")] if folder.exists() else []

    def until(self, predicate: Callable[[], Any], timeout: float, what: str, alive: tuple[Agent, ...] = ()) -> Any:
        """``wait_until``, failing at once if one of the ``alive`` agents exits meanwhile."""

        def check() -> Any:
            for agent in alive:
                code = agent.exited()
                if code is not None:
                    raise AssertionError(f"agent {agent.label} exited {code} while waiting for {what}:\n{agent.tail()}")
            return predicate()

        return wait_until(check, timeout, what)

    def stop_workers(self) -> None:
        (self.out / "STOP").touch()

    def kill(self, label: str) -> None:
        """SIGKILL an agent and its workers (torchrun puts its workers in sessions of their own)."""
        agent = self.agents[label]
        agent.kill()
        agent.wait(10)
        kill_ours([int(r["pid"]) for r in self.rows(label)], str(self.out))

    def logs(self) -> str:
        parts = []
        for label, agent in self.agents.items():
            parts.append(f"--- agent {label} (pid {agent.pid}) ---\n{agent.tail()}")
        return "\n".join(parts)

    def close(self) -> None:
        for agent in self.agents.values():
            agent.kill()
        pids = [int(p.name) for p in (self.out / "pids").glob("*")] if (self.out / "pids").exists() else []
        kill_ours(pids, str(self.out))
        for server in self.servers:
            with contextlib.suppress(Exception):
                server.kill()
        # Shut every handler down, one at a time (a c10d one closes its run: it is over anyway).
        for handler in self.handlers:
            wait([self.pool.submit(_quiet_shutdown, handler)], 20)
        self.pool.shutdown(wait=False, cancel_futures=True)


def _quiet_shutdown(handler: RendezvousHandler) -> None:
    with contextlib.suppress(Exception):
        handler.shutdown()
