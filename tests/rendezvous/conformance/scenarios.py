"""torch's rendezvous scenarios, as behaviours any backend must show, in our own words.

Taken from three torch test files (``test/distributed/...``):

- ``dynamic_rendezvous_test.py`` (``IntegrationTest``, ``DynamicRendezvousHandlerTest``):
  the handler contract, driven here through handlers that torch's registry makes;
- ``run_test.py``: launches through torchrun's command line;
- ``local_elastic_agent_test.py``: agents with workers that succeed, fail, drift apart,
  and agents that are killed.

torch drives most of these with mocks (a fake state holder, a patched ``sync``); here each
runs against the real backend: a real etcd, a real TCPStore, real torchrun agents.
Workers are ``worker.py`` (no torch) unless a scenario needs a process group or torch's
error files (``torch_worker.py``).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import wait
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from tests.rendezvous.conformance.runner import TORCH_WORKER, Run, Scenario, holds_for, wait_until
from tests.rendezvous.conformance.torch_worker import RAISED

DYN = "dynamic_rendezvous_test.py"
RUN = "run_test.py"
LEA = "local_elastic_agent_test.py"

ENV_TORCH_SETS = (
    "RANK", "LOCAL_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)  # fmt: skip


def raises(run: Run, fn: Any, timeout: float, what: str) -> BaseException:
    """The exception ``fn()`` raised; fails if it returned."""
    try:
        value = run.call(fn, timeout, what)
    except AssertionError:
        raise
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError(f"{what} returned {value!r} instead of raising")


# -- handler level: dynamic_rendezvous_test.py ------------------------------------------------------


def all_nodes_join(run: Run) -> None:
    a, b = run.handler((2, 2)), run.handler((2, 2))
    first, second = run.join(a, b)
    assert {first.rank, second.rank} == {0, 1}, (first.rank, second.rank)
    assert first.world_size == second.world_size == 2
    # Both got the round's one store.
    first.store.set("conformance/written-by", "first")
    assert second.store.get("conformance/written-by") == b"first"


def beyond_max_waits(run: Run) -> str:
    a, b = run.handler((2, 2)), run.handler((2, 2))
    run.join(a, b)
    extra = run.handler((2, 2), join_timeout="6")
    future = run.submit(extra.next_rendezvous)
    seen: set[tuple[int, int]] = set()

    def waiting_alone() -> bool:
        seen.add((a.num_nodes_waiting(), b.num_nodes_waiting()))
        return not future.done() and seen == {(0, 0)}

    # torch lets the extra node time out or wait on; either way it gets no place, and the
    # members are not made to restart for it.
    assert holds_for(waiting_alone, 2.0, interval=0.1), (
        f"a node beyond max: done {future.done()}, members' num_nodes_waiting {seen}"
    )
    run.call(a.set_closed, 10, "set_closed()")
    done, _ = wait([future], 10)
    assert done, "the node beyond max still waits after the run closed"
    exc = future.exception()
    assert isinstance(exc, RendezvousError), f"the node beyond max: {exc!r}"
    return f"then {type(exc).__name__}"


def num_nodes_waiting(run: Run) -> None:
    a, b = run.handler((2, 3)), run.handler((2, 3))
    run.join(a, b)
    assert a.num_nodes_waiting() == 0 and b.num_nodes_waiting() == 0
    c = run.handler((2, 3))
    joiner = run.submit(c.next_rendezvous)
    wait_until(lambda: a.num_nodes_waiting() and b.num_nodes_waiting(), 10, "the members to see the joiner")
    counts = (a.num_nodes_waiting(), b.num_nodes_waiting())
    assert counts == (1, 1), f"num_nodes_waiting {counts}, one node waits"
    infos = [*run.join(a, b), joiner.result(20)]
    assert sorted(i.rank for i in infos) == [0, 1, 2] and {i.world_size for i in infos} == {3}


def set_closed(run: Run) -> None:
    a = run.handler((1, 2))
    assert not a.is_closed()
    run.call(a.set_closed, 10, "set_closed()")
    run.call(a.set_closed, 10, "set_closed() again")
    assert a.is_closed()
    b = run.handler((1, 2))
    wait_until(b.is_closed, 10, "another node to see the run closed")


def closed_raises(run: Run) -> None:
    a, b = run.handler((2, 2)), run.handler((2, 2))
    run.join(a, b)
    run.call(a.set_closed, 10, "set_closed()")
    exc = raises(run, b.next_rendezvous, 10, "a member's next_rendezvous() on a closed run")
    assert isinstance(exc, RendezvousClosedError), f"member: {exc!r}"
    late = run.handler((2, 2))
    exc = raises(run, late.next_rendezvous, 10, "a newcomer's next_rendezvous() on a closed run")
    assert isinstance(exc, RendezvousClosedError), f"newcomer: {exc!r}"


def shutdown_closes(run: Run) -> None:
    a, b = run.handler((2, 2)), run.handler((2, 2))
    run.join(a, b)
    assert run.call(a.shutdown, 15, "shutdown()") is True
    assert run.call(a.shutdown, 15, "shutdown() again") is True
    wait_until(b.is_closed, 10, "the other member to see the run closed")
    assert b.num_nodes_waiting() == 0


LOST_LIMIT_S = 8.0
"""How long a handler call may take against a lost backend before it counts as hung."""


def backend_lost(
    backend: str, endpoint: str, server_pid: int, run_id: str, conf: dict[str, str], how: str, calls: list[str],
    result: str,
) -> None:  # fmt: skip
    """In a child: join a round, stall (SIGSTOP) or kill the backend's server, then time
    each of the handler's ``calls`` (``kill-poll``: until it raises) and write what each
    did to ``result``. Apart from the
    test process, so that a call left blocked (c10d's ``set_closed()`` on a stalled store
    does not return) and the client sockets of a lost server do not stay in it."""
    params = RendezvousParameters(
        backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1, local_addr="127.0.0.1", **conf
    )
    handler = get_rendezvous_handler(params)
    handler.next_rendezvous()
    if how == "stall":
        os.kill(server_pid, signal.SIGSTOP)
        _await_state(server_pid, {"T", "t"}, "stopped")
    else:  # "kill", "kill-poll"
        os.kill(server_pid, signal.SIGKILL)
        _await_state(server_pid, {"Z", "X", "gone"}, "gone")
    if how == "kill-poll":
        outcomes = _until_raised({name: getattr(handler, name) for name in calls})
    else:
        outcomes = {name: _timed(getattr(handler, name)) for name in calls}
    Path(result).write_text(json.dumps(outcomes))


def _await_state(pid: int, states: set[str], what: str, timeout: float = 5.0) -> None:
    """Wait until every thread of ``pid`` is in one of ``states`` (``/proc``): a signal is
    sent at once, but a thread may still answer a request before it takes effect."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            seen = {Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks}
        except (OSError, IndexError):
            seen = {"gone"}
        if seen <= states:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"the backend's server is not {what} after {timeout:g}s: {seen}")
        time.sleep(0.02)


