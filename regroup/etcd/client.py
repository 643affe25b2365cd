"""Connecting to etcd (TLS added here: aetcd itself only opens insecure channels), the
errors callers see, and turning on authentication."""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.utils
import grpc
import structlog
from aetcd.rpc import auth_pb2

from regroup.etcd.settings import Endpoint, EtcdSettings

log = structlog.get_logger("regroup.etcd")

T = TypeVar("T")

# Re-exported so callers never import aetcd themselves.
Client = aetcd.Client
ClientError = aetcd.exceptions.ClientError
ConnectionFailedError = aetcd.exceptions.ConnectionFailedError
ConnectionTimeoutError = aetcd.exceptions.ConnectionTimeoutError
UnauthenticatedError = aetcd.exceptions.UnauthenticatedError
RevisionCompactedError = aetcd.exceptions.RevisionCompactedError

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (ClientError, grpc.RpcError, OSError)
"""What an etcd call raises when etcd is restarting, unreachable or slow: worth trying
again. ``OSError`` covers ``TimeoutError`` (``asyncio.TimeoutError`` on 3.11) and
``ConnectionError``, ``EtcdUnavailable`` included. ``PermissionDenied`` is among them: a
job's worker may start before the controller granted the job's role."""

DENIED = "etcdserver: permission denied"
AUTH_STORE_CHANGED = "etcdserver: revision of auth store is old"
"""etcd's answer to a request whose permission check overlapped a change of its users or
roles (the controller making or removing a job's identity): nothing was done, and the same
request a moment later goes through."""
AUTH_RACE_BACKOFF_S = (0.01, 0.1)
"""A key-value call refused with ``AUTH_STORE_CHANGED`` is sent again after 10 ms, doubling up
to 100 ms, for as long as one request may take (the client's timeout): under a run of user
and role changes (many jobs starting at once) a call only goes through between two of them,
so a number of tries would give up while the changes last, not when the call is late."""


class PermissionDenied(ClientError):
    """etcd refused an operation to the identity the client connected as (gRPC
    ``PERMISSION_DENIED``): no role of that user grants the key, or no such user exists.

    A ``ClientError`` (so among ``TRANSIENT_ERRORS``): callers retry it as they retry any etcd
    error, since a job's role is granted by the controller once it sees the job, which may
    be after the job's first worker started. Its text names the operation, the key and the
    identity, so where a caller gives up, the error says what was denied to whom."""

    def __init__(self, detail: str = DENIED, *, operation: str = "", key: str = "", identity: str = "") -> None:
        self.detail = detail
        self.operation = operation
        self.key = key
        self.identity = identity
        text = detail
        if operation:
            text = f"etcd denied {operation} on {key} to identity {identity or 'anonymous'!r} ({detail})"
        super().__init__(text)

    def about(self, operation: str, key: str, identity: str) -> PermissionDenied:
        """This denial, naming what was denied to whom."""
        return PermissionDenied(self.detail, operation=operation, key=key, identity=identity)


def _map_permission_denied() -> None:
    """aetcd turns each gRPC status it knows into its own error and every other one into a
    bare ``ClientError``; PERMISSION_DENIED is not among the ones it knows. Add it to that
    table, so every call of every client raises ``PermissionDenied`` (``from`` the gRPC
    error). ``is_permission_denied`` still recognises a bare ``ClientError`` should the
    table move in a later aetcd."""
    table = getattr(aetcd.exceptions, "_EXCEPTIONS_BY_CODE", None)
    if isinstance(table, dict):
        table.setdefault(grpc.StatusCode.PERMISSION_DENIED, PermissionDenied)


_map_permission_denied()


def is_permission_denied(exc: BaseException) -> bool:
    """``exc`` is etcd's "permission denied": a ``PermissionDenied``, a ``ClientError`` raised
    from a gRPC error of that status, or that gRPC error itself (raw stub calls)."""
    if isinstance(exc, PermissionDenied):
        return True
    cause = exc.__cause__ if isinstance(exc, ClientError) else exc
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.PERMISSION_DENIED


def describe_keys(keys: Iterable[bytes | str], most: int = 3) -> str:
    """``k1, k2, k3 and 2 more``: the keys one request touches, for an error message."""
    names = list(dict.fromkeys(k.decode(errors="replace") if isinstance(k, bytes) else str(k) for k in keys))
    text = ", ".join(names[:most])
    return f"{text} and {len(names) - most} more" if len(names) > most else text


