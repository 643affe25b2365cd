"""A process's membership of the job across worlds, and ``in_place``, which re-runs the
user's training function in the same process after each re-form.

One ``Session`` per process: the stop signal, logs and traces, the ``ElasticWorld`` and the
process groups of the current world, the job's etcd channel (rank 0), and what survives from
one world to the next (the state held in memory, how the current world came to be). Each
call of the user's function under ``in_place`` is one *incarnation*: it builds its model for
the current world and creates one ``Run``; when the world is re-formed, the incarnation ends
with an exception, the session keeps the run's state in memory, forms the next world, and
calls the function again, whose new ``Run`` restores that state (NVIDIA's resiliency
extension restarts a function in process the same way; here the world changes size).
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import structlog
import torch.distributed as dist
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from regroup.failures import record_failure
from regroup.rendezvous.inplace.membership import LeavingJob, Reform, ReformFailed
from regroup.rendezvous.inplace.world import ElasticWorld
from regroup.telemetry import LineAtomicStderr, configure_logging, configure_tracing
from regroup.elastic.settings import EtcdConfig
from regroup.elastic.world.control import JobChannel
from regroup.elastic.world.runtime import Runtime, backend_for, pick_device, runtime_on_default_group
from regroup.elastic.options import Options, options_from_env
from regroup.elastic.randomness import START_SEED, StartState
from regroup.elastic.state import MisuseError, World
from regroup.elastic.world.progress import Counters
from regroup.elastic.world.reached import NodeSteps
from regroup.elastic.memory.reshard import HeldState
from regroup.elastic.world.stopping import StopSignal, exit_code
from regroup.elastic.world.world_change import WorldChange

if TYPE_CHECKING:
    from regroup.elastic.run import Run

log = structlog.get_logger("regroup.trainer")

_TIMEOUT = timedelta(minutes=10)
"""Collective timeout of the process groups (a dead peer is cut off long before, on a re-form)."""
_LAST_WORDS = timedelta(milliseconds=500)
_CARRIED_KEPT = 4
"""Steps whose small state (scheduler, extras) is kept for an in-memory re-form: the live
step and the snapshot generations (two) fit."""

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class RunInfo:
    """Facts about this incarnation, read from the environment at the edge."""

    restart_count: int = 0
    """torchrun's TORCHELASTIC_RESTART_COUNT."""
    place: tuple[str, str] = ("", "")
    """(failure domain, node) this process runs in: a snapshot's copy goes to another place."""
    ranks_on_node: int = 1
    """Ranks of this job on this node (torchrun's LOCAL_WORLD_SIZE), for the memory check."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RunInfo:
        return cls(
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            # The topology init container exports the node's zone; REGROUP_FAILURE_DOMAIN overrides it.
            place=(
                env.get("REGROUP_FAILURE_DOMAIN") or env.get("REGROUP_ZONE", ""),
                env.get("NODE_NAME") or socket.gethostname(),
            ),
            ranks_on_node=int(env.get("LOCAL_WORLD_SIZE", "1")),
        )


def etcd_ports(etcd: EtcdConfig | None) -> list[int]:
    """Ports of the job's etcd endpoints: connections to them survive a re-form."""
    if etcd is None:
        return []
    ports = []
    for endpoint in etcd.endpoint.split(","):
        _, _, port = endpoint.strip().rpartition(":")
        if port.isdigit():
            ports.append(int(port))
    return ports


