"""Runs the conformance scenarios against each backend and tabulates the results.

A scenario is a function of a ``Run``: one backend, one fresh ``--rdzv-id``, its own
folder. A ``Run`` makes rendezvous handlers (through torch's registry, as torchrun does;
etcd-v3's in a child process, see ``EtcdV3``) and starts torchrun agents as forks of the
``zygote`` launcher, and cleans up after itself: handlers shut down, agents' process
groups and workers killed, private servers stopped.

Backends: ``c10d`` (torch's own, the control) on a TCPStore at ``127.0.0.1:<free port>``
that the first agent hosts (``is_host``); ``etcd-v3`` on the test's etcd, every agent under
its own node name (``--rdzv-conf node_name={hostname}-{pid}``), as torch's tests run several
agents on one host with no per-agent environment.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from regroup.demo.etcd_server import EtcdServer
from regroup.ports import free_port
from tests.rendezvous.agents import wait_until

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
WORKER = HERE / "worker.py"
TORCH_WORKER = HERE / "torch_worker.py"

# Short timeouts: every scenario runs in seconds. The same keys mean the same in both backends.
COMMON_CONF = {"join_timeout": "20", "last_call_timeout": "1", "close_timeout": "3"}
# c10d heartbeats every keep_alive_interval (only once the last one is that old): a node is
# dead after interval x max_attempt, which must leave room for one late heartbeat.
C10D_CONF = {**COMMON_CONF, "read_timeout": "5", "keep_alive_interval": "1", "keep_alive_max_attempt": "4"}
ETCD_V3_CONF = {**COMMON_CONF, "lease_ttl": "2"}
# Variables of the launching environment that would change what an agent does.
_DROPPED_ENV = ("NODE_NAME", "POD_NAME", "POD_NAMESPACE", "TORCHELASTIC_", "PET_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


def holds_for(predicate: Callable[[], Any], seconds: float, interval: float = 0.05) -> bool:
    """Whether ``predicate`` stays truthy for ``seconds`` (checked every ``interval``):
    the event it guards against is awaited with that deadline."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not predicate():
            return False
        time.sleep(interval)
    return bool(predicate())


# -- the launcher ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Child:
    """A process the launcher forked. Known by ``ident``: pids are recycled."""

    ident: int
    pid: int


