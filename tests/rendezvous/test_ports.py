"""The round's MASTER_PORT comes from below the kernel's ephemeral range, binds, and is
never handed out twice by one process."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from regroup.ports import PortBook
from regroup.rendezvous.ports import LOWEST, ephemeral_range, master_port


def test_the_master_port_is_below_the_ephemeral_range_and_free(tmp_path: Path) -> None:
    span = tmp_path / "ip_local_port_range"
    span.write_text("32768\t60999\n")
    assert ephemeral_range(span) == (32768, 60999)
    rng = random.Random(7)
    ports = {master_port(rng=rng, path=span, book=PortBook()) for _ in range(20)}
    assert all(LOWEST <= p < 32768 for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))  # nothing holds it


def test_a_taken_port_is_never_handed_out(tmp_path: Path) -> None:
    span = tmp_path / "ip_local_port_range"
    span.write_text("32768 60999")
    first = master_port(rng=random.Random(3), path=span, book=PortBook())
    with socket.socket() as holder:
        holder.bind(("", first))
        holder.listen()
        # Same seed, same first draw, a book that never handed it out: the held port is skipped.
        assert master_port(rng=random.Random(3), path=span, book=PortBook()) != first


def test_a_port_handed_out_once_is_not_handed_out_again(tmp_path: Path) -> None:
    span = tmp_path / "ip_local_port_range"
    span.write_text("32768 60999")
    book = PortBook()
    # Same seed each time: every call draws the same first candidate, free again each time.
    ports = [master_port(rng=random.Random(5), path=span, book=book) for _ in range(10)]
    assert len(set(ports)) == 10, ports
    assert all(port in book for port in ports)


def test_without_room_below_the_range_the_process_book_is_used(tmp_path: Path) -> None:
    span = tmp_path / "ip_local_port_range"
    span.write_text("1024 65535")
    book = PortBook()
    port = master_port(path=span, book=book)
    assert 0 < port < 65536 and port in book
    assert master_port(path=tmp_path / "missing", book=book) not in (0, port)
