"""torchrun launches and their exits (``run_test.py``, ``local_elastic_agent_test.py``): a
c10d launch line with only the backend changed, a worker or the agent raising, restarts
that recover and restarts spent, the ranks of two agents, a gloo group across agents."""

from __future__ import annotations

import json
from typing import Any

from tests.rendezvous.conformance.scenario_run import TORCH_WORKER, Run
from tests.rendezvous.conformance.torch_worker import RAISED


ENV_TORCH_SETS = (
    "RANK", "LOCAL_RANK", "ROLE_RANK", "ROLE_NAME", "GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)  # fmt: skip


def _ranks(rows: list[dict[str, Any]]) -> list[int]:
    return sorted(int(r["RANK"]) for r in rows)


def launch_line_unchanged(run: Run) -> None:
    # c10d's launch line as a user has it, with only --rdzv-backend/--rdzv-endpoint changed.
    conf = {
        "join_timeout": "20", "last_call_timeout": "1", "close_timeout": "3", "read_timeout": "10",
        "keep_alive_interval": "1", "keep_alive_max_attempt": "3", "is_host": "1", "use_libuv": "true",
    }  # fmt: skip
    agent = run.start("a", "1:2", nproc=2, conf=conf)
    assert agent.wait(40) == 0, agent.tail()
    rows = run.rows("a")
    assert _ranks(rows) == [0, 1], rows
    assert {r["WORLD_SIZE"] for r in rows} == {"2"}
    missing = sorted({k for r in rows for k in ENV_TORCH_SETS if r.get(k) is None})
    assert not missing, f"workers lack {missing}"


def worker_raises(run: Run) -> None:
    error_file = run.out / "agent-error.json"
    env = {"TORCHELASTIC_ERROR_FILE": str(error_file)}
    agent = run.start("a", "1:2", script=TORCH_WORKER, args=("raise",), env=env)
    code = agent.wait(90)
    assert code == 1, f"exit {code}"
    assert "ChildFailedError" in agent.text(), agent.tail()
    data = json.loads(error_file.read_text())
    message = data["message"]["message"] if isinstance(data["message"], dict) else data["message"]
    assert RAISED in message, f"the agent's error file says {message!r}"


def agent_raises(run: Run) -> None:
    agent = run.start("a", "1:2", patch={"agent_run_raises": "agent failed on purpose"})
    code = agent.wait(30)
    assert code == 1, f"exit {code}"
    assert "AgentFailure: agent failed on purpose" in agent.text(), agent.tail()


def restart_recovers(run: Run) -> None:
    agent = run.start("a", "1", nproc=2, max_restarts=3, args=("--fail-ranks", "1", "--fail-below", "1"))
    assert agent.wait(40) == 0, agent.tail()
    rows = run.rows("a")
    by_restart: dict[str, list[int]] = {}
    for r in rows:
        by_restart.setdefault(r["TORCHELASTIC_RESTART_COUNT"], []).append(int(r["RANK"]))
    assert sorted(by_restart) == ["0", "1"], f"attempts {by_restart}"
    assert sorted(by_restart["1"]) == [0, 1]


def restarts_exhausted(run: Run) -> None:
    agent = run.start("a", "1", nproc=2, max_restarts=2, args=("--fail-ranks", "1"))
    assert agent.wait(40) == 1, agent.tail()
    restarts = sorted({r["TORCHELASTIC_RESTART_COUNT"] for r in run.rows("a")})
    assert restarts == ["0", "1", "2"], f"attempts {restarts} (max_restarts 2: three in all)"


def ranks_of_two_agents(run: Run) -> None:
    a = run.start("a", "2:2", nproc=1)
    b = run.start("b", "2:2", nproc=2)
    assert a.wait(40) == 0, a.tail()
    assert b.wait(40) == 0, b.tail()
    rows = run.rows()
    assert _ranks(rows) == [0, 1, 2], rows
    assert {r["WORLD_SIZE"] for r in rows} == {"3"} and {r["ROLE_WORLD_SIZE"] for r in rows} == {"3"}
    assert {r["GROUP_WORLD_SIZE"] for r in rows} == {"2"}
    for label, size in (("a", 1), ("b", 2)):
        mine = run.rows(label)
        ranks = _ranks(mine)
        assert ranks == list(range(ranks[0], ranks[0] + size)), f"{label}: ranks {ranks} not consecutive"
        assert len({r["GROUP_RANK"] for r in mine}) == 1 and {r["LOCAL_WORLD_SIZE"] for r in mine} == {str(size)}
    assert len({r["GROUP_RANK"] for r in rows}) == 2


def gloo_sum(run: Run) -> None:
    a = run.start("a", "2:2", script=TORCH_WORKER, args=("sum",))
    b = run.start("b", "2:2", script=TORCH_WORKER, args=("sum",))
    assert a.wait(90) == 0, a.tail()
    assert b.wait(30) == 0, b.tail()
    sums = [json.loads((run.out / f"sum-{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["sum"] for s in sums] == [1.0, 1.0], sums
