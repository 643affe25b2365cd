"""``regroup controller``: the controller process against a Kubernetes API and etcd.

HTTP (``/metrics``, ``/healthz``, ``/readyz``) is served from start to exit; with leader
election only the replica holding the Lease runs ``run_controller``, the other waits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import signal
import socket
from pathlib import Path

import structlog

from regroup.controller.http import HealthServer
from regroup.controller.jobconfig import parse_duration
from regroup.controller.kube.actuator import KubeActuator
from regroup.controller.kube.api import RawKube, load_api_client
from regroup.controller.kube.leader import LeaderElector
from regroup.controller.kube.source import KubeSource
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.runtime import run_controller
from regroup.controller.settings import CleanupSettings, ControllerSettings
from regroup.etcd import EtcdSettings
from regroup.telemetry import configure_logging, configure_tracing

log = structlog.get_logger("regroup.controller")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", type=Path, default=None,
                        help="kubeconfig file (default: in-cluster service account)")
    parser.add_argument("--etcd", default=os.environ.get("REGROUP_ETCD", "127.0.0.1:2379"),
                        help="etcd endpoint(s) host:port[,host:port] for jobs that name none (default %(default)s)")
    parser.add_argument("--etcd-cacert", type=Path, default=None, help="CA bundle for etcd TLS")
    parser.add_argument("--etcd-cert", type=Path, default=None, help="client certificate for etcd mTLS")
    parser.add_argument("--etcd-key", type=Path, default=None, help="client key for etcd mTLS")
    parser.add_argument("--http-port", type=int, default=8080, help="port of /metrics, /healthz, /readyz (default %(default)s)")
    parser.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                        help="elect one active replica through a coordination.k8s.io Lease (default on)")
    parser.add_argument("--lease-name", default="regroup-controller", help="name of the leader Lease (default %(default)s)")
    parser.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"),
                        help="namespace of the leader Lease (default $POD_NAMESPACE or default)")
    parser.add_argument("--workers", type=int, default=4, help="jobs reconciled concurrently (default %(default)s)")
    parser.add_argument("--retention", type=_cleanup, default=CleanupSettings(), metavar="DURATION",
                        help="how long a finished job, or one whose pods and members are all gone, keeps its etcd "
                             "keys (and a finished job its tombstone once its pods are gone): 90s, 10m, 1h30m "
                             "(default 10m)")


def _cleanup(text: str) -> CleanupSettings:
    """``--retention``, validated as the settings validate it (argparse names the flag)."""
    try:
        return CleanupSettings(retention=parse_duration(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def settings_from_args(args: argparse.Namespace) -> tuple[ControllerSettings, EtcdSettings]:
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    base = ControllerSettings()
    runtime = dataclasses.replace(base.runtime, identity=identity, workers=args.workers)
    settings = dataclasses.replace(base, runtime=runtime, cleanup=args.retention)
    etcd = EtcdSettings.from_endpoint_string(args.etcd, cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key)
    return settings, etcd


async def serve(args: argparse.Namespace) -> None:
    settings, etcd = settings_from_args(args)
    metrics = ControllerMetrics()
    api_client = await load_api_client(args.kubeconfig)
    raw = RawKube(api_client)
    ready = asyncio.Event()
    http = HealthServer(metrics, settings.runtime.http_host, args.http_port, healthy=lambda: True,
                        ready=lambda: ready.is_set() or (args.leader_election and not elector.leading))
    elector = LeaderElector(raw, args.lease_namespace, args.lease_name, settings.runtime.identity, settings.kube, metrics)

    async def lead() -> None:
        ready.clear()
        source = KubeSource(raw, settings.kube, metrics)
        actuator = KubeActuator(raw, settings.kube)
        await run_controller(settings, source, actuator, etcd, ready=ready, metrics=metrics)

    await http.start()
    try:
        if args.leader_election:
            await elector.run(lead)
        else:
            metrics.leader.set(1)
            await lead()
    finally:
        await http.stop()
        await api_client.close()


def run(args: argparse.Namespace) -> int:
    configure_logging(once=True)
    provider = configure_tracing("regroup-controller")

    async def main() -> None:
        task = asyncio.create_task(serve(args))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            log.info("controller stopped")

    try:
        asyncio.run(main())
    finally:
        provider.shutdown()
    return 0
