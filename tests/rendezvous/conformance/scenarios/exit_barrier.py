"""torchrun's exit barrier (``local_elastic_agent_test.py``): workers that finish apart pass
it within its timeout, or leave at timeout 0 without a restart; a barrier that fails does
not fail the job; failed workers skip it."""

from __future__ import annotations

from tests.rendezvous.conformance.scenario_run import Run


def drift_success(run: Run) -> None:
    go = run.out / "go"
    patch = {"exit_barrier_timeout": 20}
    # In c10d the first agent hosts the store; it finishes last.
    a = run.start("a", "2:2", args=("--wait-for", str(go)), patch=patch)
    b = run.start("b", "2:2", patch=patch)
    run.until(lambda: "other agents to finish" in b.text(), 40, "b in the exit barrier", alive=(a, b))
    go.touch()
    assert a.wait(30) == 0, a.tail()
    assert b.wait(30) == 0, b.tail()
    for agent in (a, b):
        passed = "Done waiting for other agents" in agent.text()
        assert passed, f"{agent.label} did not pass the exit barrier\n{agent.tail()}"


def drift_fail(run: Run) -> None:
    go = run.out / "go"
    patch = {"exit_barrier_timeout": 0}
    a = run.start("a", "2:2", args=("--wait-for", str(go)), patch=patch)
    b = run.start("b", "2:2", patch=patch)
    assert b.wait(40) == 0, b.tail()
    go.touch()  # a's worker ends only after b's agent is gone
    assert a.wait(30) == 0, a.tail()
    assert len(run.rows("a")) == 1, "a restarted its workers when b finished"


def barrier_failure(run: Run) -> None:
    agent = run.start("a", "1", patch={"exit_barrier_raises": True})
    assert agent.wait(30) == 0, agent.tail()
    assert "Error waiting on exit barrier" in agent.text(), agent.tail()


def no_barrier_on_failure(run: Run) -> None:
    # Odd ranks fail, even ones would run on: both agents fail at once, no exit barrier.
    args = ("--fail-ranks", "1,3", "--wait-for", str(run.out / "never"))
    patch = {"exit_barrier_timeout": 300}
    a = run.start("a", "2:2", nproc=2, args=args, patch=patch)
    b = run.start("b", "2:2", nproc=2, args=args, patch=patch)
    codes = (a.wait(40), b.wait(40))
    assert all(code != 0 for code in codes), f"exit codes {codes}"
