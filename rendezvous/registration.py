"""torchrun's entry point for the ``etcd-v3`` backend (group ``torchrun.handlers``).

torch calls ``handler_factory()`` once to register the backend, then the returned
creator with the launch's ``RendezvousParameters``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters

from regroup.rendezvous.settings import parse_settings


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build an ``EtcdV3RendezvousHandler`` from torchrun's parameters and the environment."""
    # Imported here: torch loads this module while its own rendezvous package initialises.
    from regroup.rendezvous.handler import EtcdV3RendezvousHandler

    _configure_logging()
    _configure_tracing(os.environ)
    settings = parse_settings(
        endpoint=params.endpoint,
        run_id=params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        conf=params.config,
        local_addr=params.local_addr,
        local_world_size=_torchrun_local_world_size(sys.argv),
    )
    return EtcdV3RendezvousHandler(settings, exit_when_excluded=True)


def _configure_logging() -> None:
    """JSON logs (one event per line, with trace ids) in the torchrun agent, unless the
    process that created the handler configured structlog itself."""
    import structlog

    from regroup.telemetry import configure_logging

    if not structlog.is_configured():
        configure_logging()


def _configure_tracing(env: Mapping[str, str]) -> None:
    """Export the agents' ``regroup.rendezvous.join`` spans when the environment names an
    exporter (``OTEL_EXPORTER_OTLP_*ENDPOINT`` or ``REGROUP_SPANS_FILE``)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    from regroup.telemetry import SPANS_FILE_ENV, configure_tracing

    wanted = any(
        env.get(k) for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", SPANS_FILE_ENV)
    )
    if wanted and not isinstance(trace.get_tracer_provider(), TracerProvider):
        configure_tracing("regroup-rendezvous")


def handler_factory() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The zero-argument factory torch's registry calls (always the same creator)."""
    return create_handler


def _torchrun_local_world_size(argv: list[str]) -> int:
    """Workers per node as torchrun computes them, when this process is torchrun; else 0.

    torch hands the handler no ``--nproc-per-node``; the member record still wants it
    (the controller counts the ranks a round will have from it).
    """
    launchers = ("torchrun", "distributed/run.py", "regroup-run", "inplace/launcher.py")
    if not argv or not argv[0].endswith(launchers):
        return 0
    try:
        from torch.distributed.run import determine_local_world_size, get_args_parser

        args, _ = get_args_parser().parse_known_args(argv[1:])
        return int(determine_local_world_size(args.nproc_per_node))
    except (SystemExit, ValueError, TypeError, AttributeError, RuntimeError):
        return 0