def process_age() -> float:
    """Seconds since this process started (interpreter start-up and imports included)."""
    try:
        with open("/proc/self/stat") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            now = float(uptime.read().split()[0])
        return max(0.0, now - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


class Session:
    """This process's membership of the job, kept across in-place re-forms."""

    _current: Session | None = None

    def __init__(self, options: Options, env: Mapping[str, str], in_place: bool) -> None:
        startup_s = process_age()
        if dist.is_initialized():
            raise MisuseError(
                "the default process group already exists: regroup forms the world itself; "
                "remove init_process_group() and use elastic.world() (rank, device, mesh)"
            )
        self.options = options
        self.in_place = in_place
        """Under ``in_place``: a re-form re-runs the training function in this process."""
        self.info = RunInfo.from_env(env)
        self.rng_start: StartState | None = None
        """The RNG state every call of the training function starts from (``in_place``)."""
        if not structlog.is_configured():
            # One JSON event per line on stderr, as every part of regroup logs (unless the
            # script configured structlog its own way).
            configure_logging(stream=LineAtomicStderr())
        self.stop = StopSignal()
        if threading.current_thread() is threading.main_thread():
            # Under torchrun, a worker outliving its agent is an orphan nobody will stop.
            self.stop.install(orphan_check=timedelta(seconds=1) if "TORCHELASTIC_RUN_ID" in env else None)
        self._provider = self._tracing()
        self.tracer = trace.get_tracer("regroup.trainer")
        self.counters = Counters()
        self.change = WorldChange(mode="restart" if self.info.restart_count else "")
        """How the current world came to be, and what resuming in it cost."""
        self.change.add("startup", startup_s)
        self.channel: JobChannel | None = None
        self.held: list[HeldState] = []
        """Shards held in memory for the next run to restore (none once one did)."""
        self.carried_at: dict[int, dict[str, Any]] = {}
        """The small replicated state (scheduler, extras) of the steps held in memory."""
        self.run: Run | None = None
        """The run of the current incarnation."""
        self.last_step = -1
        """The newest step completed in an earlier world that this process took part in or
        knew of (-1: none)."""
        self.node_steps = NodeSteps.for_agent(env)
        """This node's record of the newest step its agent's workers completed (None: no agent)."""
        self.exit_code: int | None = None
        """Set when the process is to end without finishing: 128+signal (stopped), 0 (left the job)."""
        self.ended: Reform | None = None
        """The ``Reform`` the current run raised to end its world (kept: the script or a
        wrapper may catch it on its way to ``in_place``)."""
        self._closed = False
        self.device = pick_device(options.device, int(env.get("LOCAL_RANK", "0")))
        # Under regroup-run this process may outlive its world; under torchrun it is
        # init_process_group from the environment; alone, a world of one.
        self.world = ElasticWorld.join(
            backend_for(self.device),
            timeout=_TIMEOUT,
            abort_grace=options.reform.abort_grace,
            keep_ports=etcd_ports(options.etcd),
            env=env,
            stop=lambda: self.stop.requested,
        )
        self.stop.on_force(self._last_words)
        self._form()

    # --- the process's session ------------------------------------------------------------

    @classmethod
    def current(cls) -> Session | None:
        return cls._current

    @classmethod
    def open(cls, options: Options | None, env: Mapping[str, str] | None = None, in_place: bool = False) -> Session:
        """The session of this process: a new one, which joins the world."""
        if cls._current is not None:
            raise MisuseError("regroup's world is already joined in this process: one in_place function at a time")
        env = dict(os.environ) if env is None else dict(env)
        session = cls(options or options_from_env(env), env, in_place)
        cls._current = session
        return session

    def close(self) -> None:
        """Leave: the world, the job's etcd channel, the span exporters. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if Session._current is self:
            Session._current = None
        try:
            if self.run is not None:
                self.run.release()
            self.world.close()
            if self.channel is not None:
                self.channel.close()
            if self.node_steps is not None:
                self.node_steps.close()
        finally:
            if self._provider is not None:
                self._provider.shutdown()

    def _tracing(self) -> TracerProvider | None:
        """Every process exports (rank 0 emits the spans, and any process may become rank 0
        after a re-form), unless the script set up OpenTelemetry itself."""
        if isinstance(trace.get_tracer_provider(), TracerProvider):
            return None
        return configure_tracing("regroup-trainer")

    def _last_words(self) -> None:
        """The stop watchdog's last act before a forced exit: the last completed step."""
        if self.channel is not None and self.run is not None:
            self.channel.publish_progress(self.run.last_words(), wait=True, timeout=_LAST_WORDS)

    # --- worlds -----------------------------------------------------------------------

    def _form(self) -> None:
        """The process groups and mesh of the world just formed; rank 0 opens the channel."""
        structlog.contextvars.bind_contextvars(rank=self.world.rank)
        started = time.perf_counter()
        self.rt: Runtime = runtime_on_default_group(self.world.local_rank, self.device, self.world.timeout)
        self.change.add("process_group", self.world.last_process_group_s + time.perf_counter() - started)
        if self.rt.rank == 0:
            if self.channel is None and self.options.etcd is not None:
                self.channel = JobChannel(self.options.etcd)
                self.channel.start()
        elif self.channel is not None:
            self.channel.close()
            self.channel = None
        self.world_info = World(
            rank=self.rt.rank,
            world_size=self.rt.world_size,
            local_rank=self.rt.local_rank,
            device=self.rt.device,
            mesh=self.rt.mesh,
            round=self.world.round,
            restart_count=self.info.restart_count,
        )

    def adopt(self, options: Options) -> None:
        """A run's settings: later re-forms follow them, and its etcd is the channel's."""
        if options.device not in ("auto", self.device.type):
            raise MisuseError(
                f"device={options.device!r}, but this process joined the world on {self.device.type}: "
                "give the same settings to in_place(options=...)"
            )
        self.options = options
        if self.rt.rank == 0 and self.channel is None and options.etcd is not None:
            self.channel = JobChannel(options.etcd)
            self.channel.start()

    def keep_carried(self, step: int, carried: dict[str, Any]) -> None:
        """Keep the small state of ``step`` (taken with the shards held in memory for it)."""
        if not carried:
            return
        self.carried_at.pop(step, None)
        self.carried_at[step] = carried
        while len(self.carried_at) > _CARRIED_KEPT:
            del self.carried_at[next(iter(self.carried_at))]

    def reform(self, exc: BaseException) -> bool:
        """The current world ended (``exc``: why). Keep the run's state in memory, leave, form
        the next world. False when this process is to end instead (``exit_code``): its node
        leaves the job, or a stop came while waiting."""
        run = self.run
        clean = isinstance(exc, Reform) and exc.clean
        old_world = self.rt.world_size
        old_step = run.state.step if run is not None else 0
        log.info("leaving the world for a re-form", step=old_step, clean=clean, why=str(exc)[:200])
        leaving = False
        if run is not None:
            # With the newest step the worlds before that run knew of: this process may
            # have joined after it, and is the one that remembers it now.
            self.last_step = max(self.last_step, old_step, run.last_step)
            if run.change.first_step_done:
                # A world that failed before its first step reached nothing: its state is not
                # restored yet (step 0), and a record of it would tell the controller and
                # `regroup status` that the job started over in that round.
                run._record_reached()
            held, leaving = run.leave_world(clean)
            if held:
                # A world that failed before it trained held nothing new: the state from the
                # world before stays (still the newest in memory).
                self.held = held
            run.release()
            self.run = None
        if leaving:
            # This node is leaving the job: its shards are with a survivor; its agent stops it.
            self.world.leave()
            log.info("this node leaves the job; ending", step=old_step)
            self.exit_code = 0
            return False
        while True:
            self.change = WorldChange(mode="in-place")
            try:
                membership = self.world.rejoin(stop=lambda: self.stop.requested, timeout=self.options.reform.wait)
            except LeavingJob:
                self.exit_code = 0
                return False
            except ReformFailed:
                if self.stop.requested:
                    self.exit_code = exit_code(self.stop.signum or 15)
                    return False
                raise
            self.change.traceparent = membership.traceparent
            try:
                self._form()
                break
            except Exception as formed:
                # The new world lost a member before it trained: form the next one.
                if not self.world.interrupted(formed):
                    raise
                log.warning("the new world failed while forming; forming the next one", round=membership.round,
                            why=str(formed)[:200])
        log.info(
            "re-formed in place",
            round=membership.round,
            rank=self.rt.rank,
            world_size=f"{old_world}->{self.rt.world_size}",
            step=old_step,
        )
        return True

    def reform_cause(self, exc: BaseException | None) -> BaseException | None:
        """What to re-form with when a call of the training function ended with ``exc``
        (None: it returned), or None when that end is the process's (``reform_cause``;
        never after a stop or a leave). Says so when the re-form came in disguise."""
        if self.exit_code is not None:
            return None
        run = self.run
        cause = reform_cause(exc, self.world, self.ended, run.counters.state if run is not None else None)
        if cause is not None and cause is not exc:
            log.warning(
                "the re-form reached in_place as something else; re-forming in place",
                arrived_as=type(exc).__name__ if exc is not None else "a return",
                exit_code=exc.code if isinstance(exc, SystemExit) else None,
                why=str(cause)[:200],
                hint="a wrapper or an `except` of the script caught it; let regroup.elastic.Reform through",
            )
        return cause

    def fail(self, exc: BaseException) -> None:
        """An exception ends the process: tell the agent whose fault it was. A non-zero
        exit stands for the error in its chain, where it has one (``@hydra.main`` exits 1
        on an exception); a zero exit is no failure."""
        if isinstance(exc, SystemExit):
            if exc.code in (None, 0):
                return
            exc = next((e for e in exception_chain(exc) if isinstance(e, Exception)), exc)
        if isinstance(exc, ReformFailed):
            # Not this node's fault: its agent restarts this worker the usual way (the fallback).
            record_failure(RuntimeError(f"Connection closed by peer: in-place re-form failed: {exc}"))
            log.error("in-place re-form failed; falling back to a restart", error=str(exc))
        elif isinstance(exc, Exception):
            record_failure(exc)


def exception_chain(exc: BaseException | None) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling, outermost first."""
    chain: list[BaseException] = []
    while exc is not None and not any(exc is seen for seen in chain):
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    return chain


def reform_cause(
    exc: BaseException | None, world: ElasticWorld, ended: Reform | None, run_state: str | None
) -> BaseException | None:
    """What to re-form with when a call of the training function ended with ``exc`` (None:
    it returned), or None when that end is not a re-form. ``ended``: the ``Reform`` the run
    raised in this call, if it did; ``run_state``: its run's ``Counters.state`` (None: no run).

    A re-form is one whatever the script or a wrapper made of it: ``Reform`` itself; an exit
    or an error whose chain holds it, or holds a collective's failure the world recognises
    (``@hydra.main`` turns an exception into ``sys.exit(1)``); the re-form the run raised and
    the script caught (``ended``); a return from an unfinished run of a world being
    re-formed. Never a ``LeavingJob``, a ``KeyboardInterrupt``, the end of a finished run, or
    anything outside ``regroup-run``."""
    if isinstance(exc, LeavingJob) or not world.in_place or run_state == "finished":
        return None
    if exc is not None and not isinstance(exc, Exception | SystemExit | Reform):
        return None
    chain = exception_chain(exc)
    cause = next((e for e in chain if isinstance(e, Reform)), None) or ended
    if cause is None and exc is None and run_state is not None and world.ending():
        cause = Reform("the training function returned while its world was being re-formed", clean=False)
    if cause is None:
        # Innermost first: a peer's failure is noted where the collective failed.
        cause = next((e for e in reversed(chain) if world.interrupted(e)), None)
    return cause


def world() -> World:
    """The world this process trains in now: ``rank``, ``world_size``, ``local_rank``,
    ``device``, ``mesh`` (1-D, ``dp``, for ``fully_shard(mesh=...)``). Joins it first if this
    process has not (outside ``in_place``: settings from the environment)."""
    session = Session.current() or Session.open(None)
    return session.world_info


def in_place(fn: F | None = None, *, options: Options | None = None, seed: int = START_SEED) -> Any:
    """``@elastic.in_place`` on the function that builds the model and runs the loop: under
    ``regroup-run`` a re-form calls it again in the same process, in the new world, and the
    new ``Run`` restores the state (from memory, else the newest committed checkpoint).

    The process's world is joined before the first call (``options``: the settings it
    takes, default: the environment's). A stop (SIGTERM) ends the process with 128+signal
    once the function returned; a node left out of the job ends it with 0. Every call
    starts from the same RNG state on every rank: torch's (CPU and CUDA), Python's and
    NumPy's generators seeded with ``seed``.

    It may sit above or below a wrapper (``@hydra.main``, click, typer, ``fire``) and
    around an ``except Exception``: a re-form is recognised whatever reaches it
    (``Session.reform_cause``)."""

    def decorate(function: F) -> F:
        @functools.wraps(function)
        def incarnations(*args: Any, **kwargs: Any) -> Any:
            session = Session.open(options, in_place=True)
            session.rng_start = StartState.capture(seed)
            result = None
            try:
                while True:
                    session.ended = None
                    try:
                        if session.rng_start is not None:
                            session.rng_start.restore()
                        result = function(*args, **kwargs)
                    except BaseException as exc:
                        cause = session.reform_cause(exc)
                        if cause is None:
                            if isinstance(exc, SystemExit) and session.exit_code is not None:
                                break  # a wrapper's exit after a stop or a leave: the session's code
                            session.fail(exc)
                            raise
                    else:
                        cause = session.reform_cause(None)
                        if cause is None:
                            break
                    result = None
                    try:
                        if session.reform(cause):
                            continue
                    except BaseException as failed:
                        session.fail(failed)
                        raise
                    break
            finally:
                session.close()
            if session.exit_code is not None:
                raise SystemExit(session.exit_code)
            return result

        return incarnations  # type: ignore[return-value]

    return decorate(fn) if fn is not None else decorate
