"""torchrun worker for the reshard test: load the newest checkpoint at this world size
(or train two steps if there is none), dump the full unsharded state, then save it as
the next step with an async save while a training step runs on (the step overlaps the
background copy and changes every parameter once it may). The next world size loads
that save, so its dump shows whether the async snapshot was the state at save time.
``python -m tests.elastic.reshard_worker CONFIG OUT``."""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from regroup.elastic.checkpoint.app_state import AppState, TrainerState
from regroup.elastic.world.batching import plan_batches
from regroup.elastic.checkpoint.checkpointer import Checkpointer
from regroup.trainer.config_loading import load_config
from regroup.trainer.data import batch, make_source
from regroup.elastic.world.runtime import init_runtime
from regroup.trainer.sharding import build_sharded_model
from regroup.elastic.world.stopping import hard_exit


def main(config: str, out: str) -> None:
    env = dict(os.environ)
    cfg = load_config(config, env=env)
    runtime = init_runtime(env, "cpu", timeout=timedelta(minutes=2))
    torch.manual_seed(cfg.seed)
    model = build_sharded_model(cfg.model, cfg.seed, runtime.mesh, runtime.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    app = AppState(model, optimizer, TrainerState())
    checkpointer = Checkpointer(cfg.checkpoint, runtime)
    plan = plan_batches(cfg.batch.global_batch_size, runtime.world_size, runtime.rank)
    source = make_source(cfg.data, cfg.model)

    def train_step() -> None:
        inputs, targets = batch(source, plan.step_ids(app.trainer.step))
        F.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten()).backward()
        checkpointer.wait_staged()  # the async save's copy must finish before parameters change
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        app.trainer.step += 1

    checkpointer.prepare()
    if checkpointer.load_latest(app) is None:
        train_step()
        train_step()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    if runtime.rank == 0:
        torch.save({"model": model_state, "optim": optim_state["state"], "step": app.trainer.step}, out)
    app.trainer.step += 1
    checkpointer.save(app, app.trainer.step, use_async=True)
    train_step()
    checkpointer.finish()
    dist.barrier(group=runtime.control_group)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    hard_exit(0)