class Launcher:
    """Client of ``zygote``: forks agents and helpers, reports their exits."""

    def __init__(self, python: str, env: dict[str, str], log: Path) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        self._proc = subprocess.Popen(
            [python, "-m", "tests.rendezvous.conformance.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            cwd=REPO,
        )
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ids = 0
        self._forked: dict[int, int] = {}
        """ident -> pid"""
        self._live: dict[int, int] = {}
        """pid -> ident of the running child with that pid"""
        self._exits: dict[int, int] = {}
        """ident -> exit code"""
        self._children: list[Child] = []
        self._reader = threading.Thread(target=self._read, name="conformance-launcher", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        # The launcher answers a fork before it can reap that child, so an exit always
        # belongs to the latest child with that pid.
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            with self._changed:
                if "id" in message:
                    self._forked[message["id"]] = message["pid"]
                    self._live[message["pid"]] = message["id"]
                elif message["pid"] in self._live:
                    self._exits[self._live.pop(message["pid"])] = message["exit"]
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def spawn(self, request: dict[str, Any], timeout: float = 120.0) -> Child:
        """Fork a child for ``request`` (the launcher may still be importing torch)."""
        assert self._proc.stdin is not None
        with self._changed:
            self._ids += 1
            ident = self._ids
            self._proc.stdin.write((json.dumps({**request, "id": ident}) + "\n").encode())
            self._proc.stdin.flush()
            if not self._changed.wait_for(lambda: ident in self._forked or self._proc.poll() is not None, timeout):
                raise AssertionError(f"the launcher forked nothing within {timeout}s")
            if ident not in self._forked:
                raise AssertionError(f"the launcher exited ({self._proc.returncode}); see its log {self._log.name}")
            child = Child(ident, self._forked[ident])
            self._children.append(child)
            return child

    def exit_code(self, child: Child, timeout: float) -> int | None:
        """The child's exit code, waiting up to ``timeout`` seconds for it; None if still running."""
        with self._changed:
            self._changed.wait_for(lambda: child.ident in self._exits, timeout)
            return self._exits.get(child.ident)

    def kill(self, child: Child) -> None:
        """SIGKILL the child's process group (each child leads one), if it still runs."""
        if self.exit_code(child, 0) is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)

    def close(self) -> None:
        for child in self._children:
            self.kill(child)
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._reader.join(5)
        self._log.close()


def kill_ours(pids: list[int], marker: str) -> None:
    """SIGKILL each of ``pids`` still running whose command line names ``marker`` (our own
    workers: a recycled pid of someone else's process is left alone)."""
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Agent:
    """One torchrun agent (a fork of the launcher, leading its own process group)."""

    label: str
    child: Child
    log: Path
    launcher: Launcher

    @property
    def pid(self) -> int:
        return self.child.pid

    def wait(self, timeout: float) -> int:
        code = self.launcher.exit_code(self.child, timeout)
        if code is None:
            raise AssertionError(f"agent {self.label} still running after {timeout:g}s; log:\n{self.tail()}")
        return code

    def exited(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.launcher.exit_code(self.child, 0)

    def running(self) -> bool:
        return self.exited() is None

    def kill(self) -> None:
        self.launcher.kill(self.child)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.text().splitlines()[-lines:])


# -- backends ---------------------------------------------------------------------------------------


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
        serving = wait_until(lambda: _STORE_SERVING.search(_read(log)), 60, "the TCPStore server")
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


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


# -- one scenario on one backend ------------------------------------------------------------------


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


# -- scenarios and results ------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One behaviour torch's tests expect of a rendezvous backend."""

    key: str
    """Short id (also the ``--rdzv-id``)."""
    title: str
    source: str
    """The torch test it comes from: ``file::test``."""
    run: Callable[[Run], str | None]
    """Raises ``AssertionError`` when the backend does not behave; may return a note."""
    backends: tuple[str, ...] = ("etcd-v3", "c10d")
    cost: float = 1.0
    """Rough seconds it takes; the costly ones are started first."""
    in_process: bool = False
    """Only handlers in this process (no launcher): these run first, while the launcher
    imports torch."""


@dataclass
class Result:
    scenario: Scenario
    backend: str
    passed: bool
    seconds: float
    note: str = ""
    detail: str = ""


def run_one(scenario: Scenario, backend: Backend, root: Path, launcher: Launcher, env: dict[str, str]) -> Result:
    out = root / f"{scenario.key}-{backend.name}"
    out.mkdir(parents=True)
    run = Run(backend=backend, run_id=f"{scenario.key}-{backend.name}", out=out, launcher=launcher, env=env)
    if scenario.in_process and backend.isolate_handlers:
        return _run_apart(scenario, run)
    return _run_here(scenario, run)


def _run_here(scenario: Scenario, run: Run) -> Result:
    started = time.monotonic()
    try:
        note = scenario.run(run) or ""
        return Result(scenario, run.backend.name, True, time.monotonic() - started, note)
    except Exception as exc:  # noqa: BLE001 - every failure is a result to report
        first = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        detail = "".join(traceback.format_exception(exc))[-3000:] + "\n" + run.logs()
        return Result(scenario, run.backend.name, False, time.monotonic() - started, first, detail)
    finally:
        run.close()


APART_LIMIT_S = 60.0


def _run_apart(scenario: Scenario, run: Run) -> Result:
    """The scenario in a forked child of the launcher, which writes its ``Result`` as JSON."""
    started = time.monotonic()
    result = run.out / "result.json"
    request = {
        "kind": "call",
        "env": run.env,
        "log": str(run.out / "child.log"),
        "target": "tests.rendezvous.conformance.runner:run_in_child",
        "kwargs": {
            "key": scenario.key, "backend": run.backend.name, "endpoint": run.backend.endpoint(run),
            "out": str(run.out), "run_id": run.run_id, "result": str(result),
        },
    }  # fmt: skip
    try:
        child = run.children.spawn(request)
        code = run.children.exit_code(child, APART_LIMIT_S)
        if code is None:
            run.children.kill(child)
        if not result.exists():
            log = _read(run.out / "child.log")[-3000:]
            return Result(scenario, run.backend.name, False, time.monotonic() - started, f"child exited {code}", log)
        data = json.loads(result.read_text())
        return Result(scenario, run.backend.name, data["passed"], data["seconds"], data["note"], data["detail"])
    finally:
        run.close()


def run_in_child(key: str, backend: str, endpoint: str, out: str, run_id: str, result: str) -> None:
    """``_run_apart``'s child: run scenario ``key`` here and write its result."""
    from tests.rendezvous.conformance.scenarios import SCENARIOS

    scenario = next(s for s in SCENARIOS if s.key == key)
    chosen = C10d() if backend == "c10d" else EtcdV3(endpoint)
    run = Run(backend=chosen, run_id=run_id, out=Path(out), launcher=None, env=dict(os.environ))
    outcome = _run_here(scenario, run)
    fields = {"passed": outcome.passed, "seconds": outcome.seconds, "note": outcome.note, "detail": outcome.detail}
    Path(result).write_text(json.dumps(fields))


def run_all(
    scenarios: list[Scenario],
    backends: list[Backend],
    root: Path,
    launcher: Launcher,
    env: dict[str, str],
    threads: int,
) -> list[Result]:
    # What needs no launcher first (it runs while the launcher imports torch), then the
    # costliest first.
    tasks = sorted(
        ((s, b) for s in scenarios for b in backends if b.name in s.backends),
        key=lambda task: (not (task[0].in_process and not task[1].isolate_handlers), -task[0].cost),
    )
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="conformance") as pool:
        futures = [pool.submit(run_one, s, b, root, launcher, env) for s, b in tasks]
        return [f.result() for f in futures]


