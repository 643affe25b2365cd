"""The round's ``MASTER_PORT``: a port that nothing else takes before rank 0's worker binds it.

torch picks it by binding port 0 and closing the socket (``get_free_port``), and says
itself that the port "may be taken by another process after this function returns". It
is: the kernel hands ports from the same ephemeral range to outgoing connections, and a
node's workers open dozens of them per round (gloo's full mesh, stores, etcd). Rank 0's
worker binds the port only after the round formed and the workers learnt it; if an
outgoing connection took it meanwhile, the world cannot form. Below the ephemeral range
no outgoing connection is ever given a port, so the agent picks one there that binds
now, and falls back to ``regroup.ports`` where no such range is left. Either way the port
is handed out through the process's ``PortBook``, so no two rounds (or servers) of one
process draw the same one while it may still be in use.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from regroup.ports import PORTS, PortBook

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000
"""Ports below this are left to services (and to what admins reserve by habit)."""
TRIES = 64


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int] | None:
    """The kernel's range for outgoing connections' local ports; None where unknown."""
    try:
        low, high = (int(part) for part in path.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def master_port(
    host: str = "", rng: random.Random | None = None, path: Path = EPHEMERAL_RANGE, book: PortBook = PORTS
) -> int:
    """A port for the round's store below the ephemeral range that binds on ``host`` now
    and that ``book`` has not handed out."""
    span = ephemeral_range(path)
    if span is None or span[0] - LOWEST < TRIES:
        return book.free_ports(1, host)[0]
    pick = rng or random.SystemRandom()
    for _ in range(TRIES):
        port = pick.randrange(LOWEST, span[0])
        if port not in book and _binds(host, port) and book.take(port):
            return port
    return book.free_ports(1, host)[0]


def _binds(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host or "", port))
        except OSError:
            return False
    return True
