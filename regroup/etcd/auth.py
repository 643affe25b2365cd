"""etcd identities and roles: who may touch which of regroup's keys (DESIGN contract 8).

One etcd may serve every job of a platform. Each job gets an etcd user of its own,
``regroup:job:<namespace>:<job>`` (``job_user``), authenticated by the common name of its
client certificate (etcd's ``--client-cert-auth``; the user has no password), holding one
role of the same name that grants exactly what the job's agents and trainer do
(``job_grants``): read the job's keys, write those a worker writes (``members/``, ``rdzv/``,
``acks/``, ``progress``), read the job's tombstone. Nothing of another job, no control key,
no tombstone write: those are the controller's.

The controller makes and removes the jobs' identities (``ensure_job_identity``,
``remove_job_identity``). etcd has no permission for managing users and roles narrower
than its ``root`` role, so **the controller's identity holds ``root``**: whoever holds the
controller's client certificate holds the whole etcd. ``bootstrap`` (``regroup etcd-auth
bootstrap``, run once as etcd's ``root`` by its certificate) makes ``root`` and the
controller's user and turns authentication on.

The Auth service is reached through aetcd's generated stub on the client's channel (aetcd's
client has no auth methods); its errors come out as ``PermissionDenied`` or ``ClientError``
like every other etcd call's.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aetcd
import aetcd.rpc
import aetcd.utils
import grpc
from aetcd.rpc import auth_pb2

from regroup.etcd.client import ClientError, PermissionDenied
from regroup.keys import DEFAULT_PREFIX, JobKeys

JOB_USER_PREFIX = "regroup:job:"
"""Every job's user (and role) name starts so: ``regroup:job:<namespace>:<job>``."""
ROOT = "root"
"""etcd's own superuser and its role, which every user-and-role change needs."""
_PROBE_USER = "regroup:auth-probe"
"""A user name no one has: asking etcd 3.4 to authenticate it says whether auth is on."""


class Access(enum.IntEnum):
    """What a role may do with a key range (etcd's ``authpb.Permission.Type``)."""

    READ = auth_pb2.Permission.READ
    WRITE = auth_pb2.Permission.WRITE
    READWRITE = auth_pb2.Permission.READWRITE


@dataclass(frozen=True)
class Grant:
    """One permission of a role: ``access`` to ``key``, or to every key under it."""

    access: Access
    key: str
    prefix: bool = False
    """Every key that starts with ``key`` (False: ``key`` alone)."""

    @property
    def range_end(self) -> bytes:
        """etcd's ``range_end``: empty for one key, the prefix's end otherwise."""
        return aetcd.utils.prefix_range_end(self.key.encode()) if self.prefix else b""

    def permission(self) -> auth_pb2.Permission:
        return auth_pb2.Permission(permType=int(self.access), key=self.key.encode(), range_end=self.range_end)

    def __str__(self) -> str:
        return f"{self.access.name} {self.key}{'*' if self.prefix else ''}"


def job_user(keys: JobKeys) -> str:
    """The etcd user, and its role, of the job ``keys`` names: ``regroup:job:<namespace>:<job>``
    (the CN of the client certificate its workers present)."""
    return f"{JOB_USER_PREFIX}{keys.namespace}:{keys.job}"


def job_of_user(name: str, prefix: str = DEFAULT_PREFIX) -> JobKeys | None:
    """The job whose user ``name`` is, or None for any other user. A namespace never holds
    ':' (a DNS label), so the first ':' after the prefix ends it."""
    if not name.startswith(JOB_USER_PREFIX):
        return None
    namespace, sep, job = name[len(JOB_USER_PREFIX) :].partition(":")
    if not sep:
        return None
    try:
        return JobKeys(namespace, job, prefix)
    except ValueError:
        return None


def job_grants(keys: JobKeys) -> tuple[Grant, ...]:
    """Exactly what a job's workers need (DESIGN contract 3, by writer): the agents list and
    watch the whole root and read the tombstone; they write members, rendezvous state, joins
    and round stores; rank 0 writes acks and progress. A transaction's compares need only
    READ, and its range deletes stay inside ``rdzv/``. Nothing under ``control/``, nothing of
    another job, no tombstone write."""
    return (
        Grant(Access.READ, keys.root, prefix=True),
        Grant(Access.READWRITE, keys.members, prefix=True),
        Grant(Access.READWRITE, keys.rdzv, prefix=True),
        Grant(Access.READWRITE, keys.acks, prefix=True),
        Grant(Access.READWRITE, keys.progress),
        Grant(Access.READ, keys.tombstone),
    )


# --- adapters --------------------------------------------------------------------------


