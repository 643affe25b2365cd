"""Connecting to etcd (TLS added here: aetcd itself only opens insecure channels), the
errors callers see, and turning on authentication."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.utils
import grpc
from aetcd.rpc import auth_pb2

from regroup.etcd.settings import Endpoint, EtcdSettings

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
``ConnectionError``, ``EtcdUnavailable`` included."""


class EtcdUnavailable(ConnectionError):
    """No endpoint of the configured list answered."""


class _TlsClient(aetcd.Client):
    """aetcd.Client whose channel is a TLS channel."""

    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        original = aetcd.rpc.insecure_channel
        credentials = self._credentials

        def secure(target: str, options: Any = None) -> grpc.aio.Channel:
            return grpc.aio.secure_channel(target, credentials, options=options)

        # aetcd.Client.connect builds its channel through rpc.insecure_channel; swap it for
        # the duration of this call only (connect is not re-entered concurrently per client).
        aetcd.rpc.insecure_channel = secure
        try:
            await super().connect()
        finally:
            aetcd.rpc.insecure_channel = original


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
    )
    if settings.tls:
        return _TlsClient(credentials=_credentials(settings), **kwargs)
    return aetcd.Client(**kwargs)


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
