"""Checkpoints reshard across world sizes, and count only once committed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.elastic.checkpoint_worker import NEW_EXP_AVG, NEW_LR
from tests.elastic.harness import check, events, flat_tensors, full_state, torchrun, write_config
from regroup.elastic.checkpoint.folders import COMMIT_MARKER, latest_committed, list_steps, prune, step_dir, write_commit_marker

pytestmark = pytest.mark.slow


def test_dcp_reshard_4_2_3_keeps_full_tensors_identical(tmp_path: Path, worker_env: dict[str, str]) -> None:
    config = write_config(tmp_path / "c.yaml", checkpoint={"dir": str(tmp_path / "ckpt")})
    dumps = []
    for index, world in enumerate((4, 2, 3)):  # a shrink, then a grow to an uneven split
        out = tmp_path / f"full-{index}-w{world}.pt"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
        argv += ["-m", "tests.elastic.reshard_worker", str(config), str(out)]
        check(subprocess.run(argv, env=worker_env, capture_output=True, text=True, timeout=120))
        dumps.append(torch.load(out, weights_only=False))
    assert [d["step"] for d in dumps] == [2, 3, 4]
    reference = flat_tensors({"model": dumps[0]["model"], "optim": dumps[0]["optim"]})
    assert any(".exp_avg_sq" in k for k in reference), "optimizer moments must travel with the model"
    for dump in dumps[1:]:
        tensors = flat_tensors({"model": dump["model"], "optim": dump["optim"]})
        assert sorted(tensors) == sorted(reference)
        for key, value in reference.items():
            assert torch.equal(tensors[key], value), f"{key} changed across a reshard"
    assert latest_committed(tmp_path / "ckpt") == 5


def test_commit_marker_and_retention(tmp_path: Path) -> None:
    for step in (2, 4, 6, 8):
        step_dir(tmp_path, step).mkdir()
        if step != 6:
            write_commit_marker(step_dir(tmp_path, step), step, world_size=2)
    step_dir(tmp_path, 10).mkdir()  # a save still in flight: newer than every commit
    assert latest_committed(tmp_path) == 8
    assert prune(tmp_path, keep_last=2) == [2, 6]
    assert list_steps(tmp_path) == [(4, True), (8, True), (10, False)]
    assert not (step_dir(tmp_path, 4) / f".{COMMIT_MARKER}.tmp").exists()


def test_rank_killed_mid_save_leaves_a_checkpoint_that_is_never_loaded(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    ckpt = tmp_path / "ckpt"
    config = write_config(
        tmp_path / "c.yaml", checkpoint={"dir": str(ckpt), "every_steps": 2, "async_save": False}, max_steps=5
    )
    # Rank 1 is SIGKILLed after writing its shard of step 4's checkpoint: the job fails.
    # (A second torchrun stands in for the restart: torchrun's own in-place restart with a
    # standalone store is what regroup's etcd-v3 rendezvous replaces, pytorch#135712.)
    fault = '[{"kind": "kill_during_save", "rank": 1, "step": 4}]'
    failed = torchrun(2, config, {**worker_env, "REGROUP_TRAINER_FAULTS": fault})
    assert failed.returncode != 0
    assert events(failed.stderr, "fault: killing this rank in the middle of a checkpoint save")
    assert list_steps(ckpt) == [(2, True), (4, False)]

    result = check(torchrun(2, config, worker_env))
    resumed = [e for e in events(result.stderr, "resumed") if e["rank"] == 0]
    assert [e["step"] for e in resumed] == [2], "the torn step-4 checkpoint must not be loaded"
    removed = events(result.stderr, "removed uncommitted checkpoints")
    assert [e["steps"] for e in removed] == [[4]]
    assert list_steps(ckpt) == [(2, True), (4, True), (5, True)]


def test_async_save_holds_the_current_settings_and_a_replaced_optimizer_state(
    tmp_path: Path, worker_env: dict[str, str]
) -> None:
    # The AppState reuses its get_state_dict result between saves: a new learning rate, and
    # an optimizer state replaced past it (as an in-memory reshard does), must still be saved.
    ckpt, out = tmp_path / "ckpt", tmp_path / "expected.pt"
    argv = [sys.executable, "-m", "tests.elastic.checkpoint_worker", str(ckpt), str(out)]
    check(subprocess.run(argv, env=worker_env, capture_output=True, text=True, timeout=120))
    expected = torch.load(out, weights_only=False)
    assert list_steps(ckpt) == [(1, True), (2, True), (3, True)]
    assert [group["lr"] for group in full_state(ckpt, 1, tmp_path)["optim"]["param_groups"]] != [NEW_LR]
    assert [group["lr"] for group in full_state(ckpt, 2, tmp_path)["optim"]["param_groups"]] == [NEW_LR]
    saved = full_state(ckpt, 3, tmp_path)
    assert saved["trainer"]["step"] == expected["step"] == 3
    want = flat_tensors({"model": expected["model"], "optim": expected["optim"]})
    got = flat_tensors({"model": saved["model"], "optim": saved["optim"]["state"]})
    assert sorted(got) == sorted(want)
    exp_avgs = [key for key in want if key.endswith(".exp_avg")]
    assert exp_avgs and all(bool((want[key] == NEW_EXP_AVG).all()) for key in exp_avgs)
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key}: the save does not hold the state at save time"
