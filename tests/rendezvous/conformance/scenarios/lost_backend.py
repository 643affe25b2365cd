"""A backend lost under a joined handler (``dynamic_rendezvous_test.py``): its server
stalled (SIGSTOP) or killed, the handler's calls still return or raise in bounded time.

The handler runs in a child process (``backend_lost``), so that a call left blocked and
the client sockets of a lost server stay out of the test process."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from tests.rendezvous.conformance.scenario_run import Run


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
        "target": "tests.rendezvous.conformance.scenarios.lost_backend:backend_lost",
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
