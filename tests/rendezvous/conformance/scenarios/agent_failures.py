"""Agents killed and agents refused (``local_elastic_agent_test.py``,
``dynamic_rendezvous_test.py``, and etcd-v3's own): a replacement joins a new round, the
survivor re-forms alone, a node waiting beyond max takes a killed member's place, and a
second live agent under one node name is refused."""

from __future__ import annotations

import time

from tests.rendezvous.conformance.checks import holds_for
from tests.rendezvous.conformance.scenario_run import Run


def _mesh_at(run: Run, labels: list[str], world: int) -> bool:
    meshed = run.meshed()
    return all(any(m["agent"] == label and m["world"] == world for m in meshed) for label in labels)


def _since(run: Run, label: str, world: int, after: float) -> bool:
    return any(r["t"] > after and r["WORLD_SIZE"] == str(world) for r in run.rows(label))


def fault_tolerance(run: Run) -> None:
    mesh = ("--mesh",)
    a = run.start("a", "2:2", max_restarts=2, args=mesh)
    b = run.start("b", "2:2", max_restarts=2, args=mesh)
    run.until(lambda: _mesh_at(run, ["a", "b"], 2), 40, "a and b working together", alive=(a, b))
    killed = time.time()
    run.kill("b")
    b2 = run.start("b2", "2:2", max_restarts=2, args=mesh, host=False)
    run.until(lambda: _since(run, "a", 2, killed) and _since(run, "b2", 2, killed), 40, "a and b2 in a new round",
              alive=(a, b2))
    run.stop_workers()
    assert a.wait(30) == 0, a.tail()
    assert b2.wait(30) == 0, b2.tail()


def elastic_scale_down(run: Run) -> None:
    mesh = ("--mesh",)
    a = run.start("a", "1:2", max_restarts=2, args=mesh)
    b = run.start("b", "1:2", max_restarts=2, args=mesh)
    run.until(lambda: _mesh_at(run, ["a", "b"], 2), 40, "a and b working together at world size 2", alive=(a, b))
    killed = time.time()
    run.kill("b")
    run.until(lambda: _since(run, "a", 1, killed), 40, "a working on alone at world size 1", alive=(a,))
    run.stop_workers()
    assert a.wait(30) == 0, a.tail()


def waiting_node_takes_over(run: Run) -> None:
    mesh = ("--mesh",)
    a = run.start("a", "1:2", max_restarts=2, args=mesh)
    b = run.start("b", "1:2", max_restarts=2, args=mesh)
    run.until(lambda: _mesh_at(run, ["a", "b"], 2), 40, "a and b working together at world size 2", alive=(a, b))
    attempts = len(run.rows())
    c = run.start("c", "1:2", max_restarts=2, args=mesh)
    run.until(lambda: "Rendezvous'ing worker group" in c.text(), 20, "c to enter the rendezvous", alive=(c,))
    # The job is at max: c waits, and a and b keep their workers.
    assert holds_for(lambda: len(run.rows()) == attempts, 2.0), "a node beyond max started workers or restarted others"
    killed = time.time()
    run.kill("b")
    run.until(
        lambda: _since(run, "a", 2, killed) and _since(run, "c", 2, killed), 40, "a and c in a new round", alive=(a, c)
    )
    run.stop_workers()
    assert a.wait(30) == 0, a.tail()
    assert c.wait(30) == 0, c.tail()


def duplicate_node_name(run: Run) -> None:
    same = {"NODE_NAME": "twin"}
    conf = {**run.backend.cli_conf(run, True)}
    conf.pop("node_name")
    a = run.start("a", "1:2", args=("--wait-for", str(run.out / "STOP")), env=same, conf=conf)
    run.until(lambda: run.rows("a"), 30, "a's worker", alive=(a,))
    b = run.start("b", "1:2", env=same, conf=conf)
    code = b.wait(30)
    assert code != 0, f"the second agent under one name exited {code}"
    text = b.text()
    assert "DuplicateNode" in text and "node name 'twin' is held by the live agent of pod" in text, b.tail()
    assert a.running() and len(run.rows("a")) == 1, "the first agent was disturbed"
    run.stop_workers()
    assert a.wait(30) == 0, a.tail()
