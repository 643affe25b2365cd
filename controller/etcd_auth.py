"""``regroup etcd-auth``: etcd authentication for regroup (DESIGN contract 8).

``regroup etcd-auth bootstrap`` is run once per etcd (the production overlay's one-shot Job),
connected as etcd's ``root`` by its client certificate (CN ``root``; etcd serves with
``--client-cert-auth``): it makes the ``root`` role, the ``root`` user and the controller's
user (both without a password, holding ``root``) and turns authentication on. A second run
changes nothing and says so. It names, and leaves in place, any user that is none of
regroup's identities (``other_users``). The controller's user holds ``root`` because etcd has no
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
from regroup.etcd.auth import JOB_USER_PREFIX, ROOT, bootstrap, other_users, remove_identity

UPGRADING = "docs/deploy.md#upgrading-from-one-shared-worker-identity"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    boot = actions.add_parser(
        "bootstrap", help="make etcd's root and the controller's user and turn authentication on (idempotent)",
        description="Connect as etcd's root by its client certificate (CN root), make the root role, the root "
                    "user and the controller's user (no passwords: their certificates' CNs name them; both of "
                    "role root, the only role that may manage the jobs' users and roles) and turn etcd "
                    "authentication on. A second run changes nothing and says so. Users that are none of "
                    "regroup's identities (a worker identity shared by every job, from before one per job) are "
                    "named in a warning and left in place.",
    )  # fmt: skip
    boot.add_argument("--controller-user", default="regroup-controller",
                      help="the controller's etcd user: the CN of its client certificate (default %(default)s)")
    add_etcd_arguments(boot, "etcd endpoint(s) host:port[,host:port]")
    boot.add_argument("--wait", type=_duration, default=timedelta(seconds=60), metavar="DURATION",
                      help="how long to wait for etcd to answer: 30s, 2m (default 60s)")
    remove = actions.add_parser(
        "remove-user", help="remove a user that is none of regroup's identities, and its role",
        description="Connect with a root-role identity (the controller's certificate, or root's) and remove USER "
                    "and its role (the last step of upgrading from one worker identity shared by every job). "
                    "regroup's own users are refused: the controller removes a job's, and root and the "
                    "controller's are the bootstrap's.",
    )  # fmt: skip
    remove.add_argument("user", metavar="USER", help="the etcd user to remove")
    remove.add_argument("--role", default="", help="its role to remove too (default: the one named as the user)")
    remove.add_argument("--controller-user", default="regroup-controller",
                        help="the controller's etcd user, which is refused (default %(default)s)")
    add_etcd_arguments(remove, "etcd endpoint(s) host:port[,host:port]")


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


async def _bootstrap(settings: EtcdSettings, controller_user: str, wait: timedelta) -> tuple[list[str], dict[str, list[str]]]:
    """What bootstrapping changed, and the users it found that are none of regroup's."""
    client = await _connect(settings, wait)
    try:
        return await bootstrap(client, controller_user), await other_users(client, controller_user)
    finally:
        await client.close()  # type: ignore[attr-defined]


async def _remove(settings: EtcdSettings, user: str, role: str) -> bool:
    client = await connect(settings)
    try:
        return await remove_identity(client, user, role)
    finally:
        await client.close()  # type: ignore[attr-defined]


def run(args: argparse.Namespace) -> int:
    settings = etcd_settings(args)
    if args.action == "remove-user":
        return _run_remove(args, settings)
    if settings.identity != ROOT:
        print(f"regroup etcd-auth bootstrap: connect as etcd's {ROOT} user: --etcd-cert must be a client "
              f"certificate whose CN is {ROOT} (this one is {settings.identity!r})", file=sys.stderr)
        return 2
    try:
        changes, others = asyncio.run(_bootstrap(settings, args.controller_user, args.wait))
    except (EtcdUnavailable, ClientError, ValueError) as exc:
        print(f"regroup etcd-auth bootstrap: {exc}", file=sys.stderr)
        return 1
    for name, roles in others.items():
        print(f"warning: user {name} (roles: {', '.join(roles) or 'none'}) is none of regroup's identities; if "
              f"workers present it, every job they serve is open to them: give each job its own identity, then "
              f"remove it ({UPGRADING})")
    if not changes:
        print(f"etcd auth already bootstrapped at {settings.describe()}: users {ROOT} and {args.controller_user} "
              f"hold role {ROOT} and authentication is on; nothing to do")
        return 0
    for change in changes:
        print(change)
    print(f"etcd auth bootstrapped at {settings.describe()}")
    return 0


def _run_remove(args: argparse.Namespace, settings: EtcdSettings) -> int:
    if args.user in (ROOT, args.controller_user) or args.user.startswith(JOB_USER_PREFIX):
        print(f"regroup etcd-auth remove-user: {args.user!r} is one of regroup's identities; not removed",
              file=sys.stderr)
        return 2
    try:
        removed = asyncio.run(_remove(settings, args.user, args.role))
    except (EtcdUnavailable, ClientError) as exc:
        print(f"regroup etcd-auth remove-user: {exc}", file=sys.stderr)
        return 1
    role = args.role or args.user
    print(f"user {args.user} and role {role} removed" if removed else f"no user {args.user} nor role {role}: nothing to do")
    return 0
