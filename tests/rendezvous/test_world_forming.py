"""A world superseded while it forms is dropped and the newer one formed in the same process.

Real worker processes, real gloo: the test plays the in-place agents by writing each
node's channel (``world.json``), exactly as ``InPlaceAgent`` does.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from regroup.rendezvous.inplace.channel import (
    CHANNEL_ENV,
    STANDBY_ENV,
    WORLD_FILE,
    NodeWorld,
    RankSlot,
    WorkerReport,
    write_atomically,
)
from regroup.ports import free_ports
from regroup.rendezvous.ports import master_port
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


def _running(channel: Path, round: int) -> bool:
    report = WorkerReport.read(channel, 0)
    return report is not None and report.state == "running" and report.round == round


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_a_world_superseded_while_forming_is_replaced_in_the_same_process(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # Picked as an agent picks the round's MASTER_PORT: an outgoing connection of round 1
    # cannot take round 2's port before a binds it.
    first, second = master_port(), master_port()
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
            results.append([json.loads(line) for line in out.splitlines() if line.startswith("{")][-1])
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


def _connections_to(port: int) -> int:
    """Established loopback TCP connections whose far end is ``port`` (Linux ``/proc``)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[2].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def _waiting(channel: Path, round: int) -> bool:
    report = WorkerReport.read(channel, 0)
    return report is not None and report.state == "waiting" and report.round == round


def test_a_member_lost_while_the_world_forms_leaves_the_survivor_waiting_for_the_next_world(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # Round 2 is a (rank 0, its store's host), b and a third member that has not come yet.
    # a dies while b waits inside the formation: b's connection to the store closes. b must
    # wait for the world its agent hands out next, in the same process: a worker that fails
    # here is restarted and loses the shards it holds in memory for the re-form.
    p2, p3 = master_port(), master_port()
    a = _worker(tmp_path / "a", worker_env)
    b = _worker(tmp_path / "b", worker_env)
    try:
        write_atomically(tmp_path / "a" / WORLD_FILE, _world(1, 2, p2, 0, 3))
        write_atomically(tmp_path / "b" / WORLD_FILE, _world(1, 2, p2, 1, 3))
        # a's own client and b's: both are inside round 2's formation.
        wait_until(lambda: _connections_to(p2) >= 2 or a.poll() is not None or b.poll() is not None, 120,
                   "a and b connected to round 2's store")
        a.kill()
        a.wait()
        wait_until(lambda: _waiting(tmp_path / "b", 2) or b.poll() is not None, 120, "b waiting for the next world")
        assert b.poll() is None, b.communicate()
        write_atomically(tmp_path / "b" / WORLD_FILE, _world(2, 3, p3, 0, 1))
        out, err = b.communicate(timeout=120)
    finally:
        for proc in (a, b):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert b.returncode == 0, err[-3000:]
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["round"], r["world_size"], r["sum"]) for r in results] == [(3, 1, 1)], results
    assert "a peer went away while the world formed; waiting for the next one" in out + err, out[-3000:]


def test_a_world_that_cannot_form_is_given_up_within_the_form_timeout(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # Rank 1 of this world never comes and no newer world is written: without a bound the
    # worker would wait out the collective timeout (30 s here, 10 min in the trainer).
    port = master_port()
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


def test_survivors_of_a_world_re_form_after_the_next_one_failed_to_form(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # a and b train in round 1; round 2 adds c, whose node dies before c starts; round 3 is
    # a and b again. Their formation of round 2 fails midway, after round 1 was aborted.
    p1, p2, p3 = master_port(), master_port(), master_port()
    workers = [_worker(tmp_path / name, worker_env, FINAL_ROUND="3") for name in ("a", "b")]
    try:
        for rank, name in enumerate(("a", "b")):
            write_atomically(tmp_path / name / WORLD_FILE, _world(1, 1, p1, rank, 2))
        wait_until(lambda: all(_running(tmp_path / name, 1) for name in ("a", "b"))
                   or any(w.poll() is not None for w in workers), 120, "round 1 formed")
        for rank, name in enumerate(("a", "b")):
            write_atomically(tmp_path / name / WORLD_FILE, _world(2, 2, p2, rank, 3))
        wait_until(lambda: _listening(p2) or any(w.poll() is not None for w in workers), 120, "round 2 forming")
        for rank, name in enumerate(("a", "b")):
            write_atomically(tmp_path / name / WORLD_FILE, _world(3, 3, p3, rank, 2))
        results = []
        for proc in workers:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            results.append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    finally:
        for proc in workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for lines in results:
        assert [(r["round"], r["sum"]) for r in lines] == [(1, 2), (3, 2)], lines


def _side_group_ranks(env: dict[str, str], **per_rank: dict[str, str]) -> list[dict[str, object]]:
    """Run the two ranks of ``side_group_worker``; rank r's extra environment is ``per_rank[f"r{r}"]``."""
    (port,) = free_ports(1)
    procs = [
        subprocess.Popen([sys.executable, "-m", "tests.rendezvous.side_group_worker"], cwd=ROOT,
                         env={**env, "RANK": str(rank), "PORT": str(port), **per_rank.get(f"r{rank}", {})},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in (0, 1)
    ]  # fmt: skip
    results: list[dict[str, object]] = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
            lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
            results.append(lines[-1] if lines else {})
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


def test_a_side_group_connects_within_its_bound_not_the_collective_timeout(worker_env: dict[str, str]) -> None:
    # Rank 0 never creates the side group (a peer lost right after the world formed). With
    # the collective timeout (10 min) there, rank 1 sat in gloo's constructor past the
    # re-form that dropped the peer; bounded, it fails and the rank leaves for the re-form.
    _, lone = _side_group_ranks(worker_env, r0={"JOIN_SIDE": "0"}, r1={"CONNECT_S": "2"})
    assert lone["formed"] is False, lone
    assert float(lone["seconds"]) < 25, lone  # 2 s bound, far below the 600 s collective timeout
    # Both ranks create it: it forms and carries collectives (the bound is only on connecting).
    both = _side_group_ranks(worker_env, r0={"CONNECT_S": "2"}, r1={"CONNECT_S": "2"})
    assert [r["sum"] for r in both] == [2, 2], both
