"""``regroup whatif`` as a user runs it: the tables, the JSON, and clear errors on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.whatif.spans import T0, RecordedJob
from tests.whatif.test_recorded import churned_job, spare_job


def whatif(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "regroup.cli", "whatif", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=60)  # fmt: skip


def test_the_table_compares_the_strategies_under_the_churn(tmp_path: Path) -> None:
    spans = churned_job(tmp_path / "spans.jsonl")
    result = whatif(str(spans), "--nodes", "16", "--spares", "2", "--reclaim-every", "20m", "--loss-every", "2h")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("regroup whatif: 16 nodes + 2 spares; reclaim every 20m (2m notice), loss every 2h")
    assert "recorded: 5 re-forms (1 planned shrink, 3 unplanned, 1 grow)" in lines[1]
    header = lines.index(next(line for line in lines if line.startswith("strategy")))
    rows = [line.split("  ")[0].strip() for line in lines[header + 2 : header + 6]]
    assert rows == ["in-place elastic", "restart elastic", "fixed size + spares", "fixed size, checkpoint-restart"]
    assert "seconds of training one event costs:" in lines and "seconds one re-form stops training" in result.stdout


def test_json_has_each_strategy_with_its_settings(tmp_path: Path) -> None:
    spans = churned_job(tmp_path / "spans.jsonl")
    result = whatif(str(spans), "--nodes", "8", "--loss-every", "1h", "--min-nodes", "6", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    strategies = {s["strategy"]: s for s in report["strategies"]}
    assert list(strategies) == ["in-place elastic", "restart elastic", "fixed size, checkpoint-restart"]
    assert strategies["in-place elastic"]["min_nodes"] == 6 and strategies["in-place elastic"]["max_nodes"] == 8
    for s in strategies.values():
        assert 0 < s["time_goodput"] <= 1 and 0 < s["throughput_goodput"] <= s["time_goodput"]
    assert strategies["fixed size, checkpoint-restart"]["checkpoint_every_s"] > 0
    assert report["costs"]["checkpoint"] == {"seconds": pytest.approx(0.1), "source": "recorded"}
    assert report["churn"]["loss_every_s"] == 3600.0
    # What was read: one stall per new world, with its cause.
    assert [s["cause"] for s in report["stalls"]] == ["reclaim", "node-lost", "crash", "grow", "node-lost"]


def test_on_a_demo_run_folder_each_stall_is_trace_reports_row(tmp_path: Path) -> None:
    """A ``regroup demo`` run folder holds the rank crash the run injected: the agents'
    re-form starts there, as trace-report's row does, and lasts what the row says."""
    run = tmp_path / "run"
    run.mkdir()
    spare_job(run / "spans.jsonl")
    (run / "run.json").write_text(json.dumps({"mode": "regroup", "started_at": T0}))
    (run / "events.jsonl").write_text(json.dumps({"time": T0 + 60.0, "source": "fault", "reason": "RankCrashed",
                                                  "message": "n1: rank killed", "nodes": ["n1"]}) + "\n")  # fmt: skip
    result = whatif(str(run), "--nodes", "4", "--loss-every", "30m", "--json")
    assert result.returncode == 0, result.stderr
    grow, crash = json.loads(result.stdout)["stalls"]
    rows = subprocess.run([sys.executable, "-m", "regroup.cli", "trace-report", str(run), "--json"], capture_output=True,
                          text=True, cwd=REPO, timeout=60, check=True)  # fmt: skip
    grow_row, crash_row = json.loads(rows.stdout)
    assert (crash["cause"], crash["start"], crash["seconds"]) == pytest.approx(
        (crash_row["cause"], crash_row["start"], crash_row["duration"])
    )
    assert crash["seconds"] == pytest.approx(0.7)
    # The grow's stall ends with its row, and starts at the trainers' save, after the request.
    assert grow["start"] + grow["seconds"] == pytest.approx(grow_row["end"])
    assert (grow["seconds"], grow_row["duration"]) == pytest.approx((0.58, 0.6))


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--loss-every", "2x"], "argument --loss-every: not a duration: '2x'"),
        (["--reclaim-every", "0s"], "--reclaim-every: must be positive"),
        (["--min-nodes", "9"], "--min-nodes: must be between 1 and --nodes (8), got 9"),
        (["--nodes", "eight"], "argument --nodes: invalid int value: 'eight'"),
    ],
)
def test_a_bad_option_is_named_and_exits_2(tmp_path: Path, args: list[str], named: str) -> None:
    spans = churned_job(tmp_path / "spans.jsonl")
    result = whatif(str(spans), "--nodes", "8", *args)
    assert result.returncode == 2 and named in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_spans_file_with_nothing_to_go_on_is_named_and_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    no_reform = tmp_path / "no-reform.jsonl"
    job = RecordedJob(no_reform)
    job.trainer.start_span("regroup.trainer.step").end()
    job.close()
    # A re-form, and no checkpoint at all: a trainer that exports none.
    no_checkpoint = tmp_path / "no-checkpoint.jsonl"
    job = RecordedJob(no_checkpoint)
    lost = job.reform("node-lost", 3, 2, 1.0)
    job.resume(lost, 1.5, 2.0, resumed_from=5, world=2)
    job.close()
    cases = [
        (empty, f"{empty}: no spans in it"),
        (no_reform, f"{no_reform}: no re-form in it"),
        (tmp_path / "missing.jsonl", f"no spans file at {tmp_path / 'missing.jsonl'}"),
        (no_checkpoint, "the spans record no checkpoint (no regroup.trainer.checkpoint span"),
    ]
    for path, message in cases:
        result = whatif(str(path), "--nodes", "4", "--loss-every", "1h")
        assert result.returncode == 2 and message in result.stderr, (path, result.stderr)
        assert "give --checkpoint-cost" in result.stderr or path != no_checkpoint
        assert "Traceback" not in result.stderr
    assert whatif(str(no_checkpoint), "--nodes", "4", "--checkpoint-cost", "30s").returncode == 0