POLL_LIMIT_S = 3.0
"""How long the queries of a lost backend are repeated, waiting for them to raise (c10d
answers from a state it keeps for a second)."""


def _until_raised(calls: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``_timed`` each call again and again until each raised once, or ``POLL_LIMIT_S``."""
    deadline = time.monotonic() + POLL_LIMIT_S
    outcomes: dict[str, dict[str, Any]] = {}
    while True:
        for name, call in calls.items():
            if "raised" not in outcomes.get(name, {}):
                outcomes[name] = _timed(call)
        if all("raised" in o or "seconds" not in o for o in outcomes.values()) or time.monotonic() > deadline:
            return outcomes
        time.sleep(0.1)


def _timed(call: Any) -> dict[str, Any]:
    """What ``call()`` did: ``returned`` or ``raised`` (and whether a ``RendezvousError``),
    and in ``seconds``; no ``seconds`` if it was still running after ``LOST_LIMIT_S``."""
    outcome: dict[str, Any] = {}

    def measure() -> None:
        started = time.monotonic()
        try:
            outcome["returned"] = call()
        except BaseException as exc:  # noqa: BLE001 - what it raised is the result
            outcome["raised"] = type(exc).__name__
            outcome["rendezvous_error"] = isinstance(exc, RendezvousError)
        outcome["seconds"] = round(time.monotonic() - started, 2)

    thread = threading.Thread(target=measure, daemon=True)
    thread.start()
    thread.join(LOST_LIMIT_S)
    return dict(outcome)


def _lose_backend(run: Run, how: str, calls: list[str], **conf: str) -> dict[str, dict[str, Any]]:
    server = run.server()
    result = run.out / "lost.json"
    request = {
        "kind": "call",
        "env": run.env,
        "log": str(run.out / "call.log"),
        "target": "tests.rendezvous.conformance.scenarios:backend_lost",
        "kwargs": {
            "backend": run.backend.name, "endpoint": server.endpoint, "server_pid": server.pid, "run_id": run.run_id,
            "conf": {**run.backend.conf(run, 0, False), **conf}, "how": how, "calls": calls, "result": str(result),
        },
    }  # fmt: skip
    child = run.children.spawn(request)
    code = run.children.exit_code(child, 2 * len(calls) * LOST_LIMIT_S + 30)
    log = (run.out / "call.log").read_text(errors="replace")[-2000:]
    assert code == 0, f"the child exited {code}: {log}"
    outcomes: dict[str, dict[str, Any]] = json.loads(result.read_text())
    for name, outcome in outcomes.items():
        if "seconds" not in outcome:
            raise AssertionError(f"{name}() still running after {LOST_LIMIT_S:g}s")
    return outcomes


def shutdown_false(run: Run) -> str:
    outcome = _lose_backend(run, "kill", ["shutdown"], close_timeout="2")["shutdown"]
    assert "raised" not in outcome, f"shutdown() raised {outcome['raised']}"
    assert outcome["returned"] is False, f"shutdown() returned {outcome['returned']!r} with the backend gone"
    assert outcome["seconds"] < 15, f"shutdown() took {outcome['seconds']}s"
    return f"False after {outcome['seconds']}s"


def close_timeout(run: Run) -> str:
    outcome = _lose_backend(run, "stall", ["set_closed"], close_timeout="1", read_timeout="2")["set_closed"]
    assert outcome.get("rendezvous_error"), f"set_closed() did not raise a RendezvousError: {outcome}"
    assert outcome["seconds"] < 1 + 2 + 5, f"set_closed() gave up after {outcome['seconds']}s (close_timeout 1s)"
    return f"{outcome['raised']} after {outcome['seconds']}s"


def queries_raise(run: Run) -> str:
    outcomes = _lose_backend(run, "kill-poll", ["is_closed", "num_nodes_waiting"], read_timeout="2")
    said = {name: o.get("raised", o.get("returned")) for name, o in outcomes.items()}
    for name, outcome in outcomes.items():
        assert outcome.get("rendezvous_error"), f"backend gone: {name}() gave {said[name]!r}, not a RendezvousError"
    return ", ".join(f"{name}() raised {value}" for name, value in said.items())


def join_timeout(run: Run) -> str:
    a = run.handler((2, 2), join_timeout="1")
    started = time.monotonic()
    exc = raises(run, a.next_rendezvous, 20, "next_rendezvous() with no peer")
    seconds = time.monotonic() - started
    assert isinstance(exc, RendezvousTimeoutError), f"raised {exc!r}"
    assert 0.9 <= seconds < 1 + 5, f"gave up after {seconds:.1f}s (join_timeout 1s)"
    return f"after {seconds:.1f}s"


def next_round_each_call(run: Run) -> None:
    a = run.handler((1, 1))
    previous = None
    for n in range(3):
        info = run.call(a.next_rendezvous, 15, f"next_rendezvous() #{n + 1}")
        assert (info.rank, info.world_size) == (0, 1)
        if previous is not None:
            assert not info.store.check([previous]), "the next round's store still holds the last round's key"
        previous = f"conformance/round-{n}"
        info.store.set(previous, "x")


def identity(run: Run) -> None:
    a = run.handler((1, 2))
    assert a.get_run_id() == run.run_id, a.get_run_id()
    assert a.get_backend() == run.backend.name, a.get_backend()


def local_addr(run: Run) -> None:
    a = run.handler((1, 1), local_addr="127.0.0.2")
    [info] = run.join(a)
    assert info.bootstrap_store_info is not None
    assert info.bootstrap_store_info.master_addr == "127.0.0.2", info.bootstrap_store_info


def agent_store_default(run: Run) -> None:
    a = run.handler((1, 2))
    assert a.use_agent_store is True, f"use_agent_store is {a.use_agent_store!r}"


def report_use_agent_store(backend: str, endpoint: str, run_id: str, conf: dict[str, str], result: str) -> None:
    """In a child whose environment says ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``."""
    params = RendezvousParameters(
        backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=1, max_nodes=1, local_addr="127.0.0.1", **conf
    )
    handler = get_rendezvous_handler(params)
    try:
        Path(result).write_text(json.dumps({"use_agent_store": handler.use_agent_store}))
    finally:
        handler.shutdown()


def agent_store_disabled(run: Run) -> None:
    result = run.out / "use_agent_store.json"
    request = {
        "kind": "call",
        "env": {**run.env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        "log": str(run.out / "call.log"),
        "target": "tests.rendezvous.conformance.scenarios:report_use_agent_store",
        "kwargs": {
            "backend": run.backend.name,
            "endpoint": run.backend.endpoint(run),
            "run_id": run.run_id,
            "conf": run.backend.conf(run, 0, True),
            "result": str(result),
        },
    }
    child = run.children.spawn(request)
    code = run.children.exit_code(child, 30)
    assert code == 0, f"the child exited {code}: {(run.out / 'call.log').read_text(errors='replace')[-2000:]}"
    value = json.loads(result.read_text())["use_agent_store"]
    assert value is False, f"use_agent_store is {value!r} with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


# -- torchrun: run_test.py and local_elastic_agent_test.py --------------------------------------------


def _ranks(rows: list[dict[str, Any]]) -> list[int]:
    return sorted(int(r["RANK"]) for r in rows)


def launch_line_unchanged(run: Run) -> None:
    # c10d's launch line as a user has it, with only --rdzv-backend/--rdzv-endpoint changed.
    conf = {
        "join_timeout": "20", "last_call_timeout": "1", "close_timeout": "3", "read_timeout": "10",
        "keep_alive_interval": "1", "keep_alive_max_attempt": "3", "is_host": "1", "use_libuv": "true",
    }  # fmt: skip
    agent = run.start("a", "1:2", nproc=2, conf=conf)
    assert agent.wait(40) == 0, agent.tail()
    rows = run.rows("a")
    assert _ranks(rows) == [0, 1], rows
    assert {r["WORLD_SIZE"] for r in rows} == {"2"}
    missing = sorted({k for r in rows for k in ENV_TORCH_SETS if r.get(k) is None})
    assert not missing, f"workers lack {missing}"


def worker_raises(run: Run) -> None:
    error_file = run.out / "agent-error.json"
    env = {"TORCHELASTIC_ERROR_FILE": str(error_file)}
    agent = run.start("a", "1:2", script=TORCH_WORKER, args=("raise",), env=env)
    code = agent.wait(90)
    assert code == 1, f"exit {code}"
    assert "ChildFailedError" in agent.text(), agent.tail()
    data = json.loads(error_file.read_text())
    message = data["message"]["message"] if isinstance(data["message"], dict) else data["message"]
    assert RAISED in message, f"the agent's error file says {message!r}"


def agent_raises(run: Run) -> None:
    agent = run.start("a", "1:2", patch={"agent_run_raises": "agent failed on purpose"})
    code = agent.wait(30)
    assert code == 1, f"exit {code}"
    assert "AgentFailure: agent failed on purpose" in agent.text(), agent.tail()


def restart_recovers(run: Run) -> None:
    agent = run.start("a", "1", nproc=2, max_restarts=3, args=("--fail-ranks", "1", "--fail-below", "1"))
    assert agent.wait(40) == 0, agent.tail()
    rows = run.rows("a")
    by_restart: dict[str, list[int]] = {}
    for r in rows:
        by_restart.setdefault(r["TORCHELASTIC_RESTART_COUNT"], []).append(int(r["RANK"]))
    assert sorted(by_restart) == ["0", "1"], f"attempts {by_restart}"
    assert sorted(by_restart["1"]) == [0, 1]


def restarts_exhausted(run: Run) -> None:
    agent = run.start("a", "1", nproc=2, max_restarts=2, args=("--fail-ranks", "1"))
    assert agent.wait(40) == 1, agent.tail()
    restarts = sorted({r["TORCHELASTIC_RESTART_COUNT"] for r in run.rows("a")})
    assert restarts == ["0", "1", "2"], f"attempts {restarts} (max_restarts 2: three in all)"


def ranks_of_two_agents(run: Run) -> None:
    a = run.start("a", "2:2", nproc=1)
    b = run.start("b", "2:2", nproc=2)
    assert a.wait(40) == 0, a.tail()
    assert b.wait(40) == 0, b.tail()
    rows = run.rows()
    assert _ranks(rows) == [0, 1, 2], rows
    assert {r["WORLD_SIZE"] for r in rows} == {"3"} and {r["ROLE_WORLD_SIZE"] for r in rows} == {"3"}
    assert {r["GROUP_WORLD_SIZE"] for r in rows} == {"2"}
    for label, size in (("a", 1), ("b", 2)):
        mine = run.rows(label)
        ranks = _ranks(mine)
        assert ranks == list(range(ranks[0], ranks[0] + size)), f"{label}: ranks {ranks} not consecutive"
        assert len({r["GROUP_RANK"] for r in mine}) == 1 and {r["LOCAL_WORLD_SIZE"] for r in mine} == {str(size)}
    assert len({r["GROUP_RANK"] for r in rows}) == 2


def gloo_sum(run: Run) -> None:
    a = run.start("a", "2:2", script=TORCH_WORKER, args=("sum",))
    b = run.start("b", "2:2", script=TORCH_WORKER, args=("sum",))
    assert a.wait(90) == 0, a.tail()
    assert b.wait(30) == 0, b.tail()
    sums = [json.loads((run.out / f"sum-{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["sum"] for s in sums] == [1.0, 1.0], sums


def _mesh_at(run: Run, labels: list[str], world: int) -> bool:
    meshed = run.meshed()
    return all(any(m["agent"] == label and m["world"] == world for m in meshed) for label in labels)


def _since(run: Run, label: str, world: int, after: float) -> bool:
    return any(r["t"] > after and r["WORLD_SIZE"] == str(world) for r in run.rows(label))


def fault_tolerance(run: Run) -> None:
    mesh = ("--mesh",)
    a = run.start("a", "2:2", max_restarts=2, args=mesh)
    b = run.start("b", "2:2", max_restarts=2, args=mesh)
    run.until(lambda: _mesh_at(run, ["a", "b"], 2), 40, "a and b working together", alive=(a, b))
    killed = time.time()
    run.kill("b")
    b2 = run.start("b2", "2:2", max_restarts=2, args=mesh, host=False)
    run.until(lambda: _since(run, "a", 2, killed) and _since(run, "b2", 2, killed), 40, "a and b2 in a new round",
              alive=(a, b2))
    run.stop_workers()
    assert a.wait(30) == 0, a.tail()
    assert b2.wait(30) == 0, b2.tail()


def elastic_scale_down(run: Run) -> None:
    mesh = ("--mesh",)
    a = run.start("a", "1:2", max_restarts=2, args=mesh)
    b = run.start("b", "1:2", max_restarts=2, args=mesh)
    run.until(lambda: _mesh_at(run, ["a", "b"], 2), 40, "a and b working together at world size 2", alive=(a, b))
    killed = time.time()
    run.kill("b")
    run.until(lambda: _since(run, "a", 1, killed), 40, "a working on alone at world size 1", alive=(a,))
    run.stop_workers()
    assert a.wait(30) == 0, a.tail()


def waiting_node_takes_over(run: Run) -> None:
    mesh = ("--mesh",)
    a = run.start("a", "1:2", max_restarts=2, args=mesh)
    b = run.start("b", "1:2", max_restarts=2, args=mesh)
    run.until(lambda: _mesh_at(run, ["a", "b"], 2), 40, "a and b working together at world size 2", alive=(a, b))
    attempts = len(run.rows())
    c = run.start("c", "1:2", max_restarts=2, args=mesh)
    run.until(lambda: "Rendezvous'ing worker group" in c.text(), 20, "c to enter the rendezvous", alive=(c,))
    # The job is at max: c waits, and a and b keep their workers.
    assert holds_for(lambda: len(run.rows()) == attempts, 2.0), "a node beyond max started workers or restarted others"
    killed = time.time()
    run.kill("b")
    run.until(
        lambda: _since(run, "a", 2, killed) and _since(run, "c", 2, killed), 40, "a and c in a new round", alive=(a, c)
    )
    run.stop_workers()
    assert a.wait(30) == 0, a.tail()
    assert c.wait(30) == 0, c.tail()


def drift_success(run: Run) -> None:
    go = run.out / "go"
    patch = {"exit_barrier_timeout": 20}
    # In c10d the first agent hosts the store; it finishes last.
    a = run.start("a", "2:2", args=("--wait-for", str(go)), patch=patch)
    b = run.start("b", "2:2", patch=patch)
    run.until(lambda: "other agents to finish" in b.text(), 40, "b in the exit barrier", alive=(a, b))
    go.touch()
    assert a.wait(30) == 0, a.tail()
    assert b.wait(30) == 0, b.tail()
    for agent in (a, b):
        passed = "Done waiting for other agents" in agent.text()
        assert passed, f"{agent.label} did not pass the exit barrier\n{agent.tail()}"


def drift_fail(run: Run) -> None:
    go = run.out / "go"
    patch = {"exit_barrier_timeout": 0}
    a = run.start("a", "2:2", args=("--wait-for", str(go)), patch=patch)
    b = run.start("b", "2:2", patch=patch)
    assert b.wait(40) == 0, b.tail()
    go.touch()  # a's worker ends only after b's agent is gone
    assert a.wait(30) == 0, a.tail()
    assert len(run.rows("a")) == 1, "a restarted its workers when b finished"


def barrier_failure(run: Run) -> None:
    agent = run.start("a", "1", patch={"exit_barrier_raises": True})
    assert agent.wait(30) == 0, agent.tail()
    assert "Error waiting on exit barrier" in agent.text(), agent.tail()


def no_barrier_on_failure(run: Run) -> None:
    # Odd ranks fail, even ones would run on: both agents fail at once, no exit barrier.
    args = ("--fail-ranks", "1,3", "--wait-for", str(run.out / "never"))
    patch = {"exit_barrier_timeout": 300}
    a = run.start("a", "2:2", nproc=2, args=args, patch=patch)
    b = run.start("b", "2:2", nproc=2, args=args, patch=patch)
    codes = (a.wait(40), b.wait(40))
    assert all(code != 0 for code in codes), f"exit codes {codes}"


def duplicate_node_name(run: Run) -> None:
    same = {"NODE_NAME": "twin"}
    conf = {**run.backend.cli_conf(run, True)}
    conf.pop("node_name")
    a = run.start("a", "1:2", args=("--wait-for", str(run.out / "STOP")), env=same, conf=conf)
    run.until(lambda: run.rows("a"), 30, "a's worker", alive=(a,))
    b = run.start("b", "1:2", env=same, conf=conf)
    code = b.wait(30)
    assert code != 0, f"the second agent under one name exited {code}"
    text = b.text()
    assert "DuplicateNode" in text and "node name 'twin' is held by the live agent of pod" in text, b.tail()
    assert a.running() and len(run.rows("a")) == 1, "the first agent was disturbed"
    run.stop_workers()
    assert a.wait(30) == 0, a.tail()


SCENARIOS = [
    # dynamic_rendezvous_test.py
    Scenario(
        "all-join", "all nodes join: distinct ranks, one world size, one store",
        f"{DYN}::test_all_nodes_join_rendezvous", all_nodes_join, in_process=True,
    ),
    Scenario(
        "beyond-max", "a node beyond max gets no place and makes no member restart; it ends when the run closes",
        f"{DYN}::test_redundancy_list", beyond_max_waits, cost=3, in_process=True,
    ),
    Scenario(
        "num-waiting", "num_nodes_waiting() counts a joiner; the next round takes it in",
        f"{DYN}::test_num_nodes_waiting_returns_expected_value", num_nodes_waiting, cost=2, in_process=True,
    ),
    Scenario(
        "set-closed", "set_closed() before any round, idempotent; is_closed() everywhere",
        f"{DYN}::test_set_closed_can_be_called_multiple_times", set_closed, in_process=True,
    ),
    Scenario(
        "closed-raises", "next_rendezvous() on a closed run raises RendezvousClosedError (member and newcomer)",
        f"{DYN}::test_set_closed_closes_rendezvous", closed_raises, in_process=True,
    ),
    Scenario(
        "shutdown", "shutdown() closes the run and returns True; idempotent",
        f"{DYN}::test_shutdown_closes_rendezvous_and_returns_true", shutdown_closes, in_process=True,
    ),
    Scenario(
        "shutdown-false", "shutdown() returns False when it cannot close (backend gone)",
        f"{DYN}::test_shutdown_returns_false_if_rendezvous_cannot_be_closed", shutdown_false, cost=4,
    ),
    Scenario(
        "close-timeout", "set_closed() on a stalled backend raises within its timeouts",
        f"{DYN}::test_set_closed_respects_the_requested_timeout", close_timeout, cost=4,
    ),
    Scenario(
        "lost-queries", "with the backend gone, is_closed() and num_nodes_waiting() raise a RendezvousError",
        f"{DYN}::test_num_nodes_waiting_records_and_raises_exceptions", queries_raise, cost=3,
    ),
    Scenario(
        "join-timeout", "next_rendezvous() raises RendezvousTimeoutError after join_timeout",
        f"{DYN}::test_next_rendezvous_respects_the_requested_timeout", join_timeout, cost=2, in_process=True,
    ),
    Scenario(
        "next-round", "next_rendezvous() called again moves to the next round (fresh store)",
        f"{DYN}::test_next_rendezvous_moves_to_next_round_if_called_repeatedly", next_round_each_call, in_process=True,
    ),
    Scenario(
        "identity", "get_run_id() and get_backend()",
        f"{DYN}::test_create_handler_returns_handler", identity, in_process=True,
    ),
    Scenario(
        "local-addr", "local_addr becomes master_addr",
        f"{DYN}::test_create_handler_rdzv_local_addr", local_addr, in_process=True,
    ),
    Scenario(
        "agent-store", "use_agent_store is True by default",
        f"{DYN}::test_use_agent_store_is_true_by_default", agent_store_default, in_process=True,
    ),
    Scenario(
        "agent-store-off", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: use_agent_store is False",
        f"{DYN}::test_use_agent_store_is_disabled", agent_store_disabled, cost=3,
    ),
    # run_test.py
    Scenario(
        "launch-line", "--nnodes=1:2, c10d's --rdzv-conf keys unchanged: exit 0, every rank, torch's env",
        f"{RUN}::test_launch_elastic", launch_line_unchanged, cost=4,
    ),
    Scenario(
        "worker-raises", "a worker raises: exit 1, its error in the launcher's error file",
        f"{RUN}::test_launch_elastic_worker_raise_exception", worker_raises, cost=12,
    ),
    Scenario(
        "agent-raises", "the agent raises: the launcher re-raises it",
        f"{RUN}::test_launch_elastic_agent_raise_exception", agent_raises, cost=2,
    ),
    # local_elastic_agent_test.py
    Scenario(
        "restart", "--max-restarts: a failed worker group is restarted and succeeds",
        f"{LEA}::test_rank_restart_after_failure", restart_recovers, cost=5,
    ),
    Scenario(
        "restarts-spent", "--max-restarts spent: exit 1 after max_restarts + 1 attempts",
        f"{LEA}::test_run_bipolar_function_c10d", restarts_exhausted, cost=6,
    ),
    Scenario(
        "two-agents", "two agents (1 and 2 workers): ranks 0..2, consecutive per agent",
        f"{LEA}::test_run_distributed_sum_heterogeneous_c10d", ranks_of_two_agents, cost=4,
    ),
    Scenario(
        "gloo-sum", "two agents' workers form a gloo group and all-reduce",
        f"{LEA}::test_run_distributed_sum_homogeneous_c10d", gloo_sum, cost=14,
    ),
    Scenario(
        "fault-tolerance", "one agent killed, a new one started: a new round, both exit 0",
        f"{LEA}::test_double_agent_fault_tolerance_etcd", fault_tolerance, cost=12,
    ),
    Scenario(
        "elastic", "one agent of two killed: the other re-forms alone and exits 0",
        f"{LEA}::test_double_agent_elastic_c10d", elastic_scale_down, cost=10,
    ),
    Scenario(
        "takes-over", "a node waiting beyond max takes a killed member's place",
        f"{DYN}::test_redundancy_transition_to_wait_list_then_join_rendezvous", waiting_node_takes_over, cost=14,
    ),
    Scenario(
        "drift-success", "workers finish apart, within the exit barrier: both pass it",
        f"{LEA}::test_workers_drift_success_etcd", drift_success, cost=5,
    ),
    Scenario(
        "drift-fail", "workers finish apart, exit barrier timeout 0: both exit 0, no restart",
        f"{LEA}::test_workers_drift_fail_etcd", drift_fail, cost=5,
    ),
    Scenario(
        "barrier-fails", "a failing exit barrier does not fail the job",
        f"{LEA}::test_barrier_failed_c10d", barrier_failure, cost=2,
    ),
    Scenario(
        "no-barrier", "failed workers skip the exit barrier: both agents exit non-zero",
        f"{LEA}::test_no_exit_barrier_on_failure", no_barrier_on_failure, cost=4,
    ),
    # etcd-v3's own: agents sharing a host need a name each
    Scenario(
        "duplicate-name", "two live agents under one NODE_NAME: the second is refused (DuplicateNode)",
        "(etcd-v3: one node name per live agent)", duplicate_node_name, backends=("etcd-v3",), cost=6,
    ),
]

NOT_APPLICABLE = {
    "shutdown": (
        "by design etcd-v3's shutdown() closes the run only once the job is over: the agent's "
        "workers succeeded (it entered torchrun's exit barrier, as in the drift scenarios) or no "
        "round formed; an agent that fails leaves alone and the others re-form, where c10d's "
        "closing would end the elastic job for every survivor and every later pod"
    ),
    "lost-queries": (
        "by design etcd-v3 answers both from its watch's view of the job, without a request, so "
        "training rides out an etcd restart (see Failure behaviour); c10d's agents, whose monitor "
        "loop calls num_nodes_waiting(), fail when their store does"
    ),
    "agent-store": (
        "by design etcd-v3 has no agent store (use_agent_store is False): each round's store "
        "lives in etcd and workers bootstrap from a fresh MASTER_ADDR/PORT, as with "
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (gloo-sum shows it works)"
    ),
}
"""Scenarios c10d passes that etcd-v3 need not: the reason, shown in the table."""

_PYTORCH_135712 = (
    "pytorch#135712: with the shared agent store (c10d's default) a node that joins a running job "
    "and is not rank 0 waits for a MASTER_ADDR that rank 0, keeping its first round's, never writes again"
)
C10D_KNOWN_FAILURES = {
    "num-waiting": _PYTORCH_135712,
    "fault-tolerance": _PYTORCH_135712,
    "takes-over": _PYTORCH_135712,
    "close-timeout": (
        "c10d's TCPStore compare_set has no timeout: set_closed() blocks on a stalled store past close_timeout"
    ),
}
"""Scenarios c10d fails through a known torch bug: etcd-v3 must pass them all the same."""
