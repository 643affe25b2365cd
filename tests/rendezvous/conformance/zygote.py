"""A launcher with torch already imported: it forks torchrun agents on request.

torch's own launcher tests start their agents as forks of a process that has torch
imported (``multiprocessing.Process(target=torch.distributed.run.main, ...)``). This does
the same from one small process, so an agent costs a fork, not an ``import torch``.

Protocol, one JSON object per line. Requests on stdin:

- ``{"id", "kind": "torchrun", "argv", "env", "log", "patch"}``: run
  ``torch.distributed.run.main(argv)`` in a forked child (its own session, stdout and
  stderr to ``log``). ``patch`` may hold ``exit_barrier_timeout`` (seconds, which
  torchrun's command line does not expose), ``agent_run_raises`` (the agent's ``run()``
  raises ``AgentFailure`` with that message) and ``exit_barrier_raises`` (torch's store
  barrier raises ``RuntimeError``), the ways torch's tests patch the launcher.
- ``{"id", "kind": "store", "env", "log", "host", "port"}``: host a ``TCPStore`` (a c10d
  rendezvous endpoint that no agent owns) until killed.
- ``{"id", "kind": "call", "env", "log", "target": "module:function", "kwargs"}``: call the
  function in a forked child with that environment (it writes its own result somewhere).

Replies on stdout: ``{"id", "pid"}`` once forked, ``{"pid", "exit"}`` when a child ended
(``exit`` as ``subprocess`` reports it: negative for a signal). EOF on stdin ends the
launcher; the children are the caller's to stop.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import tempfile
import traceback
from typing import Any

# Imported once, here, so that each forked agent starts at once. torch's log formatter
# imports torch._dynamo the first time it formats an exception (an agent logging a failed
# exit barrier, say): seconds, on every such agent, unless it is imported here.
import torch._dynamo  # noqa: F401
import torch.distributed.elastic.agent.server.api  # noqa: F401
import torch.distributed.elastic.utils.store
import torch.distributed.launcher.api
import torch.distributed.run

import regroup.rendezvous.handler  # noqa: F401  (the etcd-v3 backend and what it imports)
import regroup.rendezvous.registration  # noqa: F401
import tests.rendezvous.conformance.scenarios  # noqa: F401  (for the scenarios run apart)

TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")


class AgentFailure(Exception):
    """Raised by a patched agent's ``run()``."""


def _apply(patch: dict[str, Any]) -> None:
    api = torch.distributed.launcher.api
    if "exit_barrier_timeout" in patch:
        timeout = float(patch["exit_barrier_timeout"])
        base = api.LocalElasticAgent

        class Agent(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs["exit_barrier_timeout"] = timeout
                super().__init__(*args, **kwargs)

        api.LocalElasticAgent = Agent
    if patch.get("agent_run_raises"):
        message = str(patch["agent_run_raises"])

        def run(self: Any, role: str = "default") -> Any:
            raise AgentFailure(message)

        api.LocalElasticAgent.run = run
    if patch.get("exit_barrier_raises"):

        def barrier(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("exit barrier broken on purpose")

        torch.distributed.elastic.utils.store.barrier = barrier


def _child(request: dict[str, Any]) -> int:
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None  # TMPDIR as the request says, not as this launcher found it
    kind = request["kind"]
    if kind == "torchrun":
        _apply(request.get("patch") or {})
        sys.argv = [TORCHRUN, *request["argv"]]
        torch.distributed.run.main(request["argv"])
        return 0
    if kind == "store":
        import torch.distributed as dist

        store = dist.TCPStore(request["host"], int(request["port"]), is_master=True, wait_for_workers=False)
        print(f"store serving on {request['host']}:{store.port}", flush=True)
        while True:
            signal.pause()
    if kind == "call":
        module, _, name = request["target"].partition(":")
        getattr(importlib.import_module(module), name)(**request.get("kwargs", {}))
        return 0
    raise ValueError(f"unknown request kind {kind!r}")


def _fork(request: dict[str, Any]) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        try:
            code = _child(request)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main() -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    out = sys.stdout
    stdin = sys.stdin.fileno()
    pending = b""

    def reply(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    while True:
        try:
            ready, _, _ = select.select([stdin, wake_r], [], [])
        except InterruptedError:
            ready = []
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reply({"pid": pid, "exit": _exit_code(status)})
        if stdin in ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.strip():
                    request = json.loads(line)
                    reply({"id": request["id"], "pid": _fork(request)})


if __name__ == "__main__":
    main()
