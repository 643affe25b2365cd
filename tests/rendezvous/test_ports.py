"""The round's MASTER_PORT comes from below the kernel's ephemeral range, and binds."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from regroup.rendezvous.ports import LOWEST, ephemeral_range, master_port


def test_the_master_port_is_below_the_ephemeral_range_and_free(tmp_path: Path) -> None:
    span = tmp_path / "ip_local_port_range"
    span.write_text("32768\t60999\n")
    assert ephemeral_range(span) == (32768, 60999)
    rng = random.Random(7)
    ports = {master_port(rng=rng, path=span) for _ in range(20)}
    assert all(LOWEST <= p < 32768 for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("", port))  # nothing holds it


def test_a_taken_port_is_never_handed_out(tmp_path: Path) -> None:
    span = tmp_path / "ip_local_port_range"
    span.write_text("32768 60999")
    first = master_port(rng=random.Random(3), path=span)
    with socket.socket() as holder:
        holder.bind(("", first))
        holder.listen()
        # Same seed, same first draw: the held port is skipped.
        assert master_port(rng=random.Random(3), path=span) != first


def test_without_room_below_the_range_torchs_way_is_used(tmp_path: Path) -> None:
    span = tmp_path / "ip_local_port_range"
    span.write_text("1024 65535")
    port = master_port(path=span)
    assert 0 < port < 65536
    assert master_port(path=tmp_path / "missing") > 0