def test_the_checkpoint_cost_defaults_to_the_recorded_one_even_from_memory(tmp_path: Path) -> None:
    """An in-place job acks every checkpoint from memory: its spans hold what those cost, and
    that is the default (said so), not an exit 2 asking for ``--checkpoint-cost``."""
    memory_only = tmp_path / "memory.jsonl"
    job = RecordedJob(memory_only)
    reclaim = job.reform("reclaim", 3, 2, 1.0, planned=True)
    job.checkpoint(reclaim, 1.0, 0.2, step=5, world=3)
    job.resume(reclaim, 1.5, 2.0, resumed_from=5, world=2)
    grow = job.reform("grow", 2, 3, 9.0, planned=True)
    job.checkpoint(grow, 9.0, 0.4, step=25, world=2)
    job.resume(grow, 9.5, 10.0, resumed_from=25, world=3)
    job.close()
    result = whatif(str(memory_only), "--nodes", "4", "--loss-every", "1h")
    assert result.returncode == 0, result.stderr
    assert ("checkpoint 0.3s (acked from memory at 2 re-forms, not saved to storage: the spans time no save to "
            "storage)") in result.stdout  # fmt: skip
    # It is not called the cost of a save to storage: the output says what it stands in for.
    assert "note: C is an ack from memory, not the cost of a save to storage;" in result.stdout
    assert "give --checkpoint-cost for its cost" in result.stdout
    stored = whatif(str(churned_job(tmp_path / "saved.jsonl")), "--nodes", "4", "--loss-every", "1h")
    assert "note: C is an ack from memory" not in stored.stdout
    report = json.loads(whatif(str(memory_only), "--nodes", "4", "--loss-every", "1h", "--json").stdout)
    assert report["costs"]["checkpoint"]["seconds"] == pytest.approx(0.3)
    # A save to storage in the spans is what C is, whatever the acks from memory cost.
    stored = churned_job(tmp_path / "stored.jsonl")
    report = json.loads(whatif(str(stored), "--nodes", "4", "--loss-every", "1h", "--json").stdout)
    assert report["costs"]["checkpoint"] == {"seconds": pytest.approx(0.1), "source": "recorded"}
    # The option still wins.
    report = json.loads(whatif(str(memory_only), "--nodes", "4", "--checkpoint-cost", "30s", "--json").stdout)
    assert report["costs"]["checkpoint"] == {"seconds": 30.0, "source": "--checkpoint-cost"}


def test_the_help_names_the_strategies_the_output_prints(tmp_path: Path) -> None:
    helped = whatif("--help")
    assert helped.returncode == 0
    text = " ".join(helped.stdout.split())
    assert "four ways" not in text
    assert ("three strategies (in-place elastic, restart elastic, fixed size with checkpoint-restart), and a fourth "
            "with --spares (fixed size + spares)") in text  # fmt: skip
    assert "default: recorded: the trainers' saves to storage in the spans, else their checkpoints acked from memory" in text
    spans = churned_job(tmp_path / "spans.jsonl")
    for extra, count in (([], 3), (["--spares", "1"], 4)):
        report = json.loads(whatif(str(spans), "--nodes", "8", "--loss-every", "1h", "--json", *extra).stdout)
        assert len(report["strategies"]) == count, report["strategies"]