class _Client(aetcd.Client):
    """aetcd.Client whose key-value calls raise ``PermissionDenied`` naming the operation,
    the key and the identity (etcd's own answer names none of them), and log the first
    denial of each operation and key once."""

    MOST_REPORTED = 64
    """Denials remembered (so logged once each); later ones are raised, not logged."""

    def __init__(self, *args: Any, identity: str = "anonymous", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.identity = identity
        """Who etcd takes this client for (``EtcdSettings.identity``)."""
        self._reported: set[tuple[str, str]] = set()

    async def _named(self, operation: str, what: Callable[[], str], call: Callable[[], Awaitable[T]]) -> T:
        """Await ``call()``; a denial is raised naming ``operation`` and the keys ``what()``
        describes (worked out only then: most calls succeed). A call that overlapped a change
        of etcd's users or roles is sent again (``AUTH_STORE_CHANGED``)."""
        delay, longest = AUTH_RACE_BACKOFF_S
        deadline = 0.0  # set at the first refusal: most calls go through at once
        while True:
            try:
                return await call()
            except aetcd.exceptions.InvalidArgumentError as exc:
                if AUTH_STORE_CHANGED not in str(exc):
                    raise
                now = asyncio.get_running_loop().time()
                deadline = deadline or now + self._timeout
                if now + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(2 * delay, longest)
            except ClientError as exc:
                if not is_permission_denied(exc):
                    raise
                denied = exc if isinstance(exc, PermissionDenied) else PermissionDenied(str(exc) or DENIED)
                named = denied.about(operation, what(), self.identity)
                self.report(named)
                raise named from exc

    def report(self, denied: PermissionDenied) -> None:
        """Log ``denied`` the first time its operation and key are denied to this client."""
        seen = (denied.operation, denied.key)
        if seen in self._reported or len(self._reported) >= self.MOST_REPORTED:
            return
        self._reported.add(seen)
        log.warning(
            f"etcd denied {denied.operation} on {denied.key} to identity {denied.identity!r}: no role of it grants "
            "that key (a job's role is granted by the controller run with --etcd-job-identities once it sees the "
            "job; the caller retries meanwhile)",
            operation=denied.operation, key=denied.key, identity=denied.identity,
        )  # fmt: skip

    async def get(self, key: bytes, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(super().get, key, *args, **kwargs)
        return await self._named("get", lambda: describe_keys([key]), call)

    async def get_prefix(self, key_prefix: bytes, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(super().get_prefix, key_prefix, *args, **kwargs)
        return await self._named("range of the prefix", lambda: describe_keys([key_prefix]), call)

    async def get_range(self, range_start: bytes, range_end: bytes, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(super().get_range, range_start, range_end, *args, **kwargs)
        return await self._named("range", lambda: _describe_range(range_start, range_end), call)

    async def put(self, key: bytes, value: bytes, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(super().put, key, value, *args, **kwargs)
        return await self._named("put", lambda: describe_keys([key]), call)

    async def delete(self, key: bytes, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(super().delete, key, *args, **kwargs)
        return await self._named("delete", lambda: describe_keys([key]), call)

    async def delete_prefix(self, key_prefix: bytes, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(super().delete_prefix, key_prefix, *args, **kwargs)
        return await self._named("delete of the prefix", lambda: describe_keys([key_prefix]), call)

    async def delete_range(self, range_start: bytes, range_end: bytes, *args: Any, **kwargs: Any) -> Any:
        call = functools.partial(super().delete_range, range_start, range_end, *args, **kwargs)
        return await self._named("delete of the range", lambda: _describe_range(range_start, range_end), call)

    async def transaction(self, compare: Any, success: Any = None, failure: Any = None) -> Any:
        ops = (*compare, *(success or ()), *(failure or ()))
        call = functools.partial(super().transaction, compare, success, failure)
        keys = lambda: describe_keys(k for op in ops if (k := getattr(op, "key", b"")))  # noqa: E731
        return await self._named("a transaction", keys, call)

    async def revoke_lease(self, lease_id: int) -> Any:
        call = functools.partial(super().revoke_lease, lease_id)
        return await self._named("revoke", lambda: f"lease {lease_id:x} (and every key bound to it)", call)


def _describe_range(start: bytes, end: bytes) -> str:
    if end == start + b"\0":
        return describe_keys([start])
    if end == aetcd.utils.prefix_range_end(start):
        return describe_keys([start]) + " (prefix)"
    return f"[{describe_keys([start])}, {describe_keys([end])})"


class EtcdUnavailable(ConnectionError):
    """No endpoint of the configured list answered."""


_TLS_CREDENTIALS: contextvars.ContextVar[grpc.ChannelCredentials | None] = contextvars.ContextVar(
    "regroup_etcd_tls_credentials", default=None
)
"""The credentials of the TLS client connecting in this task or thread (None: a plain one)."""
_INSECURE_CHANNEL = aetcd.rpc.insecure_channel


def _channel(target: str, options: Any = None) -> grpc.aio.Channel:
    """aetcd opens every channel through ``rpc.insecure_channel``: this takes its place once,
    for good, and opens a TLS channel for a ``_TlsClient`` connecting in the current context
    (task or thread) only. Swapping the module's function around each connect instead raced
    when two TLS clients connected at once in two threads, and left it swapped for good."""
    credentials = _TLS_CREDENTIALS.get()
    if credentials is None:
        return _INSECURE_CHANNEL(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


aetcd.rpc.insecure_channel = _channel


class _TlsClient(_Client):
    """aetcd.Client whose channel is a TLS channel."""

    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        token = _TLS_CREDENTIALS.set(self._credentials)
        try:
            await super().connect()
        finally:
            _TLS_CREDENTIALS.reset(token)


def _credentials(settings: EtcdSettings) -> grpc.ChannelCredentials:
    read = lambda p: Path(p).read_bytes() if p is not None else None  # noqa: E731
    return grpc.ssl_channel_credentials(
        root_certificates=read(settings.cacert),
        private_key=read(settings.key),
        certificate_chain=read(settings.cert),
    )


def make_client(settings: EtcdSettings, endpoint: Endpoint) -> aetcd.Client:
    """An unconnected client for one endpoint."""
    timeout = max(1, int(settings.request_timeout.total_seconds()))
    kwargs: dict[str, Any] = dict(
        host=endpoint.host,
        port=endpoint.port,
        username=settings.user,
        password=settings.password,
        timeout=timeout,
        identity=settings.identity,
    )
    if settings.tls:
        return _TlsClient(credentials=_credentials(settings), **kwargs)
    return _Client(**kwargs)


async def connect(settings: EtcdSettings) -> aetcd.Client:
    """Connect to the first endpoint that answers a status request.

    Raises ``UnauthenticatedError`` on bad credentials and ``EtcdUnavailable`` (naming
    every endpoint and its error) when none answers.
    """
    errors: list[str] = []
    for endpoint in settings.endpoints:
        client = make_client(settings, endpoint)
        try:
            await client.connect()
            await client.status()
            return client
        except aetcd.exceptions.UnauthenticatedError:
            await client.close()
            raise
        except aetcd.exceptions.InvalidArgumentError as exc:
            await client.close()
            # etcd answers a wrong user or password with INVALID_ARGUMENT, not UNAUTHENTICATED.
            if "authentication failed" in str(exc):
                raise aetcd.exceptions.UnauthenticatedError(f"{endpoint}: {exc}") from exc
            errors.append(f"{endpoint}: {type(exc).__name__}: {exc}".strip())
        except TRANSIENT_ERRORS as exc:
            errors.append(f"{endpoint}: {type(exc).__name__}: {exc}".strip())
            await client.close()
    raise EtcdUnavailable(f"etcd unreachable at {settings.describe()} ({'; '.join(errors)})")


async def enable_auth(client: aetcd.Client, root_password: str, users: dict[str, str] | None = None, prefix: str = "/regroup/") -> None:
    """Turn on etcd authentication (v3 API, no etcdctl needed).

    Creates ``root`` (role ``root``) with ``root_password`` and, for each ``users`` entry
    (name -> password), a user whose role may read and write every key under ``prefix``.
    ``client`` must be connected without credentials, before auth is on.
    """
    stub = aetcd.rpc.AuthStub(client.channel)
    await stub.RoleAdd(aetcd.rpc.AuthRoleAddRequest(name="root"))
    await stub.UserAdd(aetcd.rpc.AuthUserAddRequest(name="root", password=root_password))
    await stub.UserGrantRole(aetcd.rpc.AuthUserGrantRoleRequest(user="root", role="root"))
    for name, password in (users or {}).items():
        role = f"{name}-rw"
        permission = auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE,
            key=prefix.encode(),
            range_end=aetcd.utils.prefix_range_end(prefix.encode()),
        )
        await stub.RoleAdd(aetcd.rpc.AuthRoleAddRequest(name=role))
        await stub.RoleGrantPermission(aetcd.rpc.AuthRoleGrantPermissionRequest(name=role, perm=permission))
        await stub.UserAdd(aetcd.rpc.AuthUserAddRequest(name=name, password=password))
        await stub.UserGrantRole(aetcd.rpc.AuthUserGrantRoleRequest(user=name, role=role))
    await stub.AuthEnable(aetcd.rpc.AuthEnableRequest())