async def _call(client: Any, method: str, request: Any, *, tolerate: Sequence[str] = ()) -> Any:
    """``method`` of etcd's Auth service; None when etcd answers FAILED_PRECONDITION with
    one of the ``tolerate`` phrases ("not found", "already exists", ...)."""
    stub = aetcd.rpc.AuthStub(client.channel)
    try:
        return await getattr(stub, method)(request, timeout=getattr(client, "_timeout", None),
                                           metadata=getattr(client, "metadata", None))
    except grpc.aio.AioRpcError as exc:
        detail = exc.details() or ""
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and any(p in detail for p in tolerate):
            return None
        identity = getattr(client, "identity", "anonymous")
        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
            subject = getattr(request, "user", "") or getattr(request, "name", "") or getattr(request, "role", "")
            what = ("user " if method.startswith("User") else "role ") + subject if subject else "the users and roles"
            raise PermissionDenied(f"{detail}: managing etcd users and roles needs etcd's {ROOT} role",
                                   operation=f"Auth.{method}", key=what, identity=identity) from exc
        raise ClientError(f"Auth.{method} as {identity!r}: {exc.code().name}: {detail}") from exc


async def auth_enabled(client: Any) -> bool:
    """Whether etcd enforces authentication. etcd 3.5 answers ``AuthStatus``; 3.4 lacks it,
    but refuses to authenticate anyone with "authentication is not enabled" while it is off."""
    try:
        return bool((await _call(client, "AuthStatus", aetcd.rpc.AuthStatusRequest())).enabled)
    except ClientError as exc:
        cause = exc.__cause__
        if not (isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.UNIMPLEMENTED):
            raise
    try:
        await _call(client, "Authenticate", aetcd.rpc.AuthenticateRequest(name=_PROBE_USER, password=""))
    except ClientError as exc:
        return "not enabled" not in str(exc)
    return True


def _range(key: bytes, range_end: bytes) -> str:
    text = key.decode(errors="replace")
    if not range_end:
        return text
    if range_end == aetcd.utils.prefix_range_end(key):
        return text + "*"
    return f"[{text}, {range_end.decode(errors='replace')})"


async def ensure_role(client: Any, name: str, grants: Sequence[Grant]) -> list[str]:
    """Role ``name`` exists and holds exactly ``grants`` (any other permission revoked); what
    had to change. Needs a ``root``-role identity."""
    changes = []
    role = await _call(client, "RoleGet", aetcd.rpc.AuthRoleGetRequest(role=name), tolerate=("not found",))
    if role is None:
        await _call(client, "RoleAdd", aetcd.rpc.AuthRoleAddRequest(name=name), tolerate=("already exists",))
        changes.append(f"role {name} created")
    have = {(bytes(p.key), bytes(p.range_end)): int(p.permType) for p in (role.perm if role is not None else ())}
    wanted = {(g.key.encode(), g.range_end): g for g in grants}
    for key, range_end in have.keys() - wanted.keys():
        await _call(client, "RoleRevokePermission",
                    aetcd.rpc.AuthRoleRevokePermissionRequest(role=name, key=key, range_end=range_end),
                    tolerate=("not granted", "not found"))
        changes.append(f"role {name}: revoked {_range(key, range_end)}")
    for at, grant in wanted.items():
        if have.get(at) != int(grant.access):
            await _call(client, "RoleGrantPermission",
                        aetcd.rpc.AuthRoleGrantPermissionRequest(name=name, perm=grant.permission()))
            changes.append(f"role {name}: granted {grant}")
    return changes


async def ensure_user(client: Any, name: str, roles: Sequence[str], *, exact: bool) -> list[str]:
    """User ``name`` exists (made without a password: its client certificate names it) and
    holds ``roles`` (with ``exact``, no other); what had to change. A user that exists keeps
    its password, if it has one. Needs a ``root``-role identity."""
    changes = []
    user = await _call(client, "UserGet", aetcd.rpc.AuthUserGetRequest(name=name), tolerate=("not found",))
    if user is None:
        options = auth_pb2.UserAddOptions(no_password=True)
        await _call(client, "UserAdd", aetcd.rpc.AuthUserAddRequest(name=name, options=options),
                    tolerate=("already exists",))
        changes.append(f"user {name} created (no password: its certificate's CN)")
    have = list(user.roles) if user is not None else []
    if exact:
        for role in [r for r in have if r not in roles]:
            await _call(client, "UserRevokeRole", aetcd.rpc.AuthUserRevokeRoleRequest(name=name, role=role),
                        tolerate=("not granted", "not found"))
            changes.append(f"user {name}: role {role} revoked")
    for role in [r for r in roles if r not in have]:
        await _call(client, "UserGrantRole", aetcd.rpc.AuthUserGrantRoleRequest(user=name, role=role))
        changes.append(f"user {name}: role {role} granted")
    return changes


