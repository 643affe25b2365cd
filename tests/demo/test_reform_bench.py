"""What ``python -m bench reform`` reads from recorded runs: seconds from a scripted resize
to training at the new size, steps lost, and how each new world was reached."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.reform import cli
from bench.reform.play import MODES, VARIANTS, fitting
from bench.reform.report import METRICS, event_table, measure, metric_table, versus, world_change_table
from regroup.demo.analysis import load_run
from regroup.demo.resizes import first_progress_at, reform_latencies, reform_plans, scripted_resizes, world_changes
from regroup.demo.scenario import load_scenario, resolve_scenario_path, with_overrides
from tests.demo.recorded import T0, progress_rows, spares_run, write_run

JOIN_WINDOW = 5.0
# Three nodes: a reclaim of node-2 (10 s notice), the loss of node-3, both back, node-1 flaky.
EVENTS = [
    {"time": 10.0, "source": "scenario", "reason": "reclaim", "message": "reclaim notice on node-2", "nodes": ["node-2"]},
    {"time": 10.0, "source": "cluster", "reason": "ReclaimNotice", "message": "node goes away in 10s", "nodes": ["node-2"]},
    {"time": 30.0, "source": "scenario", "reason": "lose", "message": "abrupt loss of node-3", "nodes": ["node-3"]},
    {"time": 45.0, "source": "scenario", "reason": "restore", "message": "node-2, node-3 come back",
     "nodes": ["node-2", "node-3"]},
    {"time": 65.0, "source": "scenario", "reason": "flaky", "message": "node-1 starts crashing", "nodes": ["node-1"]},
]  # fmt: skip
IN_PLACE = {"process_group": 0.2, "reshard": 0.5, "first_step": 0.4}
RESTART = {"startup": 5.0, "process_group": 0.3, "load": 1.0, "first_step": 0.4}


def worlds(
    rows: list[tuple[int, int, int, float, int, int, str, dict[str, float]]],
) -> list[dict[str, Any]]:
    """(resumed_from, first step, last step, start s, ranks, round, reform mode, resume phases) -> progress."""
    out = []
    for resumed_from, first, last, start, ranks, round_, mode, phases in rows:
        for row in progress_rows([(resumed_from, first, last, start, ranks)]):
            out.append({**row, "round": round_, "reform_mode": mode, "resume_phases": phases})
    return out


def plan(generation: int, cause: str, decided_at: float, round_after: int, **extra: Any) -> dict[str, Any]:
    """A plan as the recorder writes it once done (``plans.jsonl``)."""
    return {
        "seen": T0 + decided_at + 1, "generation": generation, "cause": cause, "planned": cause != "node-lost",
        "phase": "done", "reason": "test", "nodes_before": [], "nodes_after": [], "trace_id": "0" * 32,
        "detected_at": T0 + decided_at, "decided_at": T0 + decided_at, "round_after": round_after,
        "outcome": "completed", **extra,
    }  # fmt: skip


def _last_step(first: int, start: float, until: float) -> int:
    """The last step of a world that trains from ``start`` until ``until`` (0.5 s a step)."""
    return first + int((until - start) / 0.5)


def controlled_run(root: Path, mode: str, delay: float) -> Path:
    """A controlled run whose every re-form trains again ``delay`` seconds after it started."""
    reform = "in-place" if mode == "regroup" else "restart"
    phases = IN_PLACE if mode == "regroup" else RESTART
    end = 80.0 + 2 * delay
    # Planned reclaim at 10 s: checkpoint at step 20, no step lost; trains until just before the loss.
    reclaimed = _last_step(21, 10.0 + delay, 29.0)
    # Abrupt loss at 30 s: back to the checkpoint of step 40.
    lost = _last_step(41, 30.0 + delay, 49.0)
    # The grow's join window closes at 50 s; node-1 crashes the world just before 65 s.
    grown = _last_step(lost + 1, 50.0 + delay, 64.5)
    # Once node-1 is cordoned, the job goes on at 2 from the newest checkpoint.
    checkpoint = max(lost, grown // 20 * 20)
    progress = worlds([
        (0, 1, 20, 0.0, 3, 1, "", {}),
        (20, 21, reclaimed, 10.0 + delay, 2, 2, reform, phases),
        (40, 41, lost, 30.0 + delay, 1, 3, reform, phases),
        (lost, lost + 1, grown, 50.0 + delay, 3, 4, reform, phases),
        (checkpoint, checkpoint + 1, _last_step(checkpoint + 1, 70.0 + delay, end - 0.5), 70.0 + delay, 2, 5, "restart", RESTART),
    ])  # fmt: skip
    root = write_run(root, mode, progress, EVENTS, end)
    plans = [
        plan(1, "reclaim", 10.1, 2, mode=reform, resume_phases=phases),
        plan(2, "node-lost", 30.1, 3, mode=reform, resume_phases=phases),
        plan(3, "grow", 50.0, 4, mode=reform, resume_phases=phases),
        plan(4, "restart-storm", 66.0, 5, mode="restart", resume_phases=RESTART),
    ]
    (root / "plans.jsonl").write_text("".join(json.dumps(p) + "\n" for p in plans))
    return root


def torchrun_run(root: Path, regrows: bool = False) -> Path:
    """Plain torchrun: the reclaimed node dies at 20 s and training stops (for good, or
    until both nodes are back, ``regrows``)."""
    rows = [(0, 1, 40, 0.0, 3, 0, "", {})]
    if regrows:
        rows.append((20, 21, 40, 58.0, 3, 0, "", {}))
    return write_run(root, "torchrun-c10d", worlds(rows), EVENTS, 80.0, latest_checkpoint_step=20)


@pytest.fixture
def in_place(tmp_path: Path) -> Path:
    return controlled_run(tmp_path / "run", "regroup", delay=1.5)


@pytest.fixture
def restart(tmp_path: Path) -> Path:
    return controlled_run(tmp_path / "run" / "regroup-restart", "regroup-restart", delay=7.5)


def test_the_script_sets_the_size_each_event_should_reach(in_place: Path) -> None:
    resizes = scripted_resizes(load_run(in_place))
    assert [(r.event.reason, r.ranks_before, r.ranks_after) for r in resizes] == [
        ("reclaim", 3, 2), ("lose", 2, 1), ("restore", 1, 3), ("flaky", 3, 3),
    ]  # fmt: skip


def test_latency_runs_from_taint_kill_and_closed_join_window_to_the_first_step_at_the_new_size(in_place: Path) -> None:
    latencies = reform_latencies(load_run(in_place), JOIN_WINDOW)
    assert [(lat.event.reason, lat.start_from, lat.ranks_after) for lat in latencies] == [
        ("reclaim", "taint", 2), ("lose", "kill", 1), ("restore", "grow plan decided", 3),
    ]  # fmt: skip
    assert [lat.start - T0 for lat in latencies] == pytest.approx([10.0, 30.0, 50.0])
    assert [lat.seconds for lat in latencies] == pytest.approx([1.5, 1.5, 1.5])
    # The reclaim was checkpointed first; the loss went back from step 56 to step 40.
    assert [lat.lost_steps for lat in latencies] == [0, 16, 0]


def test_without_a_controller_the_grow_counts_from_the_restore_plus_the_join_window(tmp_path: Path) -> None:
    run = load_run(torchrun_run(tmp_path / "run", regrows=True))
    grow = next(lat for lat in reform_latencies(run, JOIN_WINDOW) if lat.event.reason == "restore")
    assert grow.start_from == "restore + join window"
    assert grow.seconds == pytest.approx(58.0 - (45.0 + JOIN_WINDOW))


def test_a_size_that_never_came_back_before_the_next_event_is_never(tmp_path: Path) -> None:
    run = load_run(torchrun_run(tmp_path / "run"))
    latencies = reform_latencies(run, JOIN_WINDOW)
    assert [lat.seconds for lat in latencies] == [None, None, None]
    # The node died with the job 20 steps past its checkpoint.
    assert latencies[0].lost_steps == 20
    # Training at 3 ranks came back, but only after the next scripted event: not the reclaim's doing.
    regrown = load_run(torchrun_run(tmp_path / "regrown", regrows=True))
    assert first_progress_at(regrown, T0 + 10.0, 3, before=T0 + 30.0) is None
    assert first_progress_at(regrown, T0 + 10.0, 3) is not None


def test_a_world_already_at_the_target_size_does_not_count(in_place: Path) -> None:
    run = load_run(in_place)
    # At 12 s the job already trains at 2 ranks; the next world of 2 ranks starts at 71.5 s.
    reached = first_progress_at(run, T0 + 12.0, 2)
    assert reached is not None and reached.time - T0 == pytest.approx(71.5)


def test_the_trainer_says_how_each_world_was_reached_not_the_plan(in_place: Path) -> None:
    # The controller finished the reclaim's plan on the old world's progress and copied it.
    plans = [json.loads(line) for line in (in_place / "plans.jsonl").read_text().splitlines()]
    plans[0] |= {"mode": "", "resume_phases": {"first_step": 9.9}}
    (in_place / "plans.jsonl").write_text("".join(json.dumps(p) + "\n" for p in plans))
    run = load_run(in_place)
    assert [p.cause for p in reform_plans(run)] == ["reclaim", "node-lost", "grow", "restart-storm"]
    changes = world_changes(run)
    assert [(c.cause, c.ranks_before, c.ranks_after, c.mode) for c in changes] == [
        ("reclaim", 3, 2, "in-place"), ("node-lost", 2, 1, "in-place"), ("grow", 1, 3, "in-place"),
        ("restart-storm", 3, 2, "restart"),
    ]  # fmt: skip
    assert changes[0].resume_phases == IN_PLACE and changes[0].plan_mode == ""
    assert changes[-1].resume_phases == RESTART
    table = world_change_table([measure(run, JOIN_WINDOW)])
    assert "| regroup | 11.5 | 2 | reclaim (planned) | 3->2 | in-place (plan: none) |" in table[2]


def test_only_the_last_record_of_each_plan_counts(in_place: Path) -> None:
    first = plan(9, "grow", 70.0, 0) | {"phase": "checkpoint", "outcome": ""}
    last = plan(9, "grow", 70.0, 6) | {"outcome": "superseded"}
    with (in_place / "plans.jsonl").open("a") as out:
        out.write(json.dumps(first) + "\n" + json.dumps(last) + "\n")
    plans = reform_plans(load_run(in_place))
    assert [(p.generation, p.round_after, p.outcome) for p in plans][-1] == (9, 6, "superseded")
    assert len(plans) == 5


def test_the_flaky_node_costs_its_downtime_unless_the_job_had_stopped_already(in_place: Path, tmp_path: Path) -> None:
    ours = measure(load_run(in_place), JOIN_WINDOW)
    # The crash stopped the world at step 103 at 64.5 s; back at 71.5 s from step 100.
    assert ours["flaky_s"] == pytest.approx(71.5 - 64.5)
    assert ours["flaky_lost_steps"] == 103 - 100
    theirs = measure(load_run(torchrun_run(tmp_path / "anchor")), JOIN_WINDOW)
    assert theirs["flaky_s"] is None and theirs["flaky_note"] == "not training when the node turned flaky"


def test_the_table_gives_each_mode_as_a_ratio_to_in_place(in_place: Path, restart: Path, tmp_path: Path) -> None:
    results = [measure(load_run(d), JOIN_WINDOW) for d in (in_place, restart, torchrun_run(tmp_path / "anchor"))]
    assert [r["mode"] for r in results] == ["regroup", "regroup-restart", "torchrun-c10d"]
    assert results[1]["reclaim_s"] == pytest.approx(7.5)
    rows = {row.split(" | ")[0].removeprefix("| "): row for row in metric_table(results)}
    reclaim = "planned reclaim: taint -> training at 2 ranks (from 3)"
    assert rows[reclaim] == f"| {reclaim} | <= 1.5 s | 1.50 s | 7.50 s (5.0x) | never (-) | yes |"
    assert "| not training (-) |" in rows["flaky node: seconds without training"]
    assert rows["goodput (useful training time / wall time)"].endswith("| **no** |")
    changes = world_change_table(results)
    assert (
        "| regroup | 11.5 | 2 | reclaim (planned) | 3->2 | in-place "
        "| process_group 0.20, reshard 0.50, first_step 0.40 = 1.10 |"
    ) in changes
    assert (
        "| regroup-restart | 17.5 | 2 | reclaim (planned) | 3->2 | restart "
        "| startup 5.00, process_group 0.30, load 1.00, first_step 0.40 = 6.70 |"
    ) in changes


def test_ratios_need_a_reference_value() -> None:
    seconds, = (m for m in METRICS if m.key == "grow_s")
    assert versus(seconds, 1.3, 8.9) == "8.90 s (6.8x)"
    assert versus(seconds, None, 8.9) == "8.90 s (-)"
    assert versus(seconds, 0.0, 8.9) == "8.90 s (-)"
    assert versus(seconds, 1.3, None) == "never (-)"


def test_quick_drops_the_events_that_no_longer_fit() -> None:
    scenario = with_overrides(load_scenario(resolve_scenario_path("default")), duration="110s")
    quick, dropped = fitting(scenario)
    assert [e.action for e in quick.events] == ["reclaim", "lose", "restore"]
    assert dropped == ["node-1 starts crashing its rank every 5 steps at 130s"]
    full, none = fitting(load_scenario(resolve_scenario_path("default")))
    assert len(full.events) == 4 and none == []


def test_a_new_world_repeating_the_last_step_of_the_old_one_is_not_a_repeat(tmp_path: Path) -> None:
    # A world of 3 crashes right after its first step; a world of 2 resumes from the same
    # checkpoint, and its first record has the same step and resume point.
    progress = worlds([
        (0, 1, 20, 0.0, 3, 1, "", {}),
        (20, 21, 21, 10.5, 3, 2, "in-place", IN_PLACE),
        (20, 21, 30, 15.0, 2, 3, "restart", RESTART),
    ])  # fmt: skip
    run = load_run(write_run(tmp_path / "run", "regroup", progress, EVENTS[:1], 20.0))
    reached = first_progress_at(run, T0 + 12.0, 2)
    assert reached is not None and (reached.time - T0, reached.step) == (15.0, 21)
    assert [c.mode for c in world_changes(run)] == ["in-place", "restart"]


def test_each_event_shows_the_longest_stand_still_until_the_next(in_place: Path, tmp_path: Path) -> None:
    """In place, training stood still only for the re-form (from the last record before the
    event to the first after it: 9.5 -> 11.5 s, and 29.0 -> 31.5 s); on plain torchrun it
    stopped for good at the reclaim: its stand-still lasts to the next event."""
    ours = measure(load_run(in_place), JOIN_WINDOW)
    assert [(e["event"], e["longest_gap_s"]) for e in ours["events"][:2]] == [
        ("reclaim", pytest.approx(2.0)), ("lose", pytest.approx(2.5)),
    ]  # fmt: skip
    theirs = measure(load_run(torchrun_run(tmp_path / "torchrun")), JOIN_WINDOW)
    reclaim = theirs["events"][0]
    assert reclaim["event"] == "reclaim" and reclaim["longest_gap_s"] == pytest.approx(30.0 - 19.5, abs=0.6)


SPARE_META = {"nodes": ["node-1", "node-2", "node-3", "node-4", "node-5"], "min_nodes": 2, "max_nodes": 4}


def replaced_run(root: Path) -> Path:
    """node-3 is lost at 10 s with node-5 waiting: node-5 takes its position in round 2,
    the same 4 ranks, from its buddy's copy one step back."""
    progress = worlds([(0, 1, 20, 0.0, 4, 1, "", {}), (19, 20, 40, 11.2, 4, 2, "in-place", IN_PLACE)])
    lose = {"time": 10.0, "source": "scenario", "reason": "lose", "message": "abrupt loss of node-3", "nodes": ["node-3"]}
    root = write_run(root, "regroup", progress, [lose], 25.0, meta=SPARE_META)
    replaced = plan(1, "node-lost", 10.2, 2, mode="in-place", strategy="replace", replaced={"node-3": "node-5"})
    (root / "plans.jsonl").write_text(json.dumps(replaced) + "\n")
    return root


