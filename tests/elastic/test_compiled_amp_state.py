"""A compiled model, a ``GradScaler``, clipping and an LR schedule through the two ways a run
restores state, in one process (a world of one on gloo): ``redistribute`` from the state held
in memory (an in-place re-form) and DCP from ``AppState`` (a checkpoint). Same world, same
batches: the trajectory after the restore is the uninterrupted one's to the bit.

The model and the step are ``tests/elastic/compiled_script.py``'s; ``torch.compile`` runs with
``backend="aot_eager"`` (see ``test_compiled_amp_reform``)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from regroup.elastic.checkpoint.app_state import AppState, TrainerState
from regroup.elastic.world.runtime import Runtime, init_runtime
from regroup.elastic.step import set_gradient_sync
from regroup.elastic.state import State
from regroup.elastic.memory.reshard import flat_state, hold_state, redistribute
from tests.elastic.compiled_script import (
    build, compiled_frames, parse, poisoned, scaler_for, schedule, settings, train_step,
)  # fmt: skip

BATCH = 12


@pytest.fixture
def world_of_one() -> Iterator[Runtime]:
    rt = init_runtime({}, "cpu", timeout=timedelta(minutes=1))  # gloo, in this process
    torch._dynamo.reset()  # each case compiles afresh, never near the recompile limit
    try:
        yield rt
    finally:
        dist.destroy_process_group()


class Trainer:
    """The script's model, AdamW, schedule and scaler, built as a new world builds them."""

    def __init__(self, args: argparse.Namespace, rt: Runtime) -> None:
        self.args = args
        self.model = build(args, rt.mesh)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        self.scheduler = schedule(args, self.optimizer)
        self.scaler = scaler_for(args)
        self.state = State(self.model, self.optimizer, self.scheduler, {"scaler": self.scaler})

    def train(self, start: int, count: int) -> dict[int, dict[str, Any]]:
        """Steps ``start`` .. ``start + count - 1``: each step's record, by the step it completes."""
        out = {}
        for index in range(start, start + count):
            ids = [range(index * BATCH, (index + 1) * BATCH)]
            poison_here = poisoned(self.args, index)
            done = train_step(self.args, self.model, self.optimizer, self.scheduler, self.scaler, ids, 1, poison_here)
            out[index + 1] = {**done, **settings(self.optimizer, self.scaler)}
        return out

    def app(self, step: int = 0) -> AppState:
        trainer = TrainerState()
        trainer.step = step
        return AppState(self.model, self.optimizer, trainer, self.state.carried())


def features(wrap: str, compile_: str, scheduler: str) -> argparse.Namespace:
    # A poisoned step every 4 (index 3, 7): the scaler skips one before the restore and one after.
    return parse(["--wrap", wrap, "--compile", compile_, "--schedule", scheduler, "--amp", "--clip", "1",
                  "--poison", "4"])  # fmt: skip


@pytest.mark.parametrize(
    ("wrap", "compile_", "scheduler"),
    [
        ("ddp", "wrap", "cosine"), ("ddp", "method", "onecycle"), ("fsdp", "wrap", "lambda"),
        ("fsdp", "method", "cosine"),
    ],
)  # fmt: skip
def test_a_compiled_model_its_scaler_and_its_schedule_resume_on_the_uninterrupted_trajectory(
    world_of_one: Runtime, tmp_path: Path, wrap: str, compile_: str, scheduler: str
) -> None:
    args = features(wrap, compile_, scheduler)
    before, after = 6, 4
    frames = compiled_frames()
    reference = Trainer(args, world_of_one).train(0, before + after)
    assert [s for s, r in reference.items() if r["skipped"]] == [4, 8]
    assert compiled_frames() > frames, "the model ran compiled"

    old = Trainer(args, world_of_one)
    assert old.train(0, before) == {s: reference[s] for s in range(1, before + 1)}
    dcp.save({"app": old.app(before)}, checkpoint_id=str(tmp_path / "ckpt"))
    carried = old.state.carried_state()
    held = hold_state(old.model, old.optimizer, 0, 1, before)

    in_memory = Trainer(args, world_of_one)
    assert redistribute(in_memory.model, in_memory.optimizer, [held], dist.group.WORLD) == before
    in_memory.state.load_carried(carried)
    from_storage = Trainer(args, world_of_one)
    app = from_storage.app()
    dcp.load({"app": app}, checkpoint_id=str(tmp_path / "ckpt"))
    assert app.trainer.step == before

    for restored in (in_memory, from_storage):
        # lr, betas, the scaler's scale and growth tracker and AdamW's step: those of the step resumed at.
        assert settings(restored.optimizer, restored.scaler) == settings_of(reference[before])
        assert restored.train(before, after) == {s: reference[s] for s in range(before + 1, before + after + 1)}


def settings_of(record: dict[str, Any]) -> dict[str, Any]:
    return {k: record[k] for k in ("lr", "betas", "scale", "tracker", "adam_step")}


@pytest.mark.parametrize("wrap", ["plain", "ddp", "fsdp"])
@pytest.mark.parametrize("compile_", ["wrap", "method"])
def test_a_compiled_model_names_its_state_as_the_model_it_compiled(
    world_of_one: Runtime, wrap: str, compile_: str
) -> None:
    """``torch.compile(model)``'s state dict says ``_orig_mod.0.weight``; the state a run holds,
    snapshots and checkpoints says ``0.weight`` either way, so a compiled run resumes from an
    uncompiled one's state and back."""
    compiled = Trainer(features(wrap, compile_, "lambda"), world_of_one)
    plain = Trainer(features(wrap, "none", "lambda"), world_of_one)
    if compile_ == "wrap":
        assert next(iter(compiled.model.state_dict())).count("_orig_mod.") == 1
    assert list(flat_state(compiled.model, compiled.optimizer)) == list(flat_state(plain.model, plain.optimizer))
    assert list(compiled.app().state_dict()["model"]) == list(plain.app().state_dict()["model"])


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_micro_batches_reduce_gradients_once_under_torch_compile_too(world_of_one: Runtime, wrap: str) -> None:
    """``torch.compile(model)`` hides the FSDP2 or DDP module inside an ``OptimizedModule``:
    the run turns gradient reduction off and on on the module it compiled."""
    model = Trainer(features(wrap, "wrap", "lambda"), world_of_one).model
    inner = model._orig_mod
    set_gradient_sync(model, False)
    if isinstance(inner, FSDPModule):
        assert not any(group.reduce_grads for group in _fsdp_groups(inner))
    else:
        assert isinstance(inner, DistributedDataParallel) and not inner.require_backward_grad_sync
    set_gradient_sync(model, True)
    if isinstance(inner, FSDPModule):
        assert all(group.reduce_grads for group in _fsdp_groups(inner))
    else:
        assert inner.require_backward_grad_sync


def _fsdp_groups(model: torch.nn.Module) -> list[Any]:
    return [g for m in model.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
