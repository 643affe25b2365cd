"""Real torchrun agents for the rendezvous tests, each posing as one node.

``TorchrunNodes.start("a")`` runs ``torchrun --rdzv-backend=etcd-v3`` with
``NODE_NAME=a`` and ``tests/rendezvous/worker.py``; the workers' step logs tell who
trained at which world size. Waits poll those files against a deadline and fail
naming what they waited for.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

WORKER = Path(__file__).with_name("worker.py")


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of ``pids`` that is still there."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def wait_until(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.05) -> object:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class TorchrunNodes:
    """Several torchrun agents of one job on this machine."""

    endpoint: str
    out: Path
    env: dict[str, str]
    torchrun: str
    job: str = "job"
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)

    def start(
        self,
        node: str,
        nnodes: str = "1:3",
        nproc: int = 1,
        max_restarts: int = 3,
        conf: str = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60",
    ) -> subprocess.Popen[bytes]:
        self.out.mkdir(parents=True, exist_ok=True)
        env = {**self.env, "NODE_NAME": node, "OMP_NUM_THREADS": "1"}
        cmd = [
            self.torchrun,
            "--rdzv-backend=etcd-v3", f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.job}",
            f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.1", f"--rdzv-conf={conf}", "--local-addr=127.0.0.1",
            str(WORKER), str(self.out),
        ]  # fmt: skip
        with open(self.out / f"agent-{node}.log", "ab") as log:
            self.procs[node] = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        return self.procs[node]

    def rows(self, node: str) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        for path in sorted(self.out.glob(f"steps-{node}-*.jsonl")):
            # A line still being written has no newline yet: read complete lines only.
            text = path.read_text()
            rows += [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
        return rows

    def training_at(self, nodes: list[str], world: int, after: float = 0.0) -> bool:
        """Every node logged a step at ``world`` written after the unix time ``after``."""
        return all(any(r["world"] == world and r["t"] > after for r in self.rows(n)) for n in nodes)

    def worker_pids(self, node: str) -> list[int]:
        return [int(p.read_text()) for p in (self.out / "pids").glob(f"{node}-*")]

    def kill_node(self, node: str) -> None:
        """SIGKILL the agent and its workers (torchrun detaches them from its process group)."""
        proc = self.procs[node]
        self.killed.add(node)
        proc.kill()
        proc.wait()
        kill_all(self.worker_pids(node))

    def exit_code(self, node: str, timeout: float) -> int:
        return self.procs[node].wait(timeout)

    def stop(self, timeout: float = 30.0) -> dict[str, int]:
        """Ask the workers to finish; return each agent's exit code."""
        (self.out / "STOP").touch()
        return {node: proc.wait(timeout) for node, proc in self.procs.items() if node not in self.killed}

    def cleanup(self) -> None:
        for node, proc in self.procs.items():
            if proc.poll() is None:
                self.kill_node(node)
            else:
                kill_all(self.worker_pids(node))

    def log(self, node: str) -> str:
        path = self.out / f"agent-{node}.log"
        return path.read_text(errors="replace") if path.exists() else ""
