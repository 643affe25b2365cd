"""A worker that does not import torch, for the scenarios that need no process group.

``python worker.py OUT [options]``. At start it writes what torchrun gave it (ranks, world
sizes, ``MASTER_ADDR``/``PORT``, restart count, ...) to
``OUT/workers/<agent>-<local_rank>-<restart>.json`` (``<agent>`` is the
``CONFORMANCE_AGENT`` its agent was started with) and its pid under ``OUT/pids/``. Then:

- ``--fail-ranks R,..``: these global ranks exit 1 (``--fail-below K``: only while the
  restart count is below K);
- ``--mesh``: the workers of one round stand for a collective: each holds a connection to
  rank 0 (found through ``OUT/mesh.json``), and a worker exits 1 as soon as a peer of its
  round is gone, as a rank blocked in a collective fails when a peer dies. They exit 0
  once ``OUT/STOP`` exists;
- ``--wait-for PATH``: exit 0 once PATH exists;
- otherwise exit 0 at once.

Every wait has a deadline (exit 3), so nothing outlives a test that lost track of it.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import sys
import time
from pathlib import Path

DEADLINE_S = 90.0
ENV = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
    "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)  # fmt: skip


def record(out: Path) -> dict[str, object]:
    agent = os.environ.get("CONFORMANCE_AGENT", "agent")
    row: dict[str, object] = {k: os.environ.get(k) for k in ENV}
    row.update(agent=agent, pid=os.getpid(), t=time.time())
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for sub in ("workers", "pids"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (out / "pids" / str(os.getpid())).write_text(str(os.getpid()))
    path = out / "workers" / f"{agent}-{os.environ['LOCAL_RANK']}-{restart}-{os.getpid()}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(row))
    tmp.rename(path)
    return row


def stopped(out: Path) -> bool:
    return (out / "STOP").exists()


def joined(out: Path, rank: int, world: int) -> None:
    """Say this worker is in its round's mesh (``OUT/meshed/<pid>``)."""
    (out / "meshed").mkdir(exist_ok=True)
    agent = os.environ.get("CONFORMANCE_AGENT", "agent")
    tmp = out / f"meshed.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"agent": agent, "rank": rank, "world": world}))
    tmp.rename(out / "meshed" / str(os.getpid()))


def _accept_peer(conn: socket.socket, world: int) -> bool:
    """Rank 0's side: the connecting worker says hello for this world; False for any other."""
    try:
        conn.settimeout(2.0)
        hello = json.loads(conn.recv(256) or b"{}")
        if hello.get("world") != world:
            return False
        conn.sendall(b"ok")
        return True
    except (OSError, ValueError):
        return False


def _connect_to_rank0(out: Path, rank: int, world: int) -> socket.socket | None:
    """The other ranks' side: None while rank 0 of this round is not up yet."""
    try:
        spot = json.loads((out / "mesh.json").read_text())
        conn = socket.create_connection(("127.0.0.1", spot["port"]), timeout=1.0)
        conn.sendall(json.dumps({"rank": rank, "world": world}).encode())
    except (OSError, ValueError, KeyError):
        return None
    try:
        welcomed = conn.recv(2) == b"ok"
    except OSError:
        welcomed = False
    if welcomed:
        return conn
    conn.close()
    return None


def mesh(out: Path, rank: int, world: int, deadline: float) -> int:
    """Hold the round together; 0 on STOP, 1 when a peer of the round is gone."""
    if world == 1:
        joined(out, rank, world)
        return wait_for(out / "STOP", deadline)
    sel = selectors.DefaultSelector()
    peers: list[socket.socket] = []
    if rank == 0:
        server = socket.create_server(("127.0.0.1", 0))
        spot = out / "mesh.json"
        tmp = out / f"mesh.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"port": server.getsockname()[1], "world": world, "pid": os.getpid()}))
        tmp.rename(spot)
        server.settimeout(0.2)
        while len(peers) < world - 1:
            if time.time() > deadline or stopped(out):
                return 0 if stopped(out) else 3
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            if _accept_peer(conn, world):
                peers.append(conn)
            else:
                conn.close()  # a worker of another round, or one gone already
    else:
        while not peers:
            if time.time() > deadline or stopped(out):
                return 0 if stopped(out) else 3
            conn = _connect_to_rank0(out, rank, world)
            if conn is not None:
                peers.append(conn)
            else:
                time.sleep(0.1)  # rank 0 of this round is not up yet
    joined(out, rank, world)
    for conn in peers:
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ)
    while time.time() < deadline:
        if stopped(out):
            return 0
        for key, _ in sel.select(0.1):
            try:
                data = key.fileobj.recv(64)  # type: ignore[union-attr]
            except OSError:
                data = b""
            if not data:
                # A peer went away: fine if the job is stopping, else a broken collective.
                return 0 if stopped(out) else 1
    return 3


def wait_for(path: Path, deadline: float) -> int:
    while not path.exists():
        if time.time() > deadline:
            return 3
        time.sleep(0.05)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--fail-ranks", default="")
    parser.add_argument("--fail-below", type=int, default=None)
    parser.add_argument("--mesh", action="store_true")
    parser.add_argument("--wait-for", type=Path, default=None)
    args = parser.parse_args()
    deadline = time.time() + DEADLINE_S
    row = record(args.out)
    rank, world = int(str(row["RANK"])), int(str(row["WORLD_SIZE"]))
    restart = int(str(row["TORCHELASTIC_RESTART_COUNT"] or 0))
    failing = {int(r) for r in args.fail_ranks.split(",") if r}
    if rank in failing and (args.fail_below is None or restart < args.fail_below):
        print(f"rank {rank} fails on purpose (restart {restart})", file=sys.stderr)
        return 1
    if args.mesh:
        return mesh(args.out, rank, world, deadline)
    if args.wait_for is not None:
        return wait_for(args.wait_for, deadline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
