"""On CUDA, a snapshot is copied on a side stream into pinned host memory while the loop
runs on: it must hold the state of the step it was taken at, not a later one."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from regroup.trainer.config_loading import config_from_dict
from regroup.elastic.world.runtime import init_runtime
from regroup.trainer.sharding import build_sharded_model
from regroup.elastic.memory.snapshot import Snapshots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def runtime() -> Iterator[object]:
    rt = init_runtime({}, "cuda", timeout=timedelta(minutes=2))  # a world of one on NCCL
    try:
        yield rt
    finally:
        dist.destroy_process_group()


def test_a_snapshot_holds_its_step_while_the_next_one_changes_the_parameters(runtime: object) -> None:
    cfg = config_from_dict({"model": {"dim": 256, "n_layers": 2, "n_heads": 4, "seq_len": 32}})
    model = build_sharded_model(cfg.model, 0, runtime.mesh, runtime.device)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(cfg.model.vocab_size, (4, 32), device="cuda", generator=None)

    def step() -> None:
        model(tokens).float().logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    snaps = Snapshots(model, optimizer, 0, 1, ("", "gpu-node"), 1, timedelta(minutes=1))
    while not snaps.done(1):  # pinned buffers are allocated in the background
        time.sleep(0.01)
    snaps.agreed(True, 0.0)
    assert snaps.ready and snaps.due(1)
    expected = {n: p.detach().to_local().float().cpu().clone() for n, p in model.named_parameters()}
    snaps.take(1)
    # The next step's forward and backward queue behind the copy's start on the GPU; only
    # its optimizer step must wait, as the loop does.
    model(tokens).float().logsumexp(-1).mean().backward()
    snaps.wait_copied()
    optimizer.step()
    assert snaps.done(2)
    snaps.agreed(True, 0.0)
    (held,) = snaps.held()
    assert held.step == 1 and held.old_rank == 0
    assert all(t.device.type == "cpu" and t.is_pinned() for k, t in held.tensors.items() if k in held.sharded)
    for name, value in expected.items():
        got = held.tensors["model/" + name].float()
        assert torch.equal(got, value), f"{name}: the snapshot is not the state of step 1"
    now = {n: p.detach().to_local().float().cpu() for n, p in model.named_parameters()}
    assert any(not torch.equal(now[n], expected[n]) for n in now), "the second step changed the parameters"
    snaps.close()
