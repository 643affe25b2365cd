"""A world superseded while it forms is dropped and the newer one formed in the same process.

Real worker processes, real gloo: the test plays the in-place agents by writing each
node's channel (``world.json``), exactly as ``InPlaceAgent`` does.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from regroup.etcd_server import free_port
from rendezvous.inplace.channel import CHANNEL_ENV, STANDBY_ENV, WORLD_FILE, NodeWorld, RankSlot, write_atomically
from tests.rendezvous.agents import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _world(seq: int, round: int, port: int, rank: int, size: int) -> bytes:
    return NodeWorld(
        seq=seq, round=round, pending=False, master_addr="127.0.0.1", master_port=port,
        group_rank=rank, group_world_size=size, slots={"0": RankSlot(rank, size, rank, size)},
    ).to_json()


def _worker(channel: Path, env: dict[str, str], **extra: str) -> subprocess.Popen[str]:
    channel.mkdir()
    full = {**env, CHANNEL_ENV: str(channel), STANDBY_ENV: "1", "LOCAL_RANK": "0", **extra}
    return subprocess.Popen([sys.executable, "-m", "tests.rendezvous.forming_worker"], cwd=ROOT, env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_world_superseded_while_forming_is_replaced_in_the_same_process(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    first, second = free_port(), free_port()
    a = _worker(tmp_path / "a", worker_env)
    b = None
    try:
        # a is rank 0 of a two-rank world whose rank 1 never comes (its node was lost).
        write_atomically(tmp_path / "a" / WORLD_FILE, _world(1, 1, first, 0, 2))
        wait_until(lambda: _listening(first) or a.poll() is not None, 120, "a hosting round 1's store")
        assert a.poll() is None, a.communicate()
        # The agents re-form: round 2 is a and b. a is still inside round 1's formation.
        write_atomically(tmp_path / "a" / WORLD_FILE, _world(2, 2, second, 0, 2))
        b = _worker(tmp_path / "b", worker_env)
        write_atomically(tmp_path / "b" / WORLD_FILE, _world(1, 2, second, 1, 2))
        results = []
        for proc in (a, b):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    # Same process, newer world, every rank in it (a's failed attempt left no trace behind:
    # its default group has the name b's has, or the all-reduce would never meet).
    assert [r["round"] for r in results] == [2, 2]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert [r["sum"] for r in results] == [2, 2]
    assert results[0]["formed"] == 1


def test_a_world_that_cannot_form_is_given_up_within_the_form_timeout(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # Rank 1 of this world never comes and no newer world is written: without a bound the
    # worker would wait out the collective timeout (30 s here, 10 min in the trainer).
    port = free_port()
    worker = _worker(tmp_path / "a", worker_env, FORM_TIMEOUT_S="2")
    try:
        write_atomically(tmp_path / "a" / WORLD_FILE, _world(1, 1, port, 0, 2))
        _, err = worker.communicate(timeout=25)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert worker.returncode != 0
    assert "ReformFailed: world of round 1 did not form within 0:00:02" in err, err[-3000:]
