"""``bench reform``'s torchft modes: what they measure in a step log, what they play of a
scenario, and how the command answers where torchft is not installed. None of these
needs torchft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.reform import cli, play, torchft_peer
from bench.reform.report import measure, metric_table
from bench.reform.torchft_measure import measure_torchft
from bench.reform.torchft_peer import timeline
from bench.reform.torchft_replica import StepRecord
from regroup.demo.analysis import RunData, ScriptedEvent
from regroup.demo.scenario import load_scenario, resolve_scenario_path

T0 = 1_700_000_000.0
STEP = 0.25
NODES = ["node-1", "node-2", "node-3"]
META: dict[str, Any] = {
    "mode": "torchft", "mode_label": "torchft", "nodes": NODES, "min_nodes": 2, "max_nodes": 3, "nproc_per_node": 1,
    "duration": 30.0, "started_at": T0, "ended_at": T0 + 30.0, "torchft": {"heartbeat_timeout_s": 5.0},
}  # fmt: skip
# node-3 is killed at 10 s and launched again at 20 s.
EVENTS = [
    ScriptedEvent(T0 + 10.0, "scenario", "lose", "abrupt loss of node-3", ("node-3",)),
    ScriptedEvent(T0 + 10.0, "torchft", "Killed", "node-3: abrupt loss: SIGKILL", ("node-3",)),
    ScriptedEvent(T0 + 20.0, "scenario", "restore", "node-3 comes back", ("node-3",)),
    ScriptedEvent(T0 + 20.0, "torchft", "Launched", "node-3: replica launched (#2)", ("node-3",)),
]


def commits(
    replicas: list[str], first: int, last: int, start: float, quorum: int, participants: int
) -> list[StepRecord]:
    """Steps ``first``..``last`` committed every ``STEP`` seconds from ``start`` (seconds after
    T0) by each of ``replicas``, each a few milliseconds after the one before."""
    return [
        {
            "time": T0 + start + (step - first) * STEP + 0.01 * i, "step": step, "participants": participants,
            "replica": replica, "quorum": quorum, "pid": 100 + i, "loss": 1.0,
        }
        for step in range(first, last + 1)
        for i, replica in enumerate(replicas)
    ]  # fmt: skip


def kill_and_rejoin() -> list[StepRecord]:
    """Three replicas until the kill; the two survivors go on from the step they had reached
    5.1 s after it (the heartbeat timed out) and train on while the fresh replica, launched
    at 20 s, starts; it recovers from a peer at 25.1 s (that step, still at 2 participants,
    heals it) and the step after is the first at 3."""
    return [
        *commits(NODES, 1, 40, 0.0, quorum=1, participants=3),  # the last at 9.75 s
        *commits(NODES[:2], 41, 80, 15.1, quorum=2, participants=2),  # the last at 24.85 s
        *commits(NODES, 81, 81, 25.1, quorum=3, participants=2),
        *commits(NODES, 82, 100, 25.35, quorum=3, participants=3),  # the last at 29.85 s
    ]


def test_a_kill_costs_until_the_first_step_at_one_replica_fewer_and_no_step() -> None:
    result = measure_torchft(kill_and_rejoin(), EVENTS, META, Path("run"))
    assert result["mode"] == "torchft (heartbeat 5 s)"
    assert result["loss_s"] == pytest.approx(5.1)
    assert result["loss_ranks"] == "2 ranks (from 3)"
    # The survivors kept their state: they went on from step 40, the last the job reached.
    assert result["loss_lost_steps"] == 0


def test_a_rejoin_counts_from_the_launch_to_the_first_step_at_the_full_count() -> None:
    result = measure_torchft(kill_and_rejoin(), EVENTS, META, Path("run"))
    assert result["grow_s"] == pytest.approx(5.35)
    assert (result["grow_from"], result["grow_ranks"], result["grow_lost_steps"]) == ("launch", "3 ranks (from 2)", 0)
    assert [(e["event"], e["measured_from"], e["measured_from_s"]) for e in result["events"]] == [
        ("lose", "kill", 10.0), ("restore", "launch", 20.0),
    ]  # fmt: skip
    # The kill stopped the survivors until the heartbeat timed out; the newcomer did not.
    assert [e["longest_gap_s"] for e in result["events"]] == pytest.approx([15.1 - 9.75, STEP])


def test_goodput_counts_the_time_between_commits_of_one_world() -> None:
    result = measure_torchft(kill_and_rejoin(), EVENTS, META, Path("run"))
    # 0 -> 9.75 s at 3, 15.1 -> 24.85 s at 2, the healing step alone, 25.35 -> 29.85 s at 3:
    # from one world's last commit to the next world's first is not training.
    assert result["goodput"] == pytest.approx((9.75 + 9.75 + 4.5) / 30.0)
    assert [(c["at_s"], c["ranks"], c["round"], c["mode"]) for c in result["world_changes"]] == [
        (15.1, "3->2", 2, "torchft"), (25.1, "2->2", 3, "torchft"), (25.35, "2->3", 3, "torchft"),
    ]  # fmt: skip


def test_every_replica_gone_loses_every_step() -> None:
    # Both survivors die too; the job starts over from step 0 in a new quorum.
    steps = [*commits(NODES, 1, 40, 0.0, 1, 3), *commits(NODES[:2], 1, 20, 15.1, 2, 2)]
    result = measure_torchft(steps, EVENTS[:2], META, Path("run"))
    assert result["loss_lost_steps"] == 40


def test_the_result_has_the_keys_of_a_demo_run_and_its_own_footnote() -> None:
    result = measure_torchft(kill_and_rejoin(), EVENTS, META, Path("run"))
    demo = measure(RunData(Path("run"), dict(META), [], [], list(EVENTS), [], []), 5.0)
    assert set(demo) <= set(result)
    rows = metric_table([result])
    grow = next(row for row in rows if row.startswith("| grow: join window closed"))
    assert "5.35 s ‡" in grow
    assert any(row.startswith("‡ torchft has no grow plan") for row in rows)


def test_the_torchft_modes_play_what_torchft_can_and_say_what_they_cannot() -> None:
    actions, not_played = timeline(load_scenario(resolve_scenario_path("default")))
    assert [(a.at, a.kind, a.event.nodes) for a in actions] == [
        (20.0, "record", ("node-2",)),
        (50.0, "kill", ("node-2",)),  # no planned leave: at the end of the 30 s notice
        (55.0, "record", ("node-3",)), (55.0, "kill", ("node-3",)),
        (85.0, "record", ("node-2", "node-3")), (85.0, "launch", ("node-2", "node-3")),
        (130.0, "record", ("node-1",)), (130.0, "flaky", ("node-1",)),
    ]  # fmt: skip
    assert not_played == []
    drain = load_scenario(resolve_scenario_path("drain"))
    assert all("torchft has no eviction, drain or cordon" in item for item in timeline(drain)[1])


def test_modes_torchft_without_torchft_names_the_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torchft_peer, "installed", lambda: False)
    assert cli.main(["--modes", "regroup,torchft", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "torchft is not installed" in error and "pip install torchft==0.2.0" in error
    assert not any(tmp_path.iterdir())


def test_the_default_modes_leave_torchft_out_where_it_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torchft_peer, "installed", lambda: False)
    assert play.default_modes()[0] == ("regroup", "regroup-spares", "regroup-restart", "torchrun-c10d")
    # A scenario that does not exist stops the command right after the modes are chosen.
    assert cli.main(["--scenario", "no-such-scenario", "--out", str(tmp_path)]) == 2
    said = capsys.readouterr().out.splitlines()
    hint = torchft_peer.INSTALL_HINT
    assert said == [f"bench reform: torchft is not installed: {hint}; the default modes leave torchft out"]
    monkeypatch.setattr(torchft_peer, "installed", lambda: True)
    assert play.default_modes() == (play.MODES, "")
