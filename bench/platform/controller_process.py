"""The controller, in a process of its own: ``regroup controller --no-leader-election``, the
command a cluster runs (the Kubernetes list+watch source and actuator over HTTP,
``run_controller`` with its etcd mirror and writes, ``/metrics`` and the probes, structlog and
the tracer provider), with production defaults but the benchmark's ``--retention`` (and,
with authentication on, its certificate and ``--etcd-job-identities``). Its own
process gives it its own CPU time and RSS in ``/proc``, and a pid to profile.
``ControllerProcess`` is the benchmark's handle on it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

READY_TIMEOUT = 120.0
IDENTITY = "regroup-controller-bench"
"""The controller's identity (its presence records): ``POD_NAME``, as a pod gives it."""


def _ready(port: int) -> bool:
    """Whether the controller on ``port`` answers ``/readyz`` with 200 (it has listed
    everything and decides)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False  # not listening yet, or not ready (503)


class ControllerProcess:
    """``await start()``: the process runs and says it is ready (``/readyz``); ``await stop()``: SIGTERM."""

    def __init__(
        self, kubeconfig: Path, etcd_endpoint: str, retention: timedelta, log: Path, etcd_flags: Sequence[str] = ()
    ) -> None:
        """``etcd_flags``: more of the command's etcd flags (with authentication on, its
        certificate and ``--etcd-job-identities``)."""
        from regroup.ports import free_port

        self.port = free_port()
        self.log = log
        self.command = [
            sys.executable, "-m", "regroup.cli", "controller", "--no-leader-election", "--kubeconfig", str(kubeconfig),
            "--etcd", etcd_endpoint, *etcd_flags, "--http-port", str(self.port),
            "--retention", f"{retention.total_seconds():g}s",
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = process = subprocess.Popen(
                self.command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "POD_NAME": IDENTITY}
            )
        deadline = time.monotonic() + READY_TIMEOUT
        while not await asyncio.to_thread(_ready, self.port):
            if process.poll() is not None:
                raise RuntimeError(f"the controller exited with {process.returncode} (log: {self.log})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the controller was not ready within {READY_TIMEOUT:.0f}s (log: {self.log})")
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 30)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)
