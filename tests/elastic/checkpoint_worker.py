"""Worker for the kept-state test, in a world of one. Three async saves, each while a step
runs on and changes everything once it may: the first; the second after a new learning
rate; the third after the optimizer's state was replaced through
``set_optimizer_state_dict`` (as an in-memory reshard does, past the ``AppState``). Dumps
the full state the third save must hold.
``python -m tests.elastic.checkpoint_worker CHECKPOINT_DIR OUT``."""

from __future__ import annotations

import copy
import sys
from datetime import timedelta

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_optimizer_state_dict

from tests.elastic.harness import TINY_MODEL
from regroup.elastic.checkpoint.app_state import AppState, TrainerState
from regroup.elastic.checkpoint.checkpointer import Checkpointer
from regroup.trainer.config_loading import config_from_dict
from regroup.elastic.world.runtime import init_runtime
from regroup.trainer.sharding import build_sharded_model
from regroup.elastic.world.stopping import hard_exit

NEW_LR = 0.0123
NEW_EXP_AVG = 7.0


def main(root: str, out: str) -> None:
    cfg = config_from_dict({"model": TINY_MODEL, "checkpoint": {"dir": root, "keep_last": 5}})
    runtime = init_runtime({}, "cpu", timeout=timedelta(minutes=2))
    model = build_sharded_model(cfg.model, 0, runtime.mesh, runtime.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    app = AppState(model, optimizer, TrainerState())
    checkpointer = Checkpointer(cfg.checkpoint, runtime)
    checkpointer.prepare()
    tokens = torch.randint(cfg.model.vocab_size, (2, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))

    def train_step() -> None:
        model(tokens).float().logsumexp(-1).mean().backward()
        checkpointer.wait_staged()
        optimizer.step()
        optimizer.zero_grad()
        app.trainer.step += 1

    def save_while_a_step_runs() -> None:
        checkpointer.save(app, app.trainer.step, use_async=True)
        train_step()
        checkpointer.finish()

    train_step()
    save_while_a_step_runs()  # step 1
    for group in optimizer.param_groups:
        group["lr"] = NEW_LR
    save_while_a_step_runs()  # step 2: the same state objects, a new learning rate

    _, optim_state = get_state_dict(model, optimizer)
    # New dicts: get_state_dict's entries are the optimizer's own, which must keep their values.
    replaced = {
        fqn: {**entry, "exp_avg": torch.full_like(entry["exp_avg"], NEW_EXP_AVG)}
        for fqn, entry in optim_state["state"].items()
    }
    set_optimizer_state_dict(model, optimizer, {"state": replaced, "param_groups": optim_state["param_groups"]})

    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=full)
    # A copy: on CPU in a world of one, the "full" state is the live tensors themselves.
    expected = copy.deepcopy({"model": model_state, "optim": optim_state["state"], "step": app.trainer.step})
    save_while_a_step_runs()  # step 3: the optimizer's state replaced
    checkpointer.close()
    torch.save(expected, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    hard_exit(0)
