"""``regroup-run``: torchrun whose agent re-forms opted-in workers in place.

It is torch's own ``torchrun`` (the same parser, flags, environment contract for the
script and error files) with ``InPlaceAgent`` in place of ``LocalElasticAgent``, plus flags
of its own, and exit 75 (``regroup.exit_codes.LEFT_JOB``) when this node leaves a job that
goes on::

    regroup-run --rdzv-backend=etcd-v3 --rdzv-endpoint=etcd:2379 --rdzv-id=$JOB \\
                --nnodes=2:4 --nproc-per-node=8 [--standby] [--in-place=off] [--term-grace=120] \\
                -m regroup.trainer ...

``--in-place=off`` forces torch's restart path; ``--standby`` starts the workers before
each rendezvous (only for scripts that use ``ElasticWorld``, which read their rank from
the agent instead of the environment); ``--probation`` keeps a node whose own workers
failed out of the next round for a while, so the others train on without it;
``--term-grace`` is the pod's ``terminationGracePeriodSeconds``: after SIGTERM the agent keeps
its workers training while a controller hands the node's work over, for at most that long
(``regroup.rendezvous.inplace.notice``), and exits 75 (``regroup.exit_codes.LEFT_JOB``).
A stop at once (SIGINT, or a second SIGTERM) stops the workers as torch does and ends with
one line, not torch's ``SignalException`` traceback: exit 75 for SIGTERM, 128+signal else.

With the ``etcd-v3`` backend the workers also get ``REGROUP_ETCD_ENDPOINT`` (from
``--rdzv-endpoint``) and, for a TLS etcd, ``REGROUP_ETCD_CACERT``, ``REGROUP_ETCD_CERT`` and
``REGROUP_ETCD_KEY`` (from ``--rdzv-conf cacert=...,cert=...,key=...``) unless their
environment sets them already, so a script reaches its job's etcd, as the job's identity
(the certificate's common name), with no configuration of its own.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
from collections.abc import MutableMapping
from datetime import timedelta

import structlog
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import record

from regroup.exit_codes import LEFT_JOB
from regroup.rendezvous.inplace.notice import DEFAULT_TERM_GRACE
from regroup.rendezvous.joining import LeftJob

log = structlog.get_logger("regroup.inplace.launcher")
STOPPED = "stopped by a signal"
"""Logged once when a signal stops the agent at once (SIGINT, a second SIGTERM), instead of
a traceback: a planned stop, not a failure."""

ETCD_ENDPOINT_ENV = "REGROUP_ETCD_ENDPOINT"
ETCD_TLS_ENV = {"cacert": "REGROUP_ETCD_CACERT", "cert": "REGROUP_ETCD_CERT", "key": "REGROUP_ETCD_KEY"}
"""``--rdzv-conf`` key -> the variable that hands it to the workers."""
ETCD_BACKEND = "etcd-v3"


def build_parser():  # type: ignore[no-untyped-def]
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "regroup-run"
    parser.add_argument(
        "--in-place",
        dest="in_place",
        choices=("auto", "off"),
        default="auto",
        help="auto: workers that use ElasticWorld survive membership changes; off: restart them (torchrun's way)",
    )
    parser.add_argument(
        "--standby",
        action="store_true",
        help="start workers before each rendezvous (scripts using ElasticWorld only)",
    )
    parser.add_argument(
        "--probation",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="after this node's own workers failed, stay out of the next round this long (default 5)",
    )
    parser.add_argument(
        "--term-grace",
        dest="term_grace",
        type=_seconds,
        default=DEFAULT_TERM_GRACE.total_seconds(),
        metavar="SECONDS",
        help="the pod's terminationGracePeriodSeconds (default 30, Kubernetes' default): after SIGTERM, "
        "train on while a controller hands this node's work over, for at most this long; then exit 75",
    )
    return parser


def _seconds(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {raw!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {raw!r}")
    return value


def _leave_before_starting(signum: int, frame: object) -> None:
    """SIGTERM before the agent runs (it connects to etcd first): nothing joined, nothing
    to hand over; leave at once, with the exit code of a node leaving a job that goes on."""
    raise LeftJob("told to stop (SIGTERM) before the agent started")


def stopped_by(signum: int) -> SystemExit:
    """The agent's exit after a signal stopped it at once (torch's agent has stopped the
    workers by then): one line, and the exit code. SIGTERM: ``LEFT_JOB``, as after a notice,
    since the node leaves a job that goes on; any other (SIGINT: stop now): 128+signal, as a
    shell reports it."""
    code = LEFT_JOB if signum == signal.SIGTERM else 128 + signum
    log.warning(STOPPED, signal=signal.Signals(signum).name, exit_code=code)
    return SystemExit(code)


def export_etcd(rdzv_backend: str, rdzv_endpoint: str, rdzv_conf: str, environ: MutableMapping[str, str]) -> list[str]:
    """Give the workers (who inherit ``environ``) the job's etcd: with the ``etcd-v3``
    backend, ``REGROUP_ETCD_ENDPOINT`` from ``--rdzv-endpoint`` and the TLS files from
    ``--rdzv-conf``, each unless the environment has it. Returns the variables set."""
    if rdzv_backend != ETCD_BACKEND:
        return []
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    wanted = {ETCD_ENDPOINT_ENV: rdzv_endpoint}
    conf = _parse_rendezvous_config(rdzv_conf or "")
    wanted.update({variable: conf.get(key, "") for key, variable in ETCD_TLS_ENV.items()})
    exported = [variable for variable, value in wanted.items() if value and not environ.get(variable)]
    for variable in exported:
        environ[variable] = wanted[variable]
    return exported


@record
def main(argv: list[str] | None = None) -> None:
    import torch.distributed.launcher.api as launcher_api
    from torch.distributed.run import run

    from regroup.rendezvous.inplace.agent import InPlaceAgent

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    # Until the agent takes SIGTERM as a notice (it runs once etcd answers), it ends the launch.
    signal.signal(signal.SIGTERM, _leave_before_starting)
    # Workers inherit the agent's environment.
    export_etcd(args.rdzv_backend, args.rdzv_endpoint, args.rdzv_conf, os.environ)
    # torch's launch_agent builds its agent from this module attribute; the rest is torch's.
    launcher_api.LocalElasticAgent = functools.partial(  # type: ignore[misc]
        InPlaceAgent,
        in_place=args.in_place == "auto",
        standby=args.standby,
        probation=timedelta(seconds=args.probation),
        term_grace=timedelta(seconds=args.term_grace),
    )
    try:
        run(args)
    except SignalException as stop:
        raise stopped_by(stop.sigval) from None
    except KeyboardInterrupt:
        raise stopped_by(signal.SIGINT) from None


if __name__ == "__main__":
    main()