def child_env(base: dict[str, str]) -> dict[str, str]:
    """The environment agents and workers start from: the repo importable, no node identity."""
    env = {k: v for k, v in base.items() if not k.startswith(_DROPPED_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["LOGLEVEL"] = "INFO"  # torch's agent logs (read by the scenarios)
    return env


def table(
    scenarios: list[Scenario], results: list[Result], not_applicable: dict[str, str], c10d_known: dict[str, str]
) -> str:
    """The results as a markdown table: scenario x backend, with the notes."""
    by = {(r.scenario.key, r.backend): r for r in results}
    lines = ["| scenario | torch test | etcd-v3 | c10d | note |", "|---|---|---|---|---|"]
    for s in scenarios:
        cells = []
        notes = []
        for backend in ("etcd-v3", "c10d"):
            r = by.get((s.key, backend))
            if r is None:
                cells.append("n/a")
                continue
            verdict = "pass" if r.passed else "differs" if s.key in not_applicable and backend == "etcd-v3" else "FAIL"
            cells.append(f"{verdict} ({r.seconds:.1f}s)")
            if r.note:
                notes.append(f"{backend}: {r.note}")
        if s.key in not_applicable:
            notes.insert(0, f"not applicable to etcd-v3: {not_applicable[s.key]}")
        control = by.get((s.key, "c10d"))
        if s.key in c10d_known and control is not None and not control.passed:
            notes = [n for n in notes if not n.startswith("c10d:")]
            notes.append(f"c10d, known torch bug: {c10d_known[s.key]} (here: {control.note[:160]})")
        lines.append(f"| {s.title} | `{s.source}` | {cells[0]} | {cells[1]} | {'; '.join(notes)} |")
    return "\n".join(lines)


@contextlib.contextmanager
def launcher_for(python: str, env: dict[str, str], log: Path) -> Iterator[Launcher]:
    launcher = Launcher(python, env, log)
    try:
        yield launcher
    finally:
        launcher.close()
