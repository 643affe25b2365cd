"""The processes of a conformance run: the client of the ``zygote`` launcher, which forks
torchrun agents and helpers and reports their exits (``Launcher``); the agents it started
(``Agent``); the environment they start from (``child_env``); and killing, by pid, only
what is our own (``kill_ours``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


# Variables of the launching environment that would change what an agent does.
_DROPPED_ENV = ("NODE_NAME", "POD_NAME", "POD_NAMESPACE", "TORCHELASTIC_", "PET_", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")


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


@contextlib.contextmanager
def launcher_for(python: str, env: dict[str, str], log: Path) -> Iterator[Launcher]:
    launcher = Launcher(python, env, log)
    try:
        yield launcher
    finally:
        launcher.close()


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


def child_env(base: dict[str, str]) -> dict[str, str]:
    """The environment agents and workers start from: the repo importable, no node identity."""
    env = {k: v for k, v in base.items() if not k.startswith(_DROPPED_ENV)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    env["LOGLEVEL"] = "INFO"  # torch's agent logs (read by the scenarios)
    return env


def read_log(path: Path) -> str:
    """The text of a log so far (empty before it exists)."""
    return path.read_text(errors="replace") if path.exists() else ""
