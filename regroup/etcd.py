"""The one layer of regroup that imports aetcd.

- ``EtcdSettings``: endpoints, TLS and auth, parsed once at the edge.
- ``connect()``: an ``aetcd.Client`` on the first endpoint that answers; TLS added here
  because aetcd itself only opens insecure channels.
- ``LeaseKeeper``: aetcd has no background keep-alive; this is the owned task that
  refreshes a lease until cancelled.
- ``LoopThread``: an asyncio loop in a daemon thread, for synchronous callers (the
  torchrun rendezvous handler, the training loop).

Everything else in regroup talks to etcd through these.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.utils
import grpc
import structlog
from aetcd.rpc import auth_pb2

log = structlog.get_logger("regroup.etcd")

T = TypeVar("T")

# Re-exported so callers never import aetcd themselves.
Client = aetcd.Client
ClientError = aetcd.exceptions.ClientError
ConnectionFailedError = aetcd.exceptions.ConnectionFailedError
ConnectionTimeoutError = aetcd.exceptions.ConnectionTimeoutError
UnauthenticatedError = aetcd.exceptions.UnauthenticatedError
RevisionCompactedError = aetcd.exceptions.RevisionCompactedError
EventKind = aetcd.rtypes.EventKind


class EtcdUnavailable(ConnectionError):
    """No endpoint of the configured list answered."""


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """Parse ``host:port[,host:port]`` (an ``http(s)://`` scheme is tolerated)."""
    endpoints = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        for scheme in ("http://", "https://"):
            item = item.removeprefix(scheme)
        host, sep, port = item.rpartition(":")
        if not sep:
            host, port = item, "2379"
        if not host or not port.isdigit():
            raise ValueError(f"bad etcd endpoint {item!r}: expected host:port")
        endpoints.append(Endpoint(host.strip("[]"), int(port)))
    if not endpoints:
        raise ValueError(f"no etcd endpoint in {text!r}")
    return tuple(endpoints)


@dataclass(frozen=True)
class EtcdSettings:
    """How to reach etcd."""

    endpoints: tuple[Endpoint, ...]
    """Tried in order; the first that answers is used."""
    cacert: Path | None = None
    """CA bundle that signed the server certificate; enables TLS."""
    cert: Path | None = None
    """Client certificate (mutual TLS); needs ``key``."""
    key: Path | None = None
    """Client private key (mutual TLS); needs ``cert``."""
    user: str | None = None
    """etcd auth user; needs ``password``."""
    password: str | None = None
    request_timeout: timedelta = timedelta(seconds=5)
    """Deadline of one etcd request."""

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("EtcdSettings.endpoints: at least one endpoint is required")
        if (self.cert is None) != (self.key is None):
            raise ValueError("EtcdSettings.cert and EtcdSettings.key must be given together")
        if (self.user is None) != (self.password is None):
            raise ValueError("EtcdSettings.user and EtcdSettings.password must be given together")
        for name in ("cacert", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"EtcdSettings.{name}: no such file {path}")

    @classmethod
    def from_endpoint_string(cls, text: str, **kwargs: Any) -> EtcdSettings:
        return cls(endpoints=parse_endpoints(text), **kwargs)

    @property
    def tls(self) -> bool:
        return self.cacert is not None or self.cert is not None

    def describe(self) -> str:
        scheme = "https" if self.tls else "http"
        return ",".join(f"{scheme}://{e}" for e in self.endpoints)


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
        except (aetcd.exceptions.ClientError, grpc.RpcError, OSError, asyncio.TimeoutError) as exc:
            errors.append(f"{endpoint}: {type(exc).__name__}: {exc}".strip())
            await client.close()
    raise EtcdUnavailable(f"etcd unreachable at {settings.describe()} ({'; '.join(errors)})")


class LeaseKeeper:
    """Keeps one etcd lease alive from an owned background task.

    ``on_lost`` is called (once) if the lease expired or could not be refreshed
    before its TTL ran out, so the owner can re-register.
    """

    def __init__(
        self,
        client: aetcd.Client,
        ttl: timedelta,
        on_lost: Callable[[], Awaitable[None] | None] | None = None,
    ) -> None:
        if ttl < timedelta(seconds=2):
            raise ValueError("LeaseKeeper ttl must be at least 2s")
        self._client = client
        self._ttl = ttl
        self._on_lost = on_lost
        self._task: asyncio.Task[None] | None = None
        self.lease: Any = None

    @property
    def id(self) -> int:
        if self.lease is None:
            raise RuntimeError("lease not granted yet")
        return int(self.lease.id)

    async def start(self) -> Any:
        self.lease = await self._client.lease(int(self._ttl.total_seconds()))
        self._task = asyncio.create_task(self._keep_alive(), name=f"lease-keeper-{self.lease.id}")
        return self.lease

    async def _keep_alive(self) -> None:
        period = self._ttl.total_seconds() / 3
        loop = asyncio.get_running_loop()
        last_ok = loop.time()
        while True:
            await asyncio.sleep(period)
            try:
                response = await self.lease.refresh()
                alive = int(getattr(response, "TTL", 1)) > 0
                if alive:
                    last_ok = loop.time()
                    continue
            except (aetcd.exceptions.ClientError, grpc.RpcError, OSError) as exc:
                log.warning("lease refresh failed", lease=self.lease.id, error=str(exc))
                if loop.time() - last_ok < self._ttl.total_seconds():
                    continue
            log.warning("lease lost", lease=self.lease.id)
            if self._on_lost is not None:
                result = self._on_lost()
                if asyncio.iscoroutine(result):
                    await result
            return

    async def stop(self, revoke: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if revoke and self.lease is not None:
            try:
                await self.lease.revoke()
            except (aetcd.exceptions.ClientError, grpc.RpcError, OSError):
                pass  # it expires on its own


class LoopThread:
    """An asyncio loop in a daemon thread, for synchronous code that needs etcd."""

    def __init__(self, name: str = "regroup-etcd") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: timedelta | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout``)."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(None if timeout is None else timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"etcd call did not finish within {timeout}") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Cancel every task on the loop, then stop it."""
        if not self._loop.is_running():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.run(cancel_all(), timeout)
        except TimeoutError:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout.total_seconds())


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
