"""What ``python -m bench script`` reads from the two variants' logs and how it sums them up:
rank 0's steps, CPU from /proc samples, medians over rounds and the ratios (no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.script import (
    _check_complete,
    CpuSample,
    Stamp,
    anchor_stamps,
    api_stamps,
    compare,
    cpu_between,
    disturbed,
    first_loss,
    global_batch_of,
    interpolate,
    same_training,
    summarize,
    table,
    thread_cpu,
)

ANCHOR_LOG = "\n".join(
    [
        "W1126 01:42:20.000000 123 torch/distributed/run.py:792] Setting OMP_NUM_THREADS environment variable",
        "Transformer(",
        '{"step": 2, "t": 1000.5, "cpu_s": 3.25, "loss": -0.1, "pid": 42}',
        '{"step": 1, "t": 1000.0, "cpu_s": 3.0, "loss": 0.0, "pid": 42}',
        '{"step": 3, "t": not json',
    ]
)


def api_event(step: int, at: str, cpu: float, **extra: object) -> str:
    record = {"step": step, "loss": 1.0, "cpu_s": cpu, "event": "step", "rank": 0, "timestamp": at, **extra}
    return json.dumps(record)


def stamps(times: list[float], cpus: list[float]) -> list[Stamp]:
    return [Stamp(i + 1, t, c) for i, (t, c) in enumerate(zip(times, cpus, strict=True))]


def test_the_anchor_lines_are_read_in_step_order_among_other_output() -> None:
    assert anchor_stamps(ANCHOR_LOG) == [Stamp(1, 1000.0, 3.0), Stamp(2, 1000.5, 3.25)]


def test_the_api_step_events_give_rank_0_wall_time_from_the_iso_timestamp() -> None:
    log = "\n".join(
        [
            '{"event": "training", "world_size": 4, "micro_batch": 8, "accumulation": 1, "rank": 0}',
            api_event(1, "2026-11-26T01:42:39.000000Z", 3.5),
            api_event(2, "2026-11-26T01:42:39.250000Z", 3.6, rank=1),  # not rank 0's
            "Running on device cpu",
            api_event(2, "2026-11-26T01:42:39.500000Z", 3.75),
            '{"step": 2, "event": "finished", "rank": 0, "timestamp": "2026-11-26T01:42:45Z"}',
        ]
    )
    found = api_stamps(log)
    assert [s.step for s in found] == [1, 2]
    assert found[1].t - found[0].t == pytest.approx(0.5)
    assert [s.cpu_s for s in found] == [3.5, 3.75]
    assert global_batch_of(log) == 32


def test_a_repeated_step_keeps_its_last_record() -> None:
    log = "\n".join([api_event(5, "2026-01-01T00:00:01Z", 1.0), api_event(5, "2026-01-01T00:00:02Z", 2.0)])
    assert api_stamps(log) == [Stamp(5, api_stamps(log)[0].t, 2.0)]
    assert api_stamps(log)[0].t % 60 == pytest.approx(2.0)


def test_warm_up_steps_are_dropped_and_the_window_gives_median_and_mean() -> None:
    # Steps end at 0, 10 (warm-up), then 10.4, 10.6, 10.8, 11.8: gaps 0.4, 0.2, 0.2, 1.0 after warm-up.
    times = [0.0, 10.0, 10.4, 10.6, 10.8, 11.8]
    cpus = [5.0, 7.0, 7.1, 7.15, 7.2, 7.45]
    row = summarize(stamps(times, cpus), warmup=1)
    assert row["steps"] == 4 and row["first_step"] == 2
    assert row["step_s"] == pytest.approx(0.3)  # median of 0.2, 0.2, 0.4, 1.0
    assert row["step_s_mean"] == pytest.approx(1.8 / 4)
    assert row["cpu_s"] == pytest.approx(0.45 / 4)
    assert row["cpu_s_median"] == pytest.approx(0.075)  # median of 0.1, 0.05, 0.05, 0.25
    assert "cpu_all_s" not in row


def test_too_few_steps_after_warm_up_is_an_error_that_says_so() -> None:
    with pytest.raises(ValueError, match="too few after 3 warm-up steps"):
        summarize(stamps([0.0, 1.0, 2.0, 3.0], [0.0] * 4), warmup=3)


def test_cpu_samples_are_interpolated_at_the_window_ends() -> None:
    assert interpolate([(0.0, 0.0), (2.0, 4.0)], 0.5) == pytest.approx(1.0)
    assert interpolate([(0.0, 1.0), (2.0, 4.0)], -1.0) == 1.0  # held flat before the first sample
    assert interpolate([(0.0, 1.0), (2.0, 4.0)], 9.0) == 4.0  # and after the last
    samples = [
        CpuSample(0.0, {1: 0.0, 2: 10.0}, {1: 0.0, 2: 9.0}, agents=100.0),
        CpuSample(1.0, {1: 1.0, 2: 10.5}, {1: 0.5, 2: 9.5}, agents=100.2),
        # Worker 2 is gone: it keeps its last value. Worker 3 shows up: it counts from 0.
        CpuSample(2.0, {1: 2.0, 3: 0.4}, {1: 1.0, 3: 0.4}, agents=100.4),
    ]
    spent = cpu_between(samples, 0.5, 2.0)
    assert spent["1"] == pytest.approx(1.5)
    assert spent["main:1"] == pytest.approx(0.75)
    assert spent["2"] == pytest.approx(0.25)
    assert spent["3"] == pytest.approx(0.4)
    assert spent["all"] == pytest.approx(1.5 + 0.25 + 0.4)
    assert spent["agents"] == pytest.approx(0.3)


def test_with_samples_a_run_also_gives_all_ranks_cpu_rank_0_off_its_main_thread_and_others_load() -> None:
    times = [0.0, 1.0, 2.0, 3.0]
    samples = [
        CpuSample(t, {7: 2 * t, 8: 3 * t}, {7: 1.5 * t, 8: 3 * t}, agents=0.1 * t, machine=6.1 * t, steal=0.2 * t)
        for t in times
    ]
    row = summarize(stamps(times, [2 * t for t in times]), warmup=1, samples=samples, rank0=7)
    assert row["others_cores"] == pytest.approx(1.0)  # the machine's 6.1 cores less the workers' 5 and agents' 0.1
    assert row["steal_cores"] == pytest.approx(0.2)
    assert row["cpu_all_s"] == pytest.approx(5.0)
    assert row["cpu_rank0_proc_s"] == pytest.approx(2.0)
    assert row["cpu_background_s"] == pytest.approx(0.5)
    assert row["cpu_agents_s"] == pytest.approx(0.1)


def test_rounds_give_medians_the_ratio_of_medians_and_the_range_of_paired_ratios() -> None:
    rounds = [
        {"without": {"step_s": 0.100, "cpu_s": 0.050}, "with": {"step_s": 0.102, "cpu_s": 0.055}},
        {"without": {"step_s": 0.110, "cpu_s": 0.050}, "with": {"step_s": 0.110, "cpu_s": 0.060}},
        {"without": {"step_s": 0.120, "cpu_s": 0.052}, "with": {"step_s": 0.130, "cpu_s": 0.052}},
    ]
    summary = compare(rounds)
    assert set(summary) == {"step_s", "cpu_s"}  # only what every run has
    step = summary["step_s"]
    assert (step["without"], step["with"]) == (pytest.approx(0.110), pytest.approx(0.110))
    assert step["ratio"] == pytest.approx(1.0)
    assert step["ratio_range"] == [pytest.approx(1.0), pytest.approx(0.130 / 0.120)]
    assert step["without_range"] == [0.100, 0.120] and step["with_range"] == [0.102, 0.130]
    cpu = summary["cpu_s"]
    assert cpu["ratio"] == pytest.approx(0.055 / 0.050)
    assert cpu["delta"] == pytest.approx(0.005)
    lines = table(summary)
    assert len(lines) == 4
    assert lines[2].startswith("| step time (median step) | 110.0 ms (100.0 ms – 120.0 ms) | 110.0 ms")
    assert "| +5.0 ms | 1.100 | 1.000 – 1.200 |" in lines[3]


def test_threads_are_summed_by_kind_between_the_window_ends() -> None:
    samples = [
        {"t": 0.0, "threads": {"1": ["MainThread", 1.0], "2": ["regroup-snapshot_0", 0.0], "3": ["native", 0.0]}},
        {"t": 1.0, "threads": {"1": ["MainThread", 2.0], "2": ["regroup-snapshot_0", 0.1], "3": ["native", 0.5],
                               "4": ["Thread-7 (run)", 0.2], "5": ["regroup-snapshot_1", 0.2]}},
        {"t": 2.0, "threads": {"1": ["MainThread", 3.0], "4": ["Thread-7 (run)", 0.4], "5": ["regroup-snapshot_1", 0.4]}},
    ]  # fmt: skip
    spent = thread_cpu(samples, 0.5, 2.0)
    assert spent["MainThread"] == pytest.approx(1.5)
    # Thread 2 ended after 0.1 s of CPU (0.05 of it after t=0.5); thread 5 counts from 0
    # at the sample before it was first seen.
    assert spent["regroup-snapshot"] == pytest.approx(0.05 + 0.3)
    assert spent["native"] == pytest.approx(0.25)
    assert spent["(run)"] == pytest.approx(0.3)


def test_both_variants_give_the_first_steps_loss_averaged_over_ranks() -> None:
    anchor = "\n".join(
        ['{"rank": 1, "first_loss": -3.0}', '{"rank": 0, "first_loss": -1.0}', ANCHOR_LOG]
    )
    assert first_loss(anchor, world=2) == pytest.approx(-2.0)
    assert first_loss(anchor, world=4) is None  # two ranks' lines missing: no mean to compare
    api = "\n".join([api_event(2, "2026-01-01T00:00:02Z", 2.0, loss=-5.0), api_event(1, "2026-01-01T00:00:01Z", 1.0, loss=-2.0)])
    assert first_loss(api) == -2.0
    assert first_loss("no steps") is None
    assert same_training(-9022.085, -9022.0851)
    assert not same_training(-9022.085, -0.0172)
    assert not same_training(None, -1.0)


def test_a_round_is_disturbed_when_any_run_saw_other_processes_above_the_limit() -> None:
    pair = {"without": {"others_cores": 0.05}, "with": {"others_cores": 0.6}}
    assert disturbed(pair, 0.2) == 0.6
    assert disturbed(pair, 1.0) is None
    assert disturbed(pair, None) is None  # no limit: never run again


def test_a_run_counts_when_every_step_was_logged_even_if_a_process_failed_on_the_way_out(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    log.write_text("terminate called without an active exception\n")
    _check_complete(stamps([0.0, 1.0, 2.0], [0.0] * 3), 3, ["torchrun exited with 1 (run.log)"], log)
    with pytest.raises(RuntimeError, match="2 of 3 steps logged; torchrun exited with 1"):
        _check_complete(stamps([0.0, 1.0], [0.0] * 2), 3, ["torchrun exited with 1 (run.log)"], log)
