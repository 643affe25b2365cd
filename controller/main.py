"""``regroup controller``: the controller process against a Kubernetes API and etcd.

HTTP (``/metrics``, ``/healthz``, ``/readyz``) is served from start to exit; with leader
election only the replica holding the Lease runs ``run_controller``, the other waits.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import os
import re
import signal
import socket
from datetime import timedelta
from pathlib import Path

import structlog

from regroup.controller.etcd_flags import add_etcd_arguments, etcd_settings
from regroup.controller.http import HealthServer
from regroup.controller.jobconfig import parse_duration
from regroup.controller.kube.actuator import KubeActuator
from regroup.controller.kube.api import RawKube, load_api_client
from regroup.controller.kube.leader import LeaderElector
from regroup.controller.kube.source import KubeSource
from regroup.controller.metrics import ControllerMetrics
from regroup.controller.runtime import run_controller
from regroup.controller.settings import CleanupSettings, ControllerSettings, RuntimeSettings
from regroup.etcd import EtcdSettings
from regroup.telemetry import configure_logging, configure_tracing

log = structlog.get_logger("regroup.controller")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kubeconfig", type=Path, default=None,
                        help="kubeconfig file (default: in-cluster service account)")
    add_etcd_arguments(parser, "etcd endpoint(s) host:port[,host:port] for jobs that name none")
    parser.add_argument("--etcd-job-identities", action=argparse.BooleanOptionalAction, default=False,
                        help="give every job its own etcd user and role, regroup:job:<namespace>:<job> (its workers' "
                             "client certificate CN), made when the job appears and removed once nothing of it is "
                             "left: its workers may then touch only their own job's keys, and only those a worker "
                             "writes. Needs etcd auth bootstrapped (regroup etcd-auth bootstrap) and this controller "
                             "connecting as a user of role root (default off)")
    parser.add_argument("--etcd-identity-grace", type=_grace, default=RuntimeSettings.etcd_identity_grace,
                        metavar="DURATION",
                        help="with --etcd-job-identities: how long a job is gone before its identity is removed "
                             "(default 30s; each change of etcd's users and roles makes in-flight requests retry)")
    parser.add_argument("--listen-address", type=_listen_address, default=RuntimeSettings.http_host, metavar="ADDRESS",
                        help="address the /metrics, /healthz, /readyz server binds: e.g. the pod IP or 127.0.0.1 "
                             "(default %(default)s: every IPv4 address of the host)")
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


def _listen_address(text: str) -> str:
    """``--listen-address``: an IP address (v4 or v6) or a host name, no port."""
    text = text.strip().removeprefix("[").removesuffix("]")
    try:
        ipaddress.ip_address(text)
    except ValueError:
        if not all(_HOST_LABEL.fullmatch(label) for label in text.split(".")):
            raise argparse.ArgumentTypeError(f"not an IP address or host name: {text!r}") from None
    return text


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _grace(text: str) -> timedelta:
    """``--etcd-identity-grace``: a duration (argparse names the flag on a bad one)."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def settings_from_args(args: argparse.Namespace) -> tuple[ControllerSettings, EtcdSettings]:
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    base = ControllerSettings()
    runtime = dataclasses.replace(base.runtime, identity=identity, workers=args.workers, http_host=args.listen_address,
                                  etcd_job_identities=args.etcd_job_identities,
                                  etcd_identity_grace=args.etcd_identity_grace)
    settings = dataclasses.replace(base, runtime=runtime, cleanup=args.retention)
    return settings, etcd_settings(args)


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
