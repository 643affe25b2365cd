"""Ports for the servers this code starts: never the same one handed out twice.

The usual way to find a free port binds port 0, reads the port the kernel chose, closes
the socket and hands the number to a server that binds it later. Between the close and
that bind nothing holds the port: the next such call can be given the same one (the kernel
draws from its ephemeral range and the port is free again): an etcd can be told to serve
clients and peers on one port, and fail to start. ``free_ports`` remembers what it handed out in
this process and never hands a port out again while it may still be in use. Another
process, or an outgoing connection, can still take a port in that gap: a server started on
a number chosen earlier is started again on fresh ports when it finds one taken
(``start_on_free_ports``). Where a server can bind port 0 itself and report its port, that
is better still: no number is chosen before the bind.
"""

from __future__ import annotations

import errno
import os
import socket
import threading
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

REMEMBERED = 4096
"""How many handed-out ports a book holds back: a port comes round again only after this
many others (far more than the servers a test session, a demo or an agent has at once)."""
DRAWS_PER_PORT = 64
"""Kernel draws allowed per port asked for, before giving up on a range that is full."""
START_ATTEMPTS = 5
"""How many starts a server whose ports keep being taken gets, each on fresh ports, before
that is an error."""

Draw = Callable[[int, str], tuple[int, ...]]
"""``(count, host) -> count distinct ports``: ``free_ports``, or a test's stand-in."""


class PortsTaken(OSError):
    """A server could not bind its ports: something else holds one of them (``EADDRINUSE``)."""

    def __init__(self, what: str, tried: Sequence[Sequence[int]], detail: str = "") -> None:
        self.tried = tuple(tuple(ports) for ports in tried)
        """The ports of each attempt, in order."""
        self.detail = detail
        """What the server said (its error or log line)."""
        attempts = "; ".join(", ".join(str(p) for p in ports) for ports in self.tried)
        times = f" on each of {len(self.tried)} attempts" if len(self.tried) > 1 else ""
        message = f"{what}: address already in use{times} (ports {attempts})"
        super().__init__(errno.EADDRINUSE, message + (f": {detail}" if detail else ""))


class PortBook:
    """Hands out ports free at the moment, each one once while it remembers it.

    Thread-safe; a forked child starts from a copy of its parent's book, so it does not
    hand out what the parent already did either."""

    def __init__(self, remember: int = REMEMBERED) -> None:
        self._remember = remember
        self._order: deque[int] = deque()
        self._out: set[int] = set()
        self._lock = threading.Lock()

    def __contains__(self, port: object) -> bool:
        return port in self._out

    def free_ports(self, count: int, host: str = "127.0.0.1") -> tuple[int, ...]:
        """``count`` distinct ports that bind on ``host`` now and that this book has not
        handed out; they are handed out by this call."""
        drawn: list[socket.socket] = []
        picked: list[int] = []
        try:
            with self._lock:
                # Every socket stays bound until the end, so the kernel cannot draw a port twice.
                while len(picked) < count:
                    if len(drawn) >= DRAWS_PER_PORT * count:
                        raise OSError(errno.EADDRNOTAVAIL, f"no free port on {host!r} after {len(drawn)} draws")
                    probe = socket.socket(_family(host), socket.SOCK_STREAM)
                    drawn.append(probe)
                    probe.bind((host, 0))
                    port = int(probe.getsockname()[1])
                    if port not in self._out:
                        picked.append(port)
                for port in picked:
                    self._note(port)
        finally:
            for probe in drawn:
                probe.close()
        return tuple(picked)

    def take(self, port: int) -> bool:
        """Hand out ``port``, chosen by the caller; False if this book handed it out already."""
        with self._lock:
            if port in self._out:
                return False
            self._note(port)
            return True

    def _note(self, port: int) -> None:
        self._out.add(port)
        self._order.append(port)
        while len(self._order) > self._remember:
            self._out.discard(self._order.popleft())

    def _after_fork(self) -> None:
        # A lock held by another thread at the fork would stay held in the child for ever.
        self._lock = threading.Lock()


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


PORTS = PortBook()
"""The process's book: every port this code hands out comes from it."""
os.register_at_fork(after_in_child=PORTS._after_fork)


def free_ports(count: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """``count`` distinct ports, free on ``host`` now, never handed out before in this process
    (while ``PORTS`` remembers them)."""
    return PORTS.free_ports(count, host)


def free_port(host: str = "127.0.0.1") -> int:
    """One port, free on ``host`` now, never handed out before in this process (see ``free_ports``)."""
    return PORTS.free_ports(1, host)[0]


def address_in_use(error: BaseException) -> bool:
    """Whether ``error`` says a port was taken: ``EADDRINUSE``, or the message as torch's
    TCPStore and etcd put it."""
    if isinstance(error, OSError) and error.errno == errno.EADDRINUSE:
        return True
    return "address already in use" in str(error).lower()


def _said(error: Exception) -> str:
    return error.detail if isinstance(error, PortsTaken) else str(error)


def _retry_or_raise(exc: Exception, ports: tuple[int, ...], tried: list[tuple[int, ...]], what: str, attempts: int) -> None:
    """After a failed start on ``ports``: return to try fresh ports while the address was in
    use and attempts are left; else raise (``exc`` itself, or ``PortsTaken`` naming every try)."""
    if not address_in_use(exc):
        raise exc
    tried.append(ports)
    if len(tried) >= attempts:
        raise PortsTaken(what, tried, _said(exc)) from exc


def start_on_free_ports(
    start: Callable[[tuple[int, ...]], T],
    what: str,
    count: int = 1,
    host: str = "127.0.0.1",
    draw: Draw = free_ports,
    attempts: int = START_ATTEMPTS,
) -> T:
    """``start(ports)`` on ``count`` ports from ``draw``; while it fails with the address in
    use, again on fresh ports, ``attempts`` times in all. Then ``PortsTaken`` names every
    port tried."""
    tried: list[tuple[int, ...]] = []
    while True:
        ports = draw(count, host)
        try:
            return start(ports)
        except Exception as exc:
            _retry_or_raise(exc, ports, tried, what, attempts)


async def start_on_free_ports_async(
    start: Callable[[tuple[int, ...]], Awaitable[T]],
    what: str,
    count: int = 1,
    host: str = "127.0.0.1",
    draw: Draw = free_ports,
    attempts: int = START_ATTEMPTS,
) -> T:
    """``start_on_free_ports`` for a ``start`` that is awaited."""
    tried: list[tuple[int, ...]] = []
    while True:
        ports = draw(count, host)
        try:
            return await start(ports)
        except Exception as exc:
            _retry_or_raise(exc, ports, tried, what, attempts)
