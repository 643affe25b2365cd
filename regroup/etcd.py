"""The one layer of regroup that imports aetcd.

- ``EtcdSettings``: endpoints, TLS and auth, parsed once at the edge.
- ``connect()``: an ``aetcd.Client`` on the first endpoint that answers; TLS added here
  because aetcd itself only opens insecure channels.
- ``LeaseKeeper``: aetcd has no background keep-alive; this is the owned task that
  refreshes a lease until cancelled.
- ``open_watch()`` / ``close_watch()``: every watch is opened and closed through these,
  so a cancellation that lands while aetcd creates the watch is never lost.
- ``LoopThread``: an asyncio loop in a daemon thread, for synchronous callers (the
  torchrun rendezvous handler, the training loop); ``loop_threads`` lists the open ones
  and what went wrong on them (the test suite fails a test that leaks either).

Everything else in regroup talks to etcd through these.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
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
    https: bool = False
    """TLS even without ``cacert`` (the system's trusted CAs then verify the server)."""

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
        return self.https or self.cacert is not None or self.cert is not None

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


Watch = aetcd.rtypes.Watch


async def open_watch(client: aetcd.Client, key: bytes, *, start_revision: int, prefix: bool = True) -> Watch:
    """A watch on ``key`` (with ``prefix``, on every key under it) from ``start_revision``.

    aetcd creates a watch under ``asyncio.wait_for``, which on Python 3.11 drops a
    cancellation that lands in the loop turn the watch is created in (CPython gh-86296):
    the caller would then wait on its new watch, cancelled but never told, and whatever
    awaits its end (a ``TaskGroup``, a shutdown) would hang. The cancellation is honoured
    here: the watch is closed and ``CancelledError`` raised.
    """
    opener = client.watch_prefix if prefix else client.watch
    watch = await opener(key, start_revision=start_revision)
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        await close_watch(watch)
        raise asyncio.CancelledError(f"cancelled while the watch on {key.decode(errors='replace')} was created")
    return watch


async def close_watch(watch: Watch, timeout: timedelta = timedelta(seconds=1)) -> bool:
    """Cancel ``watch`` on the server, waiting at most ``timeout``; False when it could not
    be (etcd gone, the stream already broken): the stream's end drops it all the same."""
    try:
        async with asyncio.timeout(timeout.total_seconds()):
            await watch.cancel()
        return True
    except (TimeoutError, aetcd.exceptions.ClientError, grpc.RpcError, OSError) as exc:
        log.debug("watch not cancelled on the server", error=str(exc))
        return False


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

    async def stop(self, revoke: bool = True) -> bool:
        """Stop renewing; with ``revoke``, end the lease now (its keys go at once). False when
        etcd could not be told: the lease then expires on its own within its TTL."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait([self._task])
            self._task = None
        if revoke and self.lease is not None:
            try:
                await self.lease.revoke()
            except (aetcd.exceptions.ClientError, grpc.RpcError, OSError) as exc:
                log.info("lease not revoked; it expires on its own", lease=self.id, error=str(exc))
                return False
        return True


@dataclass(frozen=True)
class LoopProblem:
    """Something that went wrong on a ``LoopThread``'s loop that no caller was told about:
    a task that crashed or did not stop, an exception in a callback."""

    serial: int
    """Order of recording, process-wide (see ``LoopThreads.mark``)."""
    loop: str
    """The loop thread's name and serial, e.g. ``rdzv-job#3``."""
    text: str

    def __str__(self) -> str:
        return f"{self.loop}: {self.text}"


@dataclass(frozen=True)
class LoopMark:
    """A point in time of ``loop_threads``: the serials the next loop and problem will get."""

    loop: int
    problem: int


class LoopThreads:
    """Every ``LoopThread`` of this process that is still open, and the problems they recorded.

    The open ones are held strongly until ``close()``: a dropped ``LoopThread`` keeps its
    thread and loop running, and it is exactly such a leak that must stay findable. Problems
    are kept in a bounded window (the newest ``PROBLEMS_KEPT``); each is logged when recorded.
    """

    PROBLEMS_KEPT = 1000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop_serials = itertools.count(1)
        self._problem_serials = itertools.count(1)
        self._next_loop = 1
        self._next_problem = 1
        self._open: dict[int, LoopThread] = {}
        self._problems: collections.deque[LoopProblem] = collections.deque(maxlen=self.PROBLEMS_KEPT)

    def mark(self) -> LoopMark:
        with self._lock:
            return LoopMark(self._next_loop, self._next_problem)

    def open(self, since: LoopMark | None = None) -> list[LoopThread]:
        """The loop threads not closed yet (created at or after ``since``, if given)."""
        first = since.loop if since is not None else 0
        with self._lock:
            return [t for serial, t in sorted(self._open.items()) if serial >= first]

    def problems(self, since: LoopMark | None = None) -> list[LoopProblem]:
        """The problems recorded (at or after ``since``, if given), oldest first."""
        first = since.problem if since is not None else 0
        with self._lock:
            return [p for p in self._problems if p.serial >= first]

    def _opened(self, thread: LoopThread) -> int:
        with self._lock:
            serial = next(self._loop_serials)
            self._next_loop = serial + 1
            self._open[serial] = thread
            return serial

    def _closed(self, thread: LoopThread) -> None:
        with self._lock:
            self._open.pop(thread.serial, None)

    def _record(self, thread: LoopThread, text: str) -> LoopProblem:
        with self._lock:
            serial = next(self._problem_serials)
            self._next_problem = serial + 1
            problem = LoopProblem(serial, f"{thread.name}#{thread.serial}", text)
            self._problems.append(problem)
        return problem


loop_threads = LoopThreads()
"""The process's registry of loop threads (read by the test suite's leak check)."""


def _describe_task(task: asyncio.Future[Any]) -> str:
    if isinstance(task, asyncio.Task):
        coro = task.get_coro()
        where = getattr(coro, "__qualname__", None) or repr(coro)
        return f"task {task.get_name()!r} ({where})"
    return repr(task)


class LoopThread:
    """An asyncio loop in a daemon thread, for synchronous code that needs etcd.

    Nothing that goes wrong on the loop is dropped silently: an error the loop reports (a
    task's exception nobody retrieved, an exception in a callback), a ``spawn``/``supervise``
    task that crashed, and at ``close()`` a task that crashed while being cancelled or did
    not finish cancelling, are logged and recorded in ``problems`` (and in ``loop_threads``).
    """

    def __init__(self, name: str = "regroup-etcd") -> None:
        self.name = name
        self._problems: list[str] = []
        self._stuck: set[int] = set()
        """``id()`` of the tasks recorded as not finishing their cancellation, so that being
        destroyed pending is not recorded again (a weak reference is dead by then)."""
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(self._on_loop_error)
        self.serial = loop_threads._opened(self)
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<LoopThread {self.name}#{self.serial} {state}>"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def problems(self) -> tuple[str, ...]:
        """What went wrong on this loop that no caller was told about, oldest first."""
        return tuple(self._problems)

    def run(self, coro: Coroutine[Any, Any, T], timeout: timedelta | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (at most ``timeout``)."""
        future = self.submit(coro)
        try:
            return future.result(None if timeout is None else timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"etcd call did not finish within {timeout}") from None

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting; the caller owns the result (use
        ``spawn`` when nobody will look at it). ``RuntimeError`` once closed."""
        if self._closed:
            coro.close()
            raise RuntimeError(f"{self!r}: closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Start ``coro`` on the loop with nobody waiting for it: if it ends with an exception
        (other than being cancelled), that is logged and recorded in ``problems``."""
        name = getattr(coro, "__qualname__", repr(coro))
        self.submit(coro).add_done_callback(lambda future: self._check_ended(future, f"spawned {name!r}"))

    def supervise(self, task: asyncio.Task[Any]) -> asyncio.Task[Any]:
        """For a background task on this loop that nobody awaits for a result (a watch, a
        keep-alive): if it ends with an exception other than cancellation, that is logged and
        recorded in ``problems`` at once, not found (or not) at shutdown. Returns ``task``."""
        task.add_done_callback(lambda done: self._check_ended(done, _describe_task(done)))
        return task

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Cancel every task still on the loop, stop the loop and close it. Idempotent.

        A task that ends its cancellation with an exception (not ``CancelledError``) or is
        still running ``timeout`` after being cancelled, a loop that does not answer within
        ``timeout``, a thread that does not stop: each is logged and recorded in ``problems``;
        the loop is then left to its (daemon) thread rather than closed under a running task.
        """
        if self._closed:
            return
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{self!r}: close() called from its own loop")
        self._closed = True
        seconds = timeout.total_seconds()

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=seconds)
                for task in tasks:
                    if task in pending:
                        self._stuck.add(id(task))
                        self._record(f"{_describe_task(task)} still running {seconds:g}s after being cancelled")
                    elif not task.cancelled() and task.exception() is not None:
                        self._record(f"{_describe_task(task)} ended with {task.exception()!r} when cancelled")
            await self._loop.shutdown_asyncgens()

        try:
            # The outer limit only matters when the loop itself is blocked (cancel_all has its own).
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(seconds + 5)
        except concurrent.futures.TimeoutError:
            self._record(f"the loop did not answer close() within {seconds + 5:g}s (blocked by synchronous code?)")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(seconds)
        loop_threads._closed(self)
        if self._thread.is_alive():
            self._record(f"thread still running {seconds:g}s after the loop was asked to stop")
            return
        self._loop.close()

    # -- problems ------------------------------------------------------------------------

    def _record(self, text: str) -> None:
        self._problems.append(text)
        problem = loop_threads._record(self, text)
        log.error("loop thread problem", loop=problem.loop, problem=text)

    def _check_ended(self, future: asyncio.Future[Any] | concurrent.futures.Future[Any], what: str) -> None:
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            self._record(f"{what} crashed: {exc!r}")

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if _late_grpc_completion(context):
            log.info("a gRPC completion reached an event loop already closed", loop=f"{self.name}#{self.serial}")
            return
        loop.default_exception_handler(context)  # logs it, with the traceback
        if id(context.get("task")) in self._stuck:
            self._stuck.discard(id(context["task"]))
            return  # "destroyed but pending": already recorded at close()
        parts = [str(context.get("message") or "unhandled error")]
        for key in ("task", "future", "handle"):
            if context.get(key) is not None:
                parts.append(_describe_task(context[key]) if key != "handle" else repr(context[key]))
                break
        if context.get("exception") is not None:
            parts.append(repr(context["exception"]))
        self._record(": ".join(parts))


def _late_grpc_completion(context: dict[str, Any]) -> bool:
    """gRPC's aio poller (one per process, run by the loop that first used gRPC) hands each
    completion of a call made on another loop to that loop with ``call_soon_threadsafe``.
    A completion that arrives after its own loop was closed (a call finishing its
    cancellation as a ``LoopThread`` closed) raises "Event loop is closed" here, on the
    poller's loop. The closed loop's call is gone with it, and nothing is lost on this loop:
    every queued completion has its own wake-up, so the next ones are handled on the next.
    """
    exc = context.get("exception")
    return (
        isinstance(exc, RuntimeError)
        and str(exc) == "Event loop is closed"
        and "PollerCompletionQueue._handle_events" in repr(context.get("handle"))
    )


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
