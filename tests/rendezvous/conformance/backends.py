"""The rendezvous backends under test, and how each one's handlers and agents are configured.

``c10d`` (torch's own, the control) on a TCPStore at ``127.0.0.1:<free port>`` that the
first agent hosts (``is_host``); ``etcd-v3`` on the test's etcd, every agent under its own
node name (``--rdzv-conf node_name={hostname}-{pid}``), as torch's tests run several agents
on one host with no per-agent environment. Each also starts a rendezvous server of a
scenario's own (``Server``), which the scenario may stall or kill.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from regroup.demo.etcd_server import EtcdServer
from tests.rendezvous.agents import wait_until
from tests.rendezvous.conformance.processes import read_log

if TYPE_CHECKING:
    from tests.rendezvous.conformance.scenario_run import Run


# Short timeouts: every scenario runs in seconds. The same keys mean the same in both backends.
COMMON_CONF = {"join_timeout": "20", "last_call_timeout": "1", "close_timeout": "3"}
# c10d heartbeats every keep_alive_interval (only once the last one is that old): a node is
# dead after interval x max_attempt, which must leave room for one late heartbeat.
C10D_CONF = {**COMMON_CONF, "read_timeout": "5", "keep_alive_interval": "1", "keep_alive_max_attempt": "4"}
ETCD_V3_CONF = {**COMMON_CONF, "lease_ttl": "2"}


@dataclass
class Server:
    """A rendezvous endpoint of one scenario's own, which it may stall or kill."""

    endpoint: str
    pid: int
    stop: Callable[[], None]
    """Kill it, if it still runs."""

    def kill(self) -> None:
        self.stop()


class Backend(abc.ABC):
    """One rendezvous backend under test: how its handlers and agents are configured."""

    name = ""
    isolate_handlers = False
    """Run the in-process scenarios in a child process instead of the test's (see ``EtcdV3``)."""

    @abc.abstractmethod
    def endpoint(self, run: Run) -> str:
        """``--rdzv-endpoint`` of the run."""

    @abc.abstractmethod
    def conf(self, run: Run, index: int, host: bool) -> dict[str, str]:
        """``--rdzv-conf`` of the ``index``-th handler of a run (``host``: c10d's store host)."""

    @abc.abstractmethod
    def cli_conf(self, run: Run, host: bool) -> dict[str, str]:
        """``--rdzv-conf`` of an agent."""

    @abc.abstractmethod
    def server(self, run: Run) -> Server:
        """A rendezvous endpoint of the run's own."""


class C10d(Backend):
    name = "c10d"

    def endpoint(self, run: Run) -> str:
        return f"127.0.0.1:{run.port}"

    def conf(self, run: Run, index: int, host: bool) -> dict[str, str]:
        return {**C10D_CONF, "is_host": "1" if host else "0"}

    def cli_conf(self, run: Run, host: bool) -> dict[str, str]:
        return {**C10D_CONF, "is_host": "1" if host else "0"}

    def server(self, run: Run) -> Server:
        log = run.out / "store.log"
        launcher = run.children
        # Port 0: the store binds a port of its own and says which; no number is chosen before.
        child = launcher.spawn({"kind": "store", "env": run.env, "log": str(log), "host": "127.0.0.1", "port": 0})
        serving = wait_until(lambda: _STORE_SERVING.search(read_log(log)), 60, "the TCPStore server")
        return Server(f"127.0.0.1:{serving.group(1)}", child.pid, lambda: launcher.kill(child))


class EtcdV3(Backend):
    name = "etcd-v3"
    # grpc's asyncio completion queue is process-wide: with several handlers' event loops
    # in the test process, grpc was seen to run, on the loops still open, callbacks for one
    # that had closed ("Event loop is closed"), which the suite counts as loop-thread
    # problems. A torchrun agent has one handler, so here each scenario's handlers run in
    # a child process of their own.
    isolate_handlers = True

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint

    def endpoint(self, run: Run) -> str:
        return self._endpoint

    def conf(self, run: Run, index: int, host: bool) -> dict[str, str]:
        # Handlers of one process: a name each (agents get {hostname}-{pid}).
        return {**ETCD_V3_CONF, "node_name": f"{run.run_id}-{index}"}

    def cli_conf(self, run: Run, host: bool) -> dict[str, str]:
        return {**ETCD_V3_CONF, "node_name": "{hostname}-{pid}"}

    def server(self, run: Run) -> Server:
        server = EtcdServer(data_dir=run.out / "etcd").start()
        assert server.pid is not None
        return Server(server.endpoint, server.pid, server.kill)  # SIGKILL ends a stopped one too


_STORE_SERVING = re.compile(r"store serving on [^\s:]+:(\d+)")
"""The line zygote's ``store`` request prints once its TCPStore listens."""