def test_the_spares_mode_is_the_in_place_mode_with_two_more_nodes_kept_waiting() -> None:
    assert MODES[:2] == ("regroup", "regroup-spares")
    default = load_scenario(resolve_scenario_path("default"))
    spares = VARIANTS["regroup-spares"]
    played = spares.apply(default)
    assert spares.mode == "regroup"
    assert played.nodes == (*default.nodes, "node-5", "node-6")
    assert (played.job.max_nodes, played.job.spare_nodes) == (4, 2)
    assert played.events == default.events
    no_snapshot = VARIANTS["regroup-no-snapshot"].apply(default)
    assert no_snapshot.nodes == default.nodes and no_snapshot.trainer["snapshot"] == {"every": 0}


def test_a_mode_name_the_bench_does_not_know_is_refused_naming_the_spares_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["--modes", "regroup,spare", "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "unknown mode 'spare'" in error and "regroup-spares" in error


def test_with_a_spare_a_reclaim_and_a_loss_are_measured_to_the_first_step_at_the_same_size(tmp_path: Path) -> None:
    migrated = measure(load_run(spares_run(tmp_path / "migrated", "regroup-spares")), JOIN_WINDOW)
    # Taint at 10 s, first step on the spare (round 2, 4 ranks) at 11.7 s; the loss after it
    # found no spare left and shrank the job: its own row.
    assert migrated["migrate_s"] == pytest.approx(1.7) and migrated["migrate_lost_steps"] == 0
    assert migrated["migrate_ranks"] == "4 ranks (from 4)" and "reclaim_s" not in migrated
    assert migrated["loss_ranks"] == "3 ranks (from 4)" and migrated["loss_s"] == pytest.approx(2.0)
    replaced = measure(load_run(replaced_run(tmp_path / "replaced")), JOIN_WINDOW)
    assert replaced["replace_s"] == pytest.approx(1.2) and replaced["replace_lost_steps"] == 1
    assert "loss_s" not in replaced
    assert [w["strategy"] for w in replaced["world_changes"]] == ["replace node-3->node-5"]


def test_the_spares_rows_render_beside_the_elastic_mode(in_place: Path, tmp_path: Path) -> None:
    elastic = measure(load_run(in_place), JOIN_WINDOW)
    spares = measure(load_run(spares_run(tmp_path / "spares")), JOIN_WINDOW)
    spares["mode"] = "regroup-spares"
    rows = {row.split(" | ")[0].removeprefix("| "): row for row in metric_table([elastic, spares])}
    migrate = "planned reclaim, a spare waiting: taint -> first step on the spare, at 4 ranks (from 4)"
    assert rows[migrate] == f"| {migrate} | <= 1 s | no spare | 1.70 s (-) |  |"
    assert rows["planned reclaim, a spare waiting: steps lost"] == (
        "| planned reclaim, a spare waiting: steps lost |  | no spare | 0 (-) |  |"
    )
    # The elastic rows: the spares mode went through other sizes, and says which.
    loss = rows["abrupt loss: kill -> training at 1 ranks (from 2)"]
    assert "| 2.00 s (1.3x), at 3 ranks (from 4) |" in loss
    reclaim = "planned reclaim: taint -> training at 2 ranks (from 3)"
    assert rows[reclaim] == f"| {reclaim} | <= 1.5 s | 1.50 s | a spare took over (-) | yes |"
    assert not any(name.startswith("abrupt loss, a spare waiting") for name in rows), "no mode replaced a loss"
    assert any("| regroup-spares | reclaim node-2 | 10.0 | taint |" in row for row in event_table([elastic, spares]))
