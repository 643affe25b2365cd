"""``regroup whatif --params``: what moving a model's state costs at each re-form, on paper."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regroup.whatif.churn import WhatIfError
from regroup.whatif.sizes import Hardware, SizedJob, parse_count, project
from tests.whatif.test_command import whatif
from tests.whatif.test_recorded import churned_job


def test_sizes_read_as_people_write_them() -> None:
    assert parse_count("7B", "--params") == 7e9
    assert parse_count("350M", "--params") == 350e6
    assert parse_count("1.5e9", "--params") == 1.5e9
    assert parse_count("4M", "--tokens-per-step") == 4e6
    with pytest.raises(WhatIfError, match=r"^--params: expected a number like 7B"):
        parse_count("seven", "--params")


def test_a_gpu_holds_its_share_and_a_node_its_gpus_snapshots_and_staging() -> None:
    job = SizedJob(7e9, nodes=16, gpus_per_node=8)
    p = project(job)
    assert p.state_per_gpu == pytest.approx(12 * 7e9 / 128)
    assert p.host_per_node == pytest.approx(8 * 5 * p.state_per_gpu), "4 snapshot copies and one staged checkpoint"
    assert p.device_reform == pytest.approx(12 * 7e9 / 120), "the next world's share, one node fewer"
    assert p.step_s == pytest.approx(6 * 7e9 * 4e6 / (128 * 989e12 * 0.4))


def test_every_path_costs_its_bytes_over_the_link_and_a_faster_link_makes_it_cheaper() -> None:
    job = SizedJob(70e9, nodes=64)
    slow, fast = project(job), project(job, Hardware(fabric_gbps=100.0))
    for name in ("reclaim_s", "migrate_s", "loss_s", "replace_s", "grow_s"):
        assert getattr(slow, name) > job.fixed_s
        assert getattr(fast, name) < getattr(slow, name), name
    assert slow.loss_s > slow.grow_s, "a loss detects and restores from host memory first"
    assert fast.snapshot_exchange_s < slow.snapshot_exchange_s and fast.snapshot_copy_s == slow.snapshot_copy_s


def test_auto_spaces_snapshots_out_when_they_would_cost_more_than_two_percent() -> None:
    cheap = project(SizedJob(7e9, nodes=16))
    assert cheap.auto_every == 1 and cheap.snapshot_cost_share < 0.02
    # Few tokens a step: a short step, the same bytes to copy.
    costly = project(SizedJob(7e9, nodes=16, tokens_per_step=0.1e6))
    assert costly.snapshot_cost_share > 0.02 and costly.auto_every > 1


def test_bad_sizes_are_named() -> None:
    with pytest.raises(WhatIfError, match="--nodes"):
        SizedJob(7e9, nodes=1)
    with pytest.raises(WhatIfError, match="--mfu"):
        SizedJob(7e9, nodes=4, mfu=1.5)


def test_the_command_answers_for_a_size_alone_and_beside_a_jobs_spans(tmp_path: Path) -> None:
    alone = whatif("--params", "70B", "--nodes", "64", "--gpus-per-node", "8")
    assert alone.returncode == 0, alone.stderr
    assert alone.stdout.startswith("regroup whatif: 70B parameters on 64 x 8 GPUs")
    assert "model + optimizer state per GPU" in alone.stdout and "1.64 GB" in alone.stdout
    as_json = json.loads(whatif("--params", "7B", "--nodes", "16", "--json").stdout)
    assert as_json["state_per_gpu"] == pytest.approx(12 * 7e9 / 128)
    spans = churned_job(tmp_path / "spans.jsonl")
    both = whatif(str(spans), "--nodes", "16", "--loss-every", "2h", "--params", "7B")
    assert both.returncode == 0, both.stderr
    assert "strategy" in both.stdout and "regroup whatif: 7B parameters on 16 x 8 GPUs" in both.stdout
    neither = whatif("--nodes", "16")
    assert neither.returncode == 2 and "SPANS" in neither.stderr
    bad = whatif("--params", "lots", "--nodes", "16")
    assert bad.returncode == 2 and "--params" in bad.stderr
