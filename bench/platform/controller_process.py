"""``python -m bench.platform.controller_process``: the controller, in a process of its own.

It runs what ``regroup controller --no-leader-election`` runs (``regroup.controller.main``):
the Kubernetes list+watch source and actuator over HTTP, ``run_controller`` with its etcd
mirror and writes, ``/metrics`` and the probes, structlog and the tracer provider; only the
settings are the benchmark's, built in ``controller_settings``. Its own process gives it
its own CPU time and RSS in ``/proc``, and a pid to profile. ``ControllerProcess`` is the
benchmark's handle on it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

from regroup.controller.settings import CleanupSettings, ControllerSettings


def with_retention(settings: ControllerSettings, retention: timedelta) -> ControllerSettings:
    """The one place the benchmark sets how long the controller keeps an ended job's keys
    before it deletes the job's prefix (and, for a finished job, writes its tombstone): the
    controller's ``--retention``."""
    return dataclasses.replace(settings, cleanup=CleanupSettings(retention=retention))


def controller_settings(retention: timedelta) -> ControllerSettings:
    """The production defaults, under the benchmark's identity and retention."""
    base = ControllerSettings()
    settings = dataclasses.replace(base, runtime=dataclasses.replace(base.runtime, identity="regroup-controller-bench"))
    return with_retention(settings, retention)


async def serve(kubeconfig: Path, etcd_endpoint: str, http_port: int, retention: timedelta) -> None:
    from regroup.controller.http import HealthServer
    from regroup.controller.kube.actuator import KubeActuator
    from regroup.controller.kube.api import RawKube, load_api_client
    from regroup.controller.kube.source import KubeSource
    from regroup.controller.metrics import ControllerMetrics
    from regroup.controller.runtime import run_controller
    from regroup.etcd import EtcdSettings

    settings = controller_settings(retention)
    metrics = ControllerMetrics()
    metrics.leader.set(1)
    api_client = await load_api_client(kubeconfig)
    raw = RawKube(api_client)
    ready = asyncio.Event()
    http = HealthServer(metrics, "127.0.0.1", http_port, healthy=lambda: True, ready=ready.is_set)
    await http.start()
    try:
        source = KubeSource(raw, settings.kube, metrics)
        actuator = KubeActuator(raw, settings.kube)
        etcd = EtcdSettings.from_endpoint_string(etcd_endpoint)
        await run_controller(settings, source, actuator, etcd, ready=ready, metrics=metrics)
    finally:
        await http.stop()
        await api_client.close()


READY_TIMEOUT = 120.0


class ControllerProcess:
    """``await start()``: the process runs and says it is ready (``/readyz``); ``await stop()``: SIGTERM."""

    def __init__(self, kubeconfig: Path, etcd_endpoint: str, retention: timedelta, log: Path) -> None:
        from regroup.ports import free_port

        self.port = free_port()
        self.log = log
        self.command = [
            sys.executable, "-m", "bench.platform.controller_process", "--kubeconfig", str(kubeconfig),
            "--etcd", etcd_endpoint, "--http-port", str(self.port), "--retention", str(retention.total_seconds()),
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start(self) -> None:
        with open(self.log, "ab") as out:
            self.process = process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the controller exited with {process.returncode} (log: {self.log})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/readyz", timeout=1) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError(f"the controller was not ready within {READY_TIMEOUT:.0f}s (log: {self.log})")

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


def main(argv: list[str]) -> int:
    from regroup.telemetry import configure_logging, configure_tracing

    parser = argparse.ArgumentParser(prog="python -m bench.platform.controller_process")
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--etcd", required=True)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--retention", type=float, required=True, help="seconds a finished job's keys are kept")
    args = parser.parse_args(argv)
    configure_logging(once=True)
    provider = configure_tracing("regroup-controller")

    async def run() -> None:
        task = asyncio.create_task(serve(args.kubeconfig, args.etcd, args.http_port, timedelta(seconds=args.retention)))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass

    try:
        asyncio.run(run())
    finally:
        provider.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
