"""A port handed out once is never handed out again, and a server whose port was taken
meanwhile is started again on fresh ones."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator

import pytest

from regroup.ports import (
    PORTS,
    START_ATTEMPTS,
    PortBook,
    PortsTaken,
    address_in_use,
    free_port,
    free_ports,
    start_on_free_ports,
    start_on_free_ports_async,
)


@pytest.fixture
def held() -> Iterator[int]:
    """A port something else listens on for the whole test."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _bind(ports: tuple[int, ...]) -> socket.socket:
    """A server's start: listen on ``ports[0]`` (raises EADDRINUSE if it is held)."""
    server = socket.socket()
    try:
        server.bind(("127.0.0.1", ports[0]))
    except OSError:
        server.close()
        raise
    server.listen()
    return server


def _first_answer(port: int) -> tuple[list[tuple[int, ...]], object]:
    """A draw whose first answer is ``port`` and which then asks ``free_ports``; and what it gave."""
    given: list[tuple[int, ...]] = []

    def draw(count: int, host: str) -> tuple[int, ...]:
        ports = (port, *free_ports(count - 1, host)) if not given else free_ports(count, host)
        given.append(ports)
        return ports

    return given, draw


def test_a_port_is_never_handed_out_twice_across_many_calls() -> None:
    # Binding port 0 and closing the socket, as often, repeats ports within a few hundred
    # draws (the kernel draws from ~28,000 ephemeral ports): the book must skip them all.
    ports = [free_port() for _ in range(1500)] + [p for _ in range(250) for p in free_ports(2)]
    assert len(set(ports)) == len(ports) == 2000
    assert all(port in PORTS for port in ports)


def test_ports_drawn_together_are_distinct_and_free_now() -> None:
    ports = free_ports(4)
    assert len(set(ports)) == 4
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))


def test_a_port_chosen_by_the_caller_is_handed_out_once() -> None:
    book = PortBook()
    port = book.free_ports(1)[0]
    assert port in book and not book.take(port), "the book handed it out itself"
    other = PortBook()
    assert other.take(port) and not other.take(port)


def test_a_book_forgets_a_port_only_after_as_many_others_as_it_remembers() -> None:
    book = PortBook(remember=3)
    assert all(book.take(port) for port in (1, 2, 3))
    assert not book.take(1)
    assert book.take(4)  # 1 is forgotten now: three others came after it
    assert 1 not in book and not book.take(2)
    assert book.take(1)


def test_a_server_whose_port_is_taken_starts_on_a_fresh_one(held: int) -> None:
    given, draw = _first_answer(held)
    server = start_on_free_ports(_bind, "a test server", draw=draw)  # type: ignore[arg-type]
    with server:
        assert given[0] == (held,), "the first start was on the held port"
        assert len(given) == 2
        assert server.getsockname()[1] == given[1][0] != held


async def test_an_awaited_start_whose_port_is_taken_starts_on_a_fresh_one(held: int) -> None:
    given, draw = _first_answer(held)

    async def start(ports: tuple[int, ...]) -> socket.socket:
        return _bind(ports)

    with await start_on_free_ports_async(start, "a test server", draw=draw) as server:  # type: ignore[arg-type]
        assert [ports[0] == held for ports in given] == [True, False]
        assert server.getsockname()[1] == given[1][0]


def test_a_server_that_keeps_finding_its_port_taken_fails_naming_every_port(held: int) -> None:
    with pytest.raises(PortsTaken) as failed:
        start_on_free_ports(_bind, "a test server", draw=lambda count, host: (held,))
    assert failed.value.errno == errno.EADDRINUSE
    assert failed.value.tried == ((held,),) * START_ATTEMPTS
    assert str(failed.value).startswith(f"[Errno {errno.EADDRINUSE}] a test server: address already in use on each of")
    assert f"(ports {'; '.join([str(held)] * START_ATTEMPTS)})" in str(failed.value)


def test_a_start_that_fails_otherwise_is_not_retried() -> None:
    starts: list[tuple[int, ...]] = []

    def start(ports: tuple[int, ...]) -> None:
        starts.append(ports)
        raise RuntimeError("no such binary")

    with pytest.raises(RuntimeError, match="no such binary"):
        start_on_free_ports(start, "a test server")
    assert len(starts) == 1


def test_address_in_use_is_read_from_errno_or_message() -> None:
    assert address_in_use(OSError(errno.EADDRINUSE, "bind"))
    # torch's TCPStore: a RuntimeError subclass whose message says so.
    assert address_in_use(RuntimeError("The server socket has failed to bind. ... address already in use"))
    assert not address_in_use(OSError(errno.ECONNREFUSED, "refused"))
