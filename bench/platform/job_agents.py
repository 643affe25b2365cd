"""One job's agents and its trainer rank 0, as threads of an agent host process.

The agents are real ``etcd-v3`` rendezvous handlers (``bench.rendezvous.fleet.Fleet``), each
with its own lease and member key, sharing the job's etcd connection and watch in this
process. Each runs torchrun's agent loop on its own thread: ``next_rendezvous``, then a
monitor that asks ``num_nodes_waiting()`` every ``MONITOR_INTERVAL`` (torchrun's default)
and re-enters the rendezvous when it is non-zero. An agent left out of a round (its node is
reclaimed) leaves, as torchrun's exits; the monitor leaves when the run is closed.

The monitor asks only when the job's etcd mirror changed since it last asked, or once a
second: the answer is a function of the mirror and the clock (a joiner's ``not_before``),
so that is the same answer at a tenth of the harness' CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousClosedError

from bench.platform.agent_specs import JobPlacement, Timing, identity
from bench.platform.rank_zero import RankZero
from bench.rendezvous.fleet import Fleet
from regroup.rendezvous.joining import ExcludedFromRound, ExcludedTooLong

MONITOR_INTERVAL = 0.1
"""torchrun's ``--monitor-interval`` default, in seconds."""
RECHECK_S = 1.0
"""The monitor asks at least this often while the mirror stays unchanged."""
FINISH_TIMEOUT_S = 30.0
"""How long the agents of a finished job may take to leave, all together."""

Report = Callable[[tuple[Any, ...]], None]
"""Where the agents' news goes: ``("formed", job, round, world_size, at)``, ``("resumed",
job, round, at)`` (rank 0 published its first step there), ``("error", job, node, text)``."""


class JobAgents:
    """The agents of one job and its rank 0; commands come from the host's command loop."""

    def __init__(self, placement: JobPlacement, endpoint: str, timing: Timing, report: Report) -> None:
        self.placement = placement
        self._endpoint = endpoint
        self._timing = timing
        self._report = report
        self._lock = threading.Lock()
        self._stops: list[threading.Event] = []
        self._threads: list[threading.Thread] = []
        self._returned: dict[int, set[int]] = {}
        """Round -> agents that returned from it."""
        self.fleet: Fleet | None = None
        self.rank_zero = RankZero(
            endpoint, placement.namespace, placement.job, timing.step_time, timing.progress_interval,
            on_resumed=lambda round_: report(("resumed", placement.job, round_, time.time())), tls=placement.tls,
        )  # fmt: skip

    def start(self) -> None:
        p = self.placement
        identities = [identity(p.namespace, node, pod) for node, pod in p.pods]
        self.fleet = Fleet(
            "etcd-v3", len(identities), p.job, {"etcd-v3": self._endpoint}, (p.min_nodes, p.max_nodes), fast=False,
            conf=p.rdzv_conf(self._timing), identities=identities,
        )  # fmt: skip
        self.rank_zero.start()
        for index in range(len(identities)):
            self._launch(index)

    def join(self, node: str, pod: str) -> None:
        """A node joins: its agent starts."""
        assert self.fleet is not None
        self._launch(self.fleet.add(identity(self.placement.namespace, node, pod)))

    def kill(self, node: str) -> None:
        """The agent dies without a word: no more lease refreshes, no leave."""
        assert self.fleet is not None
        index = self.fleet.nodes.index(node)
        self._stops[index].set()
        if self.fleet.handlers[index]._keys.registered:
            self.fleet.kill(index)

    def finish(self) -> None:
        """The run is over: rank 0 says so, the rendezvous is closed, every agent leaves."""
        assert self.fleet is not None
        self.rank_zero.finish()
        live = [i for i, stop in enumerate(self._stops) if not stop.is_set()]
        if live:
            self.fleet.handlers[live[0]].set_closed()
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.fleet.close()

    def _launch(self, index: int) -> None:
        self._stops.append(threading.Event())
        thread = threading.Thread(target=self._agent, args=(index,), name=f"agent-{self.placement.job}-{index}")
        thread.daemon = True
        self._threads.append(thread)
        thread.start()

    def _agent(self, index: int) -> None:
        assert self.fleet is not None
        handler, stop, node = self.fleet.handlers[index], self._stops[index], self.fleet.nodes[index]
        job = self.placement.job
        while True:
            try:
                info = handler.next_rendezvous()
            except RendezvousClosedError:
                break
            except (ExcludedFromRound, ExcludedTooLong):
                break  # its node is leaving: the agent leaves too, as torchrun's exits
            except Exception as exc:  # noqa: BLE001 - a dead agent is reported, not fatal to the host
                if not stop.is_set():
                    self._report(("error", job, node, f"{type(exc).__name__}: {exc}"))
                return
            if stop.is_set():
                return  # killed while it waited for the round
            self._formed(index, handler.round, info.world_size)
            outcome = self._monitor(handler, stop)
            if outcome == "killed":
                return
            if outcome == "closed":
                break
        stop.set()
        handler.shutdown()

    def _monitor(self, handler: Any, stop: threading.Event) -> str:
        """Until the round must be re-formed (``reform``), the run is closed (``closed``) or
        the agent is killed (``killed``)."""
        watch = handler._shared.connection.watch
        version, asked = -1, 0.0
        while not stop.wait(MONITOR_INTERVAL):
            now = time.monotonic()
            if watch.version == version and now - asked < RECHECK_S:
                continue
            version, asked = watch.version, now
            if handler.is_closed():
                return "closed"
            if handler.num_nodes_waiting() > 0:
                self.rank_zero.world_ending()
                return "reform"
        return "killed"

    def _formed(self, index: int, round_: int, world_size: int) -> None:
        with self._lock:
            returned = self._returned.setdefault(round_, set())
            returned.add(index)
            complete = len(returned) == world_size
            for old in [r for r in self._returned if r < round_]:
                del self._returned[old]
        if complete:
            self.rank_zero.world_formed(round_, world_size)
            self._report(("formed", self.placement.job, round_, world_size, time.time()))
