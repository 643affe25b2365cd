"""``regroup smoke``: the CPU wiring check, alone and under torchrun with two ranks."""

from __future__ import annotations

import argparse
import json
import subprocess
from typing import Any

import pytest

from regroup.elastic.smoke import RankResult, SmokeReport, add_arguments, dense_bf16_peak, format_report, run


def run_json(cmd: list[str], env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(line)


def test_regroup_smoke_runs_alone_on_cpu(python: str, worker_env: dict[str, str]) -> None:
    report = run_json([python, "-m", "regroup.cli", "smoke", "--json", "--peak-tflops", "2.0"], worker_env)
    assert report["ok"] is True
    assert (report["world_size"], report["backend"]) == (1, "gloo")
    (rank,) = report["ranks"]
    assert rank["device"] == "cpu" and rank["dtype"] == "float32" and rank["allreduce_ok"] is True
    assert rank["matmul_tflops"] > 0
    assert rank["mfu"] == pytest.approx(rank["matmul_tflops"] / 2.0)
    assert report["busbw_gbps"] == 0.0  # one rank moves nothing over a wire
    assert report["allreduce_bytes"] == 2**20


def test_smoke_under_torchrun_checks_the_all_reduce_on_every_rank(python: str, worker_env: dict[str, str]) -> None:
    report = run_json(
        [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "regroup.elastic.smoke", "--json"],
        worker_env,
    )
    assert report["ok"] is True and report["world_size"] == 2
    assert sorted(r["rank"] for r in report["ranks"]) == [0, 1]
    assert all(r["allreduce_ok"] and r["matmul_tflops"] > 0 and r["mfu"] is None for r in report["ranks"])
    # busbw = algbw * 2 (n - 1) / n, which is algbw itself at n = 2.
    assert report["busbw_gbps"] == pytest.approx(report["algbw_gbps"]) and report["busbw_gbps"] > 0


def test_bad_setting_is_refused_with_its_name(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args(["--matmul-size", "0"])) == 2
    assert "matmul_size" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA L40S", 362.0),
        ("Tesla T4", None),
    ],
)
def test_dense_bf16_peak_by_device_name(name: str, peak: float | None) -> None:
    assert dense_bf16_peak(name) == peak


def test_a_wrong_sum_fails_the_verdict() -> None:
    good = RankResult(0, "node-a", "NVIDIA H100 80GB HBM3", "bfloat16", 700.0, 989.0, 700.0 / 989.0, True)
    bad = RankResult(1, "node-b", "NVIDIA H100 80GB HBM3", "bfloat16", 690.0, 989.0, 690.0 / 989.0, False)
    report = SmokeReport(2, "nccl", [good, bad], 256 * 2**20, 150.0, 150.0)
    assert not report.ok
    text = format_report(report)
    assert "WRONG SUM" in text and "verdict: FAILED" in text
    assert "70.8%" in text  # MFU of rank 0
