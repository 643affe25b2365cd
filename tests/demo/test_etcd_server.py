"""The local etcd never serves clients and peers on one port, and starts on fresh ports when
the ones it drew were taken before it bound them. Real etcd."""

from __future__ import annotations

import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from regroup.demo.etcd_server import EtcdServer
from regroup.ports import START_ATTEMPTS, PortsTaken, free_ports


@pytest.fixture
def held() -> Iterator[int]:
    """A port something else listens on for the whole test (SO_REUSEADDR: a port etcd
    served on moments ago may still have connections in TIME_WAIT)."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


class FirstAnswer:
    """``draw_ports`` whose first answer puts ``port`` first; then ``free_ports``'."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.given: list[tuple[int, ...]] = []

    def __call__(self, count: int, host: str) -> tuple[int, ...]:
        ports = (self.port, *free_ports(count - 1, host)) if not self.given else free_ports(count, host)
        self.given.append(ports)
        return ports


def _answers(server: EtcdServer) -> bool:
    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as response:
        return b"true" in response.read()


def test_client_and_peer_ports_differ_and_no_two_servers_share_one(tmp_path: Path) -> None:
    servers = [EtcdServer(data_dir=tmp_path / str(i)) for i in range(200)]
    ports = [port for server in servers for port in (server.client_port, server.peer_port)]
    assert len(set(ports)) == len(ports) == 400


def test_one_port_for_clients_and_peers_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="EtcdServer.client_port and peer_port must differ, both are 2379"):
        EtcdServer(data_dir=tmp_path, client_port=2379, peer_port=2379)
    with pytest.raises(ValueError, match="both given or both 0"):
        EtcdServer(data_dir=tmp_path, client_port=2379)


def test_an_etcd_whose_client_port_was_taken_starts_on_other_ports(tmp_path: Path, held: int) -> None:
    draw = FirstAnswer(held)
    server = EtcdServer(data_dir=tmp_path / "etcd", draw_ports=draw)
    assert server.client_port == held
    with server:
        assert len(draw.given) == 2, "etcd found its first client port taken and drew again"
        assert (server.client_port, server.peer_port) == draw.given[1]
        assert held not in (server.client_port, server.peer_port)
        assert server.client_port != server.peer_port
        assert _answers(server)
    log = (tmp_path / f"etcd-{held}.log").read_text()
    assert f"127.0.0.1:{held}: bind: address already in use" in log


def test_an_etcd_whose_peer_port_was_taken_starts_on_other_ports(tmp_path: Path, held: int) -> None:
    draw = FirstAnswer(held)
    server = EtcdServer(data_dir=tmp_path / "etcd", draw_ports=lambda count, host: draw(count, host)[::-1])
    assert server.peer_port == held
    with server:
        assert len(draw.given) == 2 and held not in (server.client_port, server.peer_port)
        assert _answers(server)


def test_an_etcd_that_keeps_finding_its_ports_taken_fails_naming_them(tmp_path: Path, held: int) -> None:
    peers = iter(free_ports(START_ATTEMPTS))
    server = EtcdServer(data_dir=tmp_path / "etcd", draw_ports=lambda count, host: (held, next(peers)))
    with pytest.raises(PortsTaken) as failed:
        server.start()
    assert len(failed.value.tried) == START_ATTEMPTS
    assert all(client == held for client, _ in failed.value.tried)
    message = str(failed.value)
    assert f"etcd (client, peer) in {tmp_path / 'etcd'}: address already in use on each of {START_ATTEMPTS} attempts" in message
    assert all(f"{held}, {peer}" in message for _, peer in failed.value.tried)
    assert "bind: address already in use" in failed.value.detail


def test_once_it_has_served_etcd_starts_again_only_on_its_own_ports(tmp_path: Path) -> None:
    with EtcdServer(data_dir=tmp_path / "etcd") as server:
        ports = (server.client_port, server.peer_port)
        server.kill()
        # Clients know its endpoint now: taken, the port is named, not swapped for another.
        with socket.socket() as holder:
            holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            holder.bind(("127.0.0.1", server.client_port))
            holder.listen()
            with pytest.raises(PortsTaken, match=rf"\(ports {ports[0]}, {ports[1]}\)"):
                server.start()
        assert (server.client_port, server.peer_port) == ports
        server.start()
        assert (server.client_port, server.peer_port) == ports and _answers(server)
