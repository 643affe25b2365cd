"""One etcd client and one job mirror, opened with retries and clear errors.

torchrun runs one agent per process, so each handler opens its own connection; the
benchmark drives many agents in one process and shares one (``Shared``: a loop thread
and a ``JobConnection``, opened the same way either way).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import structlog
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from regroup import etcd
from regroup.etcd import LoopThread
from regroup.keys import JobKeys
from regroup.rendezvous.settings import RendezvousSettings
from regroup.rendezvous.watch import JobWatch

log = structlog.get_logger("regroup.rendezvous.connection")

# gRPC reports these when the two ends disagree about TLS; retrying cannot help.
_TLS_HINTS = ("ssl", "tls", "handshake", "certificate", "wrong version number", "alpn")


class JobConnection:
    """A connected etcd client plus the live mirror of one job's keys."""

    def __init__(self, client: Any, watch: JobWatch, settings: etcd.EtcdSettings) -> None:
        self.client = client
        self.watch = watch
        self.settings = settings

    @classmethod
    async def open(cls, settings: etcd.EtcdSettings, keys: JobKeys, timeout: float) -> JobConnection:
        """Connect (retrying with backoff for up to ``timeout`` seconds) and start the mirror.

        Raises ``RendezvousConnectionError`` naming the endpoints: at once for rejected
        credentials or a TLS mismatch, after ``timeout`` when etcd stays unreachable or keeps
        denying this identity the job's keys (the controller grants a job's role once it sees
        the job, which may be after this agent started: until then the listing is retried).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        client = await connect_with_retry(settings, timeout)
        watch = JobWatch(client, keys)
        backoff = 0.1
        try:
            while True:
                try:
                    await watch.start()
                    return cls(client, watch, settings)
                except etcd.UnauthenticatedError as exc:
                    raise RendezvousConnectionError(_auth_message(settings, exc)) from exc
                except etcd.PermissionDenied as exc:
                    remaining = deadline - loop.time()
                    if remaining <= 0:
                        raise RendezvousConnectionError(_denied_message(settings, exc, timeout)) from exc
                await asyncio.sleep(min(backoff, remaining))
                backoff = min(backoff * 2, 2.0)
        except BaseException:
            await client.close()
            raise

    async def close(self) -> None:
        await self.watch.stop()
        await self.client.close()


@dataclass
class Shared:
    """A loop thread and a job connection that several handlers of one process share."""

    loop: LoopThread
    connection: JobConnection

    @classmethod
    def open(cls, settings: RendezvousSettings) -> Shared:
        loop = LoopThread(name=f"rdzv-{settings.job.job}")
        try:
            connection = loop.run(
                JobConnection.open(settings.etcd, settings.job, settings.timeouts.join.total_seconds())
            )
        except BaseException:
            loop.close()
            raise
        return cls(loop, connection)

    def close(self) -> None:
        try:
            self.loop.run(self.connection.close(), timedelta(seconds=5))
        except (TimeoutError, *etcd.TRANSIENT_ERRORS) as exc:
            log.info("etcd connection not closed cleanly; dropping it", error=str(exc))
        self.loop.close()


def _denied_message(settings: etcd.EtcdSettings, exc: Exception, timeout: float) -> str:
    return (
        f"etcd at {settings.describe()} kept denying this agent the job's keys for {timeout:g}s: {exc}. A job's "
        "workers need the job's etcd role (the controller run with --etcd-job-identities grants it to the user "
        "regroup:job:<namespace>:<job>, the CN of the client certificate set in rdzv-conf cert/key)"
    )


def _auth_message(settings: etcd.EtcdSettings, exc: Exception) -> str:
    who = f"user {settings.user!r}" if settings.user else "an unauthenticated client (no rdzv-conf user/password)"
    return f"etcd at {settings.describe()} rejected {who}: {exc}"


async def connect_with_retry(settings: etcd.EtcdSettings, timeout: float) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    backoff = 0.1
    attempt = 0
    while True:
        attempt += 1
        try:
            return await etcd.connect(settings)
        except etcd.UnauthenticatedError as exc:
            raise RendezvousConnectionError(_auth_message(settings, exc)) from exc
        except etcd.EtcdUnavailable as exc:
            text = str(exc)
            if any(hint in text.lower() for hint in _TLS_HINTS):
                raise RendezvousConnectionError(
                    f"TLS handshake with etcd at {settings.describe()} failed (check rdzv-conf cacert/cert/key "
                    f"against the server's TLS settings): {text}"
                ) from exc
            remaining = deadline - loop.time()
            if remaining <= 0:
                hint = ""
                if not settings.tls and "socket closed" in text.lower():
                    hint = " (the server closed the connection: if etcd serves TLS, set rdzv-conf cacert/cert/key)"
                raise RendezvousConnectionError(
                    f"{text}; gave up after {attempt} attempts in {timeout:g}s{hint}"
                ) from exc
            log.warning("etcd unreachable; retrying", endpoints=settings.describe(), attempt=attempt, error=text)
        await asyncio.sleep(min(backoff, remaining))
        backoff = min(backoff * 2, 5.0)