async def ensure_job_identity(client: Any, keys: JobKeys) -> list[str]:
    """The job's user and role exist, the role grants exactly ``job_grants`` and the user
    holds that role alone; returns what had to change (nothing: it was so). Idempotent.
    The role is complete before the user holds it. Needs a ``root``-role identity."""
    name = job_user(keys)
    return await ensure_role(client, name, job_grants(keys)) + await ensure_user(client, name, (name,), exact=True)


async def remove_job_identity(client: Any, keys: JobKeys) -> bool:
    """Revoke the job's role from its user, delete the role, delete the user; what is
    missing already is fine. True when anything was there. Needs a ``root``-role identity.
    A watch the job's workers hold open keeps delivering (etcd checks permissions when a
    watch is created); every other request of theirs is refused from now on.

    The user's name does not say under which key prefix the job lives: a role that does not
    grant ``keys.root`` belongs to the same job name under another prefix (another controller
    sharing this etcd) and is left alone (False)."""
    name = job_user(keys)
    gone = ("not found", "not granted")
    role = await _call(client, "RoleGet", aetcd.rpc.AuthRoleGetRequest(role=name), tolerate=gone)
    ours = job_grants(keys)[0]
    if role is not None and not any(bytes(p.key) == ours.key.encode() for p in role.perm):
        return False
    return await remove_identity(client, name)


async def remove_identity(client: Any, name: str, role: str = "") -> bool:
    """Revoke ``role`` (default: the one named as the user) from user ``name``, delete the
    role, delete the user; what is missing already is fine. True when anything was there.
    Needs a ``root``-role identity."""
    role = role or name
    gone = ("not found", "not granted")
    revoked = await _call(client, "UserRevokeRole", aetcd.rpc.AuthUserRevokeRoleRequest(name=name, role=role),
                          tolerate=gone)
    deleted = await _call(client, "RoleDelete", aetcd.rpc.AuthRoleDeleteRequest(role=role), tolerate=gone)
    user = await _call(client, "UserDelete", aetcd.rpc.AuthUserDeleteRequest(name=name), tolerate=gone)
    return any(r is not None for r in (revoked, deleted, user))


async def job_identities(client: Any, prefix: str = DEFAULT_PREFIX) -> set[JobKeys]:
    """The jobs that have a user in etcd (by ``job_of_user``)."""
    listing = await _call(client, "UserList", aetcd.rpc.AuthUserListRequest())
    return {keys for name in listing.users if (keys := job_of_user(name, prefix)) is not None}


async def other_users(client: Any, controller_user: str) -> dict[str, list[str]]:
    """The users that are none of regroup's identities (``root``, the controller's, a job's),
    with their roles. One left from before per-job identities (a user every job's workers
    shared, ``readwrite`` on the whole prefix) keeps each job it still serves open to every
    other job until it is removed: ``bootstrap``'s command names them and takes none away."""
    listing = await _call(client, "UserList", aetcd.rpc.AuthUserListRequest())
    found = {}
    for name in listing.users:
        if name in (ROOT, controller_user) or name.startswith(JOB_USER_PREFIX):
            continue
        user = await _call(client, "UserGet", aetcd.rpc.AuthUserGetRequest(name=name), tolerate=("not found",))
        if user is not None:
            found[name] = sorted(user.roles)
    return found


async def bootstrap(client: Any, controller_user: str) -> list[str]:
    """Turn etcd's authentication on for regroup, connected as ``root`` by its client
    certificate (CN ``root``): the ``root`` role, the ``root`` user (no password) holding it,
    the controller's user ``controller_user`` (no password) holding ``root`` too (etcd has no
    narrower permission for managing the jobs' users and roles), then auth on. What had to
    change; nothing on a second run. Nothing there is taken away (a password kept, a role
    left): this only adds."""
    if not controller_user or controller_user.startswith(JOB_USER_PREFIX):
        raise ValueError(f"bootstrap: the controller's user must be named, and not as a job's: {controller_user!r}")
    enabled = await auth_enabled(client)
    changes = []
    if await _call(client, "RoleGet", aetcd.rpc.AuthRoleGetRequest(role=ROOT), tolerate=("not found",)) is None:
        await _call(client, "RoleAdd", aetcd.rpc.AuthRoleAddRequest(name=ROOT), tolerate=("already exists",))
        changes.append(f"role {ROOT} created")
    changes += await ensure_user(client, ROOT, (ROOT,), exact=False)
    changes += await ensure_user(client, controller_user, (ROOT,), exact=False)
    if not enabled:
        await _call(client, "AuthEnable", aetcd.rpc.AuthEnableRequest())
        changes.append("authentication enabled")
    return changes
