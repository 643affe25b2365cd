"""``regroup etcd-auth``: etcd authentication for regroup (DESIGN contract 8).

``regroup etcd-auth bootstrap`` is run once per etcd (the production overlay's one-shot Job),
connected as etcd's ``root`` by its client certificate (CN ``root``; etcd serves with
``--client-cert-auth``): it makes the ``root`` role, the ``root`` user and the controller's
user (both without a password, holding ``root``) and turns authentication on. A second run
changes nothing and says so. The controller's user holds ``root`` because etcd has no
narrower permission for managing the jobs' users and roles (``regroup.etcd.auth``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import timedelta

from regroup.controller.etcd_flags import add_etcd_arguments, etcd_settings
from regroup.controller.jobconfig import parse_duration
from regroup.etcd import ClientError, EtcdSettings, EtcdUnavailable, connect
from regroup.etcd.auth import ROOT, bootstrap


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    boot = actions.add_parser(
        "bootstrap", help="make etcd's root and the controller's user and turn authentication on (idempotent)",
        description="Connect as etcd's root by its client certificate (CN root), make the root role, the root "
                    "user and the controller's user (no passwords: their certificates' CNs name them; both of "
                    "role root, the only role that may manage the jobs' users and roles) and turn etcd "
                    "authentication on. A second run changes nothing and says so.",
    )  # fmt: skip
    boot.add_argument("--controller-user", default="regroup-controller",
                      help="the controller's etcd user: the CN of its client certificate (default %(default)s)")
    add_etcd_arguments(boot, "etcd endpoint(s) host:port[,host:port]")
    boot.add_argument("--wait", type=_duration, default=timedelta(seconds=60), metavar="DURATION",
                      help="how long to wait for etcd to answer: 30s, 2m (default 60s)")


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


async def _connect(settings: EtcdSettings, wait: timedelta) -> object:
    """Connect, retrying for ``wait`` while etcd does not answer (it may be starting)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait.total_seconds()
    delay = 0.1
    while True:
        try:
            return await connect(settings)
        except EtcdUnavailable:
            if loop.time() + delay > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def _bootstrap(settings: EtcdSettings, controller_user: str, wait: timedelta) -> list[str]:
    client = await _connect(settings, wait)
    try:
        return await bootstrap(client, controller_user)
    finally:
        await client.close()  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:
    settings = etcd_settings(args)
    if settings.identity != ROOT:
        print(f"regroup etcd-auth bootstrap: connect as etcd's {ROOT} user: --etcd-cert must be a client "
              f"certificate whose CN is {ROOT} (this one is {settings.identity!r})", file=sys.stderr)
        return 2
    try:
        changes = asyncio.run(_bootstrap(settings, args.controller_user, args.wait))
    except (EtcdUnavailable, ClientError, ValueError) as exc:
        print(f"regroup etcd-auth bootstrap: {exc}", file=sys.stderr)
        return 1
    if not changes:
        print(f"etcd auth already bootstrapped at {settings.describe()}: users {ROOT} and {args.controller_user} "
              f"hold role {ROOT} and authentication is on; nothing to do")
        return 0
    for change in changes:
        print(change)
    print(f"etcd auth bootstrapped at {settings.describe()}")
    return 0
